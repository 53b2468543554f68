"""The cuda backend end to end: placement, primitives, fused ops vs torch, idiom fusion,
in-place writes, interop and errors. Skipped where no CUDA GPU (CI); run on the device."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402
from fuelgraph.runtime.executor import compile_plan  # noqa: E402

DT = {"float32": (np.float32, torch.float32, 2e-5), "bfloat16": (None, torch.bfloat16, 2e-2),
      "float16": (np.float16, torch.float16, 3e-3)}


def _rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _on(a, dtype="float32"):
    t = torch.tensor(a, device="cuda").to(DT[dtype][1])
    return fg.from_torch(t), t


def _close(got, ref, tol):
    ref = ref.float().cpu().numpy() if isinstance(ref, torch.Tensor) else ref
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol)


def test_placement_and_roundtrip():
    a = _rand((3, 5))
    for d in ("float32", "float64", "bfloat16", "float16"):
        x = fg.tensor(a, dtype=d, device="cuda")
        assert x.device == "cuda:0"
        np.testing.assert_allclose(x.numpy().astype(np.float32), a.astype(x.dtype.np).astype(np.float32))
    assert fg.tensor(a).to("cuda").device == "cuda:0"


def test_primitive_graph_matches_cpu():
    a, b = _rand((4, 6), 1), _rand((6, 3), 2)
    def f(x, y):
        z = (x @ y).tanh() + x[:, :3].abs().sqrt() * 2.0
        return fg.cat([z, z.max(-1, keepdim=True)], -1).sum(0) - z.mean()
    cpu = f(fg.tensor(a), fg.tensor(b)).numpy()
    gpu = f(fg.tensor(a, device="cuda"), fg.tensor(b, device="cuda")).numpy()
    np.testing.assert_allclose(gpu, cpu, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", list(DT))
def test_fused_ops_vs_torch(dtype):
    tol = DT[dtype][2]
    x, xt = _on(_rand((64, 96)), dtype)
    _close(F.softmax_last_dim(x).numpy(), torch.softmax(xt.float(), -1), tol)
    _close(F.rms_norm_last_dim(x, 1e-6).numpy(), torch.nn.functional.rms_norm(xt.float(), (96,), eps=1e-6), tol)
    _close(F.layer_norm_last_dim(x, 1e-5).numpy(), torch.nn.functional.layer_norm(xt.float(), (96,), eps=1e-5), tol)
    w, wt = _on(_rand((96, 32), 3), dtype)
    bias, bt = _on(_rand((32,), 4), dtype)
    _close(F.fused_linear(x, w, bias).numpy(), torch.addmm(bt.float(), xt.float(), wt.float()), tol * 4)
    t = torch.randint(0, 96, (64,), device="cuda")
    tt = fg.from_torch(t)
    _close(F.fused_softmax_cross_entropy(x, tt).numpy(),
           torch.nn.functional.cross_entropy(xt.float(), t), tol)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradients_through_fused_ops(dtype):
    tol = DT[dtype][2] * 4
    a = _rand((16, 64))
    x = fg.tensor(a, dtype=dtype, device="cuda", requires_grad=True)
    xt = torch.tensor(a, device="cuda").to(DT[dtype][1]).float().requires_grad_()
    w = np.random.default_rng(7).standard_normal((16, 64)).astype(np.float32)
    wf = fg.tensor(w, dtype=dtype, device="cuda")
    loss = (F.rms_norm_last_dim(F.softmax_last_dim(x) * 3.0) * wf).astype(fg.float32).sum()
    (gx,) = fg.grad(loss, [x])
    wt = torch.tensor(w, device="cuda").to(DT[dtype][1]).float()
    ref = (torch.nn.functional.rms_norm(torch.softmax(xt, -1) * 3.0, (64,), eps=1e-6) * wt).sum()
    ref.backward()
    _close(gx.numpy(), xt.grad, tol)


def test_idioms_fuse_on_cuda():
    x, _ = _on(_rand((8, 32)))
    e = (x - x.max(-1, keepdim=True)).exp()
    y = e / e.sum(-1, keepdim=True)
    r = fg.explain([y])
    assert r.backend == "cuda" and r.fused_ops == {"softmax_last_dim": 1}


def test_inplace_affine_writes_in_place_on_gpu():
    x, xt = _on(_rand((128, 128)))
    y = x * 2.0
    z = F.inplace_affine(y, 3.0, 1.0)
    plan, _ = compile_plan([z.value])
    before = dict(plan.stats)
    _close(z.numpy(), xt * 6.0 + 1.0, 1e-5)
    assert plan.stats.get("inplace_reused", 0) == before.get("inplace_reused", 0) + 1


def test_missing_kernel_runs_recipe_and_explain_says_so():
    fid = fg.default_registry().register(
        "cuda_test_cube_plus_one", lambda a: a * a * a + 1.0,
        sample=lambda rng: [rng.standard_normal((3, 4)).astype(np.float32)])
    from fuelgraph.registry.core import call_fused
    x, xt = _on(_rand((3, 4)))
    y = call_fused(fid, x)
    assert fg.explain([y]).lowered.get("cuda_test_cube_plus_one") == 1
    _close(y.numpy(), xt ** 3 + 1.0, 1e-5)


def test_mixing_devices_raises():
    with pytest.raises(fg.FuelGraphError, match="devices"):
        fg.tensor([1.0, 2.0]) + fg.tensor([1.0, 2.0], device="cuda")


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


def test_scan_runs_on_cuda_with_gradient():
    a = _rand((5, 3), 9)
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


def test_listed_cuda_kernels_match_the_kernel_table():
    from fuelgraph.backends import get_backend_by_name
    from fuelgraph.backends.base import KERNELS
    from fuelgraph.backends.cuda import FUSED_KERNEL_NAMES
    get_backend_by_name("cuda")
    reg = fg.default_registry()
    have = {reg.entry(k[0]).name for k in KERNELS if k[1] == "cuda" and isinstance(k[0], int)}
    assert have == set(FUSED_KERNEL_NAMES)
