#!/usr/bin/env python3
"""The paged family on the NumPy backend, float32 (Hq 32, Hkv 8, D 128, block 16; each
sequence's blocks shuffled over the pool):

* paged_attn, decode (Sq = 1) and chunked prefill (Sq = 64): the fused kernel ("fuelgraph",
  reads only the live blocks), the recipe ("fuelgraph lowered": gathers the whole table, dense
  masked softmax) and torch CPU SDPA on a dense copy of the cache ("torch eager", the copy made
  beforehand and not timed).
* paged_cache_write of one new token for 64 sequences: the kernel writing in place into the
  pool as PagedKVCache does ("fuelgraph"), the functional recipe ("fuelgraph lowered": a new
  pool) and torch `index_put_` in place ("torch eager").

    python bench/bench_paged.py [--quick]

Writes bench/results/paged_<date>.json and prints one line per case with ratios to "fuelgraph".
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import fuelgraph.functional as F  # noqa: E402
from common import fg_case, run_cases  # noqa: E402
from fuelgraph.backends.numpy.paged import paged_cache_write  # noqa: E402

HQ, HKV, D, BS = 32, 8, 128, 16


def paged_inputs(rng, B, sq, ctx):
    """q, pools, a shuffled block table (padded with the int32 max) and the lengths, plus the
    dense k/v [B, Hkv, ctx, D] the same tokens make."""
    nblk = -(-ctx // BS)
    nb = B * nblk + 8
    perm = rng.permutation(nb)[:B * nblk].reshape(B, nblk)
    table = np.full((B, nblk + 2), np.iinfo(np.int32).max, np.int32)
    table[:, :nblk] = perm
    q = rng.standard_normal((B, HQ, sq, D)).astype(np.float32)
    kc = rng.standard_normal((nb, BS, HKV, D)).astype(np.float32)
    vc = rng.standard_normal((nb, BS, HKV, D)).astype(np.float32)
    lens = np.full(B, ctx, np.int32)
    tok = (perm[:, :, None] * BS + np.arange(BS)).reshape(B, -1)[:, :ctx]     # [B, ctx] slots
    dense = [torch.from_numpy(c.reshape(-1, HKV, D)[tok].transpose(0, 2, 1, 3).copy())
             for c in (kc, vc)]
    return [q, kc, vc, table, lens], dense


def attn_case(rng, B, sq, ctx):
    arrays, (kd, vd) = paged_inputs(rng, B, sq, ctx)
    tq = torch.from_numpy(arrays[0])
    mask = None
    if sq > 1:                                   # bottom-right causal
        mask = torch.arange(ctx)[None, :] <= (ctx - sq + torch.arange(sq))[:, None]

    def torch_run():
        return torch.nn.functional.scaled_dot_product_attention(tq, kd, vd, attn_mask=mask,
                                                                enable_gqa=True)
    return ("paged_attn", (B, HQ, sq, D, ctx), fg_case(F.paged_attn, arrays), torch_run)


def write_case(rng, B=64, nb=1024):
    pool = rng.standard_normal((nb, BS, HKV, D)).astype(np.float32)
    new = rng.standard_normal((B, HKV, D)).astype(np.float32)
    slots = (rng.permutation(nb)[:B] * BS + rng.integers(0, BS, B)).astype(np.int32)
    lowered = fg_case(F.paged_cache_write, [pool, new, slots])
    tpool, tnew = torch.from_numpy(pool.copy()), torch.from_numpy(new)
    tslots = torch.from_numpy(slots.astype(np.int64))
    flat = tpool.view(nb * BS, HKV, D)

    def make(lower_all):
        if lower_all:
            return lowered(True)
        buf = pool.copy()
        return lambda: [paged_cache_write(buf, new, slots, check=False)]

    def torch_run():
        flat.index_put_((tslots,), tnew)
        return tpool
    return ("paged_cache_write", (B, HKV, D, nb * BS), make, torch_run)


def main(quick=False):
    rng = np.random.default_rng(0)
    cases = [attn_case(rng, 8, 1, 1024), attn_case(rng, 2, 64, 1024), write_case(rng)]
    return run_cases("paged", cases, quick, min_time=0.5, repeat=3)


if __name__ == "__main__":
    main(quick="--quick" in sys.argv)
