"""Training end to end: optimizers against torch.optim over several steps, learning-rate
changes without a new graph, optimizer state dicts, traced steps (fuelgraph.jit: trace once,
replay, retrace rules, in-place updates, old values kept), and checkpoints (safetensors)."""
import numpy as np
import pytest
import torch

import fuelgraph as fg
import fuelgraph.nn as nn
import fuelgraph.nn.functional as F
import fuelgraph.optim as optim
from fuelgraph import FuelGraphError

#: checkpoints need the safetensors package (a core dependency; machines that run only the
#: GPU tests may lack it)
needs_safetensors = pytest.mark.skipif(
    __import__("importlib").util.find_spec("safetensors") is None,
    reason="safetensors is not installed")

RNG = np.random.default_rng(0)
X = RNG.standard_normal((12, 6)).astype(np.float32)
Y = RNG.integers(0, 3, 12)


def pair():
    fg.manual_seed(0)
    m = nn.Sequential(nn.Linear(6, 16), nn.SiLU(), nn.Linear(16, 3))
    tm = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.SiLU(), torch.nn.Linear(16, 3))
    tm.load_state_dict({k: torch.tensor(v.numpy()) for k, v in m.state_dict().items()})
    return m, tm


OPTS = {
    "sgd": (lambda p: optim.SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "sgd_momentum_wd": (lambda p: optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1,
                                            weight_decay=0.01),
                        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1,
                                                  weight_decay=0.01)),
    "sgd_nesterov": (lambda p: optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True),
                     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True)),
    "adamw": (lambda p: optim.AdamW(p, lr=1e-2, weight_decay=0.1),
              lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    "adamw_betas": (lambda p: optim.AdamW(p, lr=3e-3, betas=(0.8, 0.99), eps=1e-6),
                    lambda p: torch.optim.AdamW(p, lr=3e-3, betas=(0.8, 0.99), eps=1e-6)),
}


@pytest.mark.parametrize("name", list(OPTS))
def test_optimizers_match_torch_over_steps(name):
    m, tm = pair()
    opt, topt = OPTS[name][0](m.parameters()), OPTS[name][1](tm.parameters())
    x, y = fg.tensor(X), fg.tensor(Y)
    for step in range(5):
        if step == 3:                              # a schedule: no new trace
            for g, tg in zip(opt.param_groups, topt.param_groups):
                g["lr"] = g["lr"] * 0.5
                tg["lr"] = tg["lr"] * 0.5
        loss = F.cross_entropy(m(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        tl = torch.nn.functional.cross_entropy(tm(torch.tensor(X)), torch.tensor(Y))
        topt.zero_grad()
        tl.backward()
        topt.step()
        np.testing.assert_allclose(loss.item(), tl.item(), rtol=1e-5)
    for (k, p), (_, tp) in zip(m.named_parameters(), tm.named_parameters()):
        np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=2e-5, atol=2e-6,
                                   err_msg=k)
    assert opt._step.stats["traces"] == 1


@needs_safetensors
def test_optimizer_state_dict_round_trip(tmp_path):
    m, _ = pair()
    opt = optim.AdamW(m.parameters(), lr=1e-2)
    x, y = fg.tensor(X), fg.tensor(Y)
    for _ in range(2):
        opt.zero_grad()
        F.cross_entropy(m(x), y).backward()
        opt.step()
    fg.save({"model": m.state_dict(), "opt": opt.state_dict()}, tmp_path / "ck.safetensors")
    ck = fg.load(tmp_path / "ck.safetensors")
    m2, _ = pair()
    m2.load_state_dict(ck["model"])
    opt2 = optim.AdamW(m2.parameters(), lr=1e-2)
    opt2.load_state_dict(ck["opt"])
    for mm, oo in ((m, opt), (m2, opt2)):
        oo.zero_grad()
        F.cross_entropy(mm(x), y).backward()
        oo.step()
    for a, b in zip(m.parameters(), m2.parameters()):
        np.testing.assert_array_equal(a.numpy(), b.numpy())


# ---- traced steps ------------------------------------------------------------------------------
def make_step(m, opt):
    def step(x, y):
        loss = F.cross_entropy(m(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def test_jit_matches_eager_and_replays():
    m1, _ = pair()
    m2, _ = pair()
    o1, o2 = optim.AdamW(m1.parameters(), lr=1e-2), optim.AdamW(m2.parameters(), lr=1e-2)
    eager, traced = make_step(m1, o1), fg.jit(make_step(m2, o2))
    for i in range(4):
        x, y = fg.tensor(X[i:i + 8]), fg.tensor(Y[i:i + 8])
        np.testing.assert_allclose(traced(x, y).item(), eager(x, y).item(), rtol=1e-6)
    assert traced.stats == {"traces": 1, "replays": 3}
    for a, b in zip(m1.parameters(), m2.parameters()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6, atol=1e-7)
    # parameters and state were updated in place: the plan overwrote the handed-over buffers
    e = next(iter(traced.cache.values()))[0]
    assert e.plan.stats.get("inplace_reused", 0) >= 3 * 4 * 3


def test_jit_retrace_rules():
    m, _ = pair()
    calls = []

    @fg.jit
    def f(x, scale):
        calls.append(1)
        return m(x) * scale

    x = fg.tensor(X)
    f(x, 2.0)
    f(fg.tensor(X * 2), 2.0)                       # new data, same signature: replay
    assert len(calls) == 1
    f(x, 3.0)                                      # a new Python scalar: trace
    f(fg.tensor(X[:5]), 2.0)                       # a new shape: trace
    assert len(calls) == 3
    m.eval()                                       # module mode is part of the trace
    f(x, 2.0)
    assert len(calls) == 4
    m.train()
    f(x, 2.0)
    assert len(calls) == 4                         # the earlier trace still applies
    np.testing.assert_allclose(f(x, 2.0).numpy(), (m(x) * 2.0).numpy(), rtol=1e-6)


def test_jit_random_numbers_change_per_replay():
    @fg.jit
    def noisy(x):
        return F.dropout(x, 0.5) + fg.randn(x.shape)

    x = fg.ones((4, 8))
    a, b = noisy(x).numpy(), noisy(x).numpy()
    assert noisy.stats["traces"] == 1 and not np.array_equal(a, b)
    fg.manual_seed(3)
    c = noisy(x).numpy()
    fg.manual_seed(3)
    np.testing.assert_array_equal(noisy(x).numpy(), c)


def test_jit_realize_inside_raises():
    @fg.jit
    def bad(x):
        return x * float(x.sum().item())

    with pytest.raises(FuelGraphError, match="realized while the function was being traced"):
        bad(fg.ones(3))


def test_old_values_held_elsewhere_survive_in_place_updates():
    m, _ = pair()
    opt = optim.SGD(m.parameters(), lr=0.5)
    step = fg.jit(make_step(m, opt))
    w = m[0].weight
    snapshot = w * 1.0                             # lazy: reads the current value
    before = w.numpy().copy()
    step(fg.tensor(X), fg.tensor(Y))
    assert not np.array_equal(w.numpy(), before)
    np.testing.assert_array_equal(snapshot.numpy(), before)


def test_grad_accumulation_across_calls_retraces():
    m, _ = pair()

    @fg.jit
    def accumulate(x, y):
        F.cross_entropy(m(x), y).backward()

    x, y = fg.tensor(X), fg.tensor(Y)
    accumulate(x, y)
    g1 = m[0].weight.grad.numpy().copy()
    accumulate(x, y)                               # grads exist now: they are added to
    np.testing.assert_allclose(m[0].weight.grad.numpy(), 2 * g1, rtol=1e-6)
    assert accumulate.stats["traces"] == 2


# ---- checkpoints ---------------------------------------------------------------------------------
@needs_safetensors
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16", "int64", "int32",
                                   "bool", "uint8"])
def test_save_load_round_trip(tmp_path, dtype):
    a = (RNG.standard_normal((3, 4)) * 5).astype(fg.dtype.as_dtype(dtype).np)
    t = fg.tensor(a)
    fg.save({"w": t, "s": fg.tensor(np.asarray(a[0, 0]))}, tmp_path / "a.safetensors")
    back = fg.load(tmp_path / "a.safetensors")
    assert back["w"].dtype == t.dtype and back["w"].shape == (3, 4) and back["s"].shape == ()
    np.testing.assert_array_equal(back["w"].numpy(), t.numpy())


@needs_safetensors
def test_torch_reads_our_files(tmp_path):
    from safetensors.torch import load_file
    m, tm = pair()
    fg.save(m.state_dict(), tmp_path / "m.safetensors")
    sd = load_file(str(tmp_path / "m.safetensors"))
    tm.load_state_dict(sd)
    np.testing.assert_allclose(tm(torch.tensor(X)).detach().numpy(), m(fg.tensor(X)).numpy(),
                               rtol=1e-6, atol=1e-6)
    b = fg.tensor(np.ones(3, np.float32)).astype(fg.bfloat16)
    fg.save({"b": b}, tmp_path / "b.safetensors")
    assert load_file(str(tmp_path / "b.safetensors"))["b"].dtype == torch.bfloat16


@needs_safetensors
def test_bad_files_raise(tmp_path):
    fg.save({"w": fg.ones((64, 64))}, tmp_path / "ok.safetensors")
    data = (tmp_path / "ok.safetensors").read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[:-100])
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint at all")
    (tmp_path / "empty.safetensors").write_bytes(b"")
    for name in ("trunc", "junk", "empty"):
        with pytest.raises(FuelGraphError, match="load: "):
            fg.load(tmp_path / f"{name}.safetensors")
    with pytest.raises(FuelGraphError, match="no such file"):
        fg.load(tmp_path / "missing.safetensors")
    with pytest.raises(FuelGraphError, match="save: cannot store a object"):
        fg.save({"x": object()}, tmp_path / "x.safetensors")


def test_jit_pytrees_kwargs_and_python_results():
    m, _ = pair()

    @fg.jit
    def f(batch, *, scale=1.0, tag="x"):
        y = m(batch["x"]) * scale
        return {"y": y, "parts": (y.sum(), [y.mean()]), "tag": tag, "n": 3}

    x = fg.tensor(X)
    a = f({"x": x}, scale=2.0)
    b = f({"x": fg.tensor(X * 0.5)}, scale=2.0)
    assert f.stats == {"traces": 1, "replays": 1}
    assert a["tag"] == "x" and a["n"] == 3 and isinstance(a["parts"][1], list)
    np.testing.assert_allclose(a["y"].numpy(), (m(x) * 2.0).numpy(), rtol=1e-6)
    np.testing.assert_allclose(b["parts"][0].item(), float((m(fg.tensor(X * 0.5)) * 2.0).sum()),
                               rtol=1e-5)


def test_step_without_gradients_changes_nothing():
    m, _ = pair()
    opt = optim.AdamW(m.parameters(), lr=0.1)
    before = [p.numpy().copy() for p in m.parameters()]
    opt.step()                                     # no backward yet: nothing to update
    for a, p in zip(before, m.parameters()):
        np.testing.assert_array_equal(a, p.numpy())


def test_frozen_parameters_are_skipped():
    m, tm = pair()
    m[0].weight.requires_grad = False
    tm[0].weight.requires_grad_(False)
    opt, topt = optim.SGD(m.parameters(), lr=0.1, momentum=0.9), \
        torch.optim.SGD(tm.parameters(), lr=0.1, momentum=0.9)
    for _ in range(2):
        loss = F.cross_entropy(m(fg.tensor(X)), fg.tensor(Y))
        opt.zero_grad()
        loss.backward()
        opt.step()
        tl = torch.nn.functional.cross_entropy(tm(torch.tensor(X)), torch.tensor(Y))
        topt.zero_grad()
        tl.backward()
        topt.step()
    for (k, p), (_, tp) in zip(m.named_parameters(), tm.named_parameters()):
        np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-5, atol=1e-6,
                                   err_msg=k)


def test_clip_grad_norm_matches_torch():
    m, tm = pair()
    loss = F.cross_entropy(m(fg.tensor(X)), fg.tensor(Y)) * 50.0
    loss.backward()
    tl = torch.nn.functional.cross_entropy(tm(torch.tensor(X)), torch.tensor(Y)) * 50.0
    tl.backward()
    n = nn.utils.clip_grad_norm_(m.parameters(), 1.0)
    tn = torch.nn.utils.clip_grad_norm_(tm.parameters(), 1.0)
    np.testing.assert_allclose(n.item(), tn.item(), rtol=1e-5)
    for p, tp in zip(m.parameters(), tm.parameters()):
        np.testing.assert_allclose(p.grad.numpy(), tp.grad.numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("make", [
    (lambda o: optim.lr_scheduler.StepLR(o, 2, 0.5),
     lambda o: torch.optim.lr_scheduler.StepLR(o, 2, 0.5)),
    (lambda o: optim.lr_scheduler.CosineAnnealingLR(o, 5, 1e-4),
     lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 5, 1e-4)),
    (lambda o: optim.lr_scheduler.LambdaLR(o, lambda e: 1 / (1 + e)),
     lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 1 / (1 + e)))])
def test_schedulers_match_torch_without_retracing(make):
    m, tm = pair()
    opt, topt = optim.SGD(m.parameters(), lr=0.1), torch.optim.SGD(tm.parameters(), lr=0.1)
    sch, tsch = make[0](opt), make[1](topt)
    step = fg.jit(make_step(m, opt))
    for _ in range(6):
        step(fg.tensor(X), fg.tensor(Y))
        tl = torch.nn.functional.cross_entropy(tm(torch.tensor(X)), torch.tensor(Y))
        tl.backward()
        topt.step()
        topt.zero_grad()
        sch.step()
        tsch.step()
        np.testing.assert_allclose(sch.get_last_lr(), tsch.get_last_lr(), rtol=1e-12)
    assert step.stats["traces"] == 1
    for p, tp in zip(m.parameters(), tm.parameters()):
        np.testing.assert_allclose(p.numpy(), tp.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_schedule_must_state_its_formula():
    """LRScheduler is abstract: a subclass without lr_at cannot be made."""
    from fuelgraph.optim.lr_scheduler import LRScheduler
    opt = fg.optim.SGD([fg.nn.Parameter(fg.zeros(2))], lr=0.1)
    with pytest.raises(TypeError, match="lr_at"):
        type("NoFormula", (LRScheduler,), {})(opt)
