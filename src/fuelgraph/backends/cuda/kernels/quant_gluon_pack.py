"""The fragment-order copy of a quantized weight for the Gluon wgmma GEMM
(`quant_gluon_gemm`): the codes and the per-block pairs (a, b) of W = fma(v, a, b).

Layout (`pack_wgmma`, cached with the weight like `quant_packed`'s copy): rows in tiles of 16
(one warp of the warpgroup), K in steps of 64. The wgmma A fragment of a [16, 64] tile gives
lane l (r = l // 4, p = l % 4) rows r + 8 h and elements k = 32 u + 16 s + 8 c + 2 p + e of
each (h, u, s, c, e in {0, 1}: 32 elements; `gl.to_linear_layout` of the DotOperandLayout).
4-bit formats: the lane's 4 int32 words [h, u] are contiguous (one 16-byte load, a warp's 512
bytes contiguous) and element (s, c, e) is nibble 4 e + 2 c + s of word (h, u). 8-bit (Q8_0,
Q6_K): 8 words [h, u, s], element (c, e) byte 2 e + c. So codes are int32 [N / 16, K / 64,
32 lanes, 4 or 8 words]. Each 32-element block of a row is one word (4-bit) or two (8-bit) of
one thread: u is the block (Q6_K's 16-element blocks: (u, s)). Scales: per (row, block) the
float32 pair (a, b) of W = fma(v, a, b) in two arrays [N / 16, K / 64, 8 r, 2 h, 2 u] (a
thread's four a's are one 16-byte load, shared by the 4 lanes of a row group); Q4_0 / Q8_0
store no b (a fixed multiple of a), NF4 and Q6_K neither (Q6_K: a = d sc 2^-16, its code at
bit 16 of v).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .quant_packed import _q4k_scale_min, _unpack_awq, q6k_fields
from .quant_tiles import AWQ, NF4, Q4_0, Q4_K, Q6_K, Q8_0

#: formats of this kernel; kind: 0 affine 4-bit (Q4_0, AWQ), 1 Q4_K (v - 2^23 first), 2 Q8_0,
#: 3 NF4 (code by warp shuffle, times absmax), 4 Q6_K (8-bit codes, a scale a 16 elements);
#: 5 (the kernel's only): Q4_0 / AWQ's bf16x2 decode (h2)
GLUON_FORMATS = frozenset({Q4_0, AWQ, Q4_K, Q8_0, NF4, Q6_K})
_KIND = {Q4_0: 0, AWQ: 0, Q4_K: 1, Q8_0: 2, NF4: 3, Q6_K: 4}
_BITS = {Q4_0: 4, AWQ: 4, Q4_K: 4, Q8_0: 8, NF4: 4, Q6_K: 8}
#: formats whose b is a fixed multiple of a (B_OVER_A: not stored)
_BFA = frozenset({Q4_0, Q8_0})
#: float32 scale values a thread loads a step (a per 32-element block, Q6_K per 16)
_PAIRS = {0: 4, 1: 4, 2: 4, 3: 4, 4: 8}
#: bit position of the code in v = 2^23 + 2^SH q
_SH = {4: 12, 8: 8}
STEP_K = 64
MAGIC = 0x4B000000
#: 128.0 in both halves of a bf16x2 word (the h2 decode's magic)
H2_MAGIC = 0x43004300


@dataclass(frozen=True)
class WgmmaWeight:
    """codes int32 [N / 16, K / 64, 32, 4 or 8] (module docstring), pairs' a and b float32
    [N / 16, K / 64, 8, 2, 2] (Q6_K: a [N / 16, K / 64, 8, 2, 2, 2], a per 16 elements (u, s),
    b empty; NF4: a = absmax, b zeros), each flattened with two steps of padding
    (`_padded`)."""
    fmt: int
    codes: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    n: int
    k: int
    extra: dict = field(default_factory=dict, compare=False, repr=False)


def _codes(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes q uint8 [N, K] (< 2**bits) -> int32 [N / 16, K / 64, 32, 32 / bits * ...] in the
    fragment order: row 16 t + 8 h + r, k = 64 kk + 32 u + 16 s + 8 c + 2 p + e."""
    n, k = q.shape
    v = q.to(torch.int32).reshape(n // 16, 2, 8, k // 64, 2, 2, 2, 4, 2)
    #                               t     h  r  kk      u  s  c  p  e
    if bits == 4:   # word (h, u), nibble 4 e + 2 c + s
        v = v.permute(0, 3, 2, 7, 1, 4, 8, 6, 5).reshape(n // 16, k // 64, 32, 4, 8)
        shifts = 4 * torch.arange(8, dtype=torch.int32, device=q.device)
    else:           # word (h, u, s), byte 2 e + c
        v = v.permute(0, 3, 2, 7, 1, 4, 5, 8, 6).reshape(n // 16, k // 64, 32, 8, 4)
        shifts = 8 * torch.arange(4, dtype=torch.int32, device=q.device)
    w = (v.to(torch.int64) << shifts.to(torch.int64)).sum(-1)
    w = torch.where(w >= 2 ** 31, w - 2 ** 32, w)                       # two's complement
    return w.to(torch.int32).contiguous()


def _pair_tiles(t: torch.Tensor) -> torch.Tensor:
    """Per-(row, 32-block) values [N, K / 32] float32 -> [N / 16, K / 64, 8 r, 2 h, 2 u]."""
    n, g = t.shape
    return t.reshape(n // 16, 2, 8, g // 2, 2).permute(0, 3, 2, 1, 4).contiguous()


def wgmma_pairs(fmt: int, s: torch.Tensor, o: torch.Tensor):
    """(a, b) float32 [N, K / 32] of W = fma(v, a, b) (v = 2^23 + 2^SH q) for the per-block
    scale s and offset o (W = s q + o; Q4_0: o = -8 d, AWQ: -z s, Q8_0: o = -128 d for the
    stored q + 128; Q4_K: v - 2^23 is used, so b = o). a = s 2^-SH exact (a power of two; no
    f16 scale reaches float32's subnormals); b = o - s 2^(23 - SH) = -s (z + 2^(23 - SH)): the
    integer has at most 12 (4-bit, SH = 12) / 9 (Q8_0, SH = 8) significant bits and s 11
    (f16), so b is exact and so is the fused product."""
    sh = _SH[_BITS[fmt]]
    a = s * 2.0 ** -sh
    if _KIND[fmt] == 1:
        b = o
    else:
        b = (o.double() - s.double() * 2.0 ** (23 - sh)).float()
    return a.float(), b.float()


def pack_wgmma(fmt: int, w0, w1, w2, i0: int, k: int, n: int) -> WgmmaWeight:
    """The fragment-order copy of a weight given as `quant.run` takes it (GGUF: bytes, -, -,
    row bytes; AWQ: qweight, qzeros, scales, group)."""
    if fmt == Q4_0:
        raw = w0.reshape(n, k // 32, 18)
        d = raw[..., :2].contiguous().view(torch.float16).reshape(n, k // 32).float()
        qs = raw[..., 2:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)
        s, o = d, -8.0 * d
    elif fmt == Q8_0:
        raw = w0.reshape(n, k // 32, 34)
        d = raw[..., :2].contiguous().view(torch.float16).reshape(n, k // 32).float()
        q = raw[..., 2:].reshape(n, k) ^ 0x80                              # int8 q + 128
        s, o = d, -128.0 * d
    elif fmt == Q4_K:
        raw = w0.reshape(n, k // 256, 144)
        dd = raw[..., :4].contiguous().view(torch.float16).reshape(n, k // 256, 2).float()
        sc, mn = _q4k_scale_min(raw[..., 4:16].to(torch.int32))
        qs = raw[..., 16:].reshape(n, k // 256, 4, 1, 32)
        q = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, k)
        d = dd[..., 0].repeat_interleave(8, dim=1)
        dmin = dd[..., 1].repeat_interleave(8, dim=1)
        s, o = d * sc.float(), -(dmin * mn.float())                # as gguf-py forms them
    elif fmt == NF4:    # byte i: element 2i in the high nibble; a = absmax, no b
        q = torch.stack([w0 >> 4, w0 & 15], dim=-1).reshape(n, k)
        a = w1.reshape(n, k // i0).float().repeat_interleave(i0 // 32, dim=1)
        return WgmmaWeight(fmt, _padded(_codes(q, 4)), _padded(_pair_tiles(a)),
                           _padded(_pair_tiles(torch.zeros_like(a))), n, k)
    elif fmt == Q6_K:   # a = (d sc) 2^-16 a 16 elements; b = -160 (d sc) in the kernel
        q, d, sc = q6k_fields(w0, n, k)                                    # q + 32, 0..63
        sc = sc.view(torch.int8).float()
        a = d.float().repeat_interleave(16, dim=1) * sc * 2.0 ** -16       # exact
        a = a.reshape(n // 16, 2, 8, k // 64, 2, 2).permute(0, 3, 2, 1, 4, 5).contiguous()
        return WgmmaWeight(fmt, _padded(_codes(q, 8)), _padded(a), _padded(a[..., :0]), n, k)
    elif fmt == AWQ:
        q = _unpack_awq(w0).t().contiguous()                               # [N, K]
        rep = i0 // 32
        z = _unpack_awq(w1).t().float().repeat_interleave(rep, dim=1)
        s = w2.t().float().repeat_interleave(rep, dim=1)
        o = -(z * s)
        extra = {"z": _padded(_pair_tiles(z))}    # (the h2 decode's offsets, `h2_scales`)
    else:
        raise ValueError(f"no wgmma layout for format {fmt}")
    a, b = wgmma_pairs(fmt, s, o)
    b = _pair_tiles(b)
    if fmt in _BFA:     # b = a B_OVER_A in the kernel
        b = b[..., :0]
    return WgmmaWeight(fmt, _padded(_codes(q, _BITS[fmt])), _padded(_pair_tiles(a)), _padded(b),
                       n, k, extra if fmt == AWQ else {})


def _padded(t: torch.Tensor) -> torch.Tensor:
    """t [N / 16, K / 64, ...] flattened with two (tile, step) blocks of zeros after it: the
    kernel loads two steps ahead of the last one without a bound (the last tile's overrun
    lands here)."""
    flat = t.reshape(-1)
    block = flat.numel() // (t.shape[0] * t.shape[1])
    return torch.cat([flat, flat.new_zeros(2 * block)])


def h2_scales(pw: WgmmaWeight):
    """Q4_0 / AWQ for bf16 x (the h2 decode): per (row, block), in a's layout, the bf16x2
    words (dh, dl) with s = dh + dl (the block's scale: Q4_0 d, AWQ s), dh = s truncated to
    bf16's 8 significant bits and dl the rest (at most 3 bits: both exact in bf16) and, AWQ,
    (o, o) with o = -(128 + z) (Q4_0: z = 8, a constant in the kernel: no second array), as
    float32-typed tensors; made once. Then t = (128 + q) + o = q - z (exact), dl t (at most
    7 bits: exact) and fma(t, dh, dl t) = RN_bf16(s (q - z)): one rounding of the exact
    product, as the float32 path's."""
    hit = pw.extra.get("h2")
    if hit is None:
        d = pw.a * 4096.0                                           # a = s 2^-12, exact
        hi = d.view(torch.int32) & -65536                           # top 16 bits: bf16 dh
        lo = (d - hi.view(torch.float32)).view(torch.int32) & -65536
        fin = torch.isfinite(d)         # (an infinite s gives NaN, as the float32 path)
        assert torch.equal((hi.view(torch.float32) + lo.view(torch.float32))[fin], d[fin])
        half = lambda v: (v >> 16) & 0xFFFF                           # noqa: E731
        pair = lambda a, b: (a | (b << 16)).to(torch.int32).view(torch.float32)  # noqa: E731
        if "z" in pw.extra:
            o = (-(128.0 + pw.extra["z"])).view(torch.int32)          # exact in bf16
            offsets = pair(half(o), half(o))
        else:
            offsets = pw.b                                            # (empty: Q4_0)
        hit = pw.extra["h2"] = (pair(half(hi), half(lo)), offsets)
    return hit
