"""Many-row quantized matmul (`out = x @ W.T`, x [M, K] with M in the hundreds, W [N, K]) as one
Triton GEMM on the chunk-layout weight copy of `quant_packed` (cached with the weight, shared
with the one-row GEMV and the few-row dots): the weight tile is dequantized in registers right
before the tensor-core dot, no dense copy of W is written.

A program owns BLOCK_N weight rows and BLOCK_M rows of x (acc [BLOCK_N, BLOCK_M] float32, the
weight as the dot's left operand) and walks its share of K in steps of 128 elements: for the
4-bit formats (chunks of 256 elements, 32 int32 words a row) half a chunk, planes 4h .. 4h + 3
(h = step % 2), for Q8_0 / Q6_K (chunks of 128) one chunk. A step loads the row's 32 words
(16-byte loads), this step's scales and the x tile [128, BLOCK_M] in K order; the loop is a
`tl.range(num_stages=...)`, so Triton's pipeliner streams all three through shared memory
ahead of the step that uses them. The four planes are decoded to float32, rounded to x's
dtype, joined side by side and permuted back into K order (the operand goes through shared
memory on its way to the wgmma anyway), then one dot of K = 128.

Decoding (bit for bit the format's dequantizer, as the tests check):
* Q4_0, AWQ, Q4_K (W = s q + o per 32-element plane): from the per-plane float32 pairs (a, b)
  of `quant_packed.affine_pairs`, one FMA a weight (Q4_K: and an add). The pairs fold in the
  bit position SH of the nibble in the GEMV's view of the word; here every step takes the same
  two views of its half word (nibbles 0, 1 at SH = 12, 16; nibbles 2, 3 at 12, 16), so each
  plane's pair is moved to this SH once per row and step (`_pair_here`, exact): a uniform
  shift of the words per step rather than a constexpr plane index per step.
* NF4: the code values by warp shuffles from the lanes' registers (`quant_packed._nf4_shfl`;
  tl.gather under the CPU interpreter), times absmax.
* Q8_0: one FMA a weight from the f16 scale (`quant_packed._plane`, FMA_DEQ).
* Q6_K: a scale per half plane row (`quant_packed_dot._wplane_q6k`).

With every load a TMA copy (tma=2, the affine formats: `_packed_gemm_tma_kernel`) the loop
has no per-thread addresses and no register round trip of the copies. Split-K (split > 1)
adds partial tiles by float32 atomics into a zeroed output.

Where the time goes (H200, N = K = 8192, M = 256, 128 x 128 tiles, one wave of 128 programs):
0.0856 ms against dense cuBLAS's 0.054; the same loop with the decode replaced by one shift a
weight runs 0.064, so the loop's structure (the decoded tile's layout conversion through
shared memory into the wgmma's register operand, with CTA-wide barriers a step: the decode of
one step hardly overlaps the tensor cores' work on the previous one) costs as much as the
decode's ~0.022 (sm_90 SASS: ~7 instructions a weight, 3.3 of them the decode)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .common import num_sms
from .quant_packed import (_KIND, AFFINE_FORMATS, AFFINE_SHIFTS, CHUNK, INTERPRET, MAGIC_BITS,
                           NF4, PACKED_FORMATS, Q6_K, _cdiv, _lane_codes, _nf4_lookup, _nf4_shfl,
                           _plane, affine_pairs, affine_ready, packed_weight)
from .quant_packed_dot import _wplane_q6k

#: formats of the GEMM
GEMM_PACKED_FORMATS = PACKED_FORMATS
#: bit position of nibble jj (0..3) of a half word in this kernel's two views
_SH_HERE = (12, 16, 12, 16)


def _pair_shifts(fmt: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(per half h: SH_gemv - SH_here of planes 4h .. 4h + 3), the power of two that moves a
    GEMV pair (`affine_pairs`) to this kernel's view; E = 256 formats have two halves."""
    sh = AFFINE_SHIFTS[fmt]
    return tuple(tuple(sh[4 * h + jj] - _SH_HERE[jj] for jj in range(4)) for h in range(2))


#: Q4_0 / AWQ / Q4_K: (half 0, half 1) exponents of `_pair_shifts`, flattened per format kind
_DELTA = {_KIND[f]: sum(_pair_shifts(f), ()) for f in AFFINE_FORMATS}


@triton.jit
def _pair_here(KIND: tl.constexpr, pr, jj: tl.constexpr, h, D0: tl.constexpr,
               D1: tl.constexpr):
    """The GEMV pair pr (int64: a in the low word, b in the high one) of plane 4h + jj moved to
    this kernel's nibble position: a 2^D (D = D0 for h = 0, else D1; exact, a power of two) and,
    for Q4_0 / AWQ whose b holds -s 2^(23 - SH), b + a (2^23 - 2^(23 + D)) = b + s (2^(23 -
    SH_gemv) - 2^(23 - SH_here)): one FMA of exact factors whose exact result (o - s 2^(23 -
    SH_here), at most 23 significant bits as `affine_pairs` argues for SH >= 12) is
    representable, so exact. Q4_K's b = -dmin m has no SH in it."""
    a = pr.to(tl.int32).to(tl.float32, bitcast=True)
    b = (pr >> 32).to(tl.int32).to(tl.float32, bitcast=True)
    if D0 == 0 and D1 == 0:     # the pair is already at this view (AWQ)
        return a, b
    if D0 == D1:
        f = 2.0 ** D0
        c = 8388608.0 - 2.0 ** (23 + D0)
    else:
        f = tl.where(h == 0, 2.0 ** D0, 2.0 ** D1)
        c = tl.where(h == 0, 8388608.0 - 2.0 ** (23 + D0), 8388608.0 - 2.0 ** (23 + D1))
    if KIND == 4:
        return a * f, b
    return a * f, tl.fma(a, c, b)


@triton.jit
def _affine_here(KIND: tl.constexpr, view, jj: tl.constexpr, a, b, magic):
    """Plane jj of the step's half word from its moved pair: v = 2^23 + 2^SH q (the nibble OR-ed
    into 2^23's mantissa, SH = 12 or 16); Q4_0 / AWQ: fma(v, a, b), the exact product; Q4_K:
    fma(v - 2^23, a, b), the exact (d sc) q rounded once with - dmin m (as gguf-py)."""
    SH: tl.constexpr = 12 + 4 * (jj % 2)
    v = ((view & (15 << SH)) | magic).to(tl.float32, bitcast=True)
    if KIND == 4:
        v = v - 8388608.0
    return tl.fma(v, a, b)


@triton.jit
def _affine_word_plane(KIND: tl.constexpr, hw, jj: tl.constexpr, h, pr, magic, D0: tl.constexpr,
                       D1: tl.constexpr):
    """Plane 4h + jj of the half words hw (Q4_0 / AWQ / Q4_K) from its GEMV pair pr [BN, 1]."""
    a, b = _pair_here(KIND, pr, jj, h, D0, D1)
    if jj < 2:
        view = hw << 12
    else:
        view = hw << 4
    return _affine_here(KIND, view, jj, a, b, magic)


@triton.jit
def _step_scales(KIND: tl.constexpr, s_rows, ch, h, n_ok, E: tl.constexpr, BS: tl.constexpr,
                 EVEN: tl.constexpr):
    """The four planes' scales of a step in one load [BN, 4] (Q4_0 / AWQ / Q4_K: the pairs,
    32 contiguous bytes a row; Q8_0: the f16 d, 8 bytes; NF4: absmax, repeated where planes
    share a block), split into four [BN, 1] columns (no data movement: one thread holds a
    row's four)."""
    BN: tl.constexpr = s_rows.shape[0]
    j4 = tl.arange(0, 4)[None, :]
    if KIND == 0 or KIND == 2 or KIND == 4:
        g = ch * 8 + 4 * h + j4
    elif KIND == 3:
        g = ch * 4 + j4
    else:
        g = (ch * E + 128 * h + 32 * j4) // BS
    if EVEN:
        v = tl.load(s_rows + g)
    else:
        v = tl.load(s_rows + g, mask=n_ok, other=0)
    va, vb = tl.split(tl.reshape(v, (BN, 2, 2)))
    v0, v2 = tl.split(va)
    v1, v3 = tl.split(vb)
    return v0[:, None], v1[:, None], v2[:, None], v3[:, None]


@triton.jit
def _plane_here(KIND: tl.constexpr, words, hw, jj: tl.constexpr, h, ch, s_rows, z_rows, c_rows,
                n_ok, codes, magic, E: tl.constexpr, BS: tl.constexpr, EVEN: tl.constexpr,
                D0: tl.constexpr, D1: tl.constexpr, SHFL: tl.constexpr, pre=0,
                PRE: tl.constexpr = False):
    """Plane 4h + jj ([BN, 32] float32) of the step: words [BN, 32] of chunk ch (scalar), hw
    its half (words >> 16h) for the 4-bit formats; s_rows / z_rows / c_rows [BN, 1] row
    pointers of the scales (Q4_0 / AWQ / Q4_K: the pairs), AWQ zeros, table (NF4 codes, Q6_K
    d). PRE: the plane's scale (pair) `pre` [BN, 1] loaded already (`_step_scales`)."""
    if KIND == 0 or KIND == 2 or KIND == 4:
        g = ch * 8 + 4 * h + jj
        if PRE:
            pr = pre
        elif EVEN:
            pr = tl.load(s_rows + g)
        else:
            pr = tl.load(s_rows + g, mask=n_ok, other=0)
        w = _affine_word_plane(KIND, hw, jj, h, pr, magic, D0, D1)
    elif KIND == 1:     # NF4: code[q] * absmax
        g = (ch * E + (4 * h + jj) * 32) // BS
        if PRE:
            s = pre
        elif EVEN:
            s = tl.load(s_rows + g)
        else:
            s = tl.load(s_rows + g, mask=n_ok, other=0.0)
        if SHFL:        # the shuffle reads the index's low 5 bits; lanes l, l + 16 agree
            w = _nf4_shfl(hw >> (4 * jj), codes) * s
        else:
            w = _nf4_lookup((hw >> (4 * jj)) & 15, c_rows) * s
    elif KIND == 3:     # Q8_0: d (q + 128 - 128), one FMA
        if PRE:
            s = pre.to(tl.float32)
        elif EVEN:
            s = tl.load(s_rows + ch * 4 + jj).to(tl.float32)
        else:
            s = tl.load(s_rows + ch * 4 + jj, mask=n_ok, other=0.0).to(tl.float32)
        w = _plane(3, words, jj, s, 0, c_rows, magic, True)
    else:               # Q6_K: d of the super-block (2 chunks), a scale per half plane row
        BN: tl.constexpr = words.shape[0]
        ch3 = tl.zeros((1, 1, 1), tl.int32) + ch
        ok3 = n_ok[:, :, None]
        if EVEN:
            d = tl.load(c_rows[:, :, None] + ch3 // 2).to(tl.float32)
        else:
            d = tl.load(c_rows[:, :, None] + ch3 // 2, mask=ok3, other=0.0).to(tl.float32)
        w3 = _wplane_q6k(tl.reshape(words, (BN, 1, 32)), jj, ch3, ok3, s_rows[:, :, None],
                         c_rows, d, magic, E, BS, True, EVEN)
        w = tl.reshape(w3, (BN, 32))
    return w


@triton.jit
def _store_tile(acc, out_ptr, o_ptrs, o_mask, ATOMIC: tl.constexpr, MASKED: tl.constexpr):
    """The tile's result acc [BN, BM]: stored in out's dtype, or added by float32 atomics."""
    if ATOMIC:
        tl.atomic_add(o_ptrs, acc, mask=o_mask, sem="relaxed")
    elif MASKED:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty))


@triton.jit
def _half_step(KIND: tl.constexpr, acc, words, ch, h, x_ptr, x_cols, kt, pid_m, m_ok, s_rows,
               z_rows, c_rows, n_ok, codes, magic, E: tl.constexpr, BS: tl.constexpr,
               EVEN_N: tl.constexpr, EVEN_M: tl.constexpr, D0: tl.constexpr, D1: tl.constexpr,
               SHFL: tl.constexpr, TMA_X: tl.constexpr, VEC: tl.constexpr, PREC: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    """acc += planes 4h .. 4h + 3 of the chunk ch's words [BN, 32] (h = 0 where a chunk has 4
    planes) times x at K = ch * E + 128 h + [0, 128), one dot of K = 128."""
    k0 = ch * E + 128 * h
    if TMA_X:       # x_ptr is a host TensorDescriptor of x [M, K], blocks [BM, 128]
        xt = tl.trans(x_ptr.load([pid_m * BLOCK_M, k0]))
    else:
        k = k0 + kt
        if EVEN_M:
            xt = tl.load(x_cols + k[:, None])
        else:
            xt = tl.load(x_cols + k[:, None], mask=m_ok[None, :], other=0.0)
    if E == 256:
        hw = words >> (16 * h)
    else:
        hw = words
    PRE: tl.constexpr = VEC and KIND != 5
    if PRE:
        p0, p1, p2, p3 = _step_scales(KIND, s_rows, ch, h, n_ok, E, BS, EVEN_N)
    else:
        p0 = 0
        p1 = 0
        p2 = 0
        p3 = 0
    w0 = _plane_here(KIND, words, hw, 0, h, ch, s_rows, z_rows, c_rows, n_ok, codes, magic,
                     E, BS, EVEN_N, D0[0], D1[0], SHFL, p0, PRE).to(xt.dtype)
    w1 = _plane_here(KIND, words, hw, 1, h, ch, s_rows, z_rows, c_rows, n_ok, codes, magic,
                     E, BS, EVEN_N, D0[1], D1[1], SHFL, p1, PRE).to(xt.dtype)
    w2 = _plane_here(KIND, words, hw, 2, h, ch, s_rows, z_rows, c_rows, n_ok, codes, magic,
                     E, BS, EVEN_N, D0[2], D1[2], SHFL, p2, PRE).to(xt.dtype)
    w3 = _plane_here(KIND, words, hw, 3, h, ch, s_rows, z_rows, c_rows, n_ok, codes, magic,
                     E, BS, EVEN_N, D0[3], D1[3], SHFL, p3, PRE).to(xt.dtype)
    wj = tl.join(tl.join(w0, w1), tl.join(w2, w3))              # [BN, 32, 2, 2]: plane 2hh + i
    wj = tl.reshape(tl.permute(wj, (0, 3, 2, 1)), (BLOCK_N, 128))        # K order
    return tl.dot(wj, xt, acc, input_precision=PREC)


@triton.jit
def _packed_gemm_kernel(x_ptr, q_ptr, s_ptr, z_ptr, c_ptr, out_ptr, M, N, kw, s_row, c_row,
                        stride_x, stride_o, magic, STEPS: tl.constexpr, KIND: tl.constexpr,
                        E: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_M: tl.constexpr, STAGES: tl.constexpr, ATOMIC: tl.constexpr,
                        EVEN_N: tl.constexpr, EVEN_M: tl.constexpr, PREC: tl.constexpr,
                        D0: tl.constexpr = (0, 0, 0, 0), D1: tl.constexpr = (0, 0, 0, 0),
                        SHFL: tl.constexpr = False, TMA_X: tl.constexpr = False,
                        VEC: tl.constexpr = False):
    """out[M, N] (+)= x[M, K] @ W.T over steps [pid_s * STEPS, ...) of 128 elements of K, for
    W's rows [pid_n * BLOCK_N, ...) and x's rows [pid_m * BLOCK_M, ...). s_ptr: the pairs
    (Q4_0 / AWQ / Q4_K, int64 [N, K / 32]) or the scales; c_ptr: NF4's code table or Q6_K's d
    [N, K / 256] (row stride c_row). D0 / D1: per-plane exponents of `_pair_here`. TMA_X:
    x_ptr is a host tensor descriptor of x. VEC: a step's four scales in one load."""
    HALVES: tl.constexpr = E // 128
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n_ok = (offs_n < N)[:, None]
    m_ok = offs_m < M
    rows = offs_n.to(tl.int64)[:, None]
    q_rows = q_ptr + rows * kw
    s_rows = s_ptr + rows * s_row
    z_rows = z_ptr + rows * s_row
    if KIND == 5:
        c_rows = c_ptr + rows * c_row
    else:
        c_rows = c_ptr
    t = tl.arange(0, 32)[None, :]
    kt = tl.arange(0, 128)
    if TMA_X:
        x_cols = 0
    else:
        x_cols = x_ptr + offs_m.to(tl.int64)[None, :] * stride_x            # [1, BM]
    if KIND == 1 and SHFL:
        codes = _lane_codes(c_ptr, tl.zeros((BLOCK_N, 32), tl.int32))
    else:
        codes = 0
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for i in tl.range(STEPS, num_stages=STAGES):
        step = pid_s * STEPS + i
        ch = step // HALVES
        if EVEN_N:
            words = tl.load(q_rows + ch * 32 + t)
        else:
            words = tl.load(q_rows + ch * 32 + t, mask=n_ok, other=0)
        acc = _half_step(KIND, acc, words, ch, step % HALVES, x_ptr, x_cols, kt, pid_m, m_ok,
                         s_rows, z_rows, c_rows, n_ok, codes, magic, E, BS, EVEN_N, EVEN_M, D0,
                         D1, SHFL, TMA_X, VEC, PREC, BLOCK_N, BLOCK_M)
    o_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_o + offs_n[:, None]
    _store_tile(acc, out_ptr, o_ptrs, n_ok & m_ok[None, :], ATOMIC, not (EVEN_N and EVEN_M))


@triton.jit
def _tma_half(KIND: tl.constexpr, acc, words, prs, h, x_blk, magic, D0: tl.constexpr,
              D1: tl.constexpr):
    """acc [BN, BM] += planes 4h .. 4h + 3 of words [BN, 32] (pairs prs [BN, 4]) times the x
    block x_blk [BM, 128] (transposed in shared memory for the dot)."""
    BLOCK_N: tl.constexpr = words.shape[0]
    xt = tl.trans(x_blk)                                                  # [128, BM]
    hw = words >> (16 * h)
    pa, pb = tl.split(tl.reshape(prs, (BLOCK_N, 2, 2)))                  # planes 0, 2 / 1, 3
    p0, p2 = tl.split(pa)
    p1, p3 = tl.split(pb)
    w0 = _affine_word_plane(KIND, hw, 0, h, p0[:, None], magic, D0[0], D1[0]).to(xt.dtype)
    w1 = _affine_word_plane(KIND, hw, 1, h, p1[:, None], magic, D0[1], D1[1]).to(xt.dtype)
    w2 = _affine_word_plane(KIND, hw, 2, h, p2[:, None], magic, D0[2], D1[2]).to(xt.dtype)
    w3 = _affine_word_plane(KIND, hw, 3, h, p3[:, None], magic, D0[3], D1[3]).to(xt.dtype)
    wj = tl.join(tl.join(w0, w1), tl.join(w2, w3))
    wj = tl.reshape(tl.permute(wj, (0, 3, 2, 1)), (BLOCK_N, 128))
    return tl.dot(wj, xt, acc)


@triton.jit
def _packed_gemm_tma_kernel(xd, qd, sd, out_ptr, M, N, stride_o, magic, STEPS: tl.constexpr,
                            KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                            STAGES: tl.constexpr, ATOMIC: tl.constexpr, D0: tl.constexpr,
                            D1: tl.constexpr):
    """The affine formats (Q4_0 / AWQ / Q4_K) with every load a TMA copy (host descriptors:
    xd of x [M, K] in blocks [BM, 128], qd of the codes [N, K / 8] in [BN, 32], sd of the
    pairs [N, K / 32] in [BN, 4]): no per-thread addresses, no copies through registers.
    Grid (weight tiles, x tiles, split); whole tiles and steps."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_s = tl.program_id(2)
    n0 = pid_n * BLOCK_N
    m0 = pid_m * BLOCK_M
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for i in tl.range(STEPS, num_stages=STAGES):
        step = pid_s * STEPS + i
        ch = step // 2
        words = qd.load([n0, ch * 32])                                   # [BN, 32]
        prs = sd.load([n0, ch * 8 + 4 * (step % 2)])                      # [BN, 4] int64
        acc = _tma_half(KIND, acc, words, prs, step % 2, xd.load([m0, step * 128]), magic, D0,
                        D1)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    o_ptrs = out_ptr + offs_m.to(tl.int64)[None, :] * stride_o + offs_n[:, None]
    _store_tile(acc, out_ptr, o_ptrs, None, ATOMIC, False)


# ---- launch ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class PackedGemmConfig:
    """block_n weight rows x block_m rows of x a program (acc [block_n, block_m] float32),
    `split` programs along K (0: only when the tiles are under half the SMs; partial tiles
    added by float32 atomics), warps, pipeline stages of the loads; tma: 1 = the x tiles by
    TMA, 2 = every load by TMA (`_packed_gemm_tma_kernel`: the affine formats on whole tiles;
    others take 1); vec: a step's four scales (pairs) in one load rather than one a plane."""
    block_n: int = 128
    block_m: int = 128
    split: int = 0
    num_warps: int = 8
    num_stages: int = 3
    tma: int = 0
    vec: int = 0

    def tag(self) -> str:
        return (f"packed_gemm[n{self.block_n},m{self.block_m},s{self.split},"
                f"w{self.num_warps},st{self.num_stages}" + (f",tma{self.tma}" if self.tma else "")
                + (",vec" if self.vec else "") + "]")


def run_packed_gemm(fmt: int, x, w0, w1, w2, i0: int, k: int, n: int,
                    config: PackedGemmConfig | None = None):
    """x [..., K] @ W.T through the packed copy of the weight (arguments as `quant.run`;
    NF4's w2 is the code table). Returns [..., N] in x's dtype, or None where the affine pairs
    cannot be made now (the caller falls back)."""
    cfg = config or PackedGemmConfig()
    pw = packed_weight(fmt, w0, w1, w2, i0, k, n)
    aff = fmt in AFFINE_FORMATS
    if aff and not affine_ready(pw):
        return None
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    e = CHUNK[fmt]
    total = k // 128                    # steps of 128 elements
    n_tiles, m_tiles = _cdiv(n, cfg.block_n), _cdiv(m, cfg.block_m)
    split = cfg.split
    if split <= 0:
        tiles = n_tiles * m_tiles
        sms = num_sms(x.device)
        split = 1 if tiles >= sms // 2 else max(1, min(total, sms // tiles))
    steps = _cdiv(total, split)
    split = _cdiv(total, steps)
    if split * steps != total:          # whole steps only: no K masks in the kernel
        split, steps = 1, total
    atomic = split > 1
    out = torch.zeros(m, n, dtype=torch.float32, device=x.device) if atomic else \
        torch.empty(m, n, dtype=x.dtype, device=x.device)
    opts = dict(STEPS=steps, KIND=_KIND[fmt], BLOCK_N=cfg.block_n, BLOCK_M=cfg.block_m,
                STAGES=cfg.num_stages, ATOMIC=atomic, num_warps=cfg.num_warps,
                num_stages=cfg.num_stages)
    if aff:
        scales, s_row = affine_pairs(pw), k // 32
        opts.update(D0=_DELTA[_KIND[fmt]][:4], D1=_DELTA[_KIND[fmt]][4:])
    else:
        scales, s_row = pw.scales, pw.scales.shape[1]
    tma_ok = x2.data_ptr() % 16 == 0        # (TMA: 16-byte aligned bases)
    grid = (n_tiles, m_tiles, split)
    if cfg.tma >= 2 and aff and tma_ok and n % cfg.block_n == 0 and m % cfg.block_m == 0:
        _packed_gemm_tma_kernel[grid](
            TensorDescriptor.from_tensor(x2, [cfg.block_m, 128]),
            TensorDescriptor.from_tensor(pw.codes, [cfg.block_n, 32]),
            TensorDescriptor.from_tensor(scales, [cfg.block_n, 4]), out, m, n, out.stride(0),
            MAGIC_BITS, **opts)
        return out.to(x.dtype).reshape(*x.shape[:-1], n)
    tma = cfg.tma >= 1 and tma_ok
    z = pw.zeros if pw.zeros is not None else scales
    table = pw.table if fmt == Q6_K else w2 if fmt == NF4 else scales
    _packed_gemm_kernel[grid](
        TensorDescriptor.from_tensor(x2, [cfg.block_m, 128]) if tma else x2, pw.codes, scales,
        z, table, out, m, n, pw.codes.shape[1], s_row, pw.table.shape[1] if fmt == Q6_K else 0,
        x2.stride(0), out.stride(0), MAGIC_BITS, E=e, BS=32 if aff else pw.group,
        EVEN_N=n % cfg.block_n == 0, EVEN_M=m % cfg.block_m == 0,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", SHFL=fmt == NF4 and not INTERPRET,
        TMA_X=tma, VEC=bool(cfg.vec), **opts)
    return out.to(x.dtype).reshape(*x.shape[:-1], n)
