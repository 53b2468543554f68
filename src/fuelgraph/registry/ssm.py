"""State-space scans (Mamba): SELECTIVE_SCAN (id 19, Mamba-1) and SSD_CHUNK_SCAN (id 20,
Mamba-2), plus their fused backward helpers (ids 0x150, 0x151).

Both ops are linear recurrences over time with an input-dependent decay, and both return two
tensors, `(y, last_state)`:

    selective_scan   state h [B, D, N];  h_t = exp(dt_t[d] * a[d, n]) * h_{t-1} + dt_t[d] * b_t[n] * u_t[d]
                                         y_t[d] = sum_n h_t[d, n] * c_t[n]
    ssd_chunk_scan   state h [B, H, P, N]; h_t = exp(dt_t[h] * a[h]) * h_{t-1} + dt_t[h] * x_t[h, p] * b_t[h, n]
                                         y_t[h, p] = sum_n h_t[h, p, n] * c_t[h, n]

`a` is the (negative) decay rate itself, used as exp(dt * a), not a logarithm. The step size is
`dt = softplus(raw + bias)` (or `raw + bias` without softplus; no bias term when none is given).
The output then gets an optional skip term (`y += x * d`) and an optional gate (`y *= silu(z)`).
Every state, sum and exponential is kept in float32 (float64 for float64 inputs); y and
last_state are rounded to the inputs' dtype at the end.

Recipes are the sequential definition written with the Scan primitive, so they are total and
differentiable (their gradient is a reverse scan). The backward helpers take the forward inputs
plus the cotangents of y and last_state and return one gradient per forward input; their own
recipes are the reverse recurrence written with Scan too, so gradients of gradients work.
`chunk_size` of ssd_chunk_scan is a tiling hint only: it must divide L but the result does not
depend on it (kernels pick their own tiles)."""
from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from ..dtype import FLOATS
from ..errors import FuelGraphError
from ..ir import ops
from ..ir.scan import scan
from ..ir.tensor import zeros
from .core import BackwardKind, FusedOpEntry, FusedOpId, FusedOps, call_fused

SELECTIVE_SCAN_BACKWARD = FusedOpId(0x150)
SSD_CHUNK_SCAN_BACKWARD = FusedOpId(0x151)

_SS = "selective_scan"
_SSD = "ssd_chunk_scan"


# ---- params ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class SelectiveScanParams:
    """delta_softplus: dt = softplus(delta (+ delta_bias)); has_d / has_z / has_delta_bias: which
    optional inputs follow the five required ones (in the order d, z, delta_bias)."""
    delta_softplus: bool = False
    has_d: bool = False
    has_z: bool = False
    has_delta_bias: bool = False

    @property
    def optional(self) -> tuple[str, ...]:
        return tuple(n for n, f in (("d", self.has_d), ("z", self.has_z),
                                    ("delta_bias", self.has_delta_bias)) if f)


@dataclass(frozen=True)
class SsdChunkScanParams:
    """chunk_size: tiling hint (> 0, divides L); dt_softplus: dt = softplus(dt (+ dt_bias));
    has_d / has_z / has_dt_bias / has_initial_states: which optional inputs follow the five
    required ones (in the order d, z, dt_bias, initial_states)."""
    chunk_size: int = 64
    dt_softplus: bool = False
    has_d: bool = False
    has_z: bool = False
    has_dt_bias: bool = False
    has_initial_states: bool = False

    @property
    def optional(self) -> tuple[str, ...]:
        return tuple(n for n, f in (("d", self.has_d), ("z", self.has_z),
                                    ("dt_bias", self.has_dt_bias),
                                    ("initial_states", self.has_initial_states)) if f)


SS_REQUIRED = ("u", "delta", "a", "b", "c")
SSD_REQUIRED = ("x", "dt", "a", "b", "c")


def split_optional(srcs, params, n_required=5) -> dict:
    """{name: src or None} for every optional input of the op whose params are `params`."""
    names = params.optional
    got = dict(zip(names, srcs[n_required:n_required + len(names)]))
    every = ("d", "z", "delta_bias") if isinstance(params, SelectiveScanParams) else \
        ("d", "z", "dt_bias", "initial_states")
    return {n: got.get(n) for n in every}


# ---- validation -----------------------------------------------------------------------------
def _check_flags(name, params, flags):
    for f in flags:
        v = getattr(params, f)
        if not isinstance(v, (bool, np.bool_)):
            raise FuelGraphError(f"{name}: param {f} must be a bool, got {v!r}")


def _check_inputs(name, srcs, labels):
    if len(srcs) != len(labels):
        raise FuelGraphError(f"{name}: expected {len(labels)} inputs ({', '.join(labels)}), "
                             f"got {len(srcs)}")
    d0 = srcs[0].dtype
    if d0 not in FLOATS:
        raise FuelGraphError(f"{name}: {labels[0]} has dtype {d0.name}, expected one of "
                             f"{[f.name for f in FLOATS]}")
    for s, lab in zip(srcs[1:], labels[1:]):
        if s.dtype != d0:
            raise FuelGraphError(f"{name}: {lab} has dtype {s.dtype.name}, expected "
                                 f"{d0.name} (same as {labels[0]})")


def _want(name, label, got, want, what=""):
    if tuple(got) != tuple(want):
        raise FuelGraphError(f"{name}: {label} has shape {tuple(got)}, expected {tuple(want)}"
                             + (f" ({what})" if what else ""))


def _ss_labels(params, grads=False):
    labels = SS_REQUIRED + params.optional
    return labels + ("grad_y", "grad_last_state") if grads else labels


def _validate_ss(srcs, params, name=_SS, grads=False):
    _check_flags(name, params, ("delta_softplus", "has_d", "has_z", "has_delta_bias"))
    labels = _ss_labels(params, grads)
    _check_inputs(name, srcs, labels)
    u, delta, a, b, c = srcs[:5]
    if len(u.shape) != 3:
        raise FuelGraphError(f"{name}: u has shape {tuple(u.shape)}, expected rank 3 [B, L, D]")
    B, L, D = u.shape
    _want(name, "delta", delta.shape, u.shape, "same as u [B, L, D]")
    if len(a.shape) != 2 or a.shape[0] != D:
        raise FuelGraphError(f"{name}: a has shape {tuple(a.shape)}, expected [D, N] with "
                             f"D = {D} (u's last axis)")
    N = a.shape[1]
    _want(name, "b", b.shape, (B, L, N), "[B, L, N]")
    _want(name, "c", c.shape, (B, L, N), "[B, L, N]")
    opt = dict(zip(labels[5:], srcs[5:]))
    for lab, want in (("d", (D,)), ("z", (B, L, D)), ("delta_bias", (D,)),
                      ("grad_y", (B, L, D)), ("grad_last_state", (B, D, N))):
        if lab in opt:
            _want(name, lab, opt[lab].shape, want)


def _ssd_labels(params, grads=False):
    labels = SSD_REQUIRED + params.optional
    return labels + ("grad_y", "grad_last_state") if grads else labels


def _validate_ssd(srcs, params, name=_SSD, grads=False):
    _check_flags(name, params, ("dt_softplus", "has_d", "has_z", "has_dt_bias",
                                "has_initial_states"))
    labels = _ssd_labels(params, grads)
    _check_inputs(name, srcs, labels)
    x, dt, a, b, c = srcs[:5]
    if len(x.shape) != 4:
        raise FuelGraphError(f"{name}: x has shape {tuple(x.shape)}, expected rank 4 "
                             f"[B, L, H, P]")
    B, L, H, P = x.shape
    _want(name, "dt", dt.shape, (B, L, H), "[B, L, H]")
    _want(name, "a", a.shape, (H,), "[H]")
    if len(b.shape) != 4 or tuple(b.shape[:3]) != (B, L, H):
        raise FuelGraphError(f"{name}: b has shape {tuple(b.shape)}, expected [B, L, H, N] = "
                             f"[{B}, {L}, {H}, N]")
    N = b.shape[3]
    _want(name, "c", c.shape, (B, L, H, N), "same as b [B, L, H, N]")
    opt = dict(zip(labels[5:], srcs[5:]))
    if "d" in opt and tuple(opt["d"].shape) not in ((H,), (H, P)):
        raise FuelGraphError(f"{name}: d has shape {tuple(opt['d'].shape)}, expected [H] = "
                             f"[{H}] or [H, P] = [{H}, {P}]")
    for lab, want in (("z", (B, L, H, P)), ("dt_bias", (H,)), ("initial_states", (B, H, P, N)),
                      ("grad_y", (B, L, H, P)), ("grad_last_state", (B, H, P, N))):
        if lab in opt:
            _want(name, lab, opt[lab].shape, want)
    q = params.chunk_size
    if isinstance(q, (bool, np.bool_)) or not isinstance(q, (int, np.integer)):
        raise FuelGraphError(f"{name}: chunk_size must be an int, got {q!r}")
    if q <= 0:
        raise FuelGraphError(f"{name}: chunk_size must be > 0, got {q}")
    if L % q:
        raise FuelGraphError(f"{name}: chunk_size {q} does not divide the sequence length "
                             f"L = {L} (x.shape[1]); pad L or pick a divisor")


# ---- shape / dtype rules --------------------------------------------------------------------
def _ss_shapes(shapes, params):
    (B, L, D), N = shapes[0], shapes[2][1]
    return [(B, L, D), (B, D, N)]


def _ssd_shapes(shapes, params):
    (B, L, H, P), N = shapes[0], shapes[3][3]
    return [(B, L, H, P), (B, H, P, N)]


def _two_of_input0(dtypes, params):
    return [dtypes[0], dtypes[0]]


def _grad_shapes(shapes, params):
    return [tuple(s) for s in shapes[:-2]]


def _grad_dtypes(dtypes, params):
    return list(dtypes[:-2])


# ---- recipes: the sequential definition through the Scan primitive --------------------------
def _step_size(raw, bias, softplus, acc, bias_shape):
    """(dt used by the recurrence, the pre-activation) in acc."""
    pre = raw.astype(acc)
    if bias is not None:
        pre = pre + bias.astype(acc).reshape(*bias_shape)
    return (pre.softplus() if softplus else pre), pre


def _silu_grad(z):
    s = z.sigmoid()
    return s * (1.0 + z * (1.0 - s))


def _ss_step(carry, xt, k):
    (h,) = carry
    dt_t, u_t, b_t, c_t = xt                            # [B, D], [B, D], [B, N], [B, N]
    (a,) = k                                            # [D, N]
    gate = (dt_t.unsqueeze(-1) * a).exp()
    h = gate * h + (dt_t * u_t).unsqueeze(-1) * b_t.unsqueeze(1)
    return [h], [(h * c_t.unsqueeze(1)).sum(-1)]


def _time_first(t):
    return t.permute(1, 0, *range(2, t.ndim))


def selective_scan_recipe(u, delta, a, b, c, *opt, delta_softplus=False, has_d=False,
                          has_z=False, has_delta_bias=False):
    p = SelectiveScanParams(delta_softplus, has_d, has_z, has_delta_bias)
    o = split_optional((u, delta, a, b, c) + opt, p)
    T = u.dtype
    acc = T.acc
    B, L, D = u.shape
    N = a.shape[1]
    dt, _ = _step_size(delta, o["delta_bias"], delta_softplus, acc, (1, 1, D))
    uu = u.astype(acc)
    (h,), (ys,) = scan(_ss_step, [zeros((B, D, N), acc, u.device)],
                       [_time_first(t) for t in (dt, uu, b.astype(acc), c.astype(acc))],
                       [a.astype(acc)], length=L)
    y = _time_first(ys)
    if o["d"] is not None:
        y = y + uu * o["d"].astype(acc)
    if o["z"] is not None:
        y = y * o["z"].astype(acc).silu()
    return y.astype(T), h.astype(T)


def _ss_bwd_step(carry, xt, k):
    gh, da = carry                                      # dL/dh_t from later steps; sum for a
    h_prev, dt_t, u_t, b_t, c_t, gy_t = xt
    (a,) = k
    gate = (dt_t.unsqueeze(-1) * a).exp()
    bu = (dt_t * u_t).unsqueeze(-1)
    h = gate * h_prev + bu * b_t.unsqueeze(1)
    g = gh + gy_t.unsqueeze(-1) * c_t.unsqueeze(1)      # dL/dh_t, total
    dc = (gy_t.unsqueeze(-1) * h).sum(1)
    gdecay = g * h_prev * gate                          # dL/d(dt * a)
    gb = (g * b_t.unsqueeze(1)).sum(-1)                 # sum_n g * b  [B, D]
    ddt = (gdecay * a).sum(-1) + u_t * gb
    du = dt_t * gb
    db = (g * bu).sum(1)
    da = da + (gdecay * dt_t.unsqueeze(-1)).sum(0)
    return [g * gate, da], [du, ddt, db, dc]


def _ss_hist_step(carry, xt, k):
    (h_prev,) = carry
    (h,), (y,) = _ss_step(carry, xt, k)
    return [h], [h_prev, y]


def _gate_grads(g_out, x, y_ssm, d, z, acc, d_shape):
    """Cotangent of the scan output and the grads of d, z, and x's skip term, for
    out = (y_ssm + x * d) * silu(z)."""
    g = g_out
    dz = dd = dx_skip = None
    yp = y_ssm if d is None else y_ssm + x * d.astype(acc).reshape(*d_shape)
    if z is not None:
        za = z.astype(acc)
        dz = g * yp * _silu_grad(za)
        g = g * za.silu()
    if d is not None:
        dx_skip = g * d.astype(acc).reshape(*d_shape)
        dd = g * x
    return g, dz, dd, dx_skip


def selective_scan_backward_recipe(u, delta, a, b, c, *rest, delta_softplus=False, has_d=False,
                                   has_z=False, has_delta_bias=False):
    p = SelectiveScanParams(delta_softplus, has_d, has_z, has_delta_bias)
    gy, gl = rest[-2:]
    o = split_optional((u, delta, a, b, c) + rest[:-2], p)
    T = u.dtype
    acc = T.acc
    B, L, D = u.shape
    N = a.shape[1]
    dt, pre = _step_size(delta, o["delta_bias"], delta_softplus, acc, (1, 1, D))
    uu, ba, ca, aa = u.astype(acc), b.astype(acc), c.astype(acc), a.astype(acc)
    series = [_time_first(t) for t in (dt, uu, ba, ca)]
    _, (h_prev, ys) = scan(_ss_hist_step, [zeros((B, D, N), acc, u.device)], series, [aa],
                           length=L)
    g, dz, dd, du_skip = _gate_grads(gy.astype(acc), uu, _time_first(ys), o["d"], o["z"], acc,
                                     (D,))
    (_, da), (du, ddt, db, dc) = scan(
        _ss_bwd_step, [gl.astype(acc), zeros((D, N), acc, u.device)],
        [h_prev] + series + [_time_first(g)], [aa], length=L, reverse=True)
    du, ddt, db, dc = (_time_first(t) for t in (du, ddt, db, dc))
    if du_skip is not None:
        du = du + du_skip
    if delta_softplus:
        ddt = ddt * pre.sigmoid()
    grads = [du, ddt, da, db, dc]
    if o["d"] is not None:
        grads.append(dd.sum((0, 1)))
    if o["z"] is not None:
        grads.append(dz)
    if o["delta_bias"] is not None:
        grads.append(ddt.sum((0, 1)))
    return tuple(t.astype(T) for t in grads)


def _ssd_step(carry, xt, k):
    (h,) = carry                                        # [B, H, P, N]
    dt_t, x_t, b_t, c_t = xt                            # [B, H], [B, H, P], [B, H, N] x2
    (a,) = k                                            # [H]
    gate = (dt_t * a).exp().unsqueeze(-1).unsqueeze(-1)
    h = gate * h + (dt_t.unsqueeze(-1) * x_t).unsqueeze(-1) * b_t.unsqueeze(2)
    return [h], [(h * c_t.unsqueeze(2)).sum(-1)]


def _ssd_hist_step(carry, xt, k):
    (h_prev,) = carry
    (h,), (y,) = _ssd_step(carry, xt, k)
    return [h], [h_prev, y]


def _ssd_init(o, shape, acc, device):
    h0 = o["initial_states"]
    return zeros(shape, acc, device) if h0 is None else h0.astype(acc)


def ssd_chunk_scan_recipe(x, dt, a, b, c, *opt, chunk_size=64, dt_softplus=False, has_d=False,
                          has_z=False, has_dt_bias=False, has_initial_states=False):
    p = SsdChunkScanParams(chunk_size, dt_softplus, has_d, has_z, has_dt_bias, has_initial_states)
    o = split_optional((x, dt, a, b, c) + opt, p)
    T = x.dtype
    acc = T.acc
    B, L, H, P = x.shape
    N = b.shape[3]
    dtv, _ = _step_size(dt, o["dt_bias"], dt_softplus, acc, (1, 1, H))
    xa = x.astype(acc)
    (h,), (ys,) = scan(_ssd_step, [_ssd_init(o, (B, H, P, N), acc, x.device)],
                       [_time_first(t) for t in (dtv, xa, b.astype(acc), c.astype(acc))],
                       [a.astype(acc)], length=L)
    y = _time_first(ys)
    if o["d"] is not None:
        y = y + xa * o["d"].astype(acc).reshape(*_d_shape(o["d"], H))
    if o["z"] is not None:
        y = y * o["z"].astype(acc).silu()
    return y.astype(T), h.astype(T)


def _d_shape(d, H):
    return (H, 1) if d.ndim == 1 else tuple(d.shape)


def _ssd_bwd_step(carry, xt, k):
    gh, da = carry                                      # [B, H, P, N], [H]
    h_prev, dt_t, x_t, b_t, c_t, gy_t = xt
    (a,) = k
    gate = (dt_t * a).exp()                             # [B, H]
    g4 = gate.unsqueeze(-1).unsqueeze(-1)
    bx = (dt_t.unsqueeze(-1) * x_t).unsqueeze(-1)       # [B, H, P, 1]
    h = g4 * h_prev + bx * b_t.unsqueeze(2)
    g = gh + gy_t.unsqueeze(-1) * c_t.unsqueeze(2)
    dc = (gy_t.unsqueeze(-1) * h).sum(2)
    gdecay = (g * h_prev).sum((2, 3)) * gate            # dL/d(dt * a)  [B, H]
    gb = (g * b_t.unsqueeze(2)).sum(-1)                 # [B, H, P]
    ddt = gdecay * a + (gb * x_t).sum(-1)
    dx = dt_t.unsqueeze(-1) * gb
    db = (g * bx).sum(2)
    da = da + (gdecay * dt_t).sum(0)
    return [g * g4, da], [dx, ddt, db, dc]


def ssd_chunk_scan_backward_recipe(x, dt, a, b, c, *rest, chunk_size=64, dt_softplus=False,
                                   has_d=False, has_z=False, has_dt_bias=False,
                                   has_initial_states=False):
    p = SsdChunkScanParams(chunk_size, dt_softplus, has_d, has_z, has_dt_bias, has_initial_states)
    gy, gl = rest[-2:]
    o = split_optional((x, dt, a, b, c) + rest[:-2], p)
    T = x.dtype
    acc = T.acc
    B, L, H, P = x.shape
    N = b.shape[3]
    dtv, pre = _step_size(dt, o["dt_bias"], dt_softplus, acc, (1, 1, H))
    xa, ba, ca, aa = x.astype(acc), b.astype(acc), c.astype(acc), a.astype(acc)
    series = [_time_first(t) for t in (dtv, xa, ba, ca)]
    _, (h_prev, ys) = scan(_ssd_hist_step, [_ssd_init(o, (B, H, P, N), acc, x.device)], series,
                           [aa], length=L)
    d_shape = _d_shape(o["d"], H) if o["d"] is not None else None
    g, dz, dd, dx_skip = _gate_grads(gy.astype(acc), xa, _time_first(ys), o["d"], o["z"], acc,
                                     d_shape)
    (dh0, da), (dx, ddt, db, dc) = scan(
        _ssd_bwd_step, [gl.astype(acc), zeros((H,), acc, x.device)],
        [h_prev] + series + [_time_first(g)], [aa], length=L, reverse=True)
    dx, ddt, db, dc = (_time_first(t) for t in (dx, ddt, db, dc))
    if dx_skip is not None:
        dx = dx + dx_skip
    if dt_softplus:
        ddt = ddt * pre.sigmoid()
    grads = [dx, ddt, da, db, dc]
    if o["d"] is not None:
        grads.append(dd.sum((0, 1)) if o["d"].ndim == 2 else dd.sum((0, 1, 3)))
    if o["z"] is not None:
        grads.append(dz)
    if o["dt_bias"] is not None:
        grads.append(ddt.sum((0, 1)))
    if o["initial_states"] is not None:
        grads.append(dh0)
    return tuple(t.astype(T) for t in grads)


# ---- backward wiring ------------------------------------------------------------------------
def _ss_vjp(xs, ys, gs, p):
    return list(call_fused(SELECTIVE_SCAN_BACKWARD, *xs, gs[0], gs[1], **_asdict(p)))


def _ssd_vjp(xs, ys, gs, p):
    return list(call_fused(SSD_CHUNK_SCAN_BACKWARD, *xs, gs[0], gs[1], **_asdict(p)))


def _asdict(p):
    return dataclasses.asdict(p)


# ---- samples (registry-wide tests, pattern derivation) --------------------------------------
def _ss_sample(rng, B=2, L=5, D=3, N=4, grads=False):
    f = np.float32
    xs = [rng.standard_normal((B, L, D)).astype(f),
          (0.5 * rng.standard_normal((B, L, D))).astype(f),
          -np.exp(rng.standard_normal((D, N))).astype(f),
          rng.standard_normal((B, L, N)).astype(f),
          rng.standard_normal((B, L, N)).astype(f)]
    if grads:
        xs += [rng.standard_normal((B, L, D)).astype(f), rng.standard_normal((B, D, N)).astype(f)]
    return xs


def _ssd_sample(rng, B=1, L=64, H=2, P=2, N=3, grads=False):   # L: the default chunk_size
    f = np.float32
    xs = [rng.standard_normal((B, L, H, P)).astype(f),
          np.abs(0.5 * rng.standard_normal((B, L, H))).astype(f),
          -np.exp(rng.standard_normal(H)).astype(f),
          rng.standard_normal((B, L, H, N)).astype(f),
          rng.standard_normal((B, L, H, N)).astype(f)]
    if grads:
        xs += [rng.standard_normal((B, L, H, P)).astype(f),
               rng.standard_normal((B, H, P, N)).astype(f)]
    return xs


# ---- fusion patterns -------------------------------------------------------------------------
# The recurrence written with the Scan primitive, as the recipes write it, fuses back (one
# pattern per setting of the boolean flags; each traced on a sample holding its optional
# inputs). y is the matched root; the last state, when the graph reads it, becomes the fused
# node's second output. chunk_size does not show in the graph (it only tiles the kernels): a
# fused SSD scan takes the largest power of two <= 64 that divides L.
def _flagged(recipe, sample, optional, fixed, dtype):
    """`recipe` with the flags `fixed`, traced on `sample` plus the optional inputs it needs,
    in `dtype` (a 16-bit recipe casts its inputs up and its results down: another pattern)."""
    def spelling(*xs, **params):
        return recipe(*xs, **params)

    def full_sample(rng):
        xs = sample(rng)
        return [x.astype(dtype) for x in xs + [optional[k](rng, xs) for k in _names(fixed)]]
    spelling.sample = full_sample
    spelling.__name__ = spelling.__qualname__ = \
        recipe.__name__ + "".join(f"_{k}" for k, v in fixed.items() if v) + f"_{dtype.__name__}"
    return spelling


def _names(fixed):
    return [k[4:] for k in fixed if k.startswith("has_") and fixed[k]]


def _flag_spellings(recipe, sample, optional, flags, **other):
    out = []
    for dtype in (np.float32, ml_dtypes.bfloat16):
        for values in itertools.product((False, True), repeat=len(flags)):
            fixed = dict(zip(flags, values))
            out.append((_flagged(recipe, sample, optional, fixed, dtype), {**fixed, **other}))
    return tuple(out)


_SS_OPTIONAL = {
    "d": lambda rng, xs: rng.standard_normal(xs[0].shape[2]).astype(xs[0].dtype),
    "z": lambda rng, xs: rng.standard_normal(xs[0].shape).astype(xs[0].dtype),
    "delta_bias": lambda rng, xs: rng.standard_normal(xs[0].shape[2]).astype(xs[0].dtype)}
_SSD_OPTIONAL = {
    "d": lambda rng, xs: rng.standard_normal(xs[0].shape[2]).astype(xs[0].dtype),
    "z": lambda rng, xs: rng.standard_normal(xs[0].shape).astype(xs[0].dtype),
    "dt_bias": lambda rng, xs: rng.standard_normal(xs[0].shape[2]).astype(xs[0].dtype),
    "initial_states": lambda rng, xs: rng.standard_normal(
        (xs[0].shape[0], xs[0].shape[2], xs[0].shape[3], xs[3].shape[3])).astype(xs[0].dtype)}


def _read_ssd(bound):
    """chunk_size: a tiling hint the graph does not hold; the largest power of two <= 64 that
    divides L."""
    return {"chunk_size": math.gcd(bound.capture(0).shape[1], 64) or 64}


_SS_DOC = (
    "Mamba-1 selective scan. u, delta [B, L, D]; a [D, N] (the decay rate A itself, normally "
    "negative); b, c [B, L, N]; optional d [D], z [B, L, D], delta_bias [D]; one float dtype. "
    "dt = delta + delta_bias, softplus'd if delta_softplus; h_0 = 0; "
    "h_t = exp(dt_t * a) * h_{t-1} + dt_t * u_t * b_t (outer over D x N); y_t = h_t @ c_t; "
    "y += u * d; y *= silu(z). Returns (y [B, L, D], last_state = h_L [B, D, N]) in the input "
    "dtype; state and sums in float32 (float64 for float64). Fuses from its recipe and from "
    "the recurrence written with fg.scan as the recipe writes it (any optional inputs; the "
    "last state becomes the second output when the graph reads it).")
_SSD_DOC = (
    "Mamba-2 SSD scan. x [B, L, H, P]; dt [B, L, H]; a [H] (negative decay rate); b, c "
    "[B, L, H, N]; optional d [H] or [H, P], z [B, L, H, P], dt_bias [H], initial_states "
    "[B, H, P, N]; one float dtype. dt += dt_bias, softplus'd if dt_softplus; h_0 = "
    "initial_states or 0; h_t = exp(dt_t * a) * h_{t-1} + dt_t * x_t (outer) b_t; "
    "y_t = h_t @ c_t; y += x * d; y *= silu(z). Returns (y [B, L, H, P], last_state "
    "[B, H, P, N]) in the input dtype. chunk_size (> 0, divides L) is a tiling hint only. "
    "Fuses from its recipe and from the recurrence written with fg.scan as the recipe "
    "writes it (chunk_size then: the largest power of two <= 64 dividing L).")


def declare(reg):
    reg.add(FusedOpEntry(
        id=SELECTIVE_SCAN_BACKWARD, name="selective_scan_backward", family="backward",
        params=SelectiveScanParams, shape_rule=_grad_shapes, dtype_rule=_grad_dtypes,
        validate=lambda s, p: _validate_ss(s, p, "selective_scan_backward", grads=True),
        decompose=selective_scan_backward_recipe, backward=BackwardKind.DECOMPOSE,
        pattern_variants=None, sample=lambda rng: _ss_sample(rng, grads=True),
        outputs=("grad_u", "grad_delta", "grad_a", "grad_b", "grad_c", "grad_d", "grad_z",
                 "grad_delta_bias"),
        doc="Gradients of selective_scan: its inputs (same order, same optional flags) then "
            "grad_y [B, L, D] and grad_last_state [B, D, N] -> one gradient per forward input, "
            "each shaped and typed like that input."))
    reg.add(FusedOpEntry(
        id=FusedOps.SELECTIVE_SCAN, name=_SS, family="forward", params=SelectiveScanParams,
        shape_rule=_ss_shapes, dtype_rule=_two_of_input0, validate=_validate_ss,
        decompose=selective_scan_recipe, backward=BackwardKind.fused(SELECTIVE_SCAN_BACKWARD),
        vjp=_ss_vjp, pattern_variants=None, sample=_ss_sample, outputs=("y", "last_state"),
        extra_patterns=_flag_spellings(selective_scan_recipe, _ss_sample, _SS_OPTIONAL, (
            "delta_softplus", "has_d", "has_z", "has_delta_bias")), pattern_needs=(ops.Scan,),
        doc=_SS_DOC))
    reg.add(FusedOpEntry(
        id=SSD_CHUNK_SCAN_BACKWARD, name="ssd_chunk_scan_backward", family="backward",
        params=SsdChunkScanParams, shape_rule=_grad_shapes, dtype_rule=_grad_dtypes,
        validate=lambda s, p: _validate_ssd(s, p, "ssd_chunk_scan_backward", grads=True),
        decompose=ssd_chunk_scan_backward_recipe, backward=BackwardKind.DECOMPOSE,
        pattern_variants=None, sample=lambda rng: _ssd_sample(rng, grads=True),
        outputs=("grad_x", "grad_dt", "grad_a", "grad_b", "grad_c", "grad_d", "grad_z",
                 "grad_dt_bias", "grad_initial_states"),
        doc="Gradients of ssd_chunk_scan: its inputs (same order, same optional flags) then "
            "grad_y [B, L, H, P] and grad_last_state [B, H, P, N] -> one gradient per forward "
            "input, each shaped and typed like that input."))
    reg.add(FusedOpEntry(
        id=FusedOps.SSD_CHUNK_SCAN, name=_SSD, family="forward", params=SsdChunkScanParams,
        shape_rule=_ssd_shapes, dtype_rule=_two_of_input0, validate=_validate_ssd,
        decompose=ssd_chunk_scan_recipe, backward=BackwardKind.fused(SSD_CHUNK_SCAN_BACKWARD),
        vjp=_ssd_vjp, pattern_variants=None, sample=_ssd_sample, outputs=("y", "last_state"),
        extra_patterns=_flag_spellings(ssd_chunk_scan_recipe, _ssd_sample, _SSD_OPTIONAL, (
            "dt_softplus", "has_d", "has_z", "has_dt_bias", "has_initial_states"), chunk_size=64),
        read_params=_read_ssd, pattern_needs=(ops.Scan,),
        doc=_SSD_DOC))


# ---- public builders ------------------------------------------------------------------------
def _flag(v):
    return bool(v) if isinstance(v, (bool, np.bool_)) else v


def selective_scan(u, delta, a, b, c, d=None, z=None, delta_bias=None, delta_softplus=False):
    """Mamba-1 selective scan; returns `(y, last_state)`.

    u [B, L, D] input; delta [B, L, D] raw step size; a [D, N] decay rate A itself (normally
    negative, e.g. -exp(A_log)); b, c [B, L, N] input-dependent B and C (one group shared by
    every channel). Optional: d [D] skip weight, z [B, L, D] gate, delta_bias [D]. Every input
    has one float dtype (float32, float64, bfloat16 or float16).

        dt  = delta + delta_bias          (softplus(...) when delta_softplus)
        h_0 = 0
        h_t = exp(dt_t[:, None] * a) * h_{t-1} + (dt_t * u_t)[:, None] * b_t[None, :]   # [D, N]
        y_t = h_t @ c_t                   then y += u * d, then y *= silu(z)

    y [B, L, D] and last_state = h_L [B, D, N] have the inputs' dtype; the state, exponentials
    and sums are float32 (float64 for float64 inputs). Differentiable in every input, with
    gradients arriving through y and last_state. Shape or dtype mismatches raise FuelGraphError
    when the call is built."""
    opt = [t for t in (d, z, delta_bias) if t is not None]
    return call_fused(FusedOps.SELECTIVE_SCAN, u, delta, a, b, c, *opt,
                      delta_softplus=_flag(delta_softplus), has_d=d is not None,
                      has_z=z is not None, has_delta_bias=delta_bias is not None)


def ssd_chunk_scan(x, dt, a, b, c, chunk_size=64, d=None, z=None, dt_bias=None,
                   dt_softplus=False, initial_states=None):
    """Mamba-2 state-space dual (SSD) scan; returns `(y, last_state)`.

    x [B, L, H, P] per-head input; dt [B, L, H] raw step size; a [H] per-head decay rate A
    itself (normally negative); b, c [B, L, H, N] per head (repeat B/C groups over heads
    before calling). Optional: d [H] or [H, P] skip weight, z [B, L, H, P] gate, dt_bias [H],
    initial_states [B, H, P, N] (the state before step 0; zeros when absent). Every input has
    one float dtype (float32, float64, bfloat16 or float16).

        dt  = dt + dt_bias               (softplus(...) when dt_softplus)
        h_0 = initial_states
        h_t = exp(dt_t * a) * h_{t-1} + dt_t * x_t[:, :, None] * b_t[:, None, :]   # per head [P, N]
        y_t = h_t @ c_t                   then y += x * d, then y *= silu(z)

    chunk_size must be > 0 and divide L (else FuelGraphError); it is a tiling hint and the
    result does not depend on it. y [B, L, H, P] and last_state = h_L [B, H, P, N] have the
    inputs' dtype; state and sums are float32 (float64 for float64 inputs). Differentiable in
    every input, with gradients arriving through y and last_state."""
    if isinstance(chunk_size, np.integer):
        chunk_size = int(chunk_size)
    opt = [t for t in (d, z, dt_bias, initial_states) if t is not None]
    return call_fused(FusedOps.SSD_CHUNK_SCAN, x, dt, a, b, c, *opt, chunk_size=chunk_size,
                      dt_softplus=_flag(dt_softplus), has_d=d is not None, has_z=z is not None,
                      has_dt_bias=dt_bias is not None,
                      has_initial_states=initial_states is not None)
