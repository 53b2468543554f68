"""Shared helpers of the CUDA backend tests.

Two kinds of test use them:

* kernel-level tests call the Triton kernels of `fuelgraph.backends.cuda.kernels.<family>`
  directly and compare with float64 torch references. They run on a CUDA GPU or, with
  ``TRITON_INTERPRET=1``, through Triton's CPU interpreter on CPU tensors (slow; used while
  developing). Mark them (usually the whole module) with `KERNEL_TESTS`. Output buffers are
  poisoned with NaN through the caching allocator on CUDA so unwritten elements show up.
* API-level tests go through fuelgraph on ``device="cuda"`` (the planner, lowering to recipes,
  fusion, interop). They need a real GPU: mark them with `ON_GPU`.

Importing this module skips the importing test module when torch or triton is missing.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()

#: kernel-level tests: a GPU, or the Triton CPU interpreter
KERNEL_TESTS = pytest.mark.skipif(not (HAS_CUDA or INTERPRET),
                                  reason="needs a CUDA GPU (or TRITON_INTERPRET=1)")
#: API-level tests on device="cuda": a GPU
ON_GPU = [pytest.mark.cuda, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


def on_gpu(fn):
    """Decorator form of `ON_GPU`."""
    for m in reversed(ON_GPU):
        fn = m(fn)
    return fn


DEV = "cuda" if HAS_CUDA else "cpu"
F64 = torch.float64
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]

# (norm-relative bound, elementwise rtol, elementwise atol as a fraction of max|ref|)
TOL = {
    torch.float32: (1e-5, 1e-4, 1e-5),
    torch.bfloat16: (1e-2, 1.6e-2, 1e-2),
    torch.float16: (2e-3, 2e-3, 2e-3),
}

ROW_SHAPES = [(3, 7), (4, 33, 100), (128, 128), (16, 4096), (2, 20000)]
if HAS_CUDA:
    ROW_SHAPES += [(2048, 4096), (3, 5, 1000)]


# ---------------------------------------------------------------------------- kernel level
def poison():
    """Leave a NaN-filled block in the caching allocator so the next torch.empty sees NaN."""
    if HAS_CUDA:
        t = torch.full((1 << 22,), float("nan"), device=DEV)
        del t


def rand(shape, dtype, scale=1.0):
    return (torch.randn(shape, dtype=F64, device=DEV) * scale).to(dtype)


def check(out, ref, dtype, *, name="", scale_ref=None):
    """``out`` (kernel, dtype) against ``ref`` (float64). ``scale_ref`` (optional, float64, same
    shape) is the magnitude rounding errors scale with where ``ref`` itself is small through
    cancellation (e.g. y * (g - dot) when y is nearly one-hot)."""
    assert out.shape == ref.shape, (name, out.shape, ref.shape)
    o = out.to(F64)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(o), fin), f"{name}: non-finite output where ref is finite"
    o, ref = o[fin], ref[fin]
    nrel, rtol, afrac = TOL[dtype]
    denom = ref.norm().item()
    if scale_ref is not None:
        denom = max(denom, scale_ref[fin].norm().item())
    err = (o - ref).norm().item()
    assert err <= nrel * max(denom, 1e-30) + 1e-30, \
        f"{name}: norm-relative error {err / max(denom, 1e-30):.3g}"
    scale = ref.abs().max().item() if ref.numel() else 0.0
    torch.testing.assert_close(o, ref, rtol=rtol, atol=afrac * max(scale, 1e-30) + 1e-30,
                               msg=lambda m: f"{name}: {m}")


def vjp(fn, x, g):
    x = x.to(F64).detach().requires_grad_(True)
    (dx,) = torch.autograd.grad(fn(x), x, g.to(F64))
    return dx


def declared(fn):
    """The kernel-table entry (`BackendImpl`) that `@kernel` registered for function `fn`."""
    from fuelgraph.backends.base import KERNELS
    return next(k for impls in KERNELS.values() for k in impls if k.kernel is fn)


def assert_half_and_f32_only(*fns):
    """Each kernel takes float32/bfloat16/float16 and declares float64 unsupported, so the
    planner lowers a float64 call to the op's recipe (checked on a GPU by the API tests)."""
    from fuelgraph import dtype as fdt
    from fuelgraph.backends.base import accepts
    for fn in fns:
        k = declared(fn)
        for d in (fdt.float32, fdt.bfloat16, fdt.float16):
            assert accepts(k, [d]), (fn.__name__, d)
        assert not accepts(k, [fdt.float64]), fn.__name__


# ---------------------------------------------------------------------------- API level
#: fuelgraph dtype -> (NumPy dtype or None, torch dtype, tolerance vs a float32 torch result)
DT = {"float32": (np.float32, torch.float32, 2e-5), "bfloat16": (None, torch.bfloat16, 2e-2),
      "float16": (np.float16, torch.float16, 3e-3)}


def np_rand(shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def on(a, dtype="float32"):
    """(fuelgraph tensor sharing a CUDA torch tensor, that torch tensor), from NumPy `a`."""
    import fuelgraph as fg
    t = torch.tensor(a, device="cuda").to(DT[dtype][1])
    return fg.from_torch(t), t


def close(got, ref, tol):
    ref = ref.float().cpu().numpy() if isinstance(ref, torch.Tensor) else ref
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref, np.float32),
                               rtol=tol, atol=tol)


def assert_lowered_on_cuda(y, name):
    """`y`'s graph runs on the cuda backend with `name` lowered to its recipe (no kernel)."""
    import fuelgraph as fg
    rep = fg.explain(y)
    assert rep.backend == "cuda", rep.backend
    assert rep.fused_ops == {} and rep.lowered == {name: 1}, (rep.fused_ops, rep.lowered)


# ---- quantized matmul checks (test_quant*.py) ------------------------------------------------
def to_dev(a):
    """A NumPy array as a contiguous torch tensor on the test device."""
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEV)


def gguf_dequant_ref(raw, qtype: str):
    """gguf-py's own dequantization of GGUF blocks `raw` (the independent reference)."""
    import gguf
    with np.errstate(all="ignore"):
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])


def check_product(got, x, b, tol_dtype, *, same_dtype=True):
    """got vs float64 x @ b, with a tolerance by `tol_dtype` relative to the largest magnitude;
    same_dtype: got must also have that dtype and the product's shape."""
    ref = x.double().cpu() @ torch.as_tensor(np.asarray(b, np.float64))
    tol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[tol_dtype]
    if same_dtype:
        assert got.dtype == tol_dtype and got.shape == ref.shape
    err = (got.double().cpu() - ref).abs().max().item()
    assert err <= tol * max(1.0, ref.abs().max().item()), err
