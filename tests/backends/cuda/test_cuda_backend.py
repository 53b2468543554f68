"""The cuda backend as a whole, through fuelgraph on device="cuda": placement, primitives,
recipes for ops without a kernel, interop, scan, CUDA graphs, and the kernel table. The fused
ops' own tests are per family in tests/backends/cuda/test_<family>.py. Skipped where there is
no CUDA GPU (CI); the kernel-table check also runs under TRITON_INTERPRET=1."""
import numpy as np
import pytest

from .cuda_oracle import KERNEL_TESTS, close, np_rand, on, on_gpu, torch

import fuelgraph as fg
import fuelgraph.functional as F

pytestmark = KERNEL_TESTS


@on_gpu
def test_placement_and_roundtrip():
    a = np_rand((3, 5))
    for d in ("float32", "float64", "bfloat16", "float16"):
        x = fg.tensor(a, dtype=d, device="cuda")
        assert x.device == "cuda:0"
        np.testing.assert_allclose(x.numpy().astype(np.float32), a.astype(x.dtype.np).astype(np.float32))
    assert fg.tensor(a).to("cuda").device == "cuda:0"


@on_gpu
def test_primitive_graph_matches_cpu():
    a, b = np_rand((4, 6), 1), np_rand((6, 3), 2)

    def f(x, y):
        z = (x @ y).tanh() + x[:, :3].abs().sqrt() * 2.0
        return fg.cat([z, z.max(-1, keepdim=True)], -1).sum(0) - z.mean()
    cpu = f(fg.tensor(a), fg.tensor(b)).numpy()
    gpu = f(fg.tensor(a, device="cuda"), fg.tensor(b, device="cuda")).numpy()
    np.testing.assert_allclose(gpu, cpu, rtol=1e-5, atol=1e-5)


@on_gpu
def test_missing_kernel_runs_recipe_and_explain_says_so():
    fid = fg.default_registry().register(
        "cuda_test_cube_plus_one", lambda a: a * a * a + 1.0,
        sample=lambda rng: [rng.standard_normal((3, 4)).astype(np.float32)])
    from fuelgraph.registry.core import call_fused
    x, xt = on(np_rand((3, 4)))
    y = call_fused(fid, x)
    assert fg.explain([y]).lowered.get("cuda_test_cube_plus_one") == 1
    close(y.numpy(), xt ** 3 + 1.0, 1e-5)


@on_gpu
def test_mixing_devices_raises():
    with pytest.raises(fg.FuelGraphError, match="devices"):
        fg.tensor([1.0, 2.0]) + fg.tensor([1.0, 2.0], device="cuda")


@on_gpu
def test_interop_zero_copy():
    t = torch.randn(4, 4, device="cuda")
    x = fg.from_torch(t)
    assert fg.realize  # realize via to_torch keeps results on the GPU
    out = (x + 1.0).to_torch()
    assert out.is_cuda and torch.allclose(out, t + 1.0)
    from fuelgraph.ir.tensor import bound_data
    assert bound_data(x.node).data_ptr() == t.data_ptr()
    y = fg.from_dlpack(t)
    assert bound_data(y.node).data_ptr() == t.data_ptr()


@on_gpu
def test_scan_runs_on_cuda_with_gradient():
    a = np_rand((5, 3), 9)
    xs = fg.tensor(a, device="cuda", requires_grad=True)
    h0 = fg.tensor(np.zeros(3, np.float32), device="cuda")
    (h,), (ys,) = fg.scan(lambda c, x, k: ([c[0] * 0.5 + x[0]], [c[0].tanh()]), [h0], [xs])
    ref_h, ref_y = np.zeros(3, np.float32), []
    for t in range(5):                  # y_t reads the carry entering step t
        ref_y.append(np.tanh(ref_h))
        ref_h = ref_h * 0.5 + a[t]
    np.testing.assert_allclose(h.numpy(), ref_h, rtol=1e-5)
    np.testing.assert_allclose(ys.numpy(), np.stack(ref_y), rtol=1e-5)
    (g,) = fg.grad(ys.sum() + h.sum(), [xs])
    xt = torch.tensor(a, requires_grad=True)
    ht, tot = torch.zeros(3), 0
    for t in range(5):
        tot = tot + ht.tanh().sum()
        ht = ht * 0.5 + xt[t]
    (gt,) = torch.autograd.grad(tot + ht.sum(), [xt])
    np.testing.assert_allclose(g.numpy(), gt.numpy(), rtol=1e-4, atol=1e-5)


@on_gpu
def test_cuda_graph_replay_matches_eager_and_tracks_new_data():
    from fuelgraph.runtime.executor import realize_raw
    t = torch.randn(64, 32, device="cuda")
    x = fg.from_torch(t)
    y = F.softmax_last_dim((x * 2.0).tanh()) + x.mean()
    eager = realize_raw([y])[0]
    g1 = realize_raw([y], cuda_graph=True)[0]
    torch.testing.assert_close(g1, eager)
    t.mul_(3.0)                      # same buffer, new data: the replay must see it
    g2 = realize_raw([y], cuda_graph=True)[0]
    torch.testing.assert_close(g2, realize_raw([y])[0])
    x2 = fg.from_torch(torch.randn(64, 32, device="cuda"))   # same structure, other input
    y2 = F.softmax_last_dim((x2 * 2.0).tanh()) + x2.mean()
    torch.testing.assert_close(realize_raw([y2], cuda_graph=True)[0], realize_raw([y2])[0])


def test_declared_cuda_kernels_match_the_kernel_table():
    """What `declared_fused_ids` reads from the kernel sources (without importing them) is
    exactly what importing the kernel modules registers."""
    from fuelgraph.backends.base import KERNELS, import_kernel_modules
    from fuelgraph.backends.cuda import declared_fused_ids
    import_kernel_modules("fuelgraph.backends.cuda.kernels")
    # built-in ids only: run-time ops (glue regions, 0x8000 and up) get kernels from factories
    have = {k[0] for k in KERNELS if k[1] == "cuda" and isinstance(k[0], int) and k[0] < 0x8000}
    assert have == declared_fused_ids()
    assert {1, 2, 3, 4, 5, 7, 8, 9, 10, 15, 16, 17} <= have   # the first families, at least
