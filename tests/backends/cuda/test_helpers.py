"""The primitives' backward helpers on the CUDA backend: REDUCE_MAX_TO_BACKWARD and
POWI_BACKWARD as Triton kernels (backends/cuda/kernels/helpers.py) against float64 torch
references (spec §10, §15), and through fuelgraph on device="cuda". The Triton reduce-max
kernel covers the keepdim max over the last axis only: other reductions lower to the recipe
(the former torch fallback is gone). A wrongly shaped grad is a build-time registry error:
tests/registry/test_backward_helpers.py::test_reduce_max_to_backward_errors. Skips cleanly
without a GPU unless TRITON_INTERPRET=1 (then the kernel-level tests run in Triton's CPU
interpreter)."""
from __future__ import annotations

import pytest

from .cuda_oracle import (DTYPE_IDS, DTYPES, F64, DEV, HAS_CUDA, INTERPRET, KERNEL_TESTS,
                          assert_half_and_f32_only, assert_lowered_on_cuda, check, declared,
                          on_gpu, poison, rand, torch)

pytestmark = KERNEL_TESTS

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import helpers as K

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402


def ref_amax_bwd(x, g, dims):
    x64 = x.to(F64).detach().requires_grad_(True)
    y = torch.amax(x64, dim=dims, keepdim=True)
    (dx,) = torch.autograd.grad(y, x64, g.to(F64).reshape(y.shape))
    return dx


# keepdim grad shapes of x (4, 5, 6) reduced over axes other than (only) the last
OTHER_AXES = [((1, 1, 6), (0, 1)), ((4, 1, 1), (1, 2)), ((1, 1, 1), (0, 1, 2)),
              ((1, 5, 6), (0,))]


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(5, 9), (3, 4, 100), (64, 1000), (2, 20000)], ids=str)
def test_reduce_max_to_backward_last_axis(shape, dtype):
    x = torch.randint(-4, 4, shape, device=DEV).to(dtype)        # many ties
    x[0] = rand(shape[1:], dtype)                                # one tie-free slice
    g = rand(shape[:-1] + (1,), dtype)
    poison()
    dx = K.reduce_max_to_backward(x, g)
    check(dx, ref_amax_bwd(x, g, -1), dtype, name="rmax")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_reduce_max_to_backward_nan_window(dtype):
    x = rand((4, 300), dtype)
    x[2, 17] = float("nan")
    g = rand((4, 1), dtype)
    dx = K.reduce_max_to_backward(x, g)
    ref = ref_amax_bwd(x, g, -1)           # torch amax: NaN over the whole NaN window
    assert torch.isnan(dx[2]).all() and torch.isnan(ref[2]).all()
    keep = torch.tensor([0, 1, 3], device=DEV)
    check(dx[keep], ref[keep], dtype, name="rmax-nan")
    xl = rand((2, 20000), dtype)
    xl[1, 19999] = float("nan")
    dxl = K.reduce_max_to_backward(xl, rand((2, 1), dtype))
    assert torch.isnan(dxl[1]).all() and torch.isfinite(dxl[0]).all()


@pytest.mark.parametrize("gshape,dims", OTHER_AXES, ids=str)
def test_reduce_max_to_backward_declares_last_axis_only(gshape, dims):
    """Other reductions are not the kernel's: it declares so, and the planner lowers them."""
    impl = declared(K.reduce_max_to_backward)
    assert not impl.supports([(4, 5, 6), gshape], [fg.float32] * 2, None)
    assert impl.supports([(4, 5, 6), (4, 5, 1)], [fg.float32] * 2, None)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("exp", [-3, -1, 0, 1, 2, 3, 7])
def test_powi_backward(exp, dtype):
    shape = (3, 1001)
    x = rand(shape, F64)
    x = (x.sign() * (torch.rand(shape, dtype=F64, device=DEV) + 0.5)).to(dtype)  # |x| in [0.5, 1.5)
    g = rand(shape, dtype)
    poison()
    dx = K.powi_backward(x, g, exp=exp)
    x64, g64 = x.to(F64), g.to(F64)
    ref = torch.zeros_like(x64) if exp == 0 else exp * x64.pow(exp - 1) * g64
    check(dx, ref, dtype, name=f"powi{exp}")


def test_powi_backward_exp0_is_zero_at_zero():
    x = torch.zeros(10, device=DEV)
    dx = K.powi_backward(x, torch.ones(10, device=DEV), exp=0)
    assert torch.equal(dx, torch.zeros(10, device=DEV))
    dx1 = K.powi_backward(x, torch.full((10,), 3.0, device=DEV), exp=1)
    assert torch.equal(dx1, torch.full((10,), 3.0, device=DEV))


def test_kernels_declare_float64_unsupported():
    assert_half_and_f32_only(K.reduce_max_to_backward, K.powi_backward)


# ----------------------------------------------------------------------------- API on cuda
@on_gpu
@pytest.mark.parametrize("gshape,dims", OTHER_AXES, ids=str)
def test_reduce_max_to_backward_other_axes_lower_to_recipe(gshape, dims):
    xt = torch.randint(-3, 3, (4, 5, 6), device="cuda").float()     # many ties
    gt = torch.randn(gshape, device="cuda")
    dx = F.reduce_max_to_backward(fg.from_torch(xt), fg.from_torch(gt))
    assert_lowered_on_cuda(dx, "reduce_max_to_backward")
    check(dx.to_torch(), ref_amax_bwd(xt, gt, dims), torch.float32)


@on_gpu
def test_float64_lowers_to_recipe():
    xt = torch.randn(3, 40, dtype=F64, device="cuda")
    gt = torch.randn(3, 40, dtype=F64, device="cuda")
    dx = F.reduce_max_to_backward(fg.from_torch(xt), fg.from_torch(gt[:, :1].contiguous()))
    assert_lowered_on_cuda(dx, "reduce_max_to_backward")
    torch.testing.assert_close(dx.to_torch(), ref_amax_bwd(xt, gt[:, :1], -1), rtol=1e-12,
                               atol=1e-12)
    p = F.powi_backward(fg.from_torch(xt), fg.from_torch(gt), -3)
    assert_lowered_on_cuda(p, "powi_backward")
    torch.testing.assert_close(p.to_torch(), -3 * xt ** -4 * gt, rtol=1e-12, atol=1e-12)
