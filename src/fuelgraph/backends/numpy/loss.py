"""NumPy fused kernels for FUSED_SOFTMAX_CROSS_ENTROPY (spec §17, Appendix H.3) and its backward.

Rows are `logits.reshape(-1, V)`; row r is valid iff `targets[r] != ignore_index`
(`ignore_index=None`: every row is valid). A valid target outside [0, V) raises FuelGraphError.

Precision. §17 asks for float64 exp/sum/log. Here `exp` and the row sum run in the
accumulation dtype (float32 for 16/32-bit logits -- NumPy's float64 exp is ~3x slower), but the
max term is kept out of the sum: with `rest = sum_{v != argmax} exp(x_v - max)`,
`lse = max + log1p(rest)` is assembled in float64 together with `lse - x[t]` and the reduction.
`rest` keeps float32 *relative* precision, so every nll -- including the nearly zero loss of a
confident correct prediction, where float32 `log(1 + rest)` would lose everything -- lands
within a few float32 ulps of the float64 reference. The backward uses the same split, so
`softmax[argmax] - 1 = -rest / (1 + rest)` is exact to float32 precision too. float64 logits
run entirely in float64. Rows whose max lies in a moderate window (`_SAFE`) take
`exp(x)` without the max shift (a pass less; `exp(max)` cancels in `rest / exp(max)`); other
rows (huge, tiny, inf or NaN max) are shifted. The choice is made per row, so results do not
depend on chunking.
"""
from __future__ import annotations

import numpy as np

from fuelgraph.errors import FuelGraphError

from ...registry.core import FusedOps
from ...registry.loss import FUSED_SOFTMAX_CROSS_ENTROPY_BACKWARD
from ..base import kernel, row_cost
from .common import acc_dtype, row_spans, run_spans, store, to_acc

_OP = "fused_softmax_cross_entropy"
_F64 = np.dtype(np.float64)


def _prepare(op, logits, targets, reduction, ignore_index):
    """Validate; return (x2 [R, V], t [R] int64, valid [R] bool)."""
    if reduction not in ("mean", "sum", "none"):
        raise FuelGraphError(f"{op}: reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    if logits.ndim < 1:
        raise FuelGraphError(f"{op}: input 'logits' must have rank >= 1, got shape {logits.shape}")
    if targets.shape != logits.shape[:-1]:
        raise FuelGraphError(f"{op}: input 'targets' has shape {targets.shape}, "
                             f"expected {logits.shape[:-1]} (logits.shape[:-1])")
    if targets.dtype.kind not in "iu":
        raise FuelGraphError(f"{op}: input 'targets' must be int64 class indices, "
                             f"got dtype {targets.dtype}")
    v = logits.shape[-1]
    t = targets.reshape(-1).astype(np.int64, copy=False)
    valid = np.ones(t.shape, bool) if ignore_index is None else t != ignore_index
    bad = valid & ((t < 0) | (t >= v))
    if bad.any():
        raise FuelGraphError(f"{op}: input 'targets' holds class index {int(t[bad][0])}, "
                             f"outside [0, {v}) and not ignore_index={ignore_index}")
    return logits.reshape(t.size, v), t, valid


#: per acc dtype, the row-max window in which exp(x) needs no shift: no overflow even summed
#: over 10^12 classes, and terms that underflow are < 1e-29 of the row's largest term
_SAFE = {np.dtype(np.float32): (-20.0, 60.0), _F64: (-200.0, 600.0)}


def _softmax_parts(xc, acc, out=None):
    """For a row chunk: `(e, rows, am, m, emax, rest)`: `am` the argmax (first if tied), `m` the
    max (acc dtype), `e = exp(x - shift)` (acc; written into `out` when given) with the argmax
    entry set to 0, `emax = exp(m - shift)` and `rest = sum(e) / emax`, both float64."""
    e = to_acc(xc, acc)
    rows = np.arange(e.shape[0])
    am = e.argmax(axis=1)
    m = e[rows, am]
    lo, hi = _SAFE[acc]
    safe = (m >= lo) & (m <= hi)
    if safe.all():
        e = np.exp(e, out=out if e is xc else e)
    else:
        shift = np.where(safe, acc.type(0), m)
        e = np.subtract(e, shift[:, None], out=out if e is xc else e)
        np.exp(e, out=e)
    emax = e[rows, am].astype(_F64)
    e[rows, am] = 0
    rest = np.vecdot(e, np.ones(e.shape[1], acc)).astype(_F64)
    rest /= emax
    return e, rows, am, m, emax, rest


def _gather(x2, t, valid):
    """x2[r, t_r] for every row (0 on ignored rows), as float64."""
    rows = np.arange(x2.shape[0])
    return np.where(valid, x2[rows, np.where(valid, t, 0)].astype(_F64), 0.0)


@kernel(FusedOps.FUSED_SOFTMAX_CROSS_ENTROPY, "numpy", cost=row_cost(6))
def fused_softmax_cross_entropy(logits, targets, *, reduction, ignore_index):
    """FUSED_SOFTMAX_CROSS_ENTROPY: logits [..., V] float, targets [...] = logits.shape[:-1]
    int64 class indices.

    Per valid row: `nll = (max + log(sum_v exp(x_v - max))) - x[t]`; ignored rows give 0.
    reduction "none" -> shape targets.shape; "sum" -> 0-d sum over valid rows; "mean" -> 0-d
    sum / N_valid, 0 when no row is valid. Output dtype float32 (float64 for float64 logits).
    """
    x2, t, valid = _prepare(_OP, logits, targets, reduction, ignore_index)
    out_dt = _F64 if logits.dtype == _F64 else np.dtype(np.float32)
    acc = acc_dtype(logits.dtype)
    r, v = x2.shape
    nll = np.zeros(r, _F64)
    if r and v and valid.any():
        nll -= _gather(x2, t, valid)                    # -x[t]

        def work(r0, r1):
            _, _, _, m, _, rest = _softmax_parts(x2[r0:r1], acc)
            np.log1p(rest, out=rest)                     # lse = m + log1p(rest)
            rest += m
            nll[r0:r1] += rest

        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            run_spans(work, row_spans(r, v), r * v)
        nll[~valid] = 0.0
    if reduction == "none":
        return nll.reshape(targets.shape).astype(out_dt)
    total = nll.sum()
    if reduction == "mean":
        nv = int(np.count_nonzero(valid))
        total = total / nv if nv else 0.0
    return np.asarray(total, dtype=out_dt)


@kernel(FUSED_SOFTMAX_CROSS_ENTROPY_BACKWARD, "numpy", cost=row_cost(6))
def fused_softmax_cross_entropy_backward(logits, targets, grad, *, reduction, ignore_index):
    """Gradient of `fused_softmax_cross_entropy` w.r.t. logits (spec §17 / H.3).

    logits [..., V], targets [...], grad: 0-d (any size-1 array) for "mean"/"sum", shape
    targets.shape for "none". Returns dlogits, shape and dtype of logits:
    `dlogits[r] = w_r * (softmax(x_r) - onehot(t_r))` with `w_r = grad / N_valid` (mean),
    `grad` (sum), `grad[r]` (none); ignored rows (and everything when N_valid == 0) are 0.
    """
    op = _OP + "_backward"
    x2, t, valid = _prepare(op, logits, targets, reduction, ignore_index)
    dt, acc = logits.dtype, acc_dtype(logits.dtype)
    r, v = x2.shape
    g = np.asarray(grad, dtype=_F64)
    if reduction == "none":
        if g.shape != targets.shape:
            raise FuelGraphError(f"{op}: input 'grad' has shape {g.shape}, "
                                 f"expected {targets.shape} for reduction='none'")
        w = g.reshape(-1).copy()
    else:
        if g.size != 1:
            raise FuelGraphError(f"{op}: input 'grad' must hold one value for "
                                 f"reduction={reduction!r}, got shape {g.shape}")
        nv = int(np.count_nonzero(valid))
        scale = float(g.reshape(-1)[0]) / nv if reduction == "mean" and nv else \
            float(g.reshape(-1)[0])
        w = np.full(r, scale if nv else 0.0, _F64)
    w[~valid] = 0.0
    out = np.empty(logits.shape, dt)
    if out.size == 0:
        return out
    o2 = out.reshape(-1, v)
    tt = np.where(valid, t, 0)
    any_ignored = not valid.all()

    def work(r0, r1):
        e, rows, am, _, emax, rest = _softmax_parts(x2[r0:r1], acc,
                                                    o2[r0:r1] if dt == acc else None)
        wc, tc = w[r0:r1], tt[r0:r1]
        s = rest + 1.0                                   # sum(exp(x - shift)) / emax
        coef = wc / s                                    # w * softmax[argmax]
        hit = am == tc
        # argmax entry: w * (1/s - [t == argmax]); 1/s - 1 = -rest/s keeps full precision
        e_am = np.where(hit, -wc * rest / s, coef)
        np.multiply(e, (coef / emax).astype(acc)[:, None], out=e)     # w * softmax elsewhere
        e[rows, am] = e_am.astype(acc)
        miss = ~hit
        e[rows[miss], tc[miss]] -= wc[miss].astype(acc)
        if any_ignored:
            e[~valid[r0:r1]] = 0
        if dt != acc:
            store(o2[r0:r1], e)

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        run_spans(work, row_spans(r, v), r * v)
    return out
