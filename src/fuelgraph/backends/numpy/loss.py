"""NumPy kernels of the loss family: softmax cross-entropy (forward, backward, and both in one
pass) and the fused linear + cross-entropy (forward, backward, and both in one pass).

Rows are `logits.reshape(-1, V)`; row r is valid iff `targets[r] != ignore_index`
(`ignore_index=None`: every row is valid). A valid target outside [0, V) raises FuelGraphError
(a data check: it can only happen when the graph runs).

Precision. `exp` and the row sums run in the accumulation dtype (float32 for 16/32-bit logits;
NumPy's float64 exp is ~3x slower), but the max term is kept out of the sum: with
`rest = sum_{v != argmax} exp(x_v - max)`, `lse = max + log1p(rest)` is assembled in float64
together with `lse - x[t]` and the reduction. `rest` keeps float32 *relative* precision, so every
loss -- including the nearly zero loss of a confident correct prediction, where float32
`log(1 + rest)` would lose everything -- lands within a few float32 ulps of the float64 answer.
The gradient uses the same split, so `softmax[argmax] - 1 = -rest / (1 + rest)` is exact to
float32 precision too. float64 logits run entirely in float64. Rows whose max lies in a moderate
window (`_SAFE`) take `exp(x)` without the max shift (a pass less; `exp(max)` cancels in
`rest / exp(max)`); other rows (huge, tiny, inf or NaN max) are shifted. The choice is made per
row, so results never depend on how rows are chunked.

Fused linear + cross-entropy processes the tokens in chunks of `flce_chunk_rows(N, V)` rows: per
chunk the logits `x_c @ W.T + b` are formed in the accumulation dtype (rounded once to the input
dtype for 16-bit inputs, as `F.linear` would store them), the one-pass row kernel above turns
them into per-row losses and, in place, into dlogits, and two more GEMMs give `dx_c = dl @ W`
and the contribution `dl^T @ x_c` to dW (summed over chunks in the accumulation dtype, as is db).
No [N, V] buffer exists; every per-row result is independent of the chunk size, and dW / db
differ between chunkings only by the order of float32 additions.
"""
from __future__ import annotations

import numpy as np

from fuelgraph.errors import FuelGraphError

from ...registry.core import FusedOps
from ...registry.loss import (FUSED_LINEAR_CROSS_ENTROPY, FUSED_LINEAR_CROSS_ENTROPY_BACKWARD,
                              FUSED_LINEAR_CROSS_ENTROPY_FWD_BWD,
                              FUSED_SOFTMAX_CROSS_ENTROPY_BACKWARD,
                              FUSED_SOFTMAX_CROSS_ENTROPY_FWD_BWD)
from ..base import Cost, kernel, row_cost
from .common import acc_dtype, row_spans, run_spans, store, to_acc
from . import common as _common, primitives as _primitives
from .primitives import gemm, gemm_group

_CE = "fused_softmax_cross_entropy"
_FLCE = "fused_linear_cross_entropy"
_F64 = np.dtype(np.float64)
_F32 = np.dtype(np.float32)

#: per acc dtype, the row-max window in which exp(x) needs no shift: no overflow even summed
#: over 10^12 classes, and terms that underflow are < 1e-29 of the row's largest term
_SAFE = {_F32: (-20.0, 60.0), _F64: (-200.0, 600.0)}
#: logits bytes (accumulation dtype) one token chunk of the fused linear + CE may hold
FLCE_CHUNK_BYTES = 32 << 20
#: rows of dW updated per GEMM after the first chunk (bounds the temporary to a few MiB)
_DW_BLOCK = 4096
#: token chunks at least this tall take dx = dl @ W as is; shorter ones as (W^T dl^T)^T, which
#: OpenBLAS runs 2-4x faster on two threads for a [<512, 32000] x [32000, 512] product (measured)
_DX_DIRECT_ROWS = 1024


# --- shared row machinery ---------------------------------------------------------------------

def _targets(op, targets, v, ignore_index):
    """(t [R] int64 with ignored rows set to 0, valid [R] bool); raises on a bad valid target."""
    t = targets.reshape(-1).astype(np.int64, copy=False)
    valid = np.ones(t.shape, bool) if ignore_index is None else t != ignore_index
    bad = valid & ((t < 0) | (t >= v))
    if bad.any():
        raise FuelGraphError(f"{op}: input 'targets' holds class index {int(t[bad][0])}, "
                             f"outside [0, {v}) and not ignore_index={ignore_index}")
    return np.where(valid, t, 0), valid


def _row_weights(op, grad, reduction, valid, shape):
    """Per-row gradient weight w_r (float64): grad / N_valid (mean), grad (sum), grad[r]
    (none); 0 on ignored rows and everywhere when no row is valid."""
    g = np.asarray(grad, dtype=_F64)
    r = valid.size
    if reduction == "none":
        if g.shape != tuple(shape):
            raise FuelGraphError(f"{op}: input 'grad' has shape {g.shape}, expected "
                                 f"{tuple(shape)} for reduction='none'")
        w = g.reshape(-1).copy()
    else:
        if g.size != 1:
            raise FuelGraphError(f"{op}: input 'grad' must hold one value for "
                                 f"reduction={reduction!r}, got shape {g.shape}")
        nv = int(np.count_nonzero(valid))
        s = float(g.reshape(-1)[0])
        w = np.full(r, (s / nv if reduction == "mean" else s) if nv else 0.0, _F64)
    w[~valid] = 0.0
    return w


def _reduce(nll, valid, reduction, shape, out_dt):
    """The loss from per-row float64 losses (0 on ignored rows)."""
    if reduction == "none":
        return nll.reshape(shape).astype(out_dt)
    total = nll.sum()
    if reduction == "mean":
        nv = int(np.count_nonzero(valid))
        total = total / nv if nv else 0.0
    return np.asarray(total, dtype=out_dt)


def _softmax_parts(xc, acc, out=None):
    """For a row chunk: `(e, rows, am, m, emax, rest)`: `am` the argmax (first if tied), `m` the
    max (acc dtype), `e = exp(x - shift)` (acc; written into `out` when given, which may be `xc`
    itself) with the argmax entry set to 0, `emax = exp(m - shift)` and `rest = sum(e) / emax`,
    both float64."""
    e = to_acc(xc, acc)
    dst = out if e is xc else e
    rows = np.arange(e.shape[0])
    am = e.argmax(axis=1)
    m = e[rows, am]
    lo, hi = _SAFE[acc]
    safe = (m >= lo) & (m <= hi)
    if safe.all():
        e = np.exp(e, out=dst)
    else:
        shift = np.where(safe, acc.type(0), m)
        e = np.subtract(e, shift[:, None], out=dst)
        np.exp(e, out=e)
    emax = e[rows, am].astype(_F64)
    e[rows, am] = 0
    rest = np.vecdot(e, np.ones(e.shape[1], acc)).astype(_F64)
    rest /= emax
    return e, rows, am, m, emax, rest


def _rows(xc, tc, vc, acc, wc=None, nll=None, grad=None):
    """One pass over a chunk of rows `xc [r, V]` (safe targets `tc`, validity `vc`).

    nll: float64 [r] receives `lse - x[t]` on valid rows and 0 elsewhere. With weights `wc`
    (float64 [r], 0 on ignored rows), `grad` [r, V] receives `w * (softmax - onehot)`; it may
    be `xc` itself (in place) and may have a narrower dtype than acc (stored rounded)."""
    rows = np.arange(xc.shape[0])
    if nll is not None:
        xt = xc[rows, tc].astype(_F64)            # gathered before an in-place pass clobbers it
    scratch = grad if grad is not None and grad.dtype == acc else None
    e, rows, am, m, emax, rest = _softmax_parts(xc, acc, scratch)
    if nll is not None:
        lse = np.log1p(rest) + m
        nll[...] = np.where(vc, lse - xt, 0.0)
    if grad is None:
        return
    s = rest + 1.0                                 # sum(exp(x - shift)) / emax
    coef = wc / s                                  # w * softmax[argmax]
    hit = am == tc
    # argmax entry: w * (1/s - [t == argmax]); 1/s - 1 = -rest/s keeps full precision
    e_am = np.where(hit, -wc * rest / s, coef)
    np.multiply(e, (coef / emax).astype(acc)[:, None], out=e)        # w * softmax elsewhere
    e[rows, am] = e_am.astype(acc)
    miss = ~hit
    e[rows[miss], tc[miss]] -= wc[miss].astype(acc)
    if not vc.all():
        e[~vc] = 0
    if e is not grad:
        store(grad, e)


def _run_rows(x2, t, valid, acc, w=None, nll=None, grad=None):
    """`_rows` over all rows of `x2`, split in spans over the thread pool."""
    r, v = x2.shape

    def work(r0, r1):
        _rows(x2[r0:r1], t[r0:r1], valid[r0:r1], acc, None if w is None else w[r0:r1],
              None if nll is None else nll[r0:r1], None if grad is None else grad[r0:r1])

    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        run_spans(work, row_spans(r, v), r * v)


# --- softmax cross-entropy --------------------------------------------------------------------

def _ce_setup(op, logits, targets, ignore_index):
    v = logits.shape[-1]
    t, valid = _targets(op, targets, v, ignore_index)
    return logits.reshape(t.size, v), t, valid


def _loss_dtype(dt):
    return _F64 if np.dtype(dt) == _F64 else _F32


@kernel(FusedOps.FUSED_SOFTMAX_CROSS_ENTROPY, "numpy", cost=row_cost(6))
def fused_softmax_cross_entropy(logits, targets, *, reduction, ignore_index):
    """Softmax cross-entropy: logits [..., V] float, targets [...] = logits.shape[:-1] int64.

    Per valid row: `nll = (max + log(sum_v exp(x_v - max))) - x[t]`; ignored rows give 0.
    reduction "none" -> shape targets.shape; "sum" -> 0-d sum over valid rows; "mean" -> 0-d
    sum / N_valid, 0 when no row is valid. Output dtype float32 (float64 for float64 logits).
    """
    x2, t, valid = _ce_setup(_CE, logits, targets, ignore_index)
    nll = np.zeros(t.size, _F64)
    if x2.size and valid.any():
        _run_rows(x2, t, valid, acc_dtype(logits.dtype), nll=nll)
    return _reduce(nll, valid, reduction, targets.shape, _loss_dtype(logits.dtype))


@kernel(FUSED_SOFTMAX_CROSS_ENTROPY_BACKWARD, "numpy", cost=row_cost(6))
def fused_softmax_cross_entropy_backward(logits, targets, grad, *, reduction, ignore_index):
    """Gradient of the cross-entropy w.r.t. logits: shape and dtype of logits,
    `dlogits[r] = w_r * (softmax(x_r) - onehot(t_r))` with `w_r = grad / N_valid` (mean),
    `grad` (sum), `grad[r]` (none); ignored rows (and everything when N_valid == 0) are 0.
    grad: 0-d for "mean"/"sum", targets.shape for "none"."""
    op = _CE + "_backward"
    x2, t, valid = _ce_setup(op, logits, targets, ignore_index)
    w = _row_weights(op, grad, reduction, valid, targets.shape)
    out = np.empty(logits.shape, logits.dtype)
    if out.size:
        _run_rows(x2, t, valid, acc_dtype(logits.dtype), w=w, grad=out.reshape(x2.shape))
    return out


@kernel(FUSED_SOFTMAX_CROSS_ENTROPY_FWD_BWD, "numpy", cost=row_cost(8))
def fused_softmax_cross_entropy_fwd_bwd(logits, targets, grad, *, reduction, ignore_index):
    """Loss and dlogits in one pass over the logits: `(loss, dlogits)`, each exactly what
    `fused_softmax_cross_entropy` and `fused_softmax_cross_entropy_backward` return."""
    op = _CE + "_fwd_bwd"
    x2, t, valid = _ce_setup(op, logits, targets, ignore_index)
    w = _row_weights(op, grad, reduction, valid, targets.shape)
    nll = np.zeros(t.size, _F64)
    out = np.empty(logits.shape, logits.dtype)
    if out.size:
        _run_rows(x2, t, valid, acc_dtype(logits.dtype), w=w, nll=nll,
                  grad=out.reshape(x2.shape))
    return _reduce(nll, valid, reduction, targets.shape, _loss_dtype(logits.dtype)), out


# --- fused linear + cross-entropy -------------------------------------------------------------

def flce_cost(gemms):
    """Cost of `gemms` [N, H] x [H, V]-sized products plus the row pass over [N, V]."""
    def cost(shapes, params=None):
        (n, h), (v, _) = shapes[0], shapes[1]
        return Cost(2 * n * h * v * gemms + 8 * n * v, 4 * (n * h + v * h) * (1 + gemms))
    return cost


def flce_chunk_rows(n: int, v: int, chunk_bytes: int | None = None) -> int:
    """Tokens per chunk: as many as fit `chunk_bytes` (default FLCE_CHUNK_BYTES) of float32
    logits, at least 1."""
    return max(1, min(max(n, 1), (chunk_bytes or FLCE_CHUNK_BYTES) // max(1, 4 * v)))


def _flce(op, x, weight, targets, bias, grad, reduction, ignore_index, want_loss, want_grads,
          chunk_rows=None):
    n, h = x.shape
    v = weight.shape[0]
    dt, acc = x.dtype, acc_dtype(x.dtype)
    t, valid = _targets(op, targets, v, ignore_index)
    w = _row_weights(op, grad, reduction, valid, targets.shape) if want_grads else None
    xa, wa = to_acc(x, acc), to_acc(weight, acc)
    ba = None if bias is None else to_acc(bias, acc)
    nll = np.zeros(n, _F64)
    dx = _common.new_output((n, h), dt) if want_grads else None
    # dW is written whole by the first chunk's product (zeros only when there is no chunk)
    dw = (_common.new_output((v, h), acc) if n else np.zeros((v, h), acc)) if want_grads \
        else None
    db = np.zeros(v, acc) if want_grads and bias is not None else None
    step = chunk_rows or flce_chunk_rows(n, v)
    part = np.empty((min(step, n), h), acc) if want_grads and dt != acc else None
    part_t = np.empty((h, min(step, n)), acc) if want_grads and step < _DX_DIRECT_ROWS else None
    dw_part = np.empty((min(_DW_BLOCK, v), h), acc) if want_grads and n > step else None
    z_buf = np.empty((min(step, n), v), acc)
    groupable = _common.NUM_THREADS > 1 and 2.0 * min(step, n) * v * h >= \
        _primitives.PARALLEL_GEMM_FLOPS
    for r0 in range(0, n, step):
        r1 = min(r0 + step, n)
        xc = xa[r0:r1]
        z = gemm(xc, wa.T, out=z_buf[:r1 - r0])
        if ba is not None:
            np.add(z, ba, out=z)
        if dt != acc:                               # logits are stored in the input dtype
            z[...] = z.astype(dt)
        if want_grads:
            _run_rows(z, t[r0:r1], valid[r0:r1], acc, w=w[r0:r1],
                      nll=nll[r0:r1] if want_loss else None, grad=z)
            if r0 == 0 and step >= _DX_DIRECT_ROWS and dt == acc and groupable:
                # dx = dl @ W and dW = dl^T x_c are independent: whole products side by side
                gemm_group([(z, wa), (z.T, xc)], outs=[dx[r0:r1], dw])
            elif step >= _DX_DIRECT_ROWS:
                if dt == acc:
                    gemm(z, wa, out=dx[r0:r1])
                else:
                    store(dx[r0:r1], gemm(z, wa, out=part[:r1 - r0]))
            else:     # (W^T dl^T)^T: OpenBLAS threads a short, very deep product badly
                store(dx[r0:r1], gemm(wa.T, z.T, out=part_t[:, :r1 - r0]).T)
            if r0 == 0 and step >= _DX_DIRECT_ROWS and dt == acc and groupable:
                pass                                # computed with dx above
            elif r0 == 0:
                gemm(z.T, xc, out=dw)
            else:                                   # dW += dl^T x_c, in blocks of V rows
                for v0 in range(0, v, _DW_BLOCK):
                    v1 = min(v0 + _DW_BLOCK, v)
                    dw[v0:v1] += gemm(z[:, v0:v1].T, xc, out=dw_part[:v1 - v0])
            if db is not None:
                db += z.sum(axis=0)
        else:
            _run_rows(z, t[r0:r1], valid[r0:r1], acc, nll=nll[r0:r1])
    res = []
    if want_loss:
        res.append(_reduce(nll, valid, reduction, targets.shape, _loss_dtype(dt)))
    if want_grads:
        res += [dx, dw.astype(weight.dtype, copy=False)]
        if db is not None:
            res.append(db.astype(bias.dtype, copy=False))
    return res[0] if len(res) == 1 else tuple(res)


@kernel(FUSED_LINEAR_CROSS_ENTROPY, "numpy", cost=flce_cost(1))
def fused_linear_cross_entropy(x, weight, targets, *bias, reduction, ignore_index):
    """Cross-entropy of the logits `x @ weight.T + bias` without materializing them.

    x [N, H], weight [V, H] (nn.Linear layout), targets [N] int64, optional bias [V]; x, weight
    and bias share one float dtype. Returns the loss exactly as `fused_softmax_cross_entropy`
    of those logits would (float32; float64 for float64 inputs)."""
    return _flce(_FLCE, x, weight, targets, bias[0] if bias else None, None, reduction,
                 ignore_index, True, False)


@kernel(FUSED_LINEAR_CROSS_ENTROPY_BACKWARD, "numpy", cost=flce_cost(4))
def fused_linear_cross_entropy_backward(x, weight, targets, *rest, reduction, ignore_index):
    """Gradients of `fused_linear_cross_entropy`: inputs x, weight, targets, [bias], grad (0-d
    for mean/sum, [N] for none); returns `(dx, dweight)` or `(dx, dweight, dbias)`, each in its
    input's dtype."""
    bias = rest[0] if len(rest) == 2 else None
    return _flce(_FLCE + "_backward", x, weight, targets, bias, rest[-1], reduction,
                 ignore_index, False, True)


@kernel(FUSED_LINEAR_CROSS_ENTROPY_FWD_BWD, "numpy", cost=flce_cost(3))
def fused_linear_cross_entropy_fwd_bwd(x, weight, targets, *rest, reduction, ignore_index):
    """Loss and gradients in one sweep over the token chunks (three GEMMs per chunk instead of
    four): `(loss, dx, dweight[, dbias])`; inputs as `fused_linear_cross_entropy_backward`."""
    bias = rest[0] if len(rest) == 2 else None
    return _flce(_FLCE + "_fwd_bwd", x, weight, targets, bias, rest[-1], reduction,
                 ignore_index, True, True)
