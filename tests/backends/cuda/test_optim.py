"""Triton kernels of the optimizer updates (backends/cuda/kernels/optim.py) against float32
torch references written operation for operation, in place; and the optimizers through
fuelgraph on device="cuda" against the same run on the CPU. Skips cleanly without a GPU
(kernel tests also run under TRITON_INTERPRET=1)."""
from __future__ import annotations

import numpy as np
import pytest

from .cuda_oracle import DTYPE_IDS, DTYPES, HAS_CUDA, INTERPRET, KERNEL_TESTS, on_gpu, rand, torch

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import optim as K

import fuelgraph as fg  # noqa: E402


@KERNEL_TESTS
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("numel", [1, 5000])
def test_adamw_kernel(numel, dtype):
    p, g, m = (rand((numel,), dtype) for _ in range(3))
    v = rand((numel,), dtype).abs() * 0.01
    dev = p.device
    sc = [torch.tensor(x, dtype=torch.float32, device=dev) for x in (0.999, 0.01, 0.3)]
    f = [t.float() for t in (p, g, m, v)]
    pe = f[0] * sc[0]
    me = f[2] + 0.1 * (f[1] - f[2])
    ve = f[3] * 0.999 + (0.001 * f[1]) * f[1]
    pe = pe + (-sc[1]) * (me / (ve.sqrt() / sc[2] + 1e-8))
    ptrs = [t.data_ptr() for t in (p, m, v)]
    out = K.adamw_step(p, g, m, v, *sc, beta1=0.9, beta2=0.999, eps=1e-8)
    assert [t.data_ptr() for t in out] == ptrs
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    for got, want in zip(out, (pe, me, ve)):
        torch.testing.assert_close(got.float(), want.to(dtype).float(), **tol)


@KERNEL_TESTS
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("nesterov,first", [(False, True), (True, False)])
def test_sgd_kernel(dtype, nesterov, first):
    p, g, b = (rand((3000,), dtype) for _ in range(3))
    dev = p.device
    lr = torch.tensor(0.05, device=dev)
    fl = torch.tensor(1.0 if first else 0.0, device=dev)
    d = g.float() + 0.01 * p.float()
    be = d if first else b.float() * 0.9 + 1.0 * d
    de = d + 0.9 * be if nesterov else be
    pe = p.float() + (-lr) * de
    out = K.sgd_step(p, g, lr, b, fl, momentum=0.9, dampening=0.0, weight_decay=0.01,
                     nesterov=nesterov)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out[0].float(), pe.to(dtype).float(), **tol)
    torch.testing.assert_close(out[1].float(), be.to(dtype).float(), **tol)


@on_gpu
@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_optimizer_on_cuda_matches_cpu(opt):
    import fuelgraph.nn as nn
    import fuelgraph.optim as optim
    rng = np.random.default_rng(0)
    x = rng.standard_normal((16, 8)).astype(np.float32)
    y = rng.integers(0, 4, 16)
    finals = []
    for dev in ("cpu", "cuda"):
        fg.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 4)).to(dev)
        o = optim.AdamW(m.parameters(), lr=1e-2) if opt == "adamw" else \
            optim.SGD(m.parameters(), lr=0.1, momentum=0.9)
        xt, yt = fg.tensor(x, device=dev), fg.tensor(y, device=dev)
        for _ in range(3):
            loss = nn.functional.cross_entropy(m(xt), yt)
            o.zero_grad()
            loss.backward()
            o.step()
        finals.append([p.numpy() for p in m.parameters()])
    for a, b in zip(*finals):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


@on_gpu
def test_traced_step_cuda_graph_updates_in_place():
    import fuelgraph.nn as nn
    import fuelgraph.optim as optim

    def make(graph):
        fg.manual_seed(0)
        m = nn.Sequential(nn.Linear(8, 32), nn.SiLU(), nn.Linear(32, 4)).to("cuda")
        o = optim.AdamW(m.parameters(), lr=1e-2)

        def step(x, y):
            loss = nn.functional.cross_entropy(m(x), y)
            loss.backward()
            o.step()
            o.zero_grad()
            return loss
        return m, fg.jit(step, cuda_graph=graph)
    x = fg.tensor(np.random.default_rng(0).standard_normal((16, 8)).astype(np.float32),
                  device="cuda")
    y = fg.tensor(np.arange(16) % 4, device="cuda")
    m1, plain = make(False)
    m2, graphed = make(True)
    ref = [float(plain(x, y).item()) for _ in range(4)]
    got = [float(graphed(x, y).item())]
    ptrs = [p.to_torch().data_ptr() for p in m2.parameters()]
    got += [float(graphed(x, y).item()) for _ in range(3)]
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    assert [p.to_torch().data_ptr() for p in m2.parameters()] == ptrs   # updated in place
    for a, b in zip(m1.parameters(), m2.parameters()):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-6)


@on_gpu
def test_traced_step_may_make_device_constants_from_host_data():
    """A step that builds a table on the host and moves it to the GPU (as the Llama's RoPE
    cache does) traces: the table is a constant of the step, not a realize inside the trace."""
    table = np.arange(6, dtype=np.float32)

    @fg.jit
    def step(x):
        return x + fg.tensor(table, device="cuda")

    for k in range(3):
        x = fg.tensor(np.full(6, k, np.float32), device="cuda")
        np.testing.assert_array_equal(step(x).numpy(), table + k)
    assert step.stats["traces"] == 1
