"""The in-register decodes of the Gluon wgmma GEMM (`quant_gluon_gemm`) and the loads of a
step's words and scales, one format each (KIND, `quant_gluon_pack._KIND`): the words and the
per-block pairs (a, b) of W = fma(v, a, b) become the [16 T, 64] A tile of one step, rounded
once to x's dtype (bit for bit the format's dequantizer, then rounded as the other GEMMs do;
the formulas: `quant_gluon_gemm`'s docstring).

Session 11 (H200, N = K = 8192, M = 256, bf16; sm_90 SASS of the main loop a step of two,
bench/sass_quant_gluon.py, register-A launches): Q4_0 / AWQ's bf16x2 decode (h2) 252 / 258
instructions against 324 / 314 (0.0572-0.0575 / 0.0588-0.0590 ms against 0.0575-0.0578 /
0.0601-0.0604); Q6_K's code at bit 16 (no FADD) 289 against 353 (0.0642-0.0658 against
0.0656-0.0671). Lost: NF4's codes by PRMT from register tables instead of shuffles (46
instructions a word; shared A buffer: all words 0.0808, half 0.0697, against 0.0691), the
float decodes' scales by broadcast loads (see `_smem_step`)."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

@gluon.jit
def _load_step(q_ptr, a_ptr, b_ptr, tile_q, tile_s, kk, q_off, s_off, WORDS: gl.constexpr,
               PAIRS: gl.constexpr, HAS_B: gl.constexpr, rot=0, steps=1,
               ROT: gl.constexpr = False):
    """Step kk's words [T * 32 * WORDS] and pairs' a, b [T * 32 * PAIRS] (flat, blocked: a
    thread's WORDS words / PAIRS values contiguous); without b (NF4, Q6_K) b = a. ROT: step
    kk of this program is step (kk + rot) % steps of K (look-ahead past the end wraps)."""
    if ROT:
        kk = (kk + rot) % steps
    w = gl.load(q_ptr + (tile_q + kk * (32 * WORDS)) + q_off)
    a = gl.load(a_ptr + (tile_s + kk * (8 * PAIRS)) + s_off)
    if HAS_B:
        b = gl.load(b_ptr + (tile_s + kk * (8 * PAIRS)) + s_off)
    else:
        b = a
    return w, a, b


@gluon.jit
def _plane(KIND: gl.constexpr, w, j: gl.constexpr, a, b, magic):
    """Plane j of the words w (float32, w's shape). 4-bit: nibble j at bit SH = 12 (j even) or
    16 (j odd) of a view of the word (one shift a nibble pair), masked and OR-ed into 2^23 by
    one LOP3 (magic 2^23's bits in a register), then one FMA with the pair (a, b) of this SH
    (Q4_K: minus 2^23 first). Q8_0: byte j and 2^23 placed by one PRMT (v = 0x4B00qq00,
    SH = 8), then one FMA."""
    if KIND == 4:       # Q6_K: v = 0x4Bqq0000 (SH = 16; q + 32 < 64: bit 23 stays 0), then
        #                 fma(v, (d sc) 2^-16, -160 d sc) = (d sc) (q - 32) rounded once
        SEL16: gl.constexpr = 0x7044 + 256 * j
        f = gl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SEL16};", "=r,r,r", [w, magic],
                                      dtype=gl.int32, is_pure=True, pack=1)
        return gl.fma(f.to(gl.float32, bitcast=True), a, b)
    if KIND == 2:
        SEL: gl.constexpr = 0x7504 + 16 * j
        f = gl.inline_asm_elementwise(f"prmt.b32 $0, $1, $2, {SEL};", "=r,r,r", [w, magic],
                                      dtype=gl.int32, is_pure=True, pack=1)
        f = f.to(gl.float32, bitcast=True)
        return gl.fma(f, a, b)
    if KIND == 3:       # NF4: code[q] from lane q's register (low 5 bits: lanes l, l + 16
        #                 hold the same code), times absmax
        if j == 0:
            v = w
        else:
            v = w >> (4 * j)
        c = gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 31, 0xffffffff;",
                                      "=r,r,r", [b, v], dtype=gl.int32, is_pure=True, pack=1)
        return c.to(gl.float32, bitcast=True) * a
    D: gl.constexpr = 8 * (j // 2) - 12
    if D > 0:
        v = w >> D
    else:
        v = w << -D
    M: gl.constexpr = 0xF000 << (4 * (j % 2))
    f = gl.inline_asm_elementwise(f"lop3.b32 $0, $1, {M}, $2, 0xEA;", "=r,r,r", [v, magic],
                                  dtype=gl.int32, is_pure=True, pack=1)
    f = f.to(gl.float32, bitcast=True)
    if KIND == 1:
        f = f - 8388608.0
    return gl.fma(f, a, b)


@gluon.jit
def _pairs16(KIND: gl.constexpr, a, b):
    """The pair of SH = 16 from the pair of SH = 12 (exact): a 2^-4; Q4_0 / AWQ:
    b + s (2^11 - 2^7) = fma(a, 2^12 (2^11 - 2^7), b), the exact value o - s 2^7 (representable,
    `wgmma_pairs`), so the single rounding is exact; Q4_K's b has no SH in it."""
    a16 = a * 0.0625
    if KIND == 1:
        return a16, b
    return a16, gl.fma(a, 8388608.0 - 524288.0, b)


@gluon.constexpr_function
def _h2_asm(m, Z):
    """PTX of `_h2_pair` for pair m: $0 = fma(t, dh, dl t), t = ((w >> 4m) & 0x000F000F |
    128.0 x 2) + o (operands: $1 words, $2 (dh, dl) as bf16 halves, $3 (o, o) or, Z (Q4_0),
    o = -136 x 2, $4 magic; ptxas folds the half broadcasts into the HMUL2 / HFMA2 operands)."""
    o = "mov.b32 n, 0xC308C308; " if Z else "mov.b32 n, $3; "
    return ("{ .reg .b32 v, t, c, d, e, n; .reg .b16 l, h; shr.b32 v, $1, %d; "
            "lop3.b32 v, v, 983055, $4, 0xEA; mov.b32 {l, h}, $2; mov.b32 d, {l, l}; "
            "mov.b32 e, {h, h}; %sadd.rn.bf16x2 t, v, n; mul.rn.bf16x2 c, t, e; "
            "fma.rn.bf16x2 $0, t, d, c; }" % (4 * m, o))


@gluon.jit
def _h2_pair(w, m: gl.constexpr, s, o, magic, dtype: gl.constexpr, Z: gl.constexpr):
    """Nibbles m and m + 4 of the words w as a bf16 pair [..., 2] (`h2_scales`: s the words
    (dh, dl), o (o, o) or, Z, o = -136): one LOP3 (the nibbles OR-ed into 128.0's mantissa:
    128 + q), t = v + o = q - z (o = -(128 + z)), then fma(t, dh, dl t); magic =
    0x43004300."""
    r = gl.inline_asm_elementwise(_h2_asm(m, Z), "=r,r,r,r,r", [w, s, o, magic], dtype=gl.int32,
                                  is_pure=True, pack=1)
    lo, hi = gl.inline_asm_elementwise("mov.b32 {$0, $1}, $2;", "=h,=h,r", [r],
                                       dtype=(gl.bfloat16, gl.bfloat16), is_pure=True, pack=1)
    return gl.join(lo, hi)


#: Q4_0 / Q8_0 (BFA): b = a B_OVER_A exactly (b = -d (8 + 2^11), a = d 2^-12; b = -d (128 + 2^15),
#: a = d 2^-8: both -(2^23 + 2^15) a, 20 significant bits), so b is not stored
B_OVER_A = -(2.0 ** 23 + 2.0 ** 15)


@gluon.jit
def _decode(KIND: gl.constexpr, w, a, b, magic, dtype: gl.constexpr, T: gl.constexpr,
            a_layout: gl.constexpr, BFA: gl.constexpr = False):
    """The [16 T, 64] weight tile (dtype, a_layout) of one step from the thread's words w
    (flat [T * 32 * WORDS]) and pairs a, b (flat [T * 32 * 4]; BFA: b = a B_OVER_A): planes
    decoded in float32, joined, permuted to K order and rounded to dtype in the fragment's
    registers."""
    if KIND == 5:       # Q4_0 / AWQ, bf16 x: bf16x2 pairs (nibbles m, m + 4) from the word;
        #                 a: the words (dh, dl), b: (o, o) (BFA: Q4_0, o a constant)
        w5 = gl.reshape(w, [T, 8, 4, 2, 2])                    # t r p h u
        s5 = gl.convert_layout(gl.reshape(a.to(gl.int32, bitcast=True), [T, 8, 4, 2, 2]),
                               w5.type.layout)
        o5 = gl.convert_layout(gl.reshape(b.to(gl.int32, bitcast=True), [T, 8, 4, 2, 2]),
                               w5.type.layout)
        q0 = _h2_pair(w5, 0, s5, o5, magic, dtype, BFA)
        q1 = _h2_pair(w5, 1, s5, o5, magic, dtype, BFA)
        q2 = _h2_pair(w5, 2, s5, o5, magic, dtype, BFA)
        q3 = _h2_pair(w5, 3, s5, o5, magic, dtype, BFA)
        v = gl.join(gl.join(q0, q1), gl.join(q2, q3))     # t r p h u e s c (pair m = 2c + s)
        v = gl.permute(v, [0, 3, 1, 4, 6, 7, 2, 5])            # t h r | u s c p e
        return gl.convert_layout(gl.reshape(v, [16 * T, 64]), a_layout)
    if KIND == 2 or KIND == 4:
        w6 = gl.reshape(w, [T, 8, 4, 2, 2, 2])                 # t r p h u s
        if KIND == 4:       # a scale per (u, s), no b
            a6 = gl.convert_layout(gl.reshape(a, [T, 8, 4, 2, 2, 2]), w6.type.layout)
            b6 = a6 * -10485760.0   # -160 d sc (a = d sc 2^-16; exact)
        else:
            a6 = gl.convert_layout(gl.reshape(gl.join(a, a), [T, 8, 4, 2, 2, 2]),
                                   w6.type.layout)
            if BFA:
                b6 = a6 * -8421376.0
            else:
                b6 = gl.convert_layout(gl.reshape(gl.join(b, b), [T, 8, 4, 2, 2, 2]),
                                       w6.type.layout)
        p0 = _plane(KIND, w6, 0, a6, b6, magic)
        p1 = _plane(KIND, w6, 1, a6, b6, magic)
        p2 = _plane(KIND, w6, 2, a6, b6, magic)
        p3 = _plane(KIND, w6, 3, a6, b6, magic)
        v = gl.join(gl.join(p0, p1), gl.join(p2, p3))     # t r p h u s c e (byte 2e + c)
    else:
        w5 = gl.reshape(w, [T, 8, 4, 2, 2])                    # t r p h u
        a5 = gl.convert_layout(gl.reshape(a, [T, 8, 4, 2, 2]), w5.type.layout)
        if KIND == 3:       # NF4: b the lanes' codes (already in w's layout), no SH
            b5 = gl.convert_layout(gl.reshape(b, [T, 8, 4, 2, 2]), w5.type.layout)
            c5 = a5
            d5 = b5
        else:
            if BFA:
                b5 = a5 * -8421376.0
            else:
                b5 = gl.convert_layout(gl.reshape(b, [T, 8, 4, 2, 2]), w5.type.layout)
            c5, d5 = _pairs16(KIND, a5, b5)
        p0 = _plane(KIND, w5, 0, a5, b5, magic)
        p1 = _plane(KIND, w5, 1, c5, d5, magic)
        p2 = _plane(KIND, w5, 2, a5, b5, magic)
        p3 = _plane(KIND, w5, 3, c5, d5, magic)
        p4 = _plane(KIND, w5, 4, a5, b5, magic)
        p5 = _plane(KIND, w5, 5, c5, d5, magic)
        p6 = _plane(KIND, w5, 6, a5, b5, magic)
        p7 = _plane(KIND, w5, 7, c5, d5, magic)
        v = gl.join(gl.join(gl.join(p0, p1), gl.join(p2, p3)),
                    gl.join(gl.join(p4, p5), gl.join(p6, p7)))  # t r p h u s c e (4e + 2c + s)
    v = gl.permute(v, [0, 3, 1, 4, 5, 6, 2, 7])                # t h r | u s c p e
    return gl.convert_layout(gl.reshape(v, [16 * T, 64]), a_layout).to(dtype)


@gluon.jit
def _smem_pairs(buf, src, T: gl.constexpr, PAIRS: gl.constexpr, s_layout: gl.constexpr):
    """A step's scales [T, 8 PAIRS] (shared memory, WTMA) -> flat [T * 32 * PAIRS] in
    s_layout (lane l: its row group's PAIRS values, shared by the 4 lanes of the group): each
    lane reads PAIRS / 4 of them, then a shuffle a value (src: the lane holding it)."""
    Q: gl.constexpr = PAIRS // 4
    v = buf.load(gl.BlockedLayout([1, Q], [1, 32], [T, 1], [1, 0])).to(gl.int32, bitcast=True)
    v = gl.reshape(v, [T, 32, Q])
    v = gl.join(v, v)
    v = gl.permute(gl.join(v, v), [0, 1, 3, 4, 2])            # t l | c c q: each value 4 times
    v = gl.convert_layout(gl.reshape(v, [T * 32 * PAIRS]), s_layout)
    r = gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 31, 0xffffffff;", "=r,r,r",
                                  [v, src], dtype=gl.int32, is_pure=True, pack=1)
    return r.to(gl.float32, bitcast=True)


@gluon.constexpr_function
def _group_layout(T, PAIRS):
    """[T, 8 r, 4 p, PAIRS]: lane 4 r + p of warp t holds the PAIRS values of its row group r
    (its registers), whatever p."""
    bits = lambda n, dim, rank: [[1 << i if d == dim else 0 for d in range(rank)]  # noqa: E731
                                 for i in range(n.bit_length() - 1)]
    return gl.DistributedLinearLayout(bits(PAIRS, 3, 4), bits(4, 2, 4) + bits(8, 1, 4),
                                      bits(T, 0, 4), [], [T, 8, 4, PAIRS])


@gluon.jit
def _smem_pairs_bc(buf, T: gl.constexpr, PAIRS: gl.constexpr, s_layout: gl.constexpr):
    """`_smem_pairs` by broadcast loads: each lane reads its row group's PAIRS contiguous
    values itself (one 16- or 32-byte load, the 4 lanes of a group the same address): no
    shuffle."""
    L4: gl.constexpr = _group_layout(T, PAIRS)
    v = buf.reshape([T, 8, PAIRS]).load(gl.SliceLayout(2, L4))
    v = gl.broadcast(gl.expand_dims(v, 2), gl.full([T, 8, 4, PAIRS], 0.0, gl.float32, L4))[0]
    return gl.convert_layout(gl.reshape(v, [T * 32 * PAIRS]), s_layout)


@gluon.jit
def _smem_step(wt, sn, src, T: gl.constexpr, WORDS: gl.constexpr, PAIRS: gl.constexpr,
               w_layout: gl.constexpr, s_layout: gl.constexpr, WTMA: gl.constexpr,
               BC: gl.constexpr = False):
    """Step's words (flat, w_layout) and pairs a, b (s_layout; WTMA 1, no b: b = a) from ring
    buffer sn, in the registers `_load_step` gives. BC: the pairs by broadcast loads (the
    h2 decode's: with it H200 M = 256 register A Q4_0 0.0572-0.0575 ms, AWQ 0.0588-0.0590,
    against 0.0575-0.0578 / 0.0601-0.0604; the float decodes lost with them: Q4_0 0.0583-0.0586,
    AWQ 0.0605-0.0608; Q4_K 0.0620-0.0629 / NF4 0.0629-0.0632 against 0.0625-0.0633 /
    0.0632-0.0656, no gain)."""
    q_desc, a_desc, b_desc, q_ring, sa_ring, sb_ring = wt
    HAS_B: gl.constexpr = WTMA == 2
    w = q_ring.index(sn).load(gl.BlockedLayout([1, WORDS], [1, 32], [T, 1], [1, 0]))
    w = gl.convert_layout(gl.reshape(w, [T * 32 * WORDS]), w_layout)
    if BC:
        a = _smem_pairs_bc(sa_ring.index(sn), T, PAIRS, s_layout)
        if HAS_B:
            b = _smem_pairs_bc(sb_ring.index(sn), T, PAIRS, s_layout)
        else:
            b = a
    else:
        a = _smem_pairs(sa_ring.index(sn), src, T, PAIRS, s_layout)
        if HAS_B:
            b = _smem_pairs(sb_ring.index(sn), src, T, PAIRS, s_layout)
        else:
            b = a
    return w, a, b
