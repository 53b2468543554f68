"""The loss family: softmax cross-entropy (id 17) and the fused linear + cross-entropy (0x101),
each with a backward helper and a one-pass forward+backward op.

    fused_softmax_cross_entropy     logits [..., V], targets [...] int64 -> loss
    fused_linear_cross_entropy      x [N, H], weight [V, H], targets [N] int64[, bias [V]]
                                    -> loss of the logits x @ weight.T + bias

Row r (of the flattened rows) is valid iff targets[r] != ignore_index (ignore_index=None: every
row is valid). For a valid row `nll_r = logsumexp(x_r) - x_r[t_r]`; a valid target outside
[0, V) raises FuelGraphError when the graph runs (kernel and recipe alike); ignored rows give 0.
reduction "none" -> nll, shape targets.shape; "sum" -> sum over valid rows, shape [];
"mean" -> that sum / N_valid, and 0 when no row is valid. Output float32 for float32, bfloat16
and float16 inputs, float64 for float64 inputs.

The cross-entropy recipe is the stable log-softmax in primitives plus a gather, computed in
float32 (16/32-bit logits) or float64, and honours ignore_index exactly like the kernel: ignored
rows gather at a safe index 0 and are masked afterwards, so an ignored target is never read.
The linear + cross-entropy recipe is the head as nn.Linear computes it (`x @ weight.T + bias`,
in the inputs' dtype) followed by that recipe; its kernels never hold the [N, V] logits.

Backward: `dlogits = w * (softmax(x) - onehot(t))` with w = g / N_valid (mean), g (sum), g[r]
(none), and w = 0 on ignored rows: the helper `fused_softmax_cross_entropy_backward` (0x100),
whose recipe (one fused softmax, then -w scattered at the target column) is differentiable, so
second order works. `fused_linear_cross_entropy_backward` (0x102) gives (dx, dweight[, dbias])
= (dl @ weight, dl.T @ x, column sums of dl). When a loss is realized together with its
gradient, the optimizer replaces the forward and its helper by one `*_fwd_bwd` op (0x103,
0x104; see fuelgraph.opt.loss_rules): the logits are streamed once, or formed once.

Fusion (variants over reduction, each without ignored rows or with ignore_index read off the
graph's constant: `valid = t != ii`, a gather at `where(valid, t, 0)`, `where(valid, nll, 0.0)`,
then `.sum()` or `.sum() / valid.astype(acc).sum().maximum(1.0)`): log-softmax written in
primitives (`s = x - x.max(-1, keepdim=True); s - s.exp().sum(-1, keepdim=True).log()`, which
is also what `x.log_softmax(-1)` builds), `gather(-1, t.unsqueeze(-1))` then `squeeze(-1)` or
`[..., 0]`, negation, then `.mean()` / `.sum()` / nothing -- the negation either before the
reduction (`nll = -picked; nll.mean()`) or after it (`-picked.mean()`). The same idiom over
`x @ w.T + b` fuses into fused_linear_cross_entropy when the logits have no other reader (other
spellings of a linear head under the cross-entropy are rewritten by fuelgraph.opt.loss_rules)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .. import dtype as dt
from ..errors import FuelGraphError
from ..ir.tensor import where
from .core import BackwardKind, FusedOpEntry, FusedOpId, FusedOps, call_fused
from .rules import check_arity, check_float, check_same_dtype

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


def _check_params(name, params):
    if params.reduction not in REDUCTIONS:
        raise FuelGraphError(f"{name}: reduction must be one of {REDUCTIONS}, got "
                             f"{params.reduction!r}")
    ii = params.ignore_index
    if ii is not None and (isinstance(ii, bool) or not isinstance(ii, (int, np.integer))):
        raise FuelGraphError(f"{name}: ignore_index must be an int or None, got {ii!r}")


def _check_grad(name, grad, params, loss_shape):
    want = () if params.reduction != "none" else tuple(loss_shape)
    if tuple(grad.shape) != want:
        raise FuelGraphError(f"{name}: grad has shape {tuple(grad.shape)}, expected {want} (the "
                             f"loss's shape for reduction={params.reduction!r})")
    if not grad.dtype.is_float:
        raise FuelGraphError(f"{name}: grad has dtype {grad.dtype.name}, expected a float dtype")


# --- loss and dlogits in one pass ------------------------------------------------------------
#: (loss, dlogits) of one cross-entropy: what the optimizer puts in place of a forward node and
#: its backward helper over the same logits, so that the logits are streamed once
FUSED_SOFTMAX_CROSS_ENTROPY_FWD_BWD = FusedOpId(0x103)
FWD_BWD_NAME = _NAME + "_fwd_bwd"


def fwd_bwd_recipe(logits, targets, grad, reduction="mean", ignore_index=-100):
    return (cross_entropy_recipe(logits, targets, reduction, ignore_index),
            backward_recipe(logits, targets, grad, reduction, ignore_index))


def _validate_fwd_bwd(srcs, params):
    check_arity(FWD_BWD_NAME, srcs, 3)
    _validate(srcs[:2], params)
    _check_grad(FWD_BWD_NAME, srcs[2], params, srcs[1].shape)


# --- fused linear + cross-entropy -------------------------------------------------------------
FUSED_LINEAR_CROSS_ENTROPY = FusedOpId(0x101)
FUSED_LINEAR_CROSS_ENTROPY_BACKWARD = FusedOpId(0x102)
FUSED_LINEAR_CROSS_ENTROPY_FWD_BWD = FusedOpId(0x104)
LINEAR_NAME = "fused_linear_cross_entropy"
_LIN_LABELS = ["x", "weight", "targets", "bias"]


def linear_logits(x, weight, bias=None):
    """The head as nn.Linear computes it: x @ weight.T (+ bias), in the inputs' dtype."""
    logits = x @ weight.mT
    return logits if bias is None else logits + bias


def linear_cross_entropy_recipe(x, weight, targets, bias=None, reduction="mean",
                                ignore_index=-100):
    return cross_entropy_recipe(linear_logits(x, weight, bias), targets, reduction, ignore_index)


def _negated_linear(x, weight, targets, bias, reduction="mean", ignore_index=None):
    return _negated_reduction(linear_logits(x, weight, bias), targets, reduction)


def linear_backward_recipe(x, weight, targets, *rest, reduction="mean", ignore_index=-100):
    """(dx, dweight[, dbias]) through the logits' gradient: dl = w * (softmax - onehot);
    dx = dl @ weight, dweight = dl.T @ x, dbias = column sums of dl."""
    bias, grad = (rest[0] if len(rest) == 2 else None), rest[-1]
    dl = call_fused(BACKWARD_NAME, linear_logits(x, weight, bias), targets, grad,
                    reduction=reduction, ignore_index=ignore_index)
    grads = (dl @ weight, dl.mT @ x)
    if bias is None:
        return grads
    return grads + (dl.astype(dl.dtype.acc).sum(0).astype(bias.dtype),)


def linear_fwd_bwd_recipe(x, weight, targets, *rest, reduction="mean", ignore_index=-100):
    bias = rest[0] if len(rest) == 2 else None
    loss = linear_cross_entropy_recipe(x, weight, targets, bias, reduction, ignore_index)
    return (loss,) + linear_backward_recipe(x, weight, targets, *rest, reduction=reduction,
                                            ignore_index=ignore_index)


def _validate_linear(srcs, params, name=LINEAR_NAME):
    check_arity(name, srcs, 3, 4)
    check_float(name, srcs, which=[0, 1] + ([3] if len(srcs) == 4 else []), labels=_LIN_LABELS)
    check_same_dtype(name, srcs, (0, 1) + ((3,) if len(srcs) == 4 else ()), _LIN_LABELS)
    x, w, t = srcs[:3]
    if len(x.shape) != 2:
        raise FuelGraphError(f"{name}: x has shape {tuple(x.shape)}, expected rank 2 ([N, H])")
    if len(w.shape) != 2 or w.shape[1] != x.shape[1]:
        raise FuelGraphError(f"{name}: weight has shape {tuple(w.shape)}, expected [V, "
                             f"{x.shape[1]}] (nn.Linear layout [V, H]; x is {tuple(x.shape)})")
    if w.shape[0] < 1:
        raise FuelGraphError(f"{name}: weight has shape {tuple(w.shape)}, expected at least one "
                             f"class (V >= 1)")
    if t.dtype is not dt.int64:
        raise FuelGraphError(f"{name}: targets has dtype {t.dtype.name}, expected int64 class "
                             f"indices")
    if tuple(t.shape) != (x.shape[0],):
        raise FuelGraphError(f"{name}: targets has shape {tuple(t.shape)}, expected "
                             f"({x.shape[0]},) = [N]")
    if len(srcs) == 4 and tuple(srcs[3].shape) != (w.shape[0],):
        raise FuelGraphError(f"{name}: bias has shape {tuple(srcs[3].shape)}, expected "
                             f"({w.shape[0]},) = [V]")
    _check_params(name, params)


def _validate_linear_grad(name):
    def validate(srcs, params):
        check_arity(name, srcs, 4, 5)
        _validate_linear(srcs[:-1], params, name)
        _check_grad(name, srcs[-1], params, srcs[2].shape)
    return validate


def _linear_shape(shapes, params):
    return [() if params.reduction != "none" else (shapes[0][0],)]


def _linear_grad_shapes(shapes, params):
    return [tuple(shapes[0]), tuple(shapes[1])] + ([tuple(shapes[3])] if len(shapes) == 5 else [])


def _linear_grad_dtypes(dtypes, params):
    return [dtypes[0], dtypes[1]] + ([dtypes[3]] if len(dtypes) == 5 else [])


def _linear_vjp(xs, ys, gs, p):
    grads = call_fused(FUSED_LINEAR_CROSS_ENTROPY_BACKWARD, *xs, gs[0], reduction=p.reduction,
                       ignore_index=p.ignore_index)
    return [grads[0], grads[1], None] + ([grads[2]] if len(xs) == 4 else [])


def _linear_sample(rng):
    t = rng.integers(0, 5, size=(3,)).astype(np.int64)
    t[1] = -100                                     # one ignored row (public default index)
    return [rng.standard_normal((3, 4)).astype(np.float32),
            rng.standard_normal((5, 4)).astype(np.float32), t,
            rng.standard_normal((5,)).astype(np.float32)]


def _with_grad(sample):
    return lambda rng: sample(rng) + [np.asarray(rng.standard_normal(), np.float32)]


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
    reg.add(FusedOpEntry(
        id=FUSED_SOFTMAX_CROSS_ENTROPY_FWD_BWD, name=FWD_BWD_NAME, family="forward",
        params=CrossEntropyParams,
        shape_rule=lambda shapes, p: _shape_rule(shapes, p) + [tuple(shapes[0])],
        dtype_rule=lambda dts, p: [dts[0].acc, dts[0]],
        validate=_validate_fwd_bwd, decompose=fwd_bwd_recipe, backward=BackwardKind.DECOMPOSE,
        pattern_variants=None, outputs=("loss", "dlogits"),
        sample=_with_grad(_sample),
        doc="Cross-entropy loss and its gradient in one pass over the logits: logits [..., V], "
            "targets [...] int64, grad shaped like the loss -> (loss, dlogits), exactly "
            "fused_softmax_cross_entropy and fused_softmax_cross_entropy_backward of the same "
            "inputs. Put in place of that pair by the optimizer when the grad does not depend "
            "on the loss."))
    lin_variants = tuple({"reduction": r, "ignore_index": None} for r in REDUCTIONS)
    reg.add(FusedOpEntry(
        id=FUSED_LINEAR_CROSS_ENTROPY, name=LINEAR_NAME, family="forward",
        params=CrossEntropyParams, shape_rule=_linear_shape,
        dtype_rule=lambda dts, p: [dts[0].acc], validate=_validate_linear,
        decompose=linear_cross_entropy_recipe,
        backward=BackwardKind.fused(FUSED_LINEAR_CROSS_ENTROPY_BACKWARD), vjp=_linear_vjp,
        pattern_variants=lin_variants,
        extra_patterns=tuple((_negated_linear, {"reduction": r, "ignore_index": None})
                             for r in ("mean", "sum")),
        sample=_linear_sample,
        doc="Cross-entropy of a linear head without the logits: x [N, H], weight [V, H], "
            "targets [N] int64, optional bias [V] (x, weight, bias one float dtype); params "
            "reduction and ignore_index as fused_softmax_cross_entropy -> loss ([] or [N] for "
            "'none'), float32 (float64 for float64). Equals fused_softmax_cross_entropy(x @ "
            "weight.T + bias, targets); kernels stream the vocabulary or the tokens in chunks. "
            "Backward fused_linear_cross_entropy_backward."))
    reg.add(FusedOpEntry(
        id=FUSED_LINEAR_CROSS_ENTROPY_BACKWARD, name=LINEAR_NAME + "_backward",
        family="backward", params=CrossEntropyParams, shape_rule=_linear_grad_shapes,
        dtype_rule=_linear_grad_dtypes,
        validate=_validate_linear_grad(LINEAR_NAME + "_backward"),
        decompose=linear_backward_recipe, backward=BackwardKind.DECOMPOSE,
        pattern_variants=None, outputs=("dx", "dweight", "dbias"),
        sample=_with_grad(_linear_sample),
        doc="Gradients of fused_linear_cross_entropy: x, weight, targets, [bias], grad (the "
            "loss's shape) -> (dx [N, H], dweight [V, H][, dbias [V]]) in the inputs' dtypes; "
            "dl = w * (softmax(logits) - onehot(t)), dx = dl @ weight, dweight = dl.T @ x, "
            "dbias = sum of dl over the rows."))
    reg.add(FusedOpEntry(
        id=FUSED_LINEAR_CROSS_ENTROPY_FWD_BWD, name=LINEAR_NAME + "_fwd_bwd", family="forward",
        params=CrossEntropyParams,
        shape_rule=lambda shapes, p: _linear_shape(shapes, p) + _linear_grad_shapes(shapes, p),
        dtype_rule=lambda dts, p: [dts[0].acc] + _linear_grad_dtypes(dts, p),
        validate=_validate_linear_grad(LINEAR_NAME + "_fwd_bwd"),
        decompose=linear_fwd_bwd_recipe, backward=BackwardKind.DECOMPOSE,
        pattern_variants=None, outputs=("loss", "dx", "dweight", "dbias"),
        sample=_with_grad(_linear_sample),
        doc="Loss and gradients of fused_linear_cross_entropy in one sweep (three matrix "
            "products per token chunk instead of four): x, weight, targets, [bias], grad -> "
            "(loss, dx, dweight[, dbias]). Put in place of a forward and its backward helper "
            "by the optimizer when the grad does not depend on the loss."))



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


def _ignore_index_param(ignore_index):
    if isinstance(ignore_index, numbers.Integral) and not isinstance(ignore_index, bool):
        return int(ignore_index)
    return ignore_index


def fused_linear_cross_entropy(x, weight, targets, bias=None, reduction="mean",
                               ignore_index=-100):
    """Cross-entropy of a linear head, `cross_entropy(x @ weight.T + bias, targets)`, computed
    without ever holding the [N, V] logits.

    x [N, H] and weight [V, H] (nn.Linear's layout), optional bias [V], all one float dtype
    (float32, float64, bfloat16, float16); targets [N] int64 class indices. Rows whose target
    equals ignore_index (None: no row is ignored) give 0 and are left out of the mean; a target
    outside [0, V) that is not ignore_index raises FuelGraphError when the graph runs.
    reduction "none" -> [N]; "sum" -> []; "mean" -> [] = sum / (number of non-ignored rows), 0
    when every row is ignored. The loss is float32 (float64 for float64 inputs).

    The logits are what nn.Linear stores (rounded to the input dtype for 16-bit inputs); the
    log-sum-exp, the matrix products and the loss accumulate in float32 (float64 for float64).
    Differentiable in x, weight and bias: dx [N, H], dweight [V, H] and dbias [V] in their
    inputs' dtypes."""
    srcs = (x, weight, targets) + (() if bias is None else (bias,))
    return call_fused(FUSED_LINEAR_CROSS_ENTROPY, *srcs, reduction=reduction,
                      ignore_index=_ignore_index_param(ignore_index))
