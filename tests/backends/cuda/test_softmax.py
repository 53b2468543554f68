"""SOFTMAX_LAST_DIM and its backward on the CUDA backend: the Triton kernels
(backends/cuda/kernels/softmax.py) against float64 torch references (spec §1, §7), and the op
through fuelgraph on device="cuda". Skips cleanly without a GPU unless TRITON_INTERPRET=1 (then
the kernel-level tests run in Triton's CPU interpreter)."""
from __future__ import annotations

import pytest

from .cuda_oracle import (DTYPE_IDS, DTYPES, DT, F64, HAS_CUDA, INTERPRET, KERNEL_TESTS,
                          ROW_SHAPES, assert_half_and_f32_only, assert_lowered_on_cuda, check,
                          close, np_rand, on, on_gpu, poison, rand, torch, vjp)

pytestmark = KERNEL_TESTS

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import softmax as K

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402


def ref_softmax(x):
    return torch.softmax(x.to(F64), -1)


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
def test_softmax_forward(shape, dtype):
    x = rand(shape, dtype, scale=4.0)
    poison()
    y = K.softmax_last_dim(x)
    assert y.dtype == dtype and y.shape == x.shape
    check(y, ref_softmax(x), dtype, name="softmax")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softmax_forward_large_and_inf(dtype):
    x = rand((6, 300), dtype, scale=1.0)
    x[0] += 60.0                        # no overflow thanks to the max subtraction
    x[1, :150] = float("-inf")          # masked logits
    y = K.softmax_last_dim(x)
    check(y, ref_softmax(x), dtype, name="softmax-large")
    xl = rand((2, 20000), dtype)
    xl[0, :9000] = float("-inf")        # whole first chunks -inf in the looped kernel
    check(K.softmax_last_dim(xl), ref_softmax(xl), dtype, name="softmax-looped-inf")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
def test_softmax_backward(shape, dtype):
    y = torch.softmax(rand(shape, F64, 3.0), -1).to(dtype)
    g = rand(shape, dtype)
    poison()
    dx = K.softmax_last_dim_backward(y, g)
    y64, g64 = y.to(F64), g.to(F64)
    dot = (g64 * y64).sum(-1, keepdim=True)
    ref = y64 * (g64 - dot)
    check(dx, ref, dtype, name="softmax-bwd", scale_ref=y64 * (g64.abs() + dot.abs()))


def test_softmax_backward_matches_autograd():
    x = rand((5, 77), torch.float32)
    g = rand((5, 77), torch.float32)
    dx = K.softmax_last_dim_backward(K.softmax_last_dim(x), g)
    check(dx, vjp(lambda t: torch.softmax(t, -1), x, g), torch.float32, name="softmax-autograd")


def test_kernels_declare_float64_unsupported():
    assert_half_and_f32_only(K.softmax_last_dim, K.softmax_last_dim_backward)


# ----------------------------------------------------------------------------- API on cuda
@on_gpu
@pytest.mark.parametrize("dtype", list(DT))
def test_softmax_vs_torch(dtype):
    x, xt = on(np_rand((64, 96)), dtype)
    close(F.softmax_last_dim(x).numpy(), torch.softmax(xt.float(), -1), DT[dtype][2])


@on_gpu
def test_float64_lowers_to_recipe():
    xt = torch.randn(4, 64, dtype=F64, device="cuda")
    g = torch.randn(4, 64, dtype=F64, device="cuda")
    y = F.softmax_last_dim(fg.from_torch(xt))
    assert_lowered_on_cuda(y, "softmax_last_dim")
    torch.testing.assert_close(y.to_torch(), ref_softmax(xt), rtol=1e-12, atol=1e-12)
    yt = torch.softmax(xt, -1)
    dx = F.softmax_last_dim_backward(fg.from_torch(yt), fg.from_torch(g))
    assert_lowered_on_cuda(dx, "softmax_last_dim_backward")
    torch.testing.assert_close(dx.to_torch(), yt * (g - (g * yt).sum(-1, keepdim=True)),
                               rtol=1e-12, atol=1e-12)


@on_gpu
def test_idioms_fuse_on_cuda():
    x, _ = on(np_rand((8, 32)))
    e = (x - x.max(-1, keepdim=True)).exp()
    y = e / e.sum(-1, keepdim=True)
    r = fg.explain([y])
    assert r.backend == "cuda" and r.fused_ops == {"softmax_last_dim": 1}
