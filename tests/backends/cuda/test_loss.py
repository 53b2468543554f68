"""FUSED_SOFTMAX_CROSS_ENTROPY (forward and backward) on the CUDA backend: the Triton kernels
(backends/cuda/kernels/loss.py) against float64 torch references (spec §17, H.3), and the op
through fuelgraph on device="cuda". Build-time errors (targets shape, reduction) are the
registry's: tests/registry/test_loss.py::test_build_time_errors; the opt-in run-time target
check (CHECK_TARGETS) stays here. Skips cleanly without a GPU unless TRITON_INTERPRET=1 (then
the kernel-level tests run in Triton's CPU interpreter)."""
from __future__ import annotations

import pytest

from .cuda_oracle import (DTYPE_IDS, DTYPES, DT, F64, DEV, HAS_CUDA, INTERPRET, KERNEL_TESTS,
                          assert_half_and_f32_only, assert_lowered_on_cuda, check, close,
                          np_rand, on, on_gpu, poison, rand, torch, vjp)

pytestmark = KERNEL_TESTS

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import loss as K
    from fuelgraph.errors import FuelGraphError

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402


def ref_ce(logits, targets, reduction, ignore_index):
    x = logits.reshape(-1, logits.shape[-1]).to(F64)
    t = targets.reshape(-1)
    ii = -(2**62) if ignore_index is None else ignore_index
    valid = t != ii
    if reduction == "mean" and not bool(valid.any()):
        return x.sum() * 0.0            # keeps the autograd graph: zero loss, zero gradient
    out = torch.nn.functional.cross_entropy(x, t, reduction=reduction, ignore_index=ii)
    return out.reshape(targets.shape) if reduction == "none" else out


def make_targets(shape, V, ignore_index, frac_ignored=0.3):
    t = torch.randint(0, V, shape, device=DEV)
    if ignore_index is not None:
        drop = torch.rand(shape, device=DEV) < frac_ignored
        t = torch.where(drop, torch.full_like(t, ignore_index), t)
    return t


CE_SHAPES = [(7, 1000), (2, 3, 130), (5, 9000), (600, 64)]
if HAS_CUDA:
    CE_SHAPES += [(4, 128256), (1000, 32000)]


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("ignore_index", [-100, None, 3], ids=["ii-100", "iiNone", "ii3"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", CE_SHAPES, ids=str)
def test_cross_entropy(shape, dtype, reduction, ignore_index):
    V = shape[-1]
    x = rand(shape, dtype, 3.0)
    t = make_targets(shape[:-1], V, ignore_index)
    poison()
    out = K.fused_softmax_cross_entropy(x, t, reduction=reduction, ignore_index=ignore_index)
    assert out.dtype == torch.float32
    assert out.shape == (t.shape if reduction == "none" else ())
    ref = ref_ce(x, t, reduction, ignore_index)
    torch.testing.assert_close(out.to(F64), ref, rtol=2e-5, atol=2e-5)

    gshape = t.shape if reduction == "none" else ()
    g = rand(gshape, torch.float32) if reduction == "none" else torch.tensor(1.7, device=DEV)
    poison()
    dx = K.fused_softmax_cross_entropy_backward(x, t, g, reduction=reduction,
                                                ignore_index=ignore_index)
    assert dx.dtype == dtype and dx.shape == x.shape
    dref = vjp(lambda z: ref_ce(z, t, reduction, ignore_index), x, g)
    check(dx, dref, dtype, name="ce-bwd")


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_split_rows(splits, reduction):
    x = rand((3, 50000), torch.bfloat16, 3.0)
    t = torch.tensor([5, -100, 49999], device=DEV)
    out = K._fsce_forward(x, t, reduction, -100, splits=splits)
    torch.testing.assert_close(out.to(F64), ref_ce(x, t, reduction, -100), rtol=2e-5, atol=2e-5)
    g = rand((3,), torch.float32) if reduction == "none" else torch.tensor(0.5, device=DEV)
    dx = K._fsce_backward(x, t, g, reduction, -100, splits=splits)
    check(dx, vjp(lambda z: ref_ce(z, t, reduction, -100), x, g), torch.bfloat16, name="ce-split")


def test_cross_entropy_all_ignored_and_empty():
    x = rand((4, 33), torch.float32)
    t = torch.full((4,), -100, device=DEV)
    for red in ("mean", "sum"):
        out = K.fused_softmax_cross_entropy(x, t, reduction=red, ignore_index=-100)
        assert out.item() == 0.0
        dx = K.fused_softmax_cross_entropy_backward(x, t, torch.tensor(1.0, device=DEV),
                                                    reduction=red, ignore_index=-100)
        assert torch.count_nonzero(dx).item() == 0
    out = K.fused_softmax_cross_entropy(x, t, reduction="none", ignore_index=-100)
    assert out.shape == (4,) and torch.count_nonzero(out).item() == 0
    e = K.fused_softmax_cross_entropy(rand((0, 5), torch.float32),
                                      torch.zeros(0, dtype=torch.int64, device=DEV),
                                      reduction="mean", ignore_index=-100)
    assert e.shape == () and e.item() == 0.0


def test_cross_entropy_rank1_and_python_grad():
    x = rand((50,), torch.float32)
    t = torch.tensor(7, device=DEV)
    out = K.fused_softmax_cross_entropy(x, t, reduction="sum", ignore_index=None)
    assert out.shape == ()
    torch.testing.assert_close(out.to(F64), ref_ce(x[None], t[None], "sum", None))
    dx = K.fused_softmax_cross_entropy_backward(x, t, 2.0, reduction="sum", ignore_index=None)
    ref = 2.0 * (torch.softmax(x.to(F64), -1) - torch.nn.functional.one_hot(t, 50).to(F64))
    check(dx, ref, torch.float32)


def test_cross_entropy_out_of_range_target():
    x = rand((3, 40), torch.float32)
    t = torch.tensor([1, 40, -7], device=DEV)
    out = K.fused_softmax_cross_entropy(x, t, reduction="none", ignore_index=-100)
    assert torch.isfinite(out[0]) and torch.isnan(out[1]) and torch.isnan(out[2])
    dx = K.fused_softmax_cross_entropy_backward(x, t, torch.ones(3, device=DEV), reduction="none",
                                                ignore_index=-100)
    assert torch.isfinite(dx[0]).all() and torch.isnan(dx[1:]).all()
    old = K.CHECK_TARGETS
    K.CHECK_TARGETS = True              # the opt-in run-time check (one device sync)
    try:
        with pytest.raises(FuelGraphError):
            K.fused_softmax_cross_entropy(x, t, reduction="mean", ignore_index=-100)
    finally:
        K.CHECK_TARGETS = old


def test_kernels_declare_float64_unsupported():
    assert_half_and_f32_only(K.fused_softmax_cross_entropy, K.fused_softmax_cross_entropy_backward)


# ----------------------------------------------------------------------------- API on cuda
@on_gpu
@pytest.mark.parametrize("dtype", list(DT))
def test_cross_entropy_vs_torch(dtype):
    x, xt = on(np_rand((64, 96)), dtype)
    t = torch.randint(0, 96, (64,), device="cuda")
    close(F.fused_softmax_cross_entropy(x, fg.from_torch(t)).numpy(),
          torch.nn.functional.cross_entropy(xt.float(), t), DT[dtype][2])


@on_gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_float64_lowers_to_recipe(reduction):
    xt = torch.randn(4, 64, dtype=F64, device="cuda")
    t = torch.randint(0, 64, (4,), device="cuda")
    t[1] = -100
    y = F.fused_softmax_cross_entropy(fg.from_torch(xt), fg.from_torch(t), reduction)
    assert_lowered_on_cuda(y, "fused_softmax_cross_entropy")
    out = y.to_torch()
    assert out.dtype == F64
    torch.testing.assert_close(out, ref_ce(xt, t, reduction, -100), rtol=1e-12, atol=1e-12)
