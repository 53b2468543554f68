"""Torch references for the state-space scans, written from the published Mamba reference
recurrences (sequential over time, one step per loop iteration), in fuelgraph's time-major
layout. `dtype=None` computes in the inputs' dtype widened to float32 (as the Mamba reference
does for 16-bit inputs) and rounds the results back; pass torch.float64 for the oracle.

Also: input generators shared by the ssm tests (registry, NumPy and CUDA kernels)."""
import numpy as np
import torch
import torch.nn.functional as TF

import fuelgraph as fg


def _acc(t, dtype):
    if dtype is not None:
        return t.to(dtype)
    return t.to(torch.float64 if t.dtype == torch.float64 else torch.float32)


def selective_scan_ref(u, delta, a, b, c, d=None, z=None, delta_bias=None,
                       delta_softplus=False, dtype=None):
    """u, delta [B, L, D]; a [D, N]; b, c [B, L, N]; d [D]; z [B, L, D]; delta_bias [D]."""
    out_dtype = u.dtype
    u, delta, a, b, c = (_acc(t, dtype) for t in (u, delta, a, b, c))
    dt = delta if delta_bias is None else delta + _acc(delta_bias, dtype)
    if delta_softplus:
        dt = TF.softplus(dt)
    B, L, D = u.shape
    h = u.new_zeros(B, D, a.shape[1])
    ys = []
    for t in range(L):
        h = torch.exp(dt[:, t, :, None] * a) * h + (dt[:, t] * u[:, t])[:, :, None] * b[:, t, None, :]
        ys.append(torch.einsum("bdn,bn->bd", h, c[:, t]))
    y = torch.stack(ys, 1) if ys else u.new_zeros(B, 0, D)
    if d is not None:
        y = y + u * _acc(d, dtype)
    if z is not None:
        y = y * TF.silu(_acc(z, dtype))
    return y.to(out_dtype), h.to(out_dtype)


def ssd_ref(x, dt, a, b, c, d=None, z=None, dt_bias=None, dt_softplus=False,
            initial_states=None, dtype=None):
    """x [B, L, H, P]; dt [B, L, H]; a [H]; b, c [B, L, H, N]; d [H] or [H, P]; z like x;
    dt_bias [H]; initial_states [B, H, P, N]."""
    out_dtype = x.dtype
    x, dt, a, b, c = (_acc(t, dtype) for t in (x, dt, a, b, c))
    if dt_bias is not None:
        dt = dt + _acc(dt_bias, dtype)
    if dt_softplus:
        dt = TF.softplus(dt)
    B, L, H, P = x.shape
    N = b.shape[-1]
    h = x.new_zeros(B, H, P, N) if initial_states is None else _acc(initial_states, dtype)
    ys = []
    for t in range(L):
        decay = torch.exp(dt[:, t] * a)[:, :, None, None]
        h = decay * h + (dt[:, t, :, None] * x[:, t])[..., None] * b[:, t, :, None, :]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, c[:, t]))
    y = torch.stack(ys, 1) if ys else x.new_zeros(B, 0, H, P)
    if d is not None:
        dd = _acc(d, dtype)
        y = y + x * (dd[:, None] if dd.dim() == 1 else dd)
    if z is not None:
        y = y * TF.silu(_acc(z, dtype))
    return y.to(out_dtype), h.to(out_dtype)


# ---- inputs ---------------------------------------------------------------------------------
def ss_inputs(B, L, D, N, dt, d=False, z=False, bias=False, softplus=False, seed=0):
    """dict of float64 arrays rounded to `dt` (a fuelgraph dtype) so every dtype sees the same
    values; delta small (positive after softplus), a negative."""
    rng = np.random.default_rng(seed)
    r = {"u": rng.standard_normal((B, L, D)),
         "delta": (rng.standard_normal((B, L, D)) * 0.5 - (1.0 if softplus else -0.6)) *
         (1.0 if softplus else 0.5),
         "a": -np.exp(rng.standard_normal((D, N)) * 0.5),
         "b": rng.standard_normal((B, L, N)),
         "c": rng.standard_normal((B, L, N))}
    if not softplus:
        r["delta"] = np.abs(r["delta"])
    if d:
        r["d"] = rng.standard_normal(D)
    if z:
        r["z"] = rng.standard_normal((B, L, D))
    if bias:   # keeps dt > 0 without softplus (a growing state would overflow)
        r["delta_bias"] = rng.standard_normal(D) * 0.3
        if not softplus:
            r["delta_bias"] = np.abs(r["delta_bias"])
    return {k: v.astype(dt.np).astype(np.float64) for k, v in r.items()}


def ssd_inputs(B, L, H, P, N, dt, d=None, z=False, bias=False, softplus=False, init=False,
               seed=0):
    """As ss_inputs for ssd_chunk_scan; d None, "h" ([H]) or "hp" ([H, P])."""
    rng = np.random.default_rng(seed)
    r = {"x": rng.standard_normal((B, L, H, P)),
         "dt": np.abs(rng.standard_normal((B, L, H)) * 0.4) + 0.05,
         "a": -np.exp(rng.standard_normal(H) * 0.5),
         "b": rng.standard_normal((B, L, H, N)),
         "c": rng.standard_normal((B, L, H, N))}
    if softplus:
        r["dt"] = rng.standard_normal((B, L, H)) - 1.0
    if d == "h":
        r["d"] = rng.standard_normal(H)
    elif d == "hp":
        r["d"] = rng.standard_normal((H, P))
    if z:
        r["z"] = rng.standard_normal((B, L, H, P))
    if bias:
        r["dt_bias"] = rng.standard_normal(H) * 0.3
        if not softplus:
            r["dt_bias"] = np.abs(r["dt_bias"])
    if init:
        r["initial_states"] = rng.standard_normal((B, H, P, N))
    return {k: v.astype(dt.np).astype(np.float64) for k, v in r.items()}


SS_ORDER = ("u", "delta", "a", "b", "c", "d", "z", "delta_bias")
SSD_ORDER = ("x", "dt", "a", "b", "c", "d", "z", "dt_bias", "initial_states")


def ordered(inputs, order):
    return [k for k in order if k in inputs]


def torch_grads(ref, inputs, order, gy, gl, dtype=None, in_dtype=torch.float64, **kw):
    """(y, last_state, {name: grad}) of `ref` by torch autograd; inputs cast to `in_dtype`."""
    ts = {k: torch.tensor(v).to(in_dtype).requires_grad_(True) for k, v in inputs.items()}
    y, h = ref(**ts, dtype=dtype, **kw)
    names = ordered(inputs, order)
    gs = torch.autograd.grad([y, h], [ts[k] for k in names],
                             [torch.tensor(gy).to(y.dtype), torch.tensor(gl).to(h.dtype)],
                             allow_unused=True)
    return (y.detach(), h.detach(),
            {k: (g if g is not None else torch.zeros_like(ts[k])).detach()
             for k, g in zip(names, gs)})


def fg_dtype_tensors(inputs, dt):
    return {k: fg.tensor(v.astype(dt.np), dtype=dt) for k, v in inputs.items()}

