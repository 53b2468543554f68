"""The training check both language models share: four traced AdamW steps of fuelgraph next to
torch.optim.AdamW on the same transformers model, step by step."""
import torch

import fuelgraph as fg
import fuelgraph.models as M
from fuelgraph import optim


def adamw_steps_vs_torch(path, hf, batch, lr, steps=4):
    """(our model, torch model, our losses, torch's losses, the traced step)."""
    model = M.from_pretrained(path).train()
    opt = optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    tm = type(hf)(hf.config)
    tm.load_state_dict(hf.state_dict())
    tm.train()
    topt = torch.optim.AdamW(tm.parameters(), lr=lr, weight_decay=0.01)

    @fg.jit
    def step(x):
        loss = model(x, labels=x)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss

    ours, ref = [], []
    for _ in range(steps):
        ours.append(step(fg.tensor(batch)).item())
        loss = tm(torch.tensor(batch), labels=torch.tensor(batch)).loss
        loss.backward()
        topt.step()
        topt.zero_grad()
        ref.append(loss.item())
    return model, tm, ours, ref, step
