#!/usr/bin/env python3
"""SELECTIVE_SCAN / SSD_CHUNK_SCAN on the NumPy backend: the fused kernels ("fuelgraph"), the
same graph lowered to its Scan recipe ("fuelgraph lowered") and Mamba's reference algorithms
written in torch CPU ("mamba_ssm"): for the selective scan the pure-PyTorch reference loop
(channel-major layout, exp(delta A) and delta B u precomputed for every step, then one update
and one contraction per step), for SSD the minimal chunked algorithm (segment sums, four
einsums, chunk states passed by one more einsum). Forward and forward+backward (torch
autograd for the anchors, the fused backward helpers for fuelgraph), float32.

    python bench/bench_ssm.py [--quick]

Writes bench/results/ssm_<date>.json and prints one line per case with ratios to "fuelgraph".
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as TF  # noqa: E402

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402
from common import fg_case, print_table, record, timeit, write_results  # noqa: E402

SS_SHAPES = {"quick": [(1, 256, 512, 16)], "full": [(2, 1024, 1536, 16), (1, 2048, 768, 16)]}
SSD_SHAPES = {"quick": [(1, 512, 4, 64, 64, 64)],
              "full": [(1, 2048, 8, 64, 64, 64), (2, 1024, 16, 64, 128, 128)]}


# ---- Mamba's reference algorithms in torch (anchors) ----------------------------------------
def mamba_selective_scan_ref(u, delta, A, B, C):
    """u, delta (b, d, l); A (d, n); B, C (b, n, l); softplus'd delta; returns (y, last)."""
    delta = TF.softplus(delta)
    dA = torch.exp(torch.einsum("bdl,dn->bdln", delta, A))
    dBu = torch.einsum("bdl,bnl,bdl->bdln", delta, B, u)
    x = u.new_zeros(u.shape[0], u.shape[1], A.shape[1])
    ys = []
    for i in range(u.shape[2]):
        x = dA[:, :, i] * x + dBu[:, :, i]
        ys.append(torch.einsum("bdn,bn->bd", x, C[:, :, i]))
    return torch.stack(ys, dim=2), x


def _segsum(v):
    """[..., T] -> [..., T, T]: sum of v over (s, t] for s <= t, -inf above the diagonal."""
    cs = torch.cumsum(v, -1)
    seg = cs[..., :, None] - cs[..., None, :]
    keep = torch.ones(v.shape[-1], v.shape[-1], dtype=torch.bool).tril()
    return seg.masked_fill(~keep, float("-inf"))


def mamba_ssd_minimal(x, dt, a, B, C, q):
    """x [b, l, h, p], dt [b, l, h], a [h], B, C [b, l, h, n]; the minimal chunked SSD."""
    b, l, h, p = x.shape
    c = l // q
    X = (x * dt[..., None]).reshape(b, c, q, h, p)
    A = (dt * a).reshape(b, c, q, h).permute(0, 3, 1, 2)            # [b, h, c, q]
    Bc, Cc = B.reshape(b, c, q, h, -1), C.reshape(b, c, q, h, -1)
    Acum = torch.cumsum(A, -1)
    Ydiag = torch.einsum("bclhn,bcshn,bhcls,bcshp->bclhp", Cc, Bc, torch.exp(_segsum(A)), X)
    states = torch.einsum("bclhn,bhcl,bclhp->bchpn", Bc, torch.exp(Acum[..., -1:] - Acum), X)
    states = torch.cat([torch.zeros_like(states[:, :1]), states], 1)
    decay = torch.exp(_segsum(TF.pad(Acum[..., -1], (1, 0))))
    states = torch.einsum("bhzc,bchpn->bzhpn", decay, states)
    Yoff = torch.einsum("bclhn,bchpn,bhcl->bclhp", Cc, states[:, :-1], torch.exp(Acum))
    return (Ydiag + Yoff).reshape(b, l, h, p), states[:, -1]


# ---- cases ----------------------------------------------------------------------------------
def _ss_case(shape, rng):
    B, L, D, N = shape
    u = rng.standard_normal((B, L, D)).astype(np.float32)
    delta = (rng.standard_normal((B, L, D)) * 0.5 - 1).astype(np.float32)
    a = -np.exp(rng.standard_normal((D, N)) * 0.5).astype(np.float32)
    b = rng.standard_normal((B, L, N)).astype(np.float32)
    c = rng.standard_normal((B, L, N)).astype(np.float32)
    gy = rng.standard_normal((B, L, D)).astype(np.float32)
    tu, td = (torch.from_numpy(t).transpose(1, 2).contiguous() for t in (u, delta))
    tb, tc = (torch.from_numpy(t).transpose(1, 2).contiguous() for t in (b, c))
    ta, tg = torch.from_numpy(a), torch.from_numpy(gy).transpose(1, 2)

    def fwd(*ts):
        return list(F.selective_scan(*ts, delta_softplus=True))

    def fwd_bwd(*ts):
        ts = list(ts)
        y, h = F.selective_scan(*ts[:5], delta_softplus=True)
        return [y, h] + list(fg.grad([y], ts[:5], [ts[5]]))

    leaves = [t.clone().requires_grad_(True) for t in (tu, td, ta, tb, tc)]

    def anchor_bwd():
        y, h = mamba_selective_scan_ref(*leaves)
        return torch.autograd.grad(y, leaves, tg)

    inputs = [u, delta, a, b, c]
    yield "selective_scan", fg_case(fwd, inputs), lambda: mamba_selective_scan_ref(
        tu, td, ta, tb, tc), lambda y: y.transpose(1, 2)
    yield "selective_scan_fwd+bwd", fg_case(fwd_bwd, inputs + [gy]), anchor_bwd, None


def _ssd_case(shape, rng):
    B, L, H, P, N, q = shape
    x = rng.standard_normal((B, L, H, P)).astype(np.float32)
    dt = (np.abs(rng.standard_normal((B, L, H))) * 0.3 + 0.05).astype(np.float32)
    a = -np.exp(rng.standard_normal(H) * 0.5).astype(np.float32)
    b = rng.standard_normal((B, L, H, N)).astype(np.float32)
    c = rng.standard_normal((B, L, H, N)).astype(np.float32)
    gy = rng.standard_normal((B, L, H, P)).astype(np.float32)
    ts = [torch.from_numpy(t) for t in (x, dt, a, b, c)]
    tg = torch.from_numpy(gy)

    def fwd(*t):
        return list(F.ssd_chunk_scan(*t, chunk_size=q))

    def fwd_bwd(*t):
        t = list(t)
        y, h = F.ssd_chunk_scan(*t[:5], chunk_size=q)
        return [y, h] + list(fg.grad([y], t[:5], [t[5]]))

    leaves = [t.clone().requires_grad_(True) for t in ts]

    def anchor_bwd():
        y, h = mamba_ssd_minimal(*leaves, q)
        return torch.autograd.grad(y, leaves, tg)

    inputs = [x, dt, a, b, c]
    yield "ssd_chunk_scan", fg_case(fwd, inputs), lambda: mamba_ssd_minimal(*ts, q), None
    yield "ssd_chunk_scan_fwd+bwd", fg_case(fwd_bwd, inputs + [gy]), anchor_bwd, None


def _check_forward(make, anchor, to_ours):
    got = make(False)()
    want = anchor()
    y = want[0] if to_ours is None else to_ours(want[0])
    np.testing.assert_allclose(got[0], y.detach().numpy(), rtol=2e-3, atol=2e-3)
    np.testing.assert_allclose(got[0], make(True)()[0], rtol=2e-3, atol=2e-3)


def main(quick=False):
    rng = np.random.default_rng(0)
    mode = "quick" if quick else "full"
    kw = dict(min_time=0.05, repeat=2, warmup=1) if quick else dict(min_time=0.5, repeat=3)
    records = []
    cases = [c for s in SS_SHAPES[mode] for c in ((s,) + x for x in _ss_case(s, rng))] + \
            [c for s in SSD_SHAPES[mode] for c in ((s,) + x for x in _ssd_case(s, rng))]
    for shape, name, make, anchor, to_ours in cases:
        if not name.endswith("bwd"):
            _check_forward(make, anchor, to_ours)
        impls = [("fuelgraph", make(False)), ("mamba_ssm", anchor)]
        if quick or not name.endswith("bwd"):      # the Scan recipe runs step by step
            impls.insert(1, ("fuelgraph lowered", make(True)))
        for impl, fn in impls:
            records.append(record(name, impl, shape, "float32", timeit(fn, **kw),
                                  torch_threads=torch.get_num_threads(),
                                  anchor=("mamba reference algorithm, torch CPU eager"
                                          if impl == "mamba_ssm" else None)))
    path = write_results("ssm", records)
    print_table(records)
    print(f"wrote {path}")
    return records


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
