"""The mma register order of a quantized weight (`quant_mma`): `pack_mma` repacks it once (the
copy is cached with the weight by `quant_packed.packed_weight`) into int32 words [N / 16, K / 64,
32 lanes, 4 entries] (lane l = 4 r + p holds, per chunk of 64 and entry e = 2 g + h, elements
8 p .. 8 p + 7 of block g of row r + 8 h) and the scales in the layouts the kernel reads
(`MmaWeight`; quant_mma's module docstring has the whole order)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from . import quant_mma_nf4 as nf4
from .quant_tiles import AWQ, NF4, Q4_0, Q4_K, Q6_K, Q8_0


@dataclass(frozen=True)
class MmaWeight:
    """words int32 [N / 16, K / 64, 32, 4] (module docstring) and the scales in the layouts
    `_scales` reads: Q4_0 d f16 [N / 16, K / 64, 8, 4]; AWQ s f16 and z u8 [N / 16, K / group,
    8, 2]; Q4_K (sc, m) u8 [N / 16, K / 64, 8, 2, 4] and (d, dmin) f16 [N / 16, K / 256, 8, 4].
    group: elements a scale (AWQ)."""
    fmt: int
    words: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    table: torch.Tensor | None
    group: int
    n: int
    k: int


def _words_from_codes(q: torch.Tensor, halves: bool = False) -> torch.Tensor:
    """Codes q [N, K] (0..15) -> int32 [N / 16, K / 64, 32 lanes, 4 entries] (module docstring);
    halves (Q6_K): lane p's eight elements of a block are 4 p .. 4 p + 3 and 16 + 4 p .. (an
    mma step covers one 16-element half block) instead of 8 p .. 8 p + 7."""
    n, k = q.shape
    if halves:
        q = q.reshape(n, k // 32, 2, 4, 4).transpose(2, 3).reshape(n, k)
    v = q.to(torch.int64).reshape(n // 16, 2, 8, k // 64, 2, 4, 4, 2)   # t h r c g p m odd
    sh = (4 * torch.arange(4, device=q.device)).view(4, 1) + \
        16 * torch.arange(2, device=q.device).view(1, 2)
    w = (v << sh).sum(dim=(-2, -1))                                     # t h r c g p
    w = w.permute(0, 3, 2, 5, 4, 1).reshape(n // 16, k // 64, 32, 4)   # t c (r p) (g h)
    return (w - ((w >> 31) << 32)).to(torch.int32)                      # wrap to int32


def _two_planes(lo: torch.Tensor, hi: torch.Tensor, halves: bool = False) -> torch.Tensor:
    """Two 4-bit planes [N, K] -> int32 [N / 16, K / 64, 2 (plane), 32, 4]: a warp reads a
    chunk's 1 KB at once (two 16-byte loads a lane)."""
    return torch.stack([_words_from_codes(lo, halves), _words_from_codes(hi, halves)],
                       dim=2).contiguous()


def _q6_words(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Q6_K's planes (lo 4 bits, hi 2 bits [N, K], half-block order) -> int32 [N / 16, K / 128,
    3, 32, 4]: per chunk pair the two chunks' low-plane words, then one word per lane and entry
    holding both chunks' crumbs: code j = 2 m + o of chunk u at bit 2 (4 u + m) + 16 o."""
    n, k = lo.shape
    low = _words_from_codes(lo, halves=True).reshape(n // 16, k // 128, 2, 32, 4)
    h = hi.reshape(n, k // 32, 2, 4, 4).transpose(2, 3).reshape(n, k).to(torch.int64)
    v = h.reshape(n // 16, 2, 8, k // 128, 2, 2, 4, 4, 2)          # t h r c2 u g p m o
    sh = 2 * (4 * torch.arange(2, device=lo.device).view(2, 1, 1, 1, 1)
              + torch.arange(4, device=lo.device).view(1, 1, 1, 4, 1)) \
        + 16 * torch.arange(2, device=lo.device).view(1, 1, 1, 1, 2)
    w = (v << sh).sum(dim=(4, -2, -1))                              # t h r c2 g p
    w = w.permute(0, 3, 2, 5, 4, 1).reshape(n // 16, k // 128, 1, 32, 4)
    w = (w - ((w >> 31) << 32)).to(torch.int32)
    return torch.cat([low, w], dim=2).contiguous()


def _entries(v: torch.Tensor) -> torch.Tensor:
    """Per-block values [N, K / 32] -> [N / 16, K / 64, 8, 4] (entry 2 g + h: row r + 8 h,
    block g of the chunk)."""
    n, nb = v.shape
    return v.reshape(n // 16, 2, 8, nb // 2, 2).permute(0, 3, 2, 4, 1).reshape(
        n // 16, nb // 2, 8, 4).contiguous()


def _row_pairs(v: torch.Tensor) -> torch.Tensor:
    """Per-group values [N, G] -> [N / 16, G, 8, 2] (rows r, r + 8)."""
    n, g = v.shape
    return v.reshape(n // 16, 2, 8, g).permute(0, 3, 2, 1).contiguous()


def pack_mma(fmt: int, w0, w1, w2, i0: int, k: int, n: int) -> MmaWeight:
    """The mma register order of a weight given as `quant.run` takes it (GGUF: bytes, -, -,
    row bytes; AWQ: qweight, qzeros, scales, group)."""
    from .quant_packed import _q4k_scale_min, _unpack_awq
    if fmt == Q4_0:
        raw = w0.reshape(n, k // 32, 18)
        d = raw[..., :2].contiguous().view(torch.float16).reshape(n, k // 32)
        qs = raw[..., 2:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)
        return MmaWeight(fmt, _words_from_codes(q), _entries(d), None, None, 32, n, k)
    if fmt == Q4_K:     # d, dmin, 12 bytes of 6-bit (scale, min) pairs, 4 x 32 nibble bytes
        raw = w0.reshape(n, k // 256, 144)
        dd = raw[..., :4].contiguous().view(torch.float16).reshape(n, k // 256, 2)
        sc, mn = _q4k_scale_min(raw[..., 4:16].to(torch.int32))           # [N, K / 32]
        qs = raw[..., 16:].reshape(n, k // 256, 4, 1, 32)
        q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, k)
        scm = torch.stack([_entries(sc), _entries(mn)], dim=3)              # t c r 2 e
        table = torch.cat([_row_pairs(dd[..., 0]), _row_pairs(dd[..., 1])], dim=-1)
        return MmaWeight(fmt, _words_from_codes(q), scm.contiguous(), None,
                         table.contiguous(), 32, n, k)
    if fmt == Q8_0:     # two planes: u = q + 128 = 16 hi + lo
        raw = w0.reshape(n, k // 32, 34)
        d = raw[..., :2].contiguous().view(torch.float16).reshape(n, k // 32)
        u = (raw[..., 2:].reshape(n, k) ^ 0x80)
        return MmaWeight(fmt, _two_planes(u & 15, u >> 4), _entries(d), None, None, 32, n, k)
    if fmt == Q6_K:     # two planes: u = q + 32 = 16 hi + lo (hi 2 bits); 16-element scales
        raw = w0.reshape(n, k // 256, 210)
        shift4 = torch.tensor([0, 4], dtype=torch.uint8, device=w0.device).view(1, 1, 1, 2, 1)
        shift2 = torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=w0.device)
        lo = ((raw[..., :128].reshape(n, -1, 2, 1, 64) >> shift4) & 15).reshape(n, k)
        hi = ((raw[..., 128:192].reshape(n, -1, 2, 1, 32) >> shift2.view(1, 1, 1, 4, 1)) & 3)
        hi = hi.reshape(n, k)
        d = raw[..., 208:210].contiguous().view(torch.float16).reshape(n, k // 256)
        sc = raw[..., 192:208].reshape(n, k // 16).contiguous().view(torch.int8)
        # sc per (row, block, half): entries [tiles, chunks, 8, 2 (half), 4]
        sc = sc.reshape(n, k // 32, 2)
        scm = torch.stack([_entries(sc[..., 0]), _entries(sc[..., 1])], dim=3)
        return MmaWeight(fmt, _q6_words(lo, hi), scm.contiguous(), None, _row_pairs(d), 16, n, k)
    if fmt == AWQ:      # W [K, N] -> rows of W.T
        q = _unpack_awq(w0).t().contiguous()                                # [N, K]
        zeros = _unpack_awq(w1).t().contiguous()                            # [N, K / group]
        return MmaWeight(fmt, _words_from_codes(q), _row_pairs(w2.t()), _row_pairs(zeros),
                         None, i0, n, k)
    if fmt == NF4:      # packed, absmax, code table, block size
        words, absmax, tab = nf4.pack_nf4(w0, w1, w2, i0, k, n)
        return MmaWeight(fmt, words, absmax, None, tab, i0, n, k)
    raise ValueError(f"no mma layout for format {fmt}")
