"""Attention: FLASH_ATTN (id 12) and its gradient ops FLASH_ATTN_BACKWARD_Q/K/V (ids 22, 23, 24),
plus FLASH_ATTN_BACKWARD (0x111), which computes all three gradients in one pass.

Shapes: q [B, Hq, Sq, D]; k, v [B, Hkv, Sk, D] with Hq % Hkv == 0 (grouped-query attention:
query head h reads key/value head h // (Hq / Hkv)); one float dtype for q, k, v (float32,
float64, bfloat16, float16). Optional inputs, in this order after v: alibi_slopes (float32,
[Hq] or [B, Hq]) and k_len (a 0-d int32/int64 tensor; a Python int goes into the params).

Semantics, for batch b, query head h, query row i (L = k_len, or Sk without one):
    a_i   = i + L - Sq                  query position, aligned to the END of the live keys
                                        (bottom-right); may be negative when Sq > L
    key j is admissible iff  0 <= j < L
                         and (not causal or j <= a_i)
                         and (window_size_left is None or j >= a_i - window_size_left)
                         and (window_size_right is None or j <= a_i + window_size_right)
    s_ij  = softmax_scale * q_i . k_j                     (default scale 1 / sqrt(D))
    s_ij  = softcap * tanh(s_ij / softcap)                if softcap
    s_ij -= slope[b, h] * |a_i - j|                       if alibi_slopes
    out_i = sum_j p_ij v_j, p = softmax over the admissible keys of row i; a row without an
            admissible key outputs 0 (and passes no gradient)
    lse_i = log sum_j exp(s_ij) over the admissible keys, +inf for a row without one
Keys at positions >= L are never read. Scores, softmax and sums run in float32 (float64 for
float64 inputs); `out` is rounded once to the input dtype, `lse` ([B, Hq, Sq]) stays float32
(float64). FLASH_ATTN's node has two outputs (out, lse): the public function returns `out`,
the gradient ops reuse `lse`.

Gradients: with dO the gradient of `out` and delta_i = sum_d dO_id * out_id (minus the gradient
of lse_i when lse itself is differentiated), p_ij = exp(s_ij - lse_i) on admissible keys:
    dP = dO v^T;  dS = p * (dP - delta);  dS *= (1 - tanh^2(s_pre / softcap)) if softcap
    dq = softmax_scale * dS k;  dk = softmax_scale * dS^T q;  dv = p^T dO
with dk and dv summed over the query heads that share a key/value head. ALiBi slopes and k_len
get no gradient. The gradient ops take (q, k, v, grad_out, lse, delta) and then the same
optional inputs and params as the forward. Autograd (and flash_attn_backward) emits the three
ops; each is one output of FLASH_ATTN_BACKWARD, so the three of one backward lower to a single
combined node and one pass over the scores computes dq, dk and dv (5 matrix products per tile
instead of 8 for three separate passes)."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np

from .. import dtype as dt
from ..errors import FuelGraphError
from ..ir import ops
from ..ir.tensor import Tensor, const, full, iota, where
from .core import BackwardKind, FusedOpEntry, FusedOpId, FusedOps, call_fused
from .rules import check_float

FLASH_ATTN_BACKWARD = FusedOpId(0x111)   # (dq, dk, dv) in one node

_FWD = "flash_attn"
_BWD_NAMES = {FusedOps.FLASH_ATTN_BACKWARD_Q: "flash_attn_backward_q",
              FusedOps.FLASH_ATTN_BACKWARD_K: "flash_attn_backward_k",
              FusedOps.FLASH_ATTN_BACKWARD_V: "flash_attn_backward_v",
              FLASH_ATTN_BACKWARD: "flash_attn_backward"}


@dataclass(frozen=True)
class FlashAttnParams:
    """softmax_scale: multiplier of q.k; causal: mask keys after the (bottom-right aligned)
    query position; window_size_left/right: keys at most this far before/after it (None:
    unbounded); softcap: c in c * tanh(s / c) (None: off); k_len: live key count when given as
    a Python int (None: Sk, or the k_len input); has_alibi: alibi_slopes is an input;
    k_len_input: k_len is the last input (a 0-d integer tensor read when the graph runs)."""
    softmax_scale: float
    causal: bool = False
    window_size_left: int | None = None
    window_size_right: int | None = None
    softcap: float | None = None
    k_len: int | None = None
    has_alibi: bool = False
    k_len_input: bool = False


# ---- validation -----------------------------------------------------------------------------
def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))


def _is_real(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


def _check_params(name, p, sk):
    if not _is_real(p.softmax_scale) or not math.isfinite(float(p.softmax_scale)):
        raise FuelGraphError(f"{name}: softmax_scale must be a finite real number, got "
                             f"{p.softmax_scale!r}")
    if not isinstance(p.causal, (bool, np.bool_)):
        raise FuelGraphError(f"{name}: causal must be a bool, got {p.causal!r}")
    for what in ("window_size_left", "window_size_right"):
        w = getattr(p, what)
        if w is not None and (not _is_int(w) or w < 0):
            raise FuelGraphError(f"{name}: {what} must be None or an int >= 0, got {w!r}")
    c = p.softcap
    if c is not None and (not _is_real(c) or not math.isfinite(float(c)) or c <= 0):
        raise FuelGraphError(f"{name}: softcap must be None or a finite number > 0, got {c!r}")
    kl = p.k_len
    if kl is not None:
        if p.k_len_input:
            raise FuelGraphError(f"{name}: k_len is given both as a param and as an input")
        if not _is_int(kl):
            raise FuelGraphError(f"{name}: k_len must be an int or a 0-d int32/int64 tensor, "
                                 f"got {kl!r}")
        if not 0 <= kl <= sk:
            raise FuelGraphError(f"{name}: k_len = {kl} is outside [0, Sk = {sk}]")


def _check_qkv(name, q, k, v):
    for label, t in (("q", q), ("k", k), ("v", v)):
        if len(t.shape) != 4:
            raise FuelGraphError(f"{name}: {label} has shape {tuple(t.shape)}, expected rank 4 "
                                 f"({'[B, Hq, Sq, D]' if label == 'q' else '[B, Hkv, Sk, D]'})")
    check_float(name, [q, k, v], labels=["q", "k", "v"])
    for label, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise FuelGraphError(f"{name}: {label} has dtype {t.dtype.name}, expected "
                                 f"{q.dtype.name} (same as q)")
    B, Hq, _, D = q.shape
    if tuple(v.shape) != tuple(k.shape):
        raise FuelGraphError(f"{name}: v has shape {tuple(v.shape)}, expected {tuple(k.shape)} "
                             f"(same as k)")
    if k.shape[0] != B:
        raise FuelGraphError(f"{name}: k has batch {k.shape[0]}, expected {B} (batch of q)")
    if D < 1:
        raise FuelGraphError(f"{name}: q has shape {tuple(q.shape)}, expected a head dim D >= 1")
    if k.shape[3] != D:
        raise FuelGraphError(f"{name}: k has head dim {k.shape[3]}, expected {D} (head dim of q)")
    hkv = k.shape[1]
    if hkv < 1 or Hq % hkv:
        raise FuelGraphError(f"{name}: q has {Hq} heads, not a multiple of the {hkv} heads of k "
                             f"and v")


def _check_optional(name, srcs, p, first):
    """alibi_slopes and the k_len tensor, starting at input `first`; returns the count."""
    B, Hq = srcs[0].shape[:2]
    i = first
    if p.has_alibi:
        a = srcs[i]
        if a.dtype != dt.float32:
            raise FuelGraphError(f"{name}: alibi_slopes has dtype {a.dtype.name}, expected "
                                 f"float32 (for every q dtype)")
        if tuple(a.shape) not in ((Hq,), (B, Hq)):
            raise FuelGraphError(f"{name}: alibi_slopes has shape {tuple(a.shape)}, expected "
                                 f"({Hq},) or ({B}, {Hq})")
        i += 1
    if p.k_len_input:
        t = srcs[i]
        if t.dtype not in (dt.int32, dt.int64) or tuple(t.shape) != ():
            raise FuelGraphError(f"{name}: k_len has shape {tuple(t.shape)} and dtype "
                                 f"{t.dtype.name}, expected a 0-d int32 or int64 tensor")
        i += 1
    return i - first


def _check_arity(name, srcs, p, fixed):
    for flag in ("has_alibi", "k_len_input"):
        if not isinstance(getattr(p, flag), (bool, np.bool_)):
            raise FuelGraphError(f"{name}: {flag} must be a bool, got {getattr(p, flag)!r}")
    n = len(fixed) + int(bool(p.has_alibi)) + int(bool(p.k_len_input))
    if len(srcs) != n:
        names = fixed + ("alibi_slopes",) * bool(p.has_alibi) + ("k_len",) * bool(p.k_len_input)
        raise FuelGraphError(f"{name}: expected {n} inputs ({', '.join(names)}), got {len(srcs)}")


def _validate_forward(srcs, p):
    _check_arity(_FWD, srcs, p, ("q", "k", "v"))
    _check_qkv(_FWD, *srcs[:3])
    _check_params(_FWD, p, srcs[1].shape[2])
    _check_optional(_FWD, srcs, p, 3)


def _validate_backward(name):
    def validate(srcs, p):
        _check_arity(name, srcs, p, ("q", "k", "v", "grad_out", "lse", "delta"))
        q, k, v, go, lse, delta = srcs[:6]
        _check_qkv(name, q, k, v)
        _check_params(name, p, k.shape[2])
        if tuple(go.shape) != tuple(q.shape) or go.dtype != q.dtype:
            raise FuelGraphError(f"{name}: grad_out is {tuple(go.shape)} {go.dtype.name}, "
                                 f"expected {tuple(q.shape)} {q.dtype.name} (like q)")
        for label, t in (("lse", lse), ("delta", delta)):
            if tuple(t.shape) != tuple(q.shape[:3]) or t.dtype != q.dtype.acc:
                raise FuelGraphError(f"{name}: {label} is {tuple(t.shape)} {t.dtype.name}, "
                                     f"expected {tuple(q.shape[:3])} {q.dtype.acc.name}")
        _check_optional(name, srcs, p, 6)
    return validate


# ---- shape / dtype rules -------------------------------------------------------------------
def _forward_shapes(shapes, p):
    return [tuple(shapes[0]), tuple(shapes[0][:3])]


def _forward_dtypes(dtypes, p):
    return [dtypes[0], dtypes[0].acc]


_BWD_SLOT = {FusedOps.FLASH_ATTN_BACKWARD_Q: 0, FusedOps.FLASH_ATTN_BACKWARD_K: 1,
             FusedOps.FLASH_ATTN_BACKWARD_V: 2}


def _backward_shapes(op_id):
    if op_id == FLASH_ATTN_BACKWARD:
        return lambda shapes, p: [tuple(shapes[0]), tuple(shapes[1]), tuple(shapes[2])]
    slot = _BWD_SLOT[op_id]
    return lambda shapes, p: [tuple(shapes[slot])]


def _backward_dtypes(op_id):
    n = 3 if op_id == FLASH_ATTN_BACKWARD else 1
    return lambda dtypes, p: [dtypes[0]] * n


# ---- recipes (primitives only) ---------------------------------------------------------------
def _split_optional(opt, has_alibi, k_len_input):
    alibi = opt[0] if has_alibi else None
    kl = opt[-1] if k_len_input else None
    return alibi, kl


def _repeat_kv(x: Tensor, groups: int) -> Tensor:
    """[B, Hkv, S, D] -> [B, Hkv * groups, S, D], head h reading head h // groups."""
    if groups == 1:
        return x
    B, H, S, D = x.shape
    return x.reshape(B, H, 1, S, D).broadcast_to(B, H, groups, S, D).reshape(B, H * groups, S, D)


def _fold_kv(x: Tensor, groups: int) -> Tensor:
    """Sum [B, Hkv * groups, S, D] over each group of query heads -> [B, Hkv, S, D]."""
    if groups == 1:
        return x
    B, H, S, D = x.shape
    return x.reshape(B, H // groups, groups, S, D).sum(2)


def _live_keys(k, v, kl, p):
    """k, v restricted to the live keys: sliced to a static k_len, or (run-time k_len) rows
    >= k_len zeroed, so that garbage there (even NaN) never reaches a result. Also L (an int
    or a 0-d int64 tensor) and the run-time validity flag (None for a static length)."""
    Sk = k.shape[2]
    if kl is None:
        L = Sk if p.k_len is None else int(p.k_len)
        if L < Sk:
            k, v = k[:, :, :L], v[:, :, :L]
        return k, v, L, None
    L = kl.astype(dt.int64)
    live = (iota(Sk, dt.int64, k.device) < L).reshape(1, 1, Sk, 1)
    k, v = where(live, k, 0.0), where(live, v, 0.0)
    return k, v, L, (L >= 0) & (L <= Sk)


def _scores(q, k, alibi, L, dynamic, p):
    """Scaled (softcapped, ALiBi-biased) scores [B, Hq, Sq, Sk'] in acc(T) over the live keys
    k (Sk' keys), -inf outside the admissible ones; also the softcap tanh (or None)."""
    acc = q.dtype.acc
    Sq, Sk = q.shape[2], k.shape[2]
    ka = _repeat_kv(k, q.shape[1] // k.shape[1]).astype(acc)
    s = (q.astype(acc) @ ka.mT) * float(p.softmax_scale)
    t = None
    if p.softcap is not None:
        t = (s / float(p.softcap)).tanh()
        s = t * float(p.softcap)
    i = iota(Sq, dt.int64, q.device).reshape(Sq, 1)
    j = iota(Sk, dt.int64, q.device).reshape(1, Sk)
    a = i + (L - Sq)                                  # query positions, bottom-right aligned
    conds = [j < L] if dynamic else []
    if p.causal:
        conds.append(j <= a)
    if p.window_size_left is not None:
        conds.append(j >= a - int(p.window_size_left))
    if p.window_size_right is not None:
        conds.append(j <= a + int(p.window_size_right))
    if alibi is not None:
        dist = (a - j).abs().astype(dt.float32)       # [Sq, Sk]
        slopes = alibi.reshape((1,) * (2 - alibi.ndim) + alibi.shape + (1, 1))
        s = s - (slopes * dist).astype(acc)
    if conds:
        adm = conds[0]
        for c in conds[1:]:
            adm = adm & c
        s = where(adm.broadcast_to(Sq, Sk), s, -math.inf)
    return s, t


def _poison(x: Tensor, ok) -> Tensor:
    """NaN everywhere when a run-time k_len is out of range (a graph cannot raise)."""
    return x if ok is None else where(ok, x, math.nan)


def _params(**kw) -> FlashAttnParams:
    return FlashAttnParams(**kw)


def flash_attn_recipe(q, k, v, *opt, **params):
    """(out [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq] in acc(q)): attention with the scores
    materialized. Rows without an admissible key give out = 0 and lse = +inf."""
    p = _params(**params)
    alibi, kl = _split_optional(opt, p.has_alibi, p.k_len_input)
    acc = q.dtype.acc
    k, v, L, ok = _live_keys(k, v, kl, p)
    if k.shape[2] == 0:                               # no live key: every row is empty
        return (_poison(full(q.shape[:3] + (v.shape[3],), 0.0, q.dtype, q.device), ok),
                _poison(full(q.shape[:3], math.inf, acc, q.device), ok))
    s, _ = _scores(q, k, alibi, L, kl is not None, p)
    m = s.max(-1, keepdim=True).detach()              # softmax is invariant to the shift
    m = where(m == -math.inf, 0.0, m)
    e = (s - m).exp()
    den = e.sum(-1, keepdim=True)
    live = den > 0.0
    safe = where(live, den, 1.0)
    va = _repeat_kv(v, q.shape[1] // v.shape[1]).astype(acc)
    out = ((e / safe) @ va).astype(q.dtype)
    lse = where(live, m + safe.log(), math.inf).reshape(q.shape[:3])
    return _poison(out, ok), _poison(lse, ok)


def flash_attn_backward_recipe(q, k, v, grad_out, lse, delta, *opt, **params):
    """(dq, dk, dv) with the scores materialized, probabilities from the saved lse."""
    p = _params(**params)
    alibi, kl = _split_optional(opt, p.has_alibi, p.k_len_input)
    acc = q.dtype.acc
    groups = q.shape[1] // k.shape[1]
    Sk = k.shape[2]
    k, v, L, ok = _live_keys(k, v, kl, p)
    if k.shape[2] == 0:
        dq, dk, dv = (full(x.shape, 0.0, acc, q.device) for x in (q, k, v))
    else:
        s, t = _scores(q, k, alibi, L, kl is not None, p)
        prob = (s - lse.reshape(lse.shape + (1,))).exp()      # 0 on masked keys, empty rows
        do = grad_out.astype(acc)
        dv = _fold_kv(prob.mT @ do, groups)
        va = _repeat_kv(v, groups).astype(acc)
        ds = prob * ((do @ va.mT) - delta.reshape(delta.shape + (1,)))
        if t is not None:
            ds = ds * (1.0 - t * t)
        ds = ds * float(p.softmax_scale)
        dq = ds @ _repeat_kv(k, groups).astype(acc)
        dk = _fold_kv(ds.mT @ q.astype(acc), groups)
    pad = ((0, 0), (0, 0), (0, Sk - k.shape[2]), (0, 0))     # static k_len: dead keys get 0
    dk, dv = (x.pad(pad) if k.shape[2] < Sk else x for x in (dk, dv))
    return tuple(_poison(x.astype(q.dtype), ok) for x in (dq, dk, dv))


def _slot_recipe(slot, name):
    """dq / dk / dv: one output of the combined op. Lowering the three ops of one backward
    therefore meets one (hash-consed) combined node: one pass computes all three."""
    def recipe(*srcs, **params):
        return call_fused(FLASH_ATTN_BACKWARD, *srcs, **params)[slot]
    recipe.__name__ = recipe.__qualname__ = f"{name}_recipe"
    return recipe


# ---- backward wiring ------------------------------------------------------------------------
def _is_zero(t: Tensor) -> bool:
    op = t.node.op
    return isinstance(op, ops.Full) and op.value == 0


def _delta(grad_out: Tensor, out: Tensor, grad_lse: Tensor | None) -> Tensor:
    """delta_i = sum_d dO_id * out_id (in acc), minus the gradient of lse_i when it has one."""
    acc = out.dtype.acc
    d = (grad_out.astype(acc) * out.astype(acc)).sum(-1)
    return d if grad_lse is None or _is_zero(grad_lse) else d - grad_lse.astype(acc)


def _params_dict(p: FlashAttnParams) -> dict:
    return dict(softmax_scale=p.softmax_scale, causal=p.causal,
                window_size_left=p.window_size_left, window_size_right=p.window_size_right,
                softcap=p.softcap, k_len=p.k_len, has_alibi=p.has_alibi,
                k_len_input=p.k_len_input)


def _backward_nodes(q, k, v, grad_out, lse, delta, opt, p):
    srcs = (q, k, v, grad_out, lse, delta) + tuple(opt)
    kw = _params_dict(p)
    return (call_fused(FusedOps.FLASH_ATTN_BACKWARD_Q, *srcs, **kw),
            call_fused(FusedOps.FLASH_ATTN_BACKWARD_K, *srcs, **kw),
            call_fused(FusedOps.FLASH_ATTN_BACKWARD_V, *srcs, **kw))


def _vjp(xs, ys, gs, p):
    q, k, v = xs[:3]
    out, lse = ys
    delta = _delta(gs[0], out, gs[1])
    dq, dk, dv = _backward_nodes(q, k, v, gs[0], lse, delta, xs[3:], p)
    return [dq, dk, dv] + [None] * (len(xs) - 3)


# ---- samples (small, used to derive patterns and by the registry-wide tests) ----------------
def _sample_qkv(rng):
    q = rng.standard_normal((1, 4, 5, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    v = rng.standard_normal((1, 2, 6, 8)).astype(np.float32)
    return [q, k, v]


def _sample_backward(rng):
    """q, k, v, grad_out and the matching lse / delta of the unmasked forward (scale 0.25,
    the registry tests' fallback value for softmax_scale)."""
    q, k, v = _sample_qkv(rng)
    go = rng.standard_normal(q.shape).astype(np.float32)
    kk = np.repeat(k.astype(np.float64), 2, axis=1)
    vv = np.repeat(v.astype(np.float64), 2, axis=1)
    s = 0.25 * q.astype(np.float64) @ kk.transpose(0, 1, 3, 2)
    m = s.max(-1, keepdims=True)
    e = np.exp(s - m)
    lse = (m + np.log(e.sum(-1, keepdims=True)))[..., 0]
    out = (e / e.sum(-1, keepdims=True)) @ vv
    delta = (go.astype(np.float64) * out).sum(-1)
    return [q, k, v, go, lse.astype(np.float32), delta.astype(np.float32)]


# ---- public builders -------------------------------------------------------------------------
def _build_params(name, q, alibi_slopes, softmax_scale, causal, window_size_left,
                  window_size_right, softcap, k_len):
    """(optional input tensors, params dict) from the public keyword arguments."""
    opt = []
    if alibi_slopes is not None:
        if not isinstance(alibi_slopes, Tensor):
            raise FuelGraphError(f"{name}: alibi_slopes must be a Tensor (float32 [Hq] or "
                                 f"[B, Hq]), got {type(alibi_slopes).__name__}")
        opt.append(alibi_slopes)
    k_len_param, k_len_input = None, False
    if isinstance(k_len, Tensor):
        opt.append(k_len)
        k_len_input = True
    elif k_len is not None:
        if not _is_int(k_len):
            raise FuelGraphError(f"{name}: k_len must be an int or a 0-d int32/int64 tensor, "
                                 f"got {k_len!r}")
        k_len_param = int(k_len)
    if softmax_scale is None:       # a malformed q is reported by the op's validation
        ok = isinstance(q, Tensor) and q.ndim == 4 and q.shape[-1] >= 1
        softmax_scale = 1.0 / math.sqrt(q.shape[-1]) if ok else 1.0
    real = lambda x: float(x) if _is_real(x) else x     # noqa: E731  (hashable params)
    causal = False if causal is None else bool(causal) if isinstance(causal, np.bool_) else causal
    return opt, dict(softmax_scale=real(softmax_scale), causal=causal,
                     window_size_left=int(window_size_left) if _is_int(window_size_left)
                     else window_size_left,
                     window_size_right=int(window_size_right) if _is_int(window_size_right)
                     else window_size_right,
                     softcap=None if softcap is None else real(softcap), k_len=k_len_param,
                     has_alibi=alibi_slopes is not None, k_len_input=k_len_input)


def flash_attn(q, k, v, alibi_slopes=None, softmax_scale=None, causal=False,
               window_size_left=None, window_size_right=None, softcap=None, k_len=None):
    """Scaled dot-product attention in one fused op (FlashAttention semantics, heads-first).

    q [B, Hq, Sq, D]; k, v [B, Hkv, Sk, D] with Hq a multiple of Hkv (query head h uses key/value
    head h // (Hq // Hkv): grouped-query / multi-query attention without copying k and v);
    q, k, v share one dtype: float32, float64, bfloat16 or float16. Returns [B, Hq, Sq, D] in
    that dtype.

    Every optional argument may be passed as None (= off; causal=None is False):
    * softmax_scale: multiplier of q . k (default 1 / sqrt(D)).
    * k_len: number of live keys L (0 <= L <= Sk): an int, or a 0-d int32/int64 tensor read when
      the graph runs (so one cached plan serves every length). Keys at positions >= L are
      ignored and never read. Default L = Sk.
    * Masks are aligned bottom-right: query row i sits at key position a_i = i + L - Sq (which
      is negative for the first rows when Sq > L). causal keeps keys j <= a_i;
      window_size_left = wl keeps j >= a_i - wl; window_size_right = wr keeps j <= a_i + wr
      (ints >= 0). A query row with no key left outputs zeros and gets no gradient.
    * softcap = c > 0: scores become c * tanh(s / c) (after scaling, before the bias and mask).
    * alibi_slopes: float32 [Hq] or [B, Hq] (for every q dtype); adds
      -slope[h] * |a_i - j| to the scores, as FlashAttention-2 does.

    Accumulates in float32 (float64 for float64 inputs); differentiable in q, k and v (through
    flash_attn_backward's three ops); alibi_slopes and k_len get no gradient."""
    opt, kw = _build_params(_FWD, q, alibi_slopes, softmax_scale, causal, window_size_left,
                            window_size_right, softcap, k_len)
    out, _ = call_fused(FusedOps.FLASH_ATTN, q, k, v, *opt, **kw)
    return out


def flash_attn_backward(q, k, v, grad_out, alibi_slopes=None, softmax_scale=None, causal=False,
                        window_size_left=None, window_size_right=None, softcap=None, k_len=None):
    """Gradients (dq, dk, dv) of `flash_attn(q, k, v, ...)` for the upstream gradient grad_out
    ([B, Hq, Sq, D], q's dtype), with the same keyword arguments and rules as flash_attn. Built
    as the three ops flash_attn_backward_q / _k / _v on the forward's row log-sum-exp; dq has
    q's shape, dk and dv k's shape (summed over the query heads sharing a key/value head), all
    in q's dtype."""
    opt, kw = _build_params("flash_attn_backward", q, alibi_slopes, softmax_scale, causal,
                            window_size_left, window_size_right, softcap, k_len)
    if not isinstance(grad_out, Tensor):
        raise FuelGraphError(f"flash_attn_backward: grad_out must be a Tensor, got "
                             f"{type(grad_out).__name__}")
    out, lse = call_fused(FusedOps.FLASH_ATTN, q, k, v, *opt, **kw)
    if tuple(grad_out.shape) != tuple(out.shape) or grad_out.dtype != out.dtype:
        raise FuelGraphError(f"flash_attn_backward: grad_out is {tuple(grad_out.shape)} "
                             f"{grad_out.dtype.name}, expected {tuple(out.shape)} "
                             f"{out.dtype.name} (like q)")
    return _backward_nodes(q, k, v, grad_out, lse, _delta(grad_out, out, None), opt,
                           FlashAttnParams(**kw))


# ---- fusion: attention as people write it ------------------------------------------------------
# softmax(q @ k^T * scale [softcap] [mask]) @ v, k and v optionally repeated over the query heads
# (grouped-query attention written out), the softmax in primitives or softmax_last_dim. A mask
# must be a constant of the graph: a Const array (decoded into causal / window / k_len and
# rebuilt for the check), or a causal mask built from positions (iota, `i [+ Sk - Sq] >= j`
# and its mirrored spellings). A mask read from data is never fused (its contents can change
# while the cached plan stays). Rows the mask leaves empty would be NaN in the written softmax
# and 0 in flash_attn: such graphs are not fused.
_IOTA_CONDS = {"ge": (False, lambda i, j: i >= j), "le": (False, lambda i, j: j <= i),
               "gt": (True, lambda i, j: j > i), "lt": (True, lambda i, j: i < j)}


def admissible(sq, sk, causal=False, window_size_left=None, window_size_right=None, k_len=None):
    """[sq, sk] bool: the keys each query row may attend (bottom-right aligned)."""
    L = sk if k_len is None else k_len
    a = np.arange(sq)[:, None] + (L - sq)
    j = np.arange(sk)[None, :]
    adm = np.broadcast_to(j < L, (sq, sk))
    if causal:
        adm = adm & (j <= a)
    if window_size_left is not None:
        adm = adm & (j >= a - window_size_left)
    if window_size_right is not None:
        adm = adm & (j <= a + window_size_right)
    return adm


def decode_mask(adm):
    """The (causal, window_size_left, window_size_right, k_len) whose mask is `adm` [sq, sk];
    ValueError when none is (or when a row has no admissible key)."""
    sq, sk = adm.shape
    if not adm.any(axis=1).all():
        raise ValueError("a query row has no admissible key (the written softmax is NaN there)")
    lo = adm.argmax(axis=1)
    hi = sk - adm[:, ::-1].argmax(axis=1)
    for L in sorted({sk, int(hi.max())}, reverse=True):
        a = np.arange(sq) + (L - sq)
        right = hi - 1 - a
        left = a - lo
        wr = int(right[hi < L].min()) if (hi < L).any() else None
        wl = int(left[lo > 0].min()) if (lo > 0).any() else None
        if (wr is not None and wr < 0) or (wl is not None and wl < 0):
            continue
        p = dict(causal=wr == 0, window_size_left=wl,
                 window_size_right=None if wr in (None, 0) else wr,
                 k_len=None if L == sk else L)
        if np.array_equal(admissible(sq, sk, **p), adm):
            return p
    raise ValueError("the constant mask is not a causal / sliding-window / k_len mask")


def _check_rows(q, k, p):
    adm = admissible(q.shape[2], k.shape[2], p.causal, p.window_size_left,
                     p.window_size_right, p.k_len)
    if q.shape[2] and not adm.any(axis=1).all():
        raise FuelGraphError(f"{_FWD}: the mask leaves a query row without a key: the written "
                             f"softmax gives NaN there, flash_attn 0")
    return adm


def _spelling(mask, fused_softmax, cap):
    """One written form of attention as a recipe over (q, k, v); `mask` is "none", "const_add",
    "const_where", "const_fill" or "iota_<cond>_<add|where>[_off]"."""
    def idiom(q, k, v, **params):
        p = FlashAttnParams(**params)
        groups = q.shape[1] // max(k.shape[1], 1)
        sq, sk = q.shape[2], k.shape[2]
        s = (q @ _repeat_kv(k, groups).mT) * float(p.softmax_scale)
        if cap:
            s = (s / float(p.softcap)).tanh() * float(p.softcap)
        adm = _check_rows(q, k, p)
        if mask == "const_add":
            s = s + const(np.where(adm, 0.0, -np.inf).astype(s.dtype.np), s.device)
        elif mask == "const_where":
            s = where(const(adm, s.device), s, -math.inf)
        elif mask == "const_fill":
            s = where(const(~adm, s.device), -math.inf, s)
        elif mask.startswith("iota"):
            _, cond, form, *off = mask.split("_")
            i = iota(sq, dt.int64, q.device).reshape(sq, 1)
            if off:
                i = i + (sk - sq)
            j = iota(sk, dt.int64, q.device).reshape(1, sk)
            flip, fn = _IOTA_CONDS[cond]
            c = fn(i, j)
            if form == "add":
                m = where(c, -math.inf, 0.0) if flip else where(c, 0.0, -math.inf)
                s = s + m.astype(s.dtype)
            else:
                s = where(c, -math.inf, s) if flip else where(c, s, -math.inf)
        if fused_softmax:
            prob = call_fused(FusedOps.SOFTMAX_LAST_DIM, s)
        else:
            e = (s - s.max(-1, keepdim=True)).exp()
            prob = e / e.sum(-1, keepdim=True)
        out = prob @ _repeat_kv(v, groups)
        if out.dtype != q.dtype or out.shape != q.shape[:3] + (v.shape[3],):
            raise FuelGraphError(f"{_FWD}: the written attention computes {out.dtype.name} "
                                 f"{out.shape}, flash_attn {q.dtype.name}")
        return out
    idiom.mask, idiom.cap = mask, cap
    idiom.__name__ = idiom.__qualname__ = f"attention_idiom_{mask}{'_softcap' if cap else ''}"
    return idiom


def _fixed(mask, cap):
    p = dict(causal=mask.startswith("iota"), window_size_left=None, window_size_right=None,
             k_len=None, has_alibi=False, k_len_input=False)
    if cap:
        p["softcap"] = 0.5             # any value: read_params reads the graph's
    return p


def _spellings():
    """The written forms that fuse (each one traced pattern, so the list is kept short: every
    first optimize of a process derives them)."""
    const = ["none", "const_add", "const_where", "const_fill"]
    iota = [f"iota_{c}_{f}{o}" for c in _IOTA_CONDS for f in ("add", "where") for o in ("", "_off")]
    forms = [(m, False, cap) for m in const + iota for cap in (False, True)]
    forms += [(m, True, False) for m in const]          # softmax_last_dim written explicitly
    return tuple((_spelling(m, fs, cap), _fixed(m, cap)) for m, fs, cap in forms)


def _read_params(bound):
    """causal / windows / k_len decoded from a constant mask, k_len for a top-left causal mask
    written from positions, and the softcap constant."""
    fn = bound.pattern.recipe
    out = {}
    if fn.mask.startswith("const"):
        arr = np.asarray(bound.nodes_of(ops.Const)[0].op.array)
        if fn.mask == "const_add":
            if not np.isin(arr, (0.0, -np.inf)).all():
                raise ValueError("the additive mask holds values other than 0 and -inf")
            adm = arr == 0
        else:
            adm = arr.astype(bool) if fn.mask == "const_where" else ~arr.astype(bool)
        out.update(decode_mask(adm.reshape(adm.shape[-2:])))
    elif fn.mask.startswith("iota") and not fn.mask.endswith("_off"):
        sq, sk = bound.capture(0).shape[2], bound.capture(1).shape[2]
        if sq > sk:
            raise ValueError("a top-left causal mask with Sq > Sk has no bottom-right form")
        out["k_len"] = sq if sq < sk else None       # top-left causal == causal over Sq keys
    if fn.cap:
        tanh = next(n for n in bound.nodes_of(ops.Unary) if n.op.kind == "tanh")
        for p, g in bound.bind.items():
            n = g.node
            if isinstance(n.op, ops.Binary) and n.op.kind == "mul" and \
                    any(s.node is tanh for s in n.srcs):
                c = next(s.node.op for s in n.srcs if isinstance(s.node.op, ops.Full))
                out["softcap"] = float(c.value)
                break
        else:
            raise ValueError("softcap constant not found")
    return out


# ---- declarations -----------------------------------------------------------------------------
_BWD_DOC = ("q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D], grad_out like q, lse and delta [B, Hq, Sq] "
            "in float32 (float64 for float64 q), then the forward's optional alibi_slopes and "
            "k_len inputs; params as flash_attn. lse is the forward's row log-sum-exp (+inf "
            "for rows without an admissible key), delta_i = sum_d grad_out_id * out_id. With "
            "p_ij = exp(s_ij - lse_i) on admissible keys and dS = p * (grad_out v^T - delta) "
            "(times 1 - tanh^2(s_pre / softcap) with a softcap): ")


def declare(reg):
    reg.add(FusedOpEntry(
        id=FusedOps.FLASH_ATTN, name=_FWD, family="attention", params=FlashAttnParams,
        shape_rule=_forward_shapes, dtype_rule=_forward_dtypes, validate=_validate_forward,
        decompose=flash_attn_recipe, outputs=("out", "lse"),
        backward=BackwardKind.fused(FusedOps.FLASH_ATTN_BACKWARD_Q), vjp=_vjp,
        pattern_variants=None, extra_patterns=_spellings(), read_params=_read_params,
        sample=_sample_qkv,
        doc="Attention (FlashAttention semantics): q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D] "
            "(Hq % Hkv == 0), optional alibi_slopes float32 [Hq] | [B, Hq] and k_len 0-d "
            "int32/int64 tensor -> out [B, Hq, Sq, D] (q's dtype) and lse [B, Hq, Sq] "
            "(float32, float64 for float64). Masks bottom-right aligned (a_i = i + L - Sq); "
            "causal, window_size_left/right, softcap c * tanh(s / c), ALiBi -slope * "
            "|a_i - j|; rows without an admissible key give 0 (lse +inf)."))
    for slot, (op_id, what) in enumerate((
            (FusedOps.FLASH_ATTN_BACKWARD_Q, "dq = scale * dS k (q's shape)."),
            (FusedOps.FLASH_ATTN_BACKWARD_K, "dk = scale * dS^T q, summed over the query heads "
             "of each key/value head (k's shape)."),
            (FusedOps.FLASH_ATTN_BACKWARD_V, "dv = p^T grad_out, summed over the query heads of "
             "each key/value head (v's shape)."))):
        name = _BWD_NAMES[op_id]
        reg.add(FusedOpEntry(
            id=op_id, name=name, family="attention", params=FlashAttnParams,
            shape_rule=_backward_shapes(op_id), dtype_rule=_backward_dtypes(op_id),
            validate=_validate_backward(name), decompose=_slot_recipe(slot, name),
            recipe_only=("numpy", "cuda"), backward=BackwardKind.DECOMPOSE,
            pattern_variants=None, sample=_sample_backward,
            doc=_BWD_DOC + what + " Runs as one output of flash_attn_backward: the three "
                "gradient ops of one backward lower to one combined node."))
    reg.add(FusedOpEntry(
        id=FLASH_ATTN_BACKWARD, name=_BWD_NAMES[FLASH_ATTN_BACKWARD], family="attention",
        params=FlashAttnParams, shape_rule=_backward_shapes(FLASH_ATTN_BACKWARD),
        dtype_rule=_backward_dtypes(FLASH_ATTN_BACKWARD),
        validate=_validate_backward(_BWD_NAMES[FLASH_ATTN_BACKWARD]),
        decompose=flash_attn_backward_recipe, outputs=("dq", "dk", "dv"),
        backward=BackwardKind.DECOMPOSE, pattern_variants=None, sample=_sample_backward,
        doc=_BWD_DOC + "(dq, dk, dv) of flash_attn_backward_q / _k / _v in one pass over the "
            "scores."))
