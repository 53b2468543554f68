"""FUSED_SOFTMAX_CROSS_ENTROPY (id 17): softmax cross-entropy over the last axis with integer class
targets (spec fused-ops.md §17, Appendix H.3).

    logits [..., V] float (rank >= 1, V >= 1), targets [...] = logits.shape[:-1] int64

Row r (of the flattened rows) is valid iff targets[r] != ignore_index (ignore_index=None: every
row is valid). For a valid row `nll_r = logsumexp(x_r) - x_r[t_r]`; a valid target outside
[0, V) raises FuelGraphError when the graph runs (kernel and recipe alike); ignored rows give 0.
reduction "none" -> nll, shape targets.shape; "sum" -> sum over valid rows, shape [];
"mean" -> that sum / N_valid, and 0 when no row is valid. Output float32 for float32, bfloat16
and float16 logits, float64 for float64 logits.

The recipe is the stable log-softmax in primitives plus a gather, computed in float32 (16/32-bit
logits) or float64, and honours ignore_index exactly like the kernel: ignored rows gather at a
safe index 0 and are masked afterwards, so an ignored target is never read.

Backward: `dlogits = w * (softmax(x) - onehot(t))` with w = g / N_valid (mean), g (sum), g[r]
(none), and w = 0 on ignored rows. It is its own fused helper, `fused_softmax_cross_entropy_backward`
(built-in id 0x100, beyond the 25 well-known ids), whose kernels make one pass over the logits; its recipe (one fused softmax, then -w scattered at the target column)
is differentiable, so second order works.

Fusion (variants over reduction, each without ignored rows or with ignore_index read off the
graph's constant: `valid = t != ii`, a gather at `where(valid, t, 0)`, `where(valid, nll, 0.0)`,
then `.sum()` or `.sum() / valid.astype(acc).sum().maximum(1.0)`): log-softmax written in
primitives (`s = x - x.max(-1, keepdim=True); s - s.exp().sum(-1, keepdim=True).log()`, which
is also what `x.log_softmax(-1)` builds), `gather(-1, t.unsqueeze(-1))` then `squeeze(-1)` or
`[..., 0]`, negation, then `.mean()` / `.sum()` / nothing -- the negation either before the
reduction (`nll = -picked; nll.mean()`) or after it (`-picked.mean()`)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .. import dtype as dt
from ..errors import FuelGraphError
from ..ir.tensor import where
from .core import BackwardKind, FusedOpEntry, FusedOpId, FusedOps, call_fused
from .rules import check_arity, check_float

_NAME = "fused_softmax_cross_entropy"
REDUCTIONS = ("mean", "sum", "none")


@dataclass(frozen=True)
class CrossEntropyParams:
    """reduction: "mean" | "sum" | "none"; ignore_index: class index whose rows are skipped
    (None: no row is skipped)."""
    reduction: str = "mean"
    ignore_index: int | None = -100


def _log_softmax(x):
    s = x - x.max(-1, keepdim=True)
    return s - s.exp().sum(-1, keepdim=True).log()


def cross_entropy_recipe(logits, targets, reduction="mean", ignore_index=-100):
    acc = logits.dtype.acc
    ls = _log_softmax(logits.astype(acc))
    if ignore_index is None:
        nll = -ls.gather(-1, targets.unsqueeze(-1))[..., 0]
        if reduction == "none":
            return nll
        if reduction == "sum" or math.prod(targets.shape) == 0:
            return nll.sum()                      # mean over zero rows is 0, like the kernel
        return nll.mean()
    valid = targets != ignore_index
    safe = where(valid, targets, 0)               # never gather an ignored target
    nll = where(valid, -ls.gather(-1, safe.unsqueeze(-1))[..., 0], 0.0)
    if reduction == "none":
        return nll
    total = nll.sum()
    if reduction == "sum":
        return total
    return total / valid.astype(acc).sum().maximum(1.0)


def _negated_reduction(logits, targets, reduction="mean", ignore_index=None):
    """Spelling with the negation outside the reduction: -(picked.mean()) / -(picked.sum())."""
    ls = _log_softmax(logits.astype(logits.dtype.acc))
    picked = ls.gather(-1, targets.unsqueeze(-1))[..., 0]
    return -(picked.sum() if reduction == "sum" else picked.mean())


def _validate(srcs, params):
    check_arity(_NAME, srcs, 2)
    check_float(_NAME, srcs, which=[0], labels=["logits", "targets"])
    x, t = srcs
    if len(x.shape) < 1:
        raise FuelGraphError(f"{_NAME}: logits has shape {x.shape}, expected rank >= 1 ([..., V])")
    if x.shape[-1] < 1:
        raise FuelGraphError(f"{_NAME}: logits has shape {x.shape}, expected at least one class "
                             f"(V >= 1)")
    if t.dtype is not dt.int64:
        raise FuelGraphError(f"{_NAME}: targets has dtype {t.dtype.name}, expected int64 class "
                             f"indices")
    if tuple(t.shape) != tuple(x.shape[:-1]):
        raise FuelGraphError(f"{_NAME}: targets has shape {t.shape}, expected {x.shape[:-1]} "
                             f"(logits.shape[:-1])")
    if params.reduction not in REDUCTIONS:
        raise FuelGraphError(f"{_NAME}: reduction must be one of {REDUCTIONS}, got "
                             f"{params.reduction!r}")
    ii = params.ignore_index
    if ii is not None and (isinstance(ii, bool) or not isinstance(ii, (int, np.integer))):
        raise FuelGraphError(f"{_NAME}: ignore_index must be an int or None, got {ii!r}")


def _shape_rule(shapes, params):
    return [() if params.reduction != "none" else tuple(shapes[1])]


def _dtype_rule(dtypes, params):
    return [dtypes[0].acc]


BACKWARD_NAME = _NAME + "_backward"
FUSED_SOFTMAX_CROSS_ENTROPY_BACKWARD = FusedOpId(0x100)


def backward_recipe(logits, targets, grad, reduction="mean", ignore_index=-100):
    """dlogits = w * (softmax(x) - onehot(t)); w per reduction, 0 on ignored rows."""
    x, t = logits, targets
    acc = x.dtype.acc
    g = grad.astype(acc)
    sm = call_fused(FusedOps.SOFTMAX_LAST_DIM, x.astype(acc))
    valid = None if ignore_index is None else t != ignore_index
    safe = t if valid is None else where(valid, t, 0)
    if reduction == "none":
        w = g
    elif reduction == "sum":
        w = g.broadcast_to(t.shape)
    else:
        n = float(max(math.prod(t.shape), 1)) if valid is None else \
            valid.astype(acc).sum().maximum(1.0)
        w = (g / n).broadcast_to(t.shape)
    if valid is not None:
        w = where(valid, w, 0.0)
    wk = w.unsqueeze(-1)
    dx = (sm * wk).scatter_add(-1, safe.unsqueeze(-1), -wk)
    return dx.astype(x.dtype)


def _vjp(xs, ys, gs, p):
    return [call_fused(FUSED_SOFTMAX_CROSS_ENTROPY_BACKWARD, xs[0], xs[1], gs[0], reduction=p.reduction,
                       ignore_index=p.ignore_index), None]


def _validate_backward(srcs, params):
    check_arity(BACKWARD_NAME, srcs, 3)
    _validate(srcs[:2], params)
    want = () if params.reduction != "none" else tuple(srcs[1].shape)
    if tuple(srcs[2].shape) != want:
        raise FuelGraphError(f"{BACKWARD_NAME}: grad has shape {tuple(srcs[2].shape)}, expected "
                             f"{want} (the loss's shape for reduction={params.reduction!r})")
    check_float(BACKWARD_NAME, srcs, which=[2], labels=["logits", "targets", "grad"])


def _sample(rng):
    t = rng.integers(0, 7, size=(2, 3)).astype(np.int64)
    t[1, 1] = -100                                  # one ignored row (public default index)
    return [rng.standard_normal((2, 3, 7)).astype(np.float32), t]


def declare(reg):
    bwd_id = FUSED_SOFTMAX_CROSS_ENTROPY_BACKWARD
    reg.add(FusedOpEntry(
        id=bwd_id, name=BACKWARD_NAME, family="backward", params=CrossEntropyParams,
        shape_rule=lambda shapes, p: [tuple(shapes[0])], dtype_rule=lambda dts, p: [dts[0]],
        validate=_validate_backward, decompose=backward_recipe, backward=BackwardKind.DECOMPOSE,
        pattern_variants=None,
        sample=lambda rng: _sample(rng) + [np.asarray(rng.standard_normal(), np.float32)],
        doc="Gradient of fused_softmax_cross_entropy w.r.t. logits: logits [..., V], targets "
            "[...] int64, grad shaped like the loss ([] for mean/sum, targets.shape for none) "
            "-> dlogits [..., V] in the logits dtype = w * (softmax(x) - onehot(t)), w = grad / "
            "N_valid (mean), grad (sum), grad[r] (none), 0 on ignored rows."))
    # with and without ignored rows; ignore_index is read off the graph's constant
    variants = tuple({"reduction": r, "ignore_index": None} for r in REDUCTIONS) + \
        tuple({"reduction": r} for r in REDUCTIONS)
    reg.add(FusedOpEntry(
        id=FusedOps.FUSED_SOFTMAX_CROSS_ENTROPY, name=_NAME, family="forward",
        params=CrossEntropyParams, shape_rule=_shape_rule, dtype_rule=_dtype_rule,
        validate=_validate, decompose=cross_entropy_recipe,
        backward=BackwardKind.fused(bwd_id), vjp=_vjp,
        pattern_variants=variants,
        extra_patterns=tuple((_negated_reduction, {"reduction": r, "ignore_index": None})
                             for r in ("mean", "sum")),
        sample=_sample,
        doc="Softmax cross-entropy. logits [..., V] float (rank >= 1, V >= 1), targets int64 "
            "shaped logits.shape[:-1]; params reduction ('mean' | 'sum' | 'none') and "
            "ignore_index (int, or None for no ignored rows). nll = logsumexp(x) - x[t] per "
            "valid row (t != ignore_index; a valid t outside [0, V) raises when run), 0 on "
            "ignored rows; 'none' -> targets.shape, 'sum' -> [], 'mean' -> [] sum / N_valid "
            "(0 when all rows are ignored). Output float32 (float64 for float64 logits); "
            "accumulates in float64. Backward w * (softmax - onehot) through the fused softmax."))



# ---- builders (re-exported by fuelgraph.functional) ----------------------------------------
def fused_softmax_cross_entropy(logits, targets, reduction: str = "mean", ignore_index=-100):
    """Softmax cross-entropy over the last axis. logits [..., V] float (rank >= 1, V >= 1),
    targets int64 class indices shaped logits.shape[:-1]. Rows whose target equals ignore_index
    (None: no row is ignored) give 0 and are left out of the mean; a target outside [0, V) that
    is not ignore_index raises FuelGraphError when the graph runs. reduction "none" -> shape
    targets.shape; "sum" -> []; "mean" -> [] = sum / (number of non-ignored rows), 0 when every
    row is ignored. Output float32 (float64 for float64 logits)."""
    if isinstance(ignore_index, numbers.Integral) and not isinstance(ignore_index, bool):
        ignore_index = int(ignore_index)
    return call_fused(FusedOps.FUSED_SOFTMAX_CROSS_ENTROPY, logits, targets,
                      reduction=reduction, ignore_index=ignore_index)
