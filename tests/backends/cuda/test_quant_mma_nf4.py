"""NF4 on the tensor-core GEMV (`quant_mma_nf4`): the prmt lookups give bf16(code) for every
nibble (CPU, PTX prmt emulated), the repacked words read as mma.sync m16n8k16's fragments give
W @ x for bitsandbytes' layout (CPU), and the kernel against float64 torch on the dequantized
weight for 1..16 rows and a few launches (GPU)."""
from __future__ import annotations

import numpy as np
import pytest

from .cuda_oracle import DEV, HAS_CUDA, check_product, to_dev, torch

GPU = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (inline PTX mma)")


def _code():
    from fuelgraph.registry.quant import NF4_CODE
    return NF4_CODE


def _weight(rng, n, k, block=64):
    """(packed uint8 [N, K / 2], absmax float32 [N, K / block], W float64 [N, K]): bitsandbytes'
    nibble order, even element in the high nibble."""
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    absmax = rng.uniform(0.0, 2.0, size=(n, k // block)).astype(np.float32)
    q = np.stack([packed >> 4, packed & 15], axis=-1).reshape(n, k)
    w = _code().astype(np.float64)[q] * np.repeat(absmax.astype(np.float64), block, axis=1)
    return packed, absmax, w


def _bf16(v):
    return torch.from_numpy(np.asarray(v, np.float32)).to(torch.bfloat16).double().numpy()


def test_lookup_gives_bf16_codes():
    """Every nibble value, in every position of a word, through the tables and the REMAP."""
    from fuelgraph.backends.cuda.kernels import quant_mma_nf4 as F
    want = torch.from_numpy(_code()).to(torch.bfloat16).view(torch.int16).numpy()
    want = want.astype(np.int64) & 0xFFFF
    want[7] = 0x8000                                    # zero as -0.0
    inv = np.argsort(F.REMAP)                           # nibble -> code index
    rng = np.random.default_rng(0)
    nib = np.concatenate([np.arange(16)[:, None].repeat(8, 1),
                          rng.integers(0, 16, size=(64, 8))])
    words = (nib << (4 * np.arange(8))).sum(axis=1)
    got = F.emulate_unpack(words)
    np.testing.assert_array_equal(got, want[inv[nib]])


def test_shared_table_gives_the_lookups_codes():
    """The shared-memory byte table (`MmaConfig.lut`) decodes every byte value, in every byte
    of a word, to the same bf16 bits as the prmt lookups (tested against the codes above)."""
    from fuelgraph.backends.cuda.kernels import quant_mma_nf4 as F
    rng = np.random.default_rng(1)
    every = np.arange(256, dtype=np.int64)
    words = np.concatenate([every * 0x01010101, every << 8, every << 24,
                            rng.integers(0, 1 << 32, size=512, dtype=np.int64)])
    np.testing.assert_array_equal(F.emulate_lut(words), F.emulate_unpack(words))


def test_shared_table_fill_covers_every_entry():
    """fill_ptx stores each row's 8 16-byte chunks once, rows 0..255 exactly, for 1..16 warps
    (the addresses its PTX computes, replayed)."""
    import re
    from fuelgraph.backends.cuda.kernels import quant_mma_nf4 as F
    for warps in (1, 2, 4, 8, 16):
        ptx = F.fill_ptx(warps)
        rows = [int(v) for v in re.findall(r"add.u32 %la, %lt, (\d+);", ptx)]
        chunks = [int(v) for v in re.findall(r"add.u32 %lc, %lt, (\d+);", ptx)]
        threads = min(32 * warps, 256)       # threads past 256 store nothing (predicated)
        seen = sorted((t + e0, (t + c) % 8) for t in range(threads) for e0 in rows
                      for c in chunks[:8])
        assert seen == [(e, c) for e in range(256) for c in range(8)], warps
        assert ptx.count(".shared .align 16 .b8") == 1 and "bar.sync 0;" in ptx


@pytest.mark.parametrize("m,block", [(1, 64), (5, 128), (8, 64)])
def test_register_order_as_mma_fragments(m, block):
    """The words and absmax of pack_mma read as the mma's A fragments (A row-major: a0 a1 row
    l / 4, k 2 (l % 4) + (0, 1); a2 a3 row + 8; a4..a7 k + 8), x as B, the chunk's sums times
    the rows' absmax: W_bf16 @ x for W_bf16 = bf16(code) * absmax."""
    from fuelgraph.backends.cuda.kernels import quant_mma as Q
    from fuelgraph.backends.cuda.kernels import quant_mma_nf4 as F
    rng = np.random.default_rng(m)
    n, k = 32, 512
    packed, absmax, _ = _weight(rng, n, k, block)
    mw = Q.pack_mma(Q.NF4, torch.from_numpy(packed), torch.from_numpy(absmax),
                    torch.from_numpy(_code()), block, k, n)
    words = mw.words.numpy().astype(np.int64) & 0xFFFFFFFF          # [T, C, 32, 4]
    vals = F.emulate_unpack(words)                                  # [T, C, 32, 4, 8] bits
    vals = torch.from_numpy(vals.astype(np.int32).astype(np.int16)).view(torch.bfloat16)
    vals = vals.double().numpy()
    am = mw.scales.double().numpy()                                 # [T, K / block, 8, 2]
    x = rng.standard_normal((m, k))
    lane = np.arange(32)
    r, p = lane // 4, lane % 4
    xr = np.minimum(r, m - 1)
    out = np.zeros((m, n))
    for t in range(n // 16):
        acc = np.zeros((32, 4))
        for ch in range(k // 64):
            c = np.zeros((16, 8))
            for g in range(2):
                for s in range(2):
                    a = np.zeros((16, 16))
                    b = np.zeros((16, 8))
                    for e, rows in ((2 * g, r), (2 * g + 1, r + 8)):
                        for jj, slot in ((0, 0), (1, 1), (2, 8), (3, 9)):
                            a[rows, 2 * p + slot] = vals[t, ch, :, e, 4 * s + jj]
                    for jj, slot in ((0, 0), (1, 1), (2, 8), (3, 9)):
                        b[2 * p + slot, r] = x[xr, ch * 64 + g * 32 + 8 * p + 4 * s + jj]
                    c += a @ b
            for j in range(4):
                row, col = r + 8 * (j // 2), 2 * p + j % 2
                acc[:, j] += am[t, ch * 64 // block, r, j // 2] * c[row, col]
        for e in range(4):
            n_, m_ = t * 16 + r + 8 * (e // 2), 2 * p + e % 2
            ok = m_ < m
            out[m_[ok], n_[ok]] = acc[ok, e]
    q = np.stack([packed >> 4, packed & 15], axis=-1).reshape(n, k)
    w_bf16 = _bf16(_code())[q] * np.repeat(absmax.astype(np.float64), block, axis=1)
    want = x @ w_bf16.T
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-9 * np.abs(want).max())


def _ran_mma(w):
    from fuelgraph.backends.cuda.kernels import quant_packed as P
    return any(key[0] == id(w) and "pack_mma" in key for key in P._CACHE)


def _nf4(x, packed, absmax, block, cfg):
    from fuelgraph.backends.cuda.kernels import quant as K
    return K.nf4_matmul(x, packed, absmax, block_size=block, config=cfg)


@GPU
@pytest.mark.parametrize("m", list(range(1, 17)))
def test_mma_nf4_rows(m):
    """1..16 rows of bf16 x on the default route (the mma GEMV), against float64 torch."""
    rng = np.random.default_rng(m)
    n, k = 48, 1024
    packed, absmax, w = _weight(rng, n, k)
    pd, ad = to_dev(packed), to_dev(absmax)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).to(DEV)
    check_product(_nf4(x, pd, ad, 64, None), x, w.T, torch.bfloat16)
    assert _ran_mma(pd)


@GPU
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("cfg", [(4, 2, 1), (8, 2, 1), (4, 4, 0), (4, 2, 1, 1), (1, 1, 1),
                                 (4, 4, 1, 0, 0, 1), (8, 2, 1, 0, 0, 1), (4, 2, 0, 0, 0, 1),
                                 (1, 1, 1, 0, 0, 1), (4, 2, 1, 1, 0, 1), (4, 4, 1, 0, 0, 0)])
def test_mma_nf4_launches(m, cfg):
    """The launch candidates (units 1 runs with 2: the tables' operand; lut: the shared byte
    table, also on 8 warps, 1 warp, scales in their step, x a step ahead; lut 0: the prmt
    lookups), block 128, a 3-d x."""
    from fuelgraph.backends.cuda.kernels.quant_mma import MmaConfig
    rng = np.random.default_rng(7 * m + cfg[0])
    n, k = 32, 1024
    packed, absmax, w = _weight(rng, n, k, 128)
    pd, ad = to_dev(packed), to_dev(absmax)
    x = torch.randn(1, m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    out = _nf4(x.to(DEV), pd, ad, 128, MmaConfig(*cfg))
    assert out.shape == (1, m, n)
    check_product(out[0], x[0].to(DEV), w.T, torch.bfloat16)
    assert _ran_mma(pd)


@GPU
def test_mma_nf4_other_routes():
    """float32 x, 17 rows and block 32 keep the other routes."""
    rng = np.random.default_rng(3)
    n, k = 32, 512
    for m, dt, block in ((1, torch.float32, 64), (17, torch.bfloat16, 64),
                         (1, torch.bfloat16, 32)):
        packed, absmax, w = _weight(rng, n, k, block)
        pd, ad = to_dev(packed), to_dev(absmax)
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dt).to(DEV)
        check_product(_nf4(x, pd, ad, block, None), x, w.T, dt)
        assert not _ran_mma(pd)
