"""NumPy FUSED_SOFTMAX_CROSS_ENTROPY kernels (backends/numpy/loss.py), forward and backward, vs
torch. The run-time check that a valid target lies in [0, V) stays here (the kernel raises it
when the graph runs); build-time errors (targets shape/dtype, reduction, ignore_index) are the
registry's: tests/registry/test_loss.py::test_build_time_errors."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fuelgraph.backends.numpy import loss
from fuelgraph.errors import FuelGraphError

from .kernel_oracle import DTYPES, check, rand, t64, tdt

CE_SHAPES = [(11,), (5, 7), (2, 3, 11), (1, 1), (64, 300)]


def _targets(rng, shape, v, ignore_index):
    t = rng.integers(0, v, shape[:-1]).astype(np.int64)
    if ignore_index is not None and t.size > 1:
        t.reshape(-1)[::3] = ignore_index
    return t


def _torch_ce(x, t, reduction, ignore_index):
    v = x.shape[-1]
    out = F.cross_entropy(x.reshape(-1, v), torch.from_numpy(t).reshape(-1), reduction=reduction,
                          ignore_index=-100 if ignore_index is None else ignore_index)
    return out.reshape(t.shape) if reduction == "none" else out


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("shape", CE_SHAPES)
@pytest.mark.parametrize("reduction,ignore_index,scale", [
    ("mean", -100, 1.0), ("sum", None, 1.0), ("none", 2, 30.0), ("mean", 2, 30.0),
    ("none", None, 1.0)])
def test_cross_entropy(dt, shape, reduction, ignore_index, scale, chunking):
    rng = np.random.default_rng(6)
    x = rand(rng, shape, dt, scale)
    t = _targets(rng, shape, shape[-1], ignore_index)
    out = loss.fused_softmax_cross_entropy(x, t, reduction=reduction, ignore_index=ignore_index)
    out_dt = "float64" if dt == "float64" else "float32"
    assert out.shape == (t.shape if reduction == "none" else ())
    ref = _torch_ce(t64(x), t, reduction, ignore_index)
    check(out, ref, dt, _torch_ce(tdt(x, dt), t, reduction, ignore_index), out_dt=out_dt)
    # backward vs torch autograd
    g = np.asarray(rng.standard_normal(t.shape if reduction == "none" else ()), np.float32)
    dx = loss.fused_softmax_cross_entropy_backward(x, t, g, reduction=reduction,
                                                   ignore_index=ignore_index)
    xr, xs = t64(x, grad=True), tdt(x, dt, grad=True)
    ref, = torch.autograd.grad(_torch_ce(xr, t, reduction, ignore_index), xr, t64(g))
    same, = torch.autograd.grad(_torch_ce(xs, t, reduction, ignore_index), xs,
                                torch.from_numpy(g).to(xs.dtype))
    check(dx, ref, dt, same)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy_all_ignored(reduction):
    x = np.random.default_rng(7).standard_normal((4, 5)).astype(np.float32)
    t = np.full(4, -100, np.int64)
    out = loss.fused_softmax_cross_entropy(x, t, reduction=reduction, ignore_index=-100)
    assert out.dtype == np.float32 and not out.any()              # mean: 0, not 0/0
    g = np.ones(4 if reduction == "none" else (), np.float32)
    dx = loss.fused_softmax_cross_entropy_backward(x, t, g, reduction=reduction, ignore_index=-100)
    assert dx.dtype == np.float32 and dx.shape == x.shape and not dx.any()


def test_cross_entropy_empty_class_axis():
    x = np.zeros((3, 0), np.float32)
    out = loss.fused_softmax_cross_entropy(x, np.full(3, -100), reduction="none", ignore_index=-100)
    assert out.shape == (3,) and not out.any()
    # run-time target check: with V = 0 every valid target is out of range
    with pytest.raises(FuelGraphError, match="'targets'"):
        loss.fused_softmax_cross_entropy(x, np.zeros(3, np.int64), reduction="sum", ignore_index=-100)


@pytest.mark.parametrize("t,ignore_index,bad", [([0, 7, 1], -100, 7), ([0, -1, 1], -100, -1),
                                                ([0, -100, 1], None, -100), ([0, 2, 9], 2, 9)])
def test_cross_entropy_bad_target(t, ignore_index, bad):
    """The run-time out-of-range target check (values are data, not known at build time)."""
    x, t = np.zeros((3, 7), np.float32), np.array(t, np.int64)
    for fn, args in ((loss.fused_softmax_cross_entropy, ()),
                     (loss.fused_softmax_cross_entropy_backward, (np.float32(1),))):
        with pytest.raises(FuelGraphError,
                           match=rf"fused_softmax_cross_entropy.*'targets'.*(?<![\d-]){bad}(?!\d)"):
            fn(x, t, *args, reduction="mean", ignore_index=ignore_index)
