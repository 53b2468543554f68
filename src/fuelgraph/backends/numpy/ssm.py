"""NumPy kernels for the state-space scans: SELECTIVE_SCAN (Mamba-1), SSD_CHUNK_SCAN (Mamba-2)
and their backward helpers.

Everything is computed in float32 (float64 for float64 inputs) and rounded to the input dtype
on return. Optional inputs follow the five required ones in the order the params flags name
them (d, z, bias[, initial_states]).

selective_scan: the state [B, D, N] is carried through time one step at a time (two in-place
ufunc calls per step over the whole (B, D, N) block); everything that does not depend on the
previous step (exp(dt * a), dt * u * b, y = h . c, the gradient products) is computed for a
block of steps at once. Work is split over channel spans (independent recurrences) onto the
thread pool. The backward keeps one state per time block, recomputes each block's states
from it, runs the reverse recurrence of the state cotangent for the block and forms every
gradient with vectorized products and matmuls.

ssd_chunk_scan: the chunked (state-space dual) algorithm. Time is cut into chunks of Q steps
(the kernel's own Q; the op's chunk_size is only a hint, so results do not depend on it, and a
ragged tail is padded with dt = 0 steps, which leave the state unchanged). Within a chunk the
outputs are masked Q x Q matmuls, each chunk's contribution to the state is one matmul, and a
short loop over chunks passes the state along. The backward is the same algorithm transposed;
it forms the ungated output the gate's gradient needs from the chunk terms and states it
computes anyway (no second forward pass). Work runs in groups of head rows small enough that a
group's temporaries stay in L2. One token (L = 1, a decode step) runs as the recurrence itself.
Inputs may be strided (b and c broadcast over the heads of a group, sliced x and z).
"""
from __future__ import annotations

import math

import numpy as np

from ...registry.core import FusedOps
from ...registry.ssm import SELECTIVE_SCAN_BACKWARD, SSD_CHUNK_SCAN_BACKWARD
from ..base import Cost, kernel
from .common import NUM_THREADS, acc_dtype, run_spans, store, to_acc

# elements of one time block's [T, B, Dspan, N] arrays (selective scan): about L2-sized
SS_BLOCK_ELEMS = 1 << 17
# SSD: chunk length (forward, backward) and elements of one group's [G, nc, Q, Q] arrays
SSD_CHUNK = 64
SSD_CHUNK_BWD = 32
# (a group's [G, nc, Q, *] temporaries stay in L2: 2 cores, B4 L256 H16 P=N=64, one thread,
# the forward 44 -> 35 ms and the backward 130 -> 80 ms from 1 << 20)
SSD_GROUP_ELEMS = 1 << 16
SSD_GROUP_ELEMS_BWD = 1 << 15


# ---- shared pieces ---------------------------------------------------------------------------
def _opt(srcs, names):
    got = dict(zip(names, srcs))
    return got


def _ss_names(has_d, has_z, has_bias):
    return [n for n, f in (("d", has_d), ("z", has_z), ("bias", has_bias)) if f]


def _ssd_names(has_d, has_z, has_bias, has_init):
    return [n for n, f in (("d", has_d), ("z", has_z), ("bias", has_bias), ("init", has_init))
            if f]


def _step_size(raw, bias, softplus, acc):
    """(dt, pre-activation) in acc; bias broadcasts over the last axis."""
    pre = to_acc(raw, acc)
    if bias is not None:
        pre = pre + to_acc(bias, acc)
    if not softplus:
        return pre, pre
    return np.logaddexp(acc.type(0), pre), pre


def _sigmoid(v):
    return 0.5 * (np.tanh(0.5 * v) + 1)


def _epilogue(y, x, d, z, acc, d_b):
    """y = (y + x * d) * silu(z), in place on y (acc)."""
    if d is not None:
        y += x * d_b(to_acc(d, acc))
    if z is not None:
        za = to_acc(z, acc)
        y *= za * _sigmoid(za)
    return y


def _gate_backward(gy, x, y_ssm, d, z, acc, d_b):
    """For out = (y_ssm + x * d) * silu(z): (cotangent of y_ssm, dz, d-grad summand, x skip)."""
    g = to_acc(gy, acc)
    dz = dd = dx_skip = None
    if z is not None:
        za = to_acc(z, acc)
        s = _sigmoid(za)
        yp = y_ssm if d is None else y_ssm + x * d_b(to_acc(d, acc))
        dz = g * yp * (s * (1 + za * (1 - s)))
        g = g * (za * s)
    if d is not None:
        dx_skip = g * d_b(to_acc(d, acc))
        dd = g * x
    return g, dz, dd, dx_skip


def _out(a, dtype):
    if a.dtype == dtype:
        return a
    r = np.empty(a.shape, dtype)
    store(r, np.ascontiguousarray(a))
    return r


def _spans(n, parts):
    parts = max(1, min(parts, n))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [(bounds[i], bounds[i + 1]) for i in range(parts) if bounds[i + 1] > bounds[i]]


def ss_cost(shapes, params=None, itemsize=4):
    """About ten flops per (b, t, d, n) step; every [B, L, *] input read and y written once."""
    (B, L, D), N = shapes[0], shapes[2][1]
    return Cost(10 * B * L * D * N, itemsize * (sum(math.prod(s) for s in shapes) + B * L * D))


def ssd_cost(shapes, params=None, itemsize=4, q=64):
    """Chunked SSD: 2q(N + P) flops per step for the within-chunk matmuls, 4PN for the state."""
    (B, L, H, P), N = shapes[0], shapes[3][3]
    flops = 2 * B * L * H * (q * (N + P) + 2 * P * N)
    return Cost(flops, itemsize * (sum(math.prod(s) for s in shapes) + B * L * H * P))


# ---- selective scan --------------------------------------------------------------------------
def _ss_prepare(u, delta, a, b, c, opt, delta_softplus, acc):
    dt, pre = _step_size(delta, opt.get("bias"), delta_softplus, acc)
    return dt, pre, to_acc(u, acc), to_acc(a, acc), to_acc(b, acc), to_acc(c, acc)


def _ss_block_len(B, Ds, N, L):
    return max(1, min(L, SS_BLOCK_ELEMS // max(1, B * Ds * N)))


def _tm(x, t0, t1, d0=None, d1=None):
    """[B, L, K] -> contiguous time-major block [T, B, K'] (channels d0:d1 when given)."""
    blk = x[:, t0:t1] if d0 is None else x[:, t0:t1, d0:d1]
    return np.ascontiguousarray(blk.transpose(1, 0, 2))


def _ss_states(h, dA, H):
    """In place: H[t] = dA[t] * H[t-1] + H[t] (H holds dt*u*b on entry), H[-1] from h.
    dA is kept intact (a scratch row holds each product)."""
    tmp = np.empty_like(h)
    prev = h
    for t in range(H.shape[0]):
        np.multiply(dA[t], prev, out=tmp)
        np.add(H[t], tmp, out=H[t])
        prev = H[t]


def _ss_block(dt_b, u_b, a_s, b_b, h, dA, H):
    """Fill dA = exp(dt * a) and H = the block's states [T, B, Ds, N] from entry state h."""
    np.multiply(dt_b[..., None], a_s, out=dA)
    np.exp(dA, out=dA)
    np.multiply((dt_b * u_b)[..., None], b_b[:, :, None, :], out=H)
    _ss_states(h, dA, H)


@kernel(FusedOps.SELECTIVE_SCAN, "numpy", cost=ss_cost)
def selective_scan(u, delta, a, b, c, *opt, delta_softplus, has_d, has_z, has_delta_bias):
    """SELECTIVE_SCAN: u, delta [B, L, D], a [D, N], b, c [B, L, N], then the optional
    d [D], z [B, L, D], delta_bias [D] -> (y [B, L, D], last_state [B, D, N])."""
    o = _opt(opt, _ss_names(has_d, has_z, has_delta_bias))
    acc = acc_dtype(u.dtype)
    B, L, D = u.shape
    N = a.shape[1]
    dt, _, ua, aa, ba, ca = _ss_prepare(u, delta, a, b, c, o, delta_softplus, acc)
    y = np.zeros((B, L, D), acc)
    last = np.zeros((B, D, N), acc)

    def work(d0, d1):
        Ds = d1 - d0
        T = _ss_block_len(B, Ds, N, L)
        h = np.zeros((B, Ds, N), acc)
        dA = np.empty((T, B, Ds, N), acc)
        H = np.empty((T, B, Ds, N), acc)
        a_s = aa[d0:d1]
        for t0 in range(0, L, T):
            t1 = min(L, t0 + T)
            n = t1 - t0
            dA_, H_ = dA[:n], H[:n]
            _ss_block(_tm(dt, t0, t1, d0, d1), _tm(ua, t0, t1, d0, d1), a_s, _tm(ba, t0, t1),
                      h, dA_, H_)
            yb = np.matmul(H_.reshape(n * B, Ds, N), _tm(ca, t0, t1).reshape(n * B, N, 1))
            y[:, t0:t1, d0:d1] = yb.reshape(n, B, Ds).transpose(1, 0, 2)
            h[...] = H_[n - 1]
        last[:, d0:d1] = h

    if B * D * N and L:
        with np.errstate(over="ignore", under="ignore"):
            run_spans(work, _spans(D, NUM_THREADS if B * L * D * N >= (1 << 16) else 1),
                      B * L * D * N)
    _epilogue(y, ua, o.get("d"), o.get("z"), acc, lambda v: v)
    return _out(y, u.dtype), _out(last, u.dtype)


@kernel(SELECTIVE_SCAN_BACKWARD, "numpy", cost=lambda s, p=None: ss_cost(s[:5], p))
def selective_scan_backward(u, delta, a, b, c, *rest, delta_softplus, has_d, has_z,
                            has_delta_bias):
    """Backward of SELECTIVE_SCAN: the forward inputs, then grad_y [B, L, D] and
    grad_last_state [B, D, N] -> one gradient per forward input (its shape and dtype)."""
    names = _ss_names(has_d, has_z, has_delta_bias)
    o = _opt(rest[:-2], names)
    gy, gl = rest[-2:]
    acc = acc_dtype(u.dtype)
    B, L, D = u.shape
    N = a.shape[1]
    dt, pre, ua, aa, ba, ca = _ss_prepare(u, delta, a, b, c, o, delta_softplus, acc)
    gla = to_acc(gl, acc)
    need_y = o.get("z") is not None
    y_ssm = np.zeros((B, L, D), acc) if need_y else None
    if need_y:                        # the ungated output feeds dz: one forward pass first
        with np.errstate(over="ignore", under="ignore"):
            y_ssm = selective_scan(ua, dt, aa, ba, ca, delta_softplus=False, has_d=False,
                                   has_z=False, has_delta_bias=False)[0]
    g, dz, dd, du_skip = _gate_backward(gy, ua, y_ssm, o.get("d"), o.get("z"), acc,
                                        lambda v: v)
    du = np.empty((B, L, D), acc)
    ddt = np.empty((B, L, D), acc)
    da = np.zeros((D, N), acc)
    spans = _spans(D, NUM_THREADS if B * L * D * N >= (1 << 16) else 1)
    db_parts = [np.zeros((B, L, N), acc) for _ in spans]
    dc_parts = [np.zeros((B, L, N), acc) for _ in spans]

    def work(d0, d1):
        k = next(i for i, s in enumerate(spans) if s[0] == d0)
        Ds = d1 - d0
        T = _ss_block_len(B, Ds, N, L)
        starts = list(range(0, L, T))
        a_s = aa[d0:d1]
        # states entering each block
        h = np.zeros((B, Ds, N), acc)
        hb = np.empty((len(starts), B, Ds, N), acc)
        dA = np.empty((T, B, Ds, N), acc)
        H = np.empty((T, B, Ds, N), acc)
        Gh = np.empty((T, B, Ds, N), acc)
        for i, t0 in enumerate(starts):
            t1 = min(L, t0 + T)
            hb[i] = h
            n = t1 - t0
            _ss_block(_tm(dt, t0, t1, d0, d1), _tm(ua, t0, t1, d0, d1), a_s, _tm(ba, t0, t1),
                      h, dA[:n], H[:n])
            h[...] = H[n - 1]
        carry = gla[:, d0:d1].copy()                      # dL/dh_t from later steps
        da_s = np.zeros((Ds, N), acc)
        for i in range(len(starts) - 1, -1, -1):
            t0 = starts[i]
            t1 = min(L, t0 + T)
            n = t1 - t0
            dt_b, u_b = _tm(dt, t0, t1, d0, d1), _tm(ua, t0, t1, d0, d1)
            b_b, c_b, gy_b = _tm(ba, t0, t1), _tm(ca, t0, t1), _tm(g, t0, t1, d0, d1)
            dA_, H_, G_ = dA[:n], H[:n], Gh[:n]
            _ss_block(dt_b, u_b, a_s, b_b, hb[i], dA_, H_)
            np.multiply(gy_b[..., None], c_b[:, :, None, :], out=G_)
            for t in range(n - 1, -1, -1):               # g_t = gy_t c_t + dA_{t+1} g_{t+1}
                np.add(G_[t], carry, out=G_[t])
                np.multiply(G_[t], dA_[t], out=carry)
            TB = n * B
            # dc = sum_d gy * h ;  db = sum_d g * dt * u ;  gb = sum_n g * b
            dc_parts[k][:, t0:t1] = np.matmul(gy_b.reshape(TB, 1, Ds),
                                              H_.reshape(TB, Ds, N)).reshape(n, B, N) \
                .transpose(1, 0, 2)
            dtu = dt_b * u_b
            db_parts[k][:, t0:t1] = np.matmul(dtu.reshape(TB, 1, Ds),
                                              G_.reshape(TB, Ds, N)).reshape(n, B, N) \
                .transpose(1, 0, 2)
            gb = np.matmul(G_.reshape(TB, Ds, N), b_b.reshape(TB, N, 1)).reshape(n, B, Ds)
            # dL/d(dt * a) = g_t * h_{t-1} * dA_t  (into G_, reusing dA_ as scratch)
            np.multiply(G_, dA_, out=G_)
            if n > 1:
                np.multiply(G_[1:], H_[:-1], out=G_[1:])
            np.multiply(G_[0], hb[i], out=G_[0])
            ddt_b = np.einsum("tbdn,dn->tbd", G_, a_s)
            ddt_b += u_b * gb
            np.multiply(G_, dt_b[..., None], out=G_)
            da_s += G_.reshape(TB, Ds, N).sum(0)
            ddt[:, t0:t1, d0:d1] = ddt_b.transpose(1, 0, 2)
            du[:, t0:t1, d0:d1] = (dt_b * gb).transpose(1, 0, 2)
        da[d0:d1] = da_s

    if B * D * N and L:
        with np.errstate(over="ignore", under="ignore"):
            run_spans(work, spans, B * L * D * N)
    elif L == 0 or B * D * N == 0:
        du[...] = 0
        ddt[...] = 0
    db = db_parts[0]
    dc = dc_parts[0]
    for p in db_parts[1:]:
        db += p
    for p in dc_parts[1:]:
        dc += p
    if du_skip is not None:
        du += du_skip
    if delta_softplus:
        ddt *= _sigmoid(pre)
    grads = [du, ddt, da, db, dc]
    if "d" in o:
        grads.append(dd.sum((0, 1)))
    if "z" in o:
        grads.append(dz)
    if "bias" in o:
        grads.append(ddt.sum((0, 1)))
    return tuple(_out(gr, u.dtype) for gr in grads)


# ---- SSD (chunked) ---------------------------------------------------------------------------
def _ssd_prepare(x, dt, a, b, c, o, softplus, acc, chunk=None):
    """Head-major, chunk-padded arrays: X [BH, Lp, P], DT [BH, Lp], Bm/Cm [BH, Lp, N], a [BH],
    plus dt and its pre-activation in [B, L, H]."""
    B, L, H, P = x.shape
    N = b.shape[3]
    dtv, pre = _step_size(dt, o.get("bias"), softplus, acc)
    Q = min(chunk or SSD_CHUNK, max(1, L))
    Lp = -(-L // Q) * Q

    def hm(t, last):                     # [B, L, H, *last] -> [B*H, Lp, *last]
        t = np.moveaxis(to_acc(t, acc), 2, 1).reshape((B * H, L) + last)
        if Lp == L:
            return np.ascontiguousarray(t)
        r = np.zeros((B * H, Lp) + last, acc)
        r[:, :L] = t
        return r

    X, Bm, Cm = hm(x, (P,)), hm(b, (N,)), hm(c, (N,))
    DT = hm(dtv[..., None], (1,))[..., 0]
    aa = np.broadcast_to(to_acc(a, acc), (B, H)).reshape(B * H)
    return X, DT, aa, Bm, Cm, Q, Lp, dtv, pre


def _ssd_chunk_terms(DT, aa, Cm, Bm, Q):
    """Per chunk: Acum [G, nc, Q] (inclusive prefix sums of dt * a), Lm [G, nc, Q, Q]
    (exp(Acum[t] - Acum[s]) for s <= t, else 0), CB = C B^T [G, nc, Q, Q]."""
    G, Lp = DT.shape
    nc = Lp // Q
    s = DT.reshape(G, nc, Q) * aa[:, None, None]
    Acum = np.cumsum(s, axis=-1)
    Lm = Acum[..., :, None] - Acum[..., None, :]
    np.copyto(Lm, -np.inf, where=~np.tri(Q, dtype=bool))
    np.exp(Lm, out=Lm)
    CB = np.matmul(Cm.reshape(G, nc, Q, -1), Bm.reshape(G, nc, Q, -1).swapaxes(-1, -2))
    return Acum, Lm, CB


def _ssd_group_fwd(X, DT, aa, Bm, Cm, h0, Q):
    """Chunked SSD on G head rows: y [G, Lp, P] and the states entering each chunk
    [G, nc + 1, P, N] (the last one is the final state)."""
    G, Lp, P = X.shape
    N = Bm.shape[-1]
    nc = Lp // Q
    Acum, Lm, CB = _ssd_chunk_terms(DT, aa, Cm, Bm, Q)
    dtc = DT.reshape(G, nc, Q)
    Xc, Bc, Cc = X.reshape(G, nc, Q, P), Bm.reshape(G, nc, Q, N), Cm.reshape(G, nc, Q, N)
    M = CB
    M *= Lm
    M *= dtc[:, :, None, :]
    y = np.matmul(M, Xc)                                             # intra-chunk
    w = np.exp(Acum[..., -1:] - Acum) * dtc                          # decay to chunk end * dt
    Sloc = np.matmul((Xc * w[..., None]).swapaxes(-1, -2), Bc)       # [G, nc, P, N]
    Hs = np.empty((G, nc + 1, P, N), X.dtype)
    Hs[:, 0] = h0
    dec = np.exp(Acum[..., -1])                                      # [G, nc]
    for k in range(nc):
        np.multiply(Hs[:, k], dec[:, k, None, None], out=Hs[:, k + 1])
        Hs[:, k + 1] += Sloc[:, k]
    yoff = np.matmul(Cc, Hs[:, :nc].swapaxes(-1, -2))                # [G, nc, Q, P]
    yoff *= np.exp(Acum)[..., None]
    y += yoff
    return y.reshape(G, Lp, P), Hs


def _ssd_groups(BH, L, Q, elems=None):
    G = max(1, min(BH, (elems or SSD_GROUP_ELEMS) // max(1, L * Q)))
    spans = [(i, min(BH, i + G)) for i in range(0, BH, G)]
    if len(spans) < NUM_THREADS and BH >= NUM_THREADS and BH * L * Q >= (1 << 16):
        spans = _spans(BH, NUM_THREADS)
    return spans


def _d_b(H, P):
    return lambda v: v[:, None] if v.ndim == 1 else v


# strided inputs: the head-major copies below are the only ones (b and c broadcast over the
# heads of a group, x and z slices of a projection are read where they are)
@kernel(FusedOps.SSD_CHUNK_SCAN, "numpy", cost=ssd_cost, strided_input=True)
def ssd_chunk_scan(x, dt, a, b, c, *opt, chunk_size, dt_softplus, has_d, has_z, has_dt_bias,
                   has_initial_states):
    """SSD_CHUNK_SCAN: x [B, L, H, P], dt [B, L, H], a [H], b, c [B, L, H, N], then the optional
    d [H] or [H, P], z [B, L, H, P], dt_bias [H], initial_states [B, H, P, N] ->
    (y [B, L, H, P], last_state [B, H, P, N])."""
    o = _opt(opt, _ssd_names(has_d, has_z, has_dt_bias, has_initial_states))
    acc = acc_dtype(x.dtype)
    B, L, H, P = x.shape
    N = b.shape[3]
    h0 = np.zeros((B * H, P, N), acc) if "init" not in o else \
        np.ascontiguousarray(to_acc(o["init"], acc).reshape(B * H, P, N))
    if L == 0 or B * H * P * N == 0:
        y = np.zeros((B, L, H, P), acc)
        _epilogue(y, to_acc(x, acc), o.get("d"), o.get("z"), acc, _d_b(H, P))
        return _out(y, x.dtype), _out(h0.reshape(B, H, P, N), x.dtype)
    if L == 1:
        return _ssd_one_step(x, dt, a, b, c, o, dt_softplus, acc, h0)
    X, DT, aa, Bm, Cm, Q, Lp, _, _ = _ssd_prepare(x, dt, a, b, c, o, dt_softplus, acc)
    Y = np.empty((B * H, Lp, P), acc)
    last = np.empty((B * H, P, N), acc)

    def work(g0, g1):
        y, Hs = _ssd_group_fwd(X[g0:g1], DT[g0:g1], aa[g0:g1], Bm[g0:g1], Cm[g0:g1],
                               h0[g0:g1], Q)
        Y[g0:g1] = y
        last[g0:g1] = Hs[:, -1]

    with np.errstate(over="ignore", under="ignore"):
        run_spans(work, _ssd_groups(B * H, Lp, Q), B * H * Lp * Q)
    y = np.ascontiguousarray(np.moveaxis(Y[:, :L].reshape(B, H, L, P), 1, 2))
    _epilogue(y, to_acc(x, acc), o.get("d"), o.get("z"), acc, _d_b(H, P))
    return _out(y, x.dtype), _out(last.reshape(B, H, P, N), x.dtype)


#: head rows per part of a one-token step at most: 32 states of 64 x 64 float32 (512 KiB)
#: stay in L2 (2 cores, B4 H16 P=N=64, one thread: 16-64 rows per part all ~340 us a layer)
SSD_STEP_ROWS = 32


def _ssd_one_step(x, dt, a, b, c, o, softplus, acc, h0):
    """SSD_CHUNK_SCAN of one token (a decode step) as the recurrence itself: per head row,
    h = exp(dt * a) * h0 + (dt * x) b^T and y = h c, in parts of SSD_STEP_ROWS head rows on
    the pool so that each part's states stay in cache between the passes."""
    B, _, H, P = x.shape
    N = b.shape[3]
    dtv, _ = _step_size(dt, o.get("bias"), softplus, acc)            # [B, 1, H]
    DT = np.ascontiguousarray(dtv.reshape(B * H))
    decay = np.exp(DT * np.broadcast_to(to_acc(a, acc), (B, H)).reshape(B * H))
    DX = to_acc(x, acc).reshape(B * H, P) * DT[:, None]              # dt * x
    Bm, Cm = to_acc(b, acc).reshape(B * H, N), to_acc(c, acc).reshape(B * H, N)
    last = np.empty((B * H, P, N), acc)
    y = np.empty((B * H, P), acc)

    def work(g0, g1):
        h = last[g0:g1]
        # decay as a [rows, P*N] product with a per-row factor (with run_spans' row-sized ufunc
        # buffer, ~2.5x faster than over [rows, P, N]); the outer product by einsum (~1.6x
        # faster than the broadcast multiply)
        np.multiply(h0[g0:g1].reshape(g1 - g0, P * N), decay[g0:g1, None],
                    out=h.reshape(g1 - g0, P * N))
        h += np.einsum("gp,gn->gpn", DX[g0:g1], Bm[g0:g1])
        np.matmul(h, Cm[g0:g1, :, None], out=y[g0:g1, :, None])

    spans = [(i, min(B * H, i + SSD_STEP_ROWS)) for i in range(0, B * H, SSD_STEP_ROWS)]
    with np.errstate(over="ignore", under="ignore"):
        run_spans(work, spans, B * H * P * N, row_elems=P * N)
    y = y.reshape(B, 1, H, P)
    _epilogue(y, to_acc(x, acc), o.get("d"), o.get("z"), acc, _d_b(H, P))
    return _out(y, x.dtype), _out(last.reshape(B, H, P, N), x.dtype)


def _ssd_group_bwd(X, DT, aa, Bm, Cm, h0, GY, GL, Q, Z=None, Dr=None):
    """Gradients on G head rows given the cotangent GY [G, Lp, P] of the output and GL
    [G, P, N] of the final state, the output gated by Z [G, Lp, P] (silu) and skipped by
    Dr (d per head row, [G, 1, 1] or [G, 1, P]) when given: dX, dDT (direct + decay terms),
    da [G], dB, dC, dh0, dZ (or None), the d-gradient summed over the row [G, P] (or None).
    The ungated y the gate's gradient needs is formed here from the chunk terms and states
    the backward computes anyway (no second forward pass)."""
    G, Lp, P = X.shape
    N = Bm.shape[-1]
    nc = Lp // Q
    Acum, Lm, CB = _ssd_chunk_terms(DT, aa, Cm, Bm, Q)
    dtc = DT.reshape(G, nc, Q)
    Xc, Bc, Cc = X.reshape(G, nc, Q, P), Bm.reshape(G, nc, Q, N), Cm.reshape(G, nc, Q, N)
    eA = np.exp(Acum)                                                # decay from chunk start
    wend = np.exp(Acum[..., -1:] - Acum)                             # decay to chunk end
    dec = eA[..., -1]                                                # whole-chunk decay
    # forward states entering each chunk
    Sloc = np.matmul((Xc * (wend * dtc)[..., None]).swapaxes(-1, -2), Bc)
    Hs = np.empty((G, nc + 1, P, N), X.dtype)
    Hs[:, 0] = h0
    for k in range(nc):
        np.multiply(Hs[:, k], dec[:, k, None, None], out=Hs[:, k + 1])
        Hs[:, k + 1] += Sloc[:, k]
    dZ = dD = None
    if Z is not None or Dr is not None:
        GY, dZ, dD, skip = _gate_rows(GY.reshape(G, nc, Q, P), Xc, CB, Lm, dtc, Cc, Hs, eA,
                                      Z, Dr)
    Yg = GY.reshape(G, nc, Q, P)
    # Dst[k] = dL/d(state at the end of chunk k), from later chunks and GL
    Yc = np.matmul((Yg * eA[..., None]).swapaxes(-1, -2), Cc)       # [G, nc, P, N]
    Dst = np.empty((G, nc + 1, P, N), X.dtype)                       # Dst[k + 1] <-> chunk k
    Dst[:, nc] = GL
    for k in range(nc - 1, -1, -1):
        np.multiply(Dst[:, k + 1], dec[:, k, None, None], out=Dst[:, k])
        Dst[:, k] += Yc[:, k]
    dh0 = Dst[:, 0]
    Dend = Dst[:, 1:]                                                # [G, nc, P, N]
    Hin = Hs[:, :nc]
    CBm = CB * Lm                                                    # [t, s], s <= t
    # x: dt_s * (sum_t CBm[t, s] gy_t + wend_s * B_s Dend^T)
    QB = np.matmul(Bc, np.ascontiguousarray(Dend.swapaxes(-1, -2)))  # [G, nc, Q, P]
    gB = np.matmul(CBm.swapaxes(-1, -2), Yg)
    gB += wend[..., None] * QB
    dX = gB * dtc[..., None]
    ddt = np.vecdot(gB, Xc)
    # b: dt_s * (sum_t W[t, s] C_t + wend_s * X_s Dend)
    W = np.matmul(Yg, Xc.swapaxes(-1, -2))                           # [t, s] = gy_t . x_s
    W *= Lm
    dB = np.matmul(W.swapaxes(-1, -2), Cc)
    dB += wend[..., None] * np.matmul(Xc, Dend)
    dB *= dtc[..., None]
    # c: sum_s V[t, s] B_s + eA_t * gy_t Hin
    W *= dtc[:, :, None, :]                                          # V
    dC = np.matmul(W, Bc)
    yoff = np.matmul(Yg, Hin)                                        # [G, nc, Q, N]
    dC += eA[..., None] * yoff
    # d loss / d Acum
    W *= CB                                                          # Z
    dAc = W.sum(-1) - W.sum(-2)
    dAc += eA * np.vecdot(yoff, Cc)                                  # gy . Yoff
    r = wend * dtc * np.vecdot(Xc, QB)
    dAc -= r
    dAc[..., -1] += r.sum(-1) + dec * np.vecdot(Dend.reshape(G, nc, -1), Hin.reshape(G, nc, -1))
    ds = np.flip(np.cumsum(np.flip(dAc, -1), -1), -1)               # d loss / d (dt * a)
    ddt += ds * aa[:, None, None]
    da = (ds * dtc).sum((1, 2))
    dX = dX.reshape(G, Lp, P)
    if Dr is not None:
        dX += skip
    return (dX, ddt.reshape(G, Lp), da, dB.reshape(G, Lp, N), dC.reshape(G, Lp, N), dh0, dZ,
            dD)


def _gate_rows(GY, Xc, CB, Lm, dtc, Cc, Hs, eA, Z, Dr):
    """The gate and skip of the SSD output on head rows (chunked [G, nc, Q, P]): the ungated
    y = (CB * Lm * dt) x + exp(Acum) C h_in, then for out = (y + x * d) * silu(z):
    (cotangent of y [G, Lp, P], dZ, d-gradient per row [G, P], x's skip gradient)."""
    G, nc, Q, P = GY.shape
    g, dZ, dD, skip = GY.reshape(G, nc * Q, P), None, None, None
    X = Xc.reshape(G, nc * Q, P)
    if Z is not None:
        M = CB * Lm
        M *= dtc[:, :, None, :]
        y = np.matmul(M, Xc)
        yoff = np.matmul(Cc, Hs[:, :nc].swapaxes(-1, -2))
        yoff *= eA[..., None]
        y += yoff
        y = y.reshape(G, nc * Q, P)
        if Dr is not None:
            y += X * Dr
        s = _sigmoid(Z)
        dZ = s * (1 + Z * (1 - s))
        dZ *= g
        dZ *= y
        g = g * (Z * s)
    if Dr is not None:
        skip = g * Dr
        dD = np.vecdot(g.swapaxes(1, 2), X.swapaxes(1, 2))                # [G, P]
    return g, dZ, dD, skip


@kernel(SSD_CHUNK_SCAN_BACKWARD, "numpy", cost=lambda s, p=None: ssd_cost(s[:5], p),
        strided_input=True)
def ssd_chunk_scan_backward(x, dt, a, b, c, *rest, chunk_size, dt_softplus, has_d, has_z,
                            has_dt_bias, has_initial_states):
    """Backward of SSD_CHUNK_SCAN: the forward inputs, then grad_y [B, L, H, P] and
    grad_last_state [B, H, P, N] -> one gradient per forward input (its shape and dtype)."""
    o = _opt(rest[:-2], _ssd_names(has_d, has_z, has_dt_bias, has_initial_states))
    gy, gl = rest[-2:]
    acc = acc_dtype(x.dtype)
    B, L, H, P = x.shape
    N = b.shape[3]
    h0 = np.zeros((B * H, P, N), acc) if "init" not in o else \
        np.ascontiguousarray(to_acc(o["init"], acc).reshape(B * H, P, N))
    X, DT, aa, Bm, Cm, Q, Lp, dtv, pre = _ssd_prepare(x, dt, a, b, c, o, dt_softplus, acc,
                                                      SSD_CHUNK_BWD)
    BH = B * H

    def hm(t, last):
        t = np.moveaxis(to_acc(t, acc), 2, 1).reshape((BH, L) + last)
        r = np.zeros((BH, Lp) + last, acc)
        r[:, :L] = t
        return r

    GY = hm(gy, (P,))
    Z = hm(o["z"], (P,)) if "z" in o else None
    Dr = None
    if "d" in o:                                        # d of each head row
        d = to_acc(o["d"], acc)
        Dr = np.broadcast_to(d.reshape(1, H, -1), (B, H, d.size // H)).reshape(BH, 1, -1)
    GL = np.ascontiguousarray(to_acc(gl, acc).reshape(BH, P, N))
    dX, dDT = np.zeros((BH, Lp, P), acc), np.zeros((BH, Lp), acc)
    dBm, dCm = np.zeros((BH, Lp, N), acc), np.zeros((BH, Lp, N), acc)
    da_bh, dh0 = np.zeros(BH, acc), GL.copy()
    dZ = np.zeros((BH, Lp, P), acc) if Z is not None else None
    dD = np.zeros((BH, P), acc) if Dr is not None else None

    def work(g0, g1):
        r = _ssd_group_bwd(X[g0:g1], DT[g0:g1], aa[g0:g1], Bm[g0:g1], Cm[g0:g1], h0[g0:g1],
                           GY[g0:g1], GL[g0:g1], Q, None if Z is None else Z[g0:g1],
                           None if Dr is None else Dr[g0:g1])
        for dst, src in zip((dX, dDT, da_bh, dBm, dCm, dh0, dZ, dD), r):
            if dst is not None:
                dst[g0:g1] = src

    if L and BH * P * N:
        with np.errstate(over="ignore", under="ignore"):
            run_spans(work, _ssd_groups(BH, Lp, Q, SSD_GROUP_ELEMS_BWD), BH * Lp * Q)
    elif dZ is not None or dD is not None:                # no state: out = x * d * silu(z)
        g = GY
        if Z is not None:
            s = _sigmoid(Z)
            yp = X * Dr if Dr is not None else np.zeros_like(X)
            dZ = GY * yp * (s * (1 + Z * (1 - s)))
            g = GY * (Z * s)
        if Dr is not None:
            dX += g * Dr
            dD = (g * X).sum(1)

    def back(t, last):                                  # [BH, Lp, *last] -> [B, L, H, *last]
        return np.moveaxis(t[:, :L].reshape((B, H, L) + last), 1, 2)

    dx = back(dX, (P,))
    ddt = back(dDT[..., None], (1,))[..., 0]
    if dt_softplus:
        ddt = ddt * _sigmoid(pre)
    grads = [dx, ddt, da_bh.reshape(B, H).sum(0), back(dBm, (N,)), back(dCm, (N,))]
    if "d" in o:
        dd = dD.reshape(B, H, P).sum(0)
        grads.append(dd if o["d"].ndim == 2 else dd.sum(-1))
    if "z" in o:
        grads.append(back(dZ, (P,)))
    if "bias" in o:
        grads.append(ddt.sum((0, 1)))
    if "init" in o:
        grads.append(dh0.reshape(B, H, P, N))
    return tuple(_out(np.ascontiguousarray(gr), x.dtype) for gr in grads)
