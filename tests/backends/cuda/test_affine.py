"""INPLACE_AFFINE on the CUDA backend: the Triton kernel (backends/cuda/kernels/affine.py),
bit-exact against a float32 torch multiply-then-add, and the op through fuelgraph on
device="cuda" (buffer reuse, strided inputs, float64). Skips cleanly without a GPU unless
TRITON_INTERPRET=1 (then the kernel-level tests run in Triton's CPU interpreter)."""
from __future__ import annotations

import pytest

from .cuda_oracle import (DTYPE_IDS, DTYPES, F64, HAS_CUDA, INTERPRET, KERNEL_TESTS,
                          assert_half_and_f32_only, assert_lowered_on_cuda, close, np_rand, on,
                          on_gpu, rand, torch)

pytestmark = KERNEL_TESTS

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import affine as K

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402
from fuelgraph.opt import regions  # noqa: E402
from fuelgraph.runtime import executor  # noqa: E402
from fuelgraph.runtime.executor import compile_plan  # noqa: E402


@pytest.fixture
def no_glue(monkeypatch):
    """The API tests below check the affine op's own kernel and buffer contract. With glue
    regions on, an affine next to other elementwise work runs inside their generated kernel
    (no buffer of its own to reuse), so the glue pass is off for them."""
    monkeypatch.setattr(regions, "ENABLED", False)
    executor._PLANS.clear()
    yield
    executor._PLANS.clear()


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("numel", [1, 1000, 70001])
def test_inplace_affine(numel, dtype):
    x = rand((numel,), dtype)
    expect = (x.float() * torch.tensor(1.37, dtype=torch.float32)
              + torch.tensor(-0.25, dtype=torch.float32)).to(dtype)
    ptr = x.data_ptr()
    out = K.inplace_affine(x, mul=1.37, add=-0.25)
    assert out is x and x.data_ptr() == ptr
    if INTERPRET and dtype != torch.float32:
        # the CPU interpreter narrows float32 -> bf16/f16 by truncation, the GPU rounds to nearest
        torch.testing.assert_close(x, expect, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(x, expect)     # float32 multiply, then add: bit-exact


def test_kernels_declare_float64_unsupported():
    assert_half_and_f32_only(K.inplace_affine)


# ----------------------------------------------------------------------------- API on cuda
@on_gpu
def test_inplace_affine_writes_in_place_on_gpu(no_glue):
    x, xt = on(np_rand((128, 128)))
    y = x * 2.0
    z = F.inplace_affine(y, 3.0, 1.0)
    plan, _ = compile_plan([z.value])
    before = dict(plan.stats)
    close(z.numpy(), xt * 6.0 + 1.0, 1e-5)
    assert plan.stats.get("inplace_reused", 0) == before.get("inplace_reused", 0) + 1


@on_gpu
def test_inplace_affine_strided_input(no_glue):
    """A strided view (of a graph input, or of an intermediate) is made contiguous by the
    planner before the kernel runs (the kernel's old torch path for it is gone); user memory is
    never written."""
    base = torch.randn(6, 8, device="cuda")
    keep = base.clone()
    x = fg.from_torch(base)
    for src, ref in ((x[:, ::2], keep[:, ::2]), ((x * 1.5)[:, 1::2], keep[:, 1::2] * 1.5)):
        y = F.inplace_affine(src, 2.0, 1.0)
        assert fg.explain(y).fused_ops == {"inplace_affine": 1}
        torch.testing.assert_close(y.to_torch(), ref * 2.0 + 1.0)
    assert torch.equal(base, keep)


@on_gpu
def test_float64_lowers_to_recipe():
    xt = torch.randn(5, 7, dtype=F64, device="cuda")
    y = F.inplace_affine(fg.from_torch(xt), 1.37, -0.25)
    assert_lowered_on_cuda(y, "inplace_affine")
    torch.testing.assert_close(y.to_torch(), xt * 1.37 - 0.25, rtol=1e-15, atol=1e-15)
