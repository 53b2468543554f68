"""Scenarios run by every process of a multi-process test (see harness.py). Each returns plain
data (arrays, numbers, strings) that the tests compare with references they compute in one
process. Inputs are drawn from seeds that depend on the rank, so the tests can draw every
rank's inputs again (`rank_input`)."""
from __future__ import annotations

import os
import tempfile

import numpy as np

NP = {"float32": np.float32, "float64": np.float64, "bfloat16": "bfloat16",
      "float16": np.float16}
DTYPES = tuple(NP)


def np_dtype(name):
    import ml_dtypes
    return ml_dtypes.bfloat16 if name == "bfloat16" else NP[name]


def rank_input(rank, shape, dtype, salt=0):
    rng = np.random.default_rng(1000 * salt + rank)
    return rng.standard_normal(shape).astype(np_dtype(dtype))


def _f64(t):
    return np.asarray(t.numpy(), np.float64)


def dev() -> str:
    """The device of the run: "cpu" (gloo), or this process's GPU (NCCL) when the harness
    runs on GPUs."""
    if os.environ.get("FG_TEST_DEVICE", "cpu") == "cuda":
        import fuelgraph.distributed as dist
        return dist.device()
    return "cpu"


# ---- collectives through the public builders, forward and backward ----------------------------
COLLECTIVE_CASES = [            # (name, builder kwargs, input shape)
    ("all_reduce_sum", {"op": "sum"}, (3, 5)),
    ("all_reduce_avg", {"op": "avg"}, (3, 5)),
    ("all_reduce_0d", {"op": "sum"}, ()),
    ("all_gather_0", {"axis": 0}, (3, 4)),
    ("all_gather_1", {"axis": 1}, (2, 3, 4)),
    ("all_gather_shard_grad", {"axis": -1, "grad": "shard"}, (3, 4)),
    ("reduce_scatter_0", {"axis": 0, "op": "sum"}, (4, 3)),
    ("reduce_scatter_1_avg", {"axis": 1, "op": "avg"}, (3, 6, 2)),
    ("shard_1", {"axis": 1}, (3, 4)),
    ("replicate", {}, (3, 4)),
]


def _builder(name):
    import fuelgraph.functional as F
    for op in ("all_reduce", "all_gather", "reduce_scatter", "shard", "replicate"):
        if name.startswith(op):
            return getattr(F, op)
    raise KeyError(name)


def collectives():
    """Per case and dtype: the output, and x.grad of sum(y * w) for a rank-dependent w."""
    import fuelgraph as fg
    import fuelgraph.distributed as dist
    import fuelgraph.functional as F
    from fuelgraph import FuelGraphError
    r = dist.rank()
    out = {}
    for case, kw, shape in COLLECTIVE_CASES:
        for dtype in DTYPES:
            x = fg.tensor(rank_input(r, shape, dtype, 1), device=dev(), requires_grad=True)
            y = _builder(case)(x, **kw)
            w = fg.tensor(rank_input(r, y.shape, dtype, 2), device=dev())
            (y * w).sum().backward()
            out[(case, dtype)] = (_f64(y), _f64(x.grad), tuple(y.shape))
    # integer sums, and an input leaf is not overwritten by the in-place all_reduce
    xi = fg.tensor(np.arange(6, dtype=np.int64) * (r + 1), device=dev())
    out["int_sum"] = F.all_reduce(xi).numpy().copy()
    out["leaf_kept"] = xi.numpy().copy()
    # broadcast_ gives every process rank 0's values, whatever the dtype
    bs = [fg.tensor(rank_input(r, (3, 2), d, 6), device=dev()) for d in DTYPES] + \
        [fg.tensor(np.arange(4) * (r + 1), device=dev())]
    dist.broadcast_(bs)
    out["broadcast"] = [np.asarray(t.numpy(), np.float64) for t in bs]
    # several collectives and compute in one plan
    a = fg.tensor(rank_input(r, (4, 6), "float32", 3), device=dev())
    b = F.all_reduce(a * 2.0)
    c = F.all_gather(b.sum(0, keepdim=True) + 1.0, 0)
    d = F.reduce_scatter(c @ a.mT, 1)
    out["chain"] = tuple(_f64(t) for t in fg.realize([b, c, d]))
    # the recipe refuses over two processes
    try:
        fg.realize([F.all_reduce(a)], lower_all=True)
        out["lower_all"] = "no error"
    except FuelGraphError as e:
        out["lower_all"] = str(e)
    # different graphs on the two processes: the agreement check raises on both
    z = fg.tensor(np.ones(3 + r, np.float32), device=dev())
    try:
        F.all_reduce(z).numpy()
        out["mismatch"] = "no error"
    except FuelGraphError as e:
        out["mismatch"] = str(e)
    return out


def numpy_kernels():
    """The NumPy kernels called directly: handles, out=, 16-bit accumulation, axes."""
    import fuelgraph.backends.numpy.collective as K
    import fuelgraph.distributed as dist
    r, w = dist.rank(), dist.world_size()
    out = {}
    for dtype in DTYPES:
        x = rank_input(r, (5, 4), dtype, 4)
        h, y = K.all_reduce(x.copy(), op="sum", group="world", world=w)
        h.wait()
        h.wait()                                       # waiting twice is harmless
        fresh = np.empty_like(x)
        h2, y2 = K.all_reduce(x, op="avg", group="world", world=w, out=fresh)
        h2.wait()
        h3, y3 = K.all_gather(x, axis=1, grad="reduce_scatter", group="world", world=w)
        h4, y4 = K.reduce_scatter(x.reshape(10, 2), axis=0, op="sum", group="world", world=w)
        h3.wait()
        h4.wait()
        y5 = K.shard(x, axis=1, group="world", world=w)
        out[dtype] = [np.asarray(v, np.float64) for v in (y, y2, y3, y4, y5)] + \
            [y2 is fresh, np.array_equal(x, rank_input(r, (5, 4), dtype, 4))]
    return out


def cuda_kernels():
    """The CUDA kernels called directly (as numpy_kernels; torch CUDA tensors)."""
    import torch
    import fuelgraph.backends.cuda.kernels.collective as K
    import fuelgraph.distributed as dist
    r, w = dist.rank(), dist.world_size()
    out = {}
    for dtype in DTYPES:
        a = rank_input(r, (5, 4), dtype, 4)
        x = torch.tensor(np.asarray(a, np.float64)).to(getattr(torch, dtype)).to(dev())
        h, y = K.all_reduce(x.clone(), op="sum", group="world", world=w)
        h.wait()
        fresh = torch.empty_like(x)
        h2, y2 = K.all_reduce(x, op="avg", group="world", world=w, out=fresh)
        h3, y3 = K.all_gather(x, axis=1, grad="reduce_scatter", group="world", world=w)
        h4, y4 = K.reduce_scatter(x.reshape(10, 2), axis=0, op="sum", group="world", world=w)
        for h in (h2, h3, h4):
            h.wait()
        y5 = K.shard(x, axis=1, group="world", world=w)
        kept = torch.equal(x.double().cpu(), torch.tensor(np.asarray(a, np.float64)))
        out[dtype] = [v.double().cpu().numpy() for v in (y, y2, y3, y4, y5)] + \
            [y2 is fresh, kept]
    return out


# ---- scheduling -------------------------------------------------------------------------------
def mlp(seed=0, sizes=(16, 32, 32, 8)):
    import fuelgraph as fg
    import fuelgraph.nn as nn
    fg.manual_seed(seed)
    layers = []
    for i, (a, b) in enumerate(zip(sizes, sizes[1:])):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(nn.SiLU())
    return nn.Sequential(*layers).to(dev())


def schedule():
    """Issue order of a data-parallel step's collectives, and whether the first gradient
    all-reduce starts before the backward's last matrix product (overlap)."""
    import fuelgraph.distributed as dist
    import fuelgraph.nn.functional as F
    from fuelgraph.ir.tensor import Tensor
    from fuelgraph.runtime.executor import compile_plan
    m = mlp()
    dp = dist.DataParallel(m, bucket_mb=4096 / 2**20)
    x, y = dp.shard_batch(*dp_batch())
    loss = F.cross_entropy(dp(x), y)
    dp.backward(loss)
    grads = [p.grad for p in m.parameters()]
    plan, _ = compile_plan([Tensor(loss.value).value] + [g.value for g in grads])
    names = [st.op.name for st in plan.steps]
    colls = [i for i, n in enumerate(names) if n == "all_reduce"]
    mms = [i for i, n in enumerate(names) if n in ("matmul", "fused_linear")]
    return {"names": names, "n_buckets": len(dp.buckets()), "first_coll": colls[0],
            "last_matmul": mms[-1], "coll_shapes": [plan.slot_types[plan.steps[i].srcs[0]][0]
                                                    for i in colls]}


# ---- data parallel ------------------------------------------------------------------------------
DP_STEPS_TRACED, DP_STEPS_EAGER = 3, 2


def dp_batch(step=0, n=8):
    rng = np.random.default_rng(50 + step)
    return rng.standard_normal((n, 16)).astype(np.float32), rng.integers(0, 8, n)


def data_parallel():
    """Losses (averaged over the processes) and final parameters of a data-parallel run:
    traced steps, then eager ones; rank 1 starts from other weights (the broadcast fixes it)."""
    import fuelgraph.distributed as dist
    import fuelgraph.nn.functional as F
    import fuelgraph.optim as optim
    m = mlp(seed=0 if dist.rank() == 0 else 7)
    dp = dist.DataParallel(m, bucket_mb=4096 / 2**20)
    opt = optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
    step = dp.train_step(lambda x, y: F.cross_entropy(dp(x), y), opt)
    losses = []
    for i in range(DP_STEPS_TRACED):
        losses.append(step(*dp.shard_batch(*dp_batch(i))).item())
    for i in range(DP_STEPS_TRACED, DP_STEPS_TRACED + DP_STEPS_EAGER):
        x, y = dp.shard_batch(*dp_batch(i))
        loss = F.cross_entropy(dp(x), y)
        dp.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(dp.average(loss).item())
    return {"losses": losses, "params": {k: v.numpy().copy() for k, v in m.state_dict().items()},
            "replays": step.stats["replays"], "traces": step.stats["traces"]}


def reference_data_parallel():
    """The same training in one process on the whole batch."""
    import fuelgraph.nn.functional as F
    import fuelgraph.optim as optim
    from fuelgraph.api import tensor
    m = mlp(seed=0)
    opt = optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.01)
    losses = []
    for i in range(DP_STEPS_TRACED + DP_STEPS_EAGER):
        x, y = dp_batch(i)
        loss = F.cross_entropy(m(tensor(x)), tensor(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": {k: v.numpy().copy() for k, v in m.state_dict().items()}}


# ---- tensor parallel ----------------------------------------------------------------------------
TP = dict(vocab=48, dim=32, heads=4, kv_heads=2, ffn=64, layers=2, seq=8, batch=2)


def tiny_lm(seed=0, device=None):
    """A Llama-style model from fuelgraph.nn layers: embedding, pre-norm blocks (RMS norm,
    grouped-query attention with RoPE, a SiLU-gated MLP with biases), a final norm and an
    output head."""
    import fuelgraph as fg
    import fuelgraph.functional as FF
    import fuelgraph.nn as nn
    import fuelgraph.nn.functional as F
    c = TP

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads, self.kv_heads, self.head_dim = c["heads"], c["kv_heads"], \
                c["dim"] // c["heads"]
            hd = self.head_dim
            self.wq = nn.Linear(c["dim"], c["heads"] * hd, bias=False)
            self.wk = nn.Linear(c["dim"], c["kv_heads"] * hd, bias=False)
            self.wv = nn.Linear(c["dim"], c["kv_heads"] * hd, bias=False)
            self.wo = nn.Linear(c["heads"] * hd, c["dim"], bias=True)

        def forward(self, x, cos, sin):
            b, s, _ = x.shape
            q = self.wq(x).reshape(b, s, self.heads, self.head_dim).transpose(1, 2)
            k = self.wk(x).reshape(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
            v = self.wv(x).reshape(b, s, self.kv_heads, self.head_dim).transpose(1, 2)
            q, k = FF.rope(q, cos, sin), FF.rope(k, cos, sin)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            return self.wo(o.transpose(1, 2).reshape(b, s, self.heads * self.head_dim))

    class MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate = nn.Linear(c["dim"], c["ffn"], bias=True)
            self.up = nn.Linear(c["dim"], c["ffn"], bias=False)
            self.down = nn.Linear(c["ffn"], c["dim"], bias=True)

        def forward(self, x):
            return self.down(F.silu(self.gate(x)) * self.up(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.RMSNorm(c["dim"], 1e-6), nn.RMSNorm(c["dim"], 1e-6)
            self.attn, self.mlp = Attention(), MLP()

        def forward(self, x, cos, sin):
            x = x + self.attn(self.norm1(x), cos, sin)
            return x + self.mlp(self.norm2(x))

    class TinyLM(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(c["vocab"], c["dim"])
            self.blocks = nn.ModuleList([Block() for _ in range(c["layers"])])
            self.norm = nn.RMSNorm(c["dim"], 1e-6)
            self.head = nn.Linear(c["dim"], c["vocab"], bias=False)
            hd = c["dim"] // c["heads"]
            inv = 10000.0 ** (-np.arange(0, hd, 2) / hd)
            ang = np.arange(c["seq"])[:, None] * inv[None, :]
            self.cos = fg.tensor(np.concatenate([np.cos(ang)] * 2, -1).astype(np.float32),
                                 device=device or "cpu")
            self.sin = fg.tensor(np.concatenate([np.sin(ang)] * 2, -1).astype(np.float32),
                                 device=device or "cpu")

        def forward(self, idx):
            x = self.emb(idx)
            for blk in self.blocks:
                x = blk(x, self.cos, self.sin)
            return self.head(self.norm(x))

    fg.manual_seed(seed)
    m = TinyLM()
    return m.to(device) if device else m


def tp_plan():
    from fuelgraph.distributed import Heads
    return {"blocks.*.attn.w[qkv]": "column", "blocks.*.attn.wo": "row",
            "blocks.*.attn": Heads("heads", "kv_heads"), "blocks.*.mlp.gate": "column",
            "blocks.*.mlp.up": "column", "blocks.*.mlp.down": "row", "head": "column_gather"}


def tp_batch(step=0):
    rng = np.random.default_rng(70 + step)
    c = TP
    return (rng.integers(0, c["vocab"], (c["batch"], c["seq"])),
            rng.integers(0, c["vocab"], (c["batch"], c["seq"])))


def tensor_parallel():
    """Logits and two training steps of a tensor-parallel model loaded from a full checkpoint,
    against the single-device model in the same process; the shard of every parameter."""
    import fuelgraph as fg
    import fuelgraph.distributed as dist
    import fuelgraph.nn.functional as F
    import fuelgraph.optim as optim
    from fuelgraph.api import tensor
    full = tiny_lm(seed=0, device=dev())
    path = os.path.join(tempfile.gettempdir(), f"fg_tp_{os.environ['MASTER_PORT']}.safetensors")
    if dist.rank() == 0:
        fg.save(full.state_dict(), path)
    dist.barrier()
    tp = dist.parallelize(tiny_lm(seed=5, device=dev()), tp_plan())   # the load sets weights
    dist.load_sharded(tp, path)
    dist.barrier()
    if dist.rank() == 0:
        os.remove(path)
    idx, tgt = (tensor(a, device=dev()) for a in tp_batch())
    out = {"logits": tp(idx).numpy().copy(), "logits_full": full(idx).numpy().copy()}

    def loss_of(model, i, t):
        return F.cross_entropy(model(i).reshape(-1, TP["vocab"]), t.reshape(-1))
    # SGD: the update is linear in the gradient, so the comparison is as tight as the
    # gradients (AdamW's m / sqrt(v) amplifies rounding where a gradient is near zero)
    opts = [optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (tp, full)]
    steps = [fg.jit(lambda i, t, m=m, o=o: _train(loss_of(m, i, t), o)) for m, o in
             zip((tp, full), opts)]
    losses = []
    for s in range(2):
        i, t = (tensor(a, device=dev()) for a in tp_batch(s))
        losses.append((steps[0](i, t).item(), steps[1](i, t).item()))
    out["losses"] = losses
    out["tp_params"] = {k: v.numpy().copy() for k, v in tp.state_dict().items()}
    out["full_params"] = {k: v.numpy().copy() for k, v in full.state_dict().items()}
    out["shard_axes"] = {k: getattr(m, "shard_axes", {}) for k, m in tp.named_modules()}
    return out


def _train(loss, opt):
    loss.backward()
    opt.step()
    opt.zero_grad()
    return loss


# ---- tensor parallel: fuelgraph.models' Llama ------------------------------------------------
def llama_config():
    from fuelgraph.models import LlamaConfig
    return LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, attention_bias=True,
                       max_position_embeddings=64)


def tensor_parallel_llama():
    """fuelgraph.models.LlamaForCausalLM split by `llama_plan()` and loaded from a Hugging Face
    checkpoint directory: logits, loss and one SGD step against the single-device model."""
    import fuelgraph as fg
    import fuelgraph.distributed as dist
    import fuelgraph.optim as optim
    from fuelgraph.api import tensor
    from fuelgraph.models import LlamaForCausalLM, init_random, save_pretrained
    cfg = llama_config()
    full = init_random(LlamaForCausalLM(cfg, device=dev()), seed=0)
    path = os.path.join(tempfile.gettempdir(), f"fg_tp_llama_{os.environ['MASTER_PORT']}")
    if dist.rank() == 0:
        save_pretrained(full, path)
    dist.barrier()
    tp = dist.parallelize(LlamaForCausalLM(cfg, device=dev()), dist.llama_plan())
    dist.load_sharded(tp, path)
    dist.barrier()
    if dist.rank() == 0:
        import shutil
        shutil.rmtree(path)
    ids = tensor(np.random.default_rng(3).integers(0, cfg.vocab_size, (2, 8)), device=dev())
    out = {"logits": tp(ids).numpy().copy(), "logits_full": full(ids).numpy().copy()}
    losses = []
    for m in (tp, full):
        opt = optim.SGD(m.parameters(), lr=0.1)
        loss = m(ids, labels=ids)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    out["losses"] = losses
    out["tp_params"] = {k: v.numpy().copy() for k, v in tp.state_dict().items()}
    out["full_params"] = {k: v.numpy().copy() for k, v in full.state_dict().items()}
    out["shard_axes"] = {k: getattr(m, "shard_axes", {}) for k, m in tp.named_modules()}
    out["heads"] = (tp.model.layers[0].self_attn.hq, tp.model.layers[0].self_attn.hkv)
    return out
