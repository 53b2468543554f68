"""Few-row quantized matmul (`out = x @ W.T`, x [M, K] bf16 with M <= 16, W [N, K]; Q4_0,
Q8_0, Q4_K, Q6_K, AWQ, NF4) on the tensor cores through `mma.sync.m16n8k16` written as inline PTX,
on a copy of the weight repacked once into the mma's own register order (cached with the
weight like `quant_packed`'s copy). The default route for one row of bf16 x of these formats
and for 1..16 rows of Q6_K (`MMA_DEFAULT_ROWS`; H200 numbers at `DEFAULT_MMA`).

Why: the CUDA-core GEMV of `quant_packed` spends ~4 SASS instructions a weight (unpack, scale,
multiply-add; sm_90) and is issue-bound next to the weight stream. Here a 16 x 16 weight tile is
the mma's A operand with x as B (its 8 columns are x's rows, clamped to the last one; a second
mma for rows 8..15), so one instruction multiplies 256 weights and a weight costs its
unpacking: a nibble pair into a bf16x2 register by one LOP3 (the nibble ORed into the mantissa
of 128.0) and one bf16x2 FMA to an exact small integer (Q4_0 q - 8), about 1.4 instructions a
weight. The products are exact and summed in float32 by the tensor core over a 32-element
block; the block's scale then multiplies the block's sum in float32 (one FFMA an output and
block). Per format (`_ptx`): Q4_0 d (q - 8); Q4_K and AWQ a q + b a block (A = 128 + q, the x
sums of the block by one more mma with an all-ones A, out += a C + (b - 128 a) C1); Q8_0 and
Q6_K as two 4-bit planes (q + offset = 16 hi + lo: A = lo and 16 hi - offset into one sum;
Q6_K's high plane 2-bit crumbs, 0.82 bytes a weight as the format, its 16-element scales one
mma step each). x is read as bf16 where it lies (no conversion kernel) and the output is
written by the program that owns the rows (no split-K atomics, no zeroed float32 buffer): one
launch a call. Results are the format's dequantized weights times x with float32 sums, not
bit-identical to the CUDA-core kernels' (the dequantization itself stays tested bit-exact
there).

Register order (`quant_mma_pack.pack_mma`): rows in tiles of 16, K in chunks of 64 (two
32-element blocks). Lane l of a warp (r = l // 4, p = l % 4) holds, per chunk and plane, four
int32 words (one 16-byte load, the warp's 512 bytes contiguous): entry e = 2 g + h is row r + 8 h
of block g,
elements 8 p .. 8 p + 7 of the block (Q6_K: 4 p .. 4 p + 3 and 16 + 4 p .., one half block an
mma step), element 2 m in bits 4 m and 2 m + 1 in bits 16 + 4 m (so (word >> 4 m) & 0x000F000F
is the bf16x2 pair the mma wants). In mma step s of block g the lane's A registers are pairs
2 s, 2 s + 1 of entries (2 g, 2 g + 1) and its B registers x[8 p + 4 s .. + 3] of that block:
the mma's k-slots (2 p, 2 p + 1, 2 p + 8, 2 p + 9) are the elements 8 p + 4 s + (0, 1, 2, 3),
one 16-byte x load a block. Scale fields: `MmaWeight`, read by `_scale_loads`.

The layout of every tensor here is [threads, U, 4] (the thread index i = 32 warp + lane, U
chunks a step in a thread, 4 registers), loaded with 16-byte vectors: Triton lays that out as
sizePerThread [1, 1, 4], threadsPerWarp [32, 1, 1], warpsPerCTA [warps, 1, 1], which is what the
PTX assumes of its operands (checked in the compiled TTGIR by bench/sass_quant_mma.py; the
register order against the PTX ISA's fragment layout by the CPU emulation in the tests). Runs
on sm_80+ GPUs only (no interpreter: the PTX is warp-collective). NF4's codes by register table
lookups or, by default, by loads from a byte table in shared memory (`MmaConfig.lut`):
`quant_mma_nf4`; one row of Q4_K / AWQ with a lane scaling one block: `quant_mma_diag`."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import quant_mma_nf4 as nf4
from .quant_mma_diag import ptx_diag
from .quant_mma_pack import MmaWeight, pack_mma
from .quant_tiles import AWQ, NF4, Q4_0, Q4_K, Q6_K, Q8_0

#: Triton's CPU interpreter runs no inline PTX: the other routes serve there
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
MMA_FORMATS = frozenset({Q4_0, AWQ, Q4_K, Q8_0, Q6_K, NF4})
CHUNK_K = 64        # elements of a row a chunk (two 32-element blocks)
TILE_N = 16         # rows a tile (the mma's M)
_MMA = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
#: PTX mode per format: "q4" A = q - 8, out += d C a block; "aff" A = q, out += a C + b C1 (C1:
#: the x sums by an all-ones A); "q8" / "q6": two planes, A = lo and 16 hi - 128 (- 32), both
#: into C, out += d C a block (Q8_0) or out += (d sc) C a half block (Q6_K: a mma step each);
#: "nf4": A = bf16(code) by table lookups (`quant_mma_nf4`), out += absmax C a chunk
MODE = {Q4_0: "q4", AWQ: "aff", Q4_K: "aff", Q8_0: "q8", Q6_K: "q6", NF4: "nf4"}
#: bf16x2 constants: -136 (128 + q - 136 = q - 8), -128, 16, -2176 (16 (128 + h) - 2048 - 128),
#: -2080 (- 2048 - 32)
_NEG = {"q4": "0xC308C308", "aff": "0xC300C300", "q8": "0xC300C300", "q6": "0xC300C300",
        "nf4": "0xC300C300"}
_NEG_HI = {"q8": "0xC508C508", "q6": "0xC502C502"}


def _ptx(mode: str, units: int, nt: int, one_row: bool = False, lut: bool = False) -> str:
    """PTX of `units` chunks for one thread, for nt 8-column tiles of x (rows 0..7, 8..15).
    Operands, P = 4 units registers each, in this order: the new sums (nt outputs), the old
    sums (nt), the words (q8 / q6: the low plane, then the high plane), x of block 0 and block
    1 per x tile (2 nt), the scales a (float32), then (aff: the offsets b; q6: the second half
    blocks' scales). Modes: MODE (aff: A = 128 + q as unpacked, the caller passes b - 128 a:
    the products stay exact, and the cancellation against 128 a C1 costs ~4 of float32's 24
    bits, against one bf16x2 FMA a pair saved). lut (nf4): the codes by loads from the shared
    byte table (`quant_mma_nf4.lut_ptx`; sb's first register: the thread's table address)."""
    p = 4 * units
    planes = 2 if mode in ("q8", "q6") else 1
    names = ([f"out{t}" for t in range(nt)] + [f"acc{t}" for t in range(nt)]
             + [f"w{i}" for i in range(planes)]
             + [f"x{t}{g}" for t in range(nt) for g in range(2)] + ["sa"]
             + (["sb"] if mode in ("aff", "q6", "nf4") else []))
    base = {name: i * p for i, name in enumerate(names)}

    def op(name, u, j):
        return f"${base[name] + 4 * u + j}"
    lines = ["{", ".reg .b32 %fq<32>, %ft, %fone, %fneg, %fsix, %fneh;",
             ".reg .f32 %fc<8>, %fd<8>, %fz;",
             "mov.b32 %fone, 0x3F803F80;",       # bf16x2 (1, 1)
             f"mov.b32 %fneg, {_NEG[mode]};",
             "mov.f32 %fz, 0f00000000;"]
    if planes == 2:
        lines += ["mov.b32 %fsix, 0x41804180;", f"mov.b32 %fneh, {_NEG_HI[mode]};"]
    if mode == "nf4":       # the lookup tables: operand sb's 8 registers (units >= 2)
        lines.append(nf4.DECLARE)
        tab = [op("sb", i // 4, i % 4) for i in range(8)]
    # one row of x: columns 2 p + 1 repeat column 2 p (x rows clamp to the last), and only
    # column 0 is stored, so c1 and c3 are left unscaled
    js = (0, 2) if one_row else range(4)
    ones = "{%fone, %fone, %fone, %fone}"
    zero = "%fz, %fz, %fz, %fz"
    for u in range(units):
        for pl in range(planes):
            for e in range(4):
                w = op(f"w{pl}", u, e)
                q0 = 16 * pl + 4 * e
                if pl == 1 and mode == "q6":    # 2-bit crumbs of a chunk pair (unit u % 2)
                    for m in range(4):
                        sh = 2 * (4 * (u % 2) + m)
                        src = w
                        if sh:
                            lines.append(f"shr.u32 %ft, {w}, {sh};")
                            src = "%ft"
                        lines.append(f"lop3.b32 %fq{q0 + m}, {src}, 0x00030003, 0x43004300, "
                                     "0xEA;")
                    continue
                if mode == "nf4":
                    dests = [f"%fq{q0 + m}" for m in range(4)]
                    lines += (nf4.lut_ptx(w, dests, tab[0]) if lut
                              else nf4.unpack_ptx(w, dests, tab))
                    continue
                lines.append(f"lop3.b32 %fq{q0}, {w}, 0x000F000F, 0x43004300, 0xEA;")
                for m in range(1, 4):
                    lines.append(f"shr.u32 %ft, {w}, {4 * m};")
                    lines.append(f"lop3.b32 %fq{q0 + m}, %ft, 0x000F000F, 0x43004300, 0xEA;")
            for i in range(16):
                if pl == 0:
                    if mode not in ("aff", "nf4"):  # aff: A = 128 + q (b - 128 a takes it)
                        lines.append(f"fma.rn.bf16x2 %fq{i}, %fq{i}, %fone, %fneg;")
                else:
                    lines.append(f"fma.rn.bf16x2 %fq{16 + i}, %fq{16 + i}, %fsix, %fneh;")
        for g in range(2):
            for t in range(nt):
                c = ", ".join(f"%fc{4 * t + j}" for j in range(4))
                c1 = ", ".join(f"%fd{4 * t + j}" for j in range(4))
                for s in range(2):
                    b = f"{{{op(f'x{t}{g}', u, 2 * s)}, {op(f'x{t}{g}', u, 2 * s + 1)}}}"
                    first = s == 0 or mode == "q6"      # q6: each step scaled on its own
                    if mode == "nf4":                   # the chunk's 64 elements in one C
                        first = s == 0 and g == 0
                    for pl in range(planes):
                        o = 16 * pl
                        a = [f"%fq{o + 4 * (2 * g) + 2 * s}", f"%fq{o + 4 * (2 * g + 1) + 2 * s}",
                             f"%fq{o + 4 * (2 * g) + 2 * s + 1}",
                             f"%fq{o + 4 * (2 * g + 1) + 2 * s + 1}"]
                        lines.append(f"{_MMA} {{{c}}}, {{{', '.join(a)}}}, {b}, "
                                     f"{{{zero if first and pl == 0 else c}}};")
                    if mode == "aff":
                        lines.append(f"{_MMA} {{{c1}}}, {ones}, {b}, "
                                     f"{{{zero if s == 0 else c1}}};")
                    if mode == "q6":    # scale of half block s: sa (s = 0) / sb (s = 1)
                        for j in js:
                            e = 2 * g + j // 2
                            prev = op(f"acc{t}", u, j) if g == 0 and s == 0 else \
                                op(f"out{t}", u, j)
                            lines.append(f"fma.rn.f32 {op(f'out{t}', u, j)}, %fc{4 * t + j}, "
                                         f"{op('sa' if s == 0 else 'sb', u, e)}, {prev};")
                if mode == "q6" or (mode == "nf4" and g == 0):
                    continue
                for j in js:            # c0, c1: row r; c2, c3: row r + 8
                    if mode == "nf4":   # absmax of rows r, r + 8: entries 0, 1
                        lines.append(f"fma.rn.f32 {op(f'out{t}', u, j)}, %fc{4 * t + j}, "
                                     f"{op('sa', u, j // 2)}, {op(f'acc{t}', u, j)};")
                        continue
                    e = 2 * g + j // 2
                    prev = op(f"acc{t}", u, j) if g == 0 else op(f"out{t}", u, j)
                    dst = op(f"out{t}", u, j)
                    lines.append(f"fma.rn.f32 {dst}, %fc{4 * t + j}, {op('sa', u, e)}, {prev};")
                    if mode == "aff":
                        lines.append(f"fma.rn.f32 {dst}, %fd{4 * t + j}, {op('sb', u, e)}, "
                                     f"{dst};")
    lines.append("}")
    return "\n".join(lines)


@triton.jit
def _mma_units(acc0, acc1, words, words2, x00, x01, x10, x11, sa, sb, ASM: tl.constexpr,
               CONS: tl.constexpr, P: tl.constexpr, NT: tl.constexpr, PLANES: tl.constexpr,
               SB: tl.constexpr):
    """(acc0, acc1) += the chunks' products (`_ptx`); acc1 / x1. unused unless NT == 2,
    words2 unless PLANES == 2, sb unless SB."""
    if NT == 1:
        if PLANES == 2:
            if SB:
                acc0 = tl.inline_asm_elementwise(ASM, CONS, [acc0, words, words2, x00, x01, sa,
                                                             sb], dtype=tl.float32,
                                                 is_pure=True, pack=P)
            else:
                acc0 = tl.inline_asm_elementwise(ASM, CONS, [acc0, words, words2, x00, x01, sa],
                                                 dtype=tl.float32, is_pure=True, pack=P)
        elif SB:
            acc0 = tl.inline_asm_elementwise(ASM, CONS, [acc0, words, x00, x01, sa, sb],
                                             dtype=tl.float32, is_pure=True, pack=P)
        else:
            acc0 = tl.inline_asm_elementwise(ASM, CONS, [acc0, words, x00, x01, sa],
                                             dtype=tl.float32, is_pure=True, pack=P)
    else:
        if PLANES == 2:
            if SB:
                acc0, acc1 = tl.inline_asm_elementwise(
                    ASM, CONS, [acc0, acc1, words, words2, x00, x01, x10, x11, sa, sb],
                    dtype=(tl.float32, tl.float32), is_pure=True, pack=P)
            else:
                acc0, acc1 = tl.inline_asm_elementwise(
                    ASM, CONS, [acc0, acc1, words, words2, x00, x01, x10, x11, sa],
                    dtype=(tl.float32, tl.float32), is_pure=True, pack=P)
        elif SB:
            acc0, acc1 = tl.inline_asm_elementwise(
                ASM, CONS, [acc0, acc1, words, x00, x01, x10, x11, sa, sb],
                dtype=(tl.float32, tl.float32), is_pure=True, pack=P)
        else:
            acc0, acc1 = tl.inline_asm_elementwise(
                ASM, CONS, [acc0, acc1, words, x00, x01, x10, x11, sa],
                dtype=(tl.float32, tl.float32), is_pure=True, pack=P)
    return acc0, acc1


@triton.jit
def _scale_loads(FMT: tl.constexpr, s_ptr, z_ptr, t_ptr, tile, kch, ch, r, c,
                 GPC: tl.constexpr):
    """The raw scale fields of chunks ch, [NTH, U, 4] each (entry e = 2 g + h: row r + 8 h of
    block g; layouts: `pack_mma`), loaded a step ahead with the words: Q4_0 / Q8_0 d; Q4_K sc,
    m, d, dmin; Q6_K the two half blocks' sc, d; AWQ s, z."""
    if FMT == 0 or FMT == 4:    # Q4_0 / Q8_0: d f16 [tiles, chunks, 8, 4]
        f0 = tl.load(s_ptr + (tile * kch + ch) * 32 + r * 4 + c)
        f1 = f0
        f2 = f0
        f3 = f0
    elif FMT == 7:      # Q4_K: (sc, m) u8 [tiles, chunks, 8, 2, 4], (d, dmin) f16 [tiles,
        #                 chunks / 4, 8, (d_r, d_r8, dmin_r, dmin_r8)]
        sm = s_ptr + ((tile * kch + ch) * 8 + r) * 8 + c
        dd = t_ptr + ((tile * (kch // 4) + ch // 4) * 8 + r) * 4 + c % 2
        f0 = tl.load(sm)
        f1 = tl.load(sm + 4)
        f2 = tl.load(dd)
        f3 = tl.load(dd + 2)
    elif FMT == 9:      # Q6_K: sc i8 [tiles, chunks, 8, 2 (half), 4], d f16 [tiles,
        #                 chunks / 4, 8, 2]
        sm = s_ptr + ((tile * kch + ch) * 8 + r) * 8 + c
        f0 = tl.load(sm)
        f1 = tl.load(sm + 4)
        f2 = tl.load(t_ptr + (tile * (kch // 4) + ch // 4) * 16 + r * 2 + c % 2)
        f3 = f2
    elif FMT == 10:     # NF4: absmax f32 [tiles, blocks, 8, 2], GPC chunks a block
        f0 = tl.load(s_ptr + (tile * (kch // GPC) + ch // GPC) * 16 + r * 2 + c % 2)
        f1 = f0
        f2 = f0
        f3 = f0
    else:               # AWQ: s f16 and z u8 [tiles, groups, 8, 2], GPC chunks a group
        g = (tile * (kch // GPC) + ch // GPC) * 16 + r * 2 + c % 2
        f0 = tl.load(s_ptr + g)
        f1 = tl.load(z_ptr + g)
        f2 = f0
        f3 = f0
    return f0, f1, f2, f3


@triton.jit
def _scales(FMT: tl.constexpr, f0, f1, f2, f3):
    """The entries' float32 scale pairs from `_scale_loads`: Q4_0 / Q8_0 (d, -); AWQ
    (s, -z s - 128 s), Q4_K (d sc, -dmin m - 128 d sc) as gguf-py forms d sc and dmin m (the
    128: `_ptx`'s aff mode); Q6_K (d sc) of the two half blocks."""
    if FMT == 0 or FMT == 4 or FMT == 10:     # (NF4: absmax)
        a = f0.to(tl.float32)
        b = a
    elif FMT == 7:
        a = f2.to(tl.float32) * f0.to(tl.float32)
        b = -(f3.to(tl.float32) * f1.to(tl.float32)) - 128.0 * a
    elif FMT == 9:
        d = f2.to(tl.float32)
        a = d * f0.to(tl.float32)
        b = d * f1.to(tl.float32)
    else:
        a = f0.to(tl.float32)
        b = -(_byte_float(f1) * a) - 128.0 * a
    return a, b


@triton.jit
def _scale_words(FMT: tl.constexpr, s_ptr, z_ptr, t_ptr, tile, kch, ch, r, GPC: tl.constexpr,
                 first):
    """The byte-sized scale fields of Q4_K / Q6_K / AWQ as whole words [NTH, U, 1] (one
    register each to carry a step ahead; `_scales_from_words` takes them apart). Q4_K / Q6_K's
    super-block d (4 chunks) once a step from its first chunk `first` [NTH, 1, 1] (U <= 4,
    steps start at multiples of U)."""
    if FMT == 7:        # Q4_K: the four sc, the four m; (d_r, d_r8), (dmin_r, dmin_r8)
        sw = s_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + ((tile * kch + ch) * 8 + r) * 2
        dw = t_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + \
            ((tile * (kch // 4) + first // 4) * 8 + r) * 2
        w0 = tl.load(sw)
        w1 = tl.load(sw + 1)
        w2 = tl.load(dw)
        w3 = tl.load(dw + 1)
    elif FMT == 9:      # Q6_K: the four sc of half 0, of half 1; (d_r, d_r8)
        sw = s_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + ((tile * kch + ch) * 8 + r) * 2
        w0 = tl.load(sw)
        w1 = tl.load(sw + 1)
        w2 = tl.load(t_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
                     + (tile * (kch // 4) + first // 4) * 8 + r)
        w3 = w2
    else:               # AWQ: (s_r, s_r8), (z_r, z_r8)
        g = (tile * (kch // GPC) + ch // GPC) * 8 + r
        w0 = tl.load(s_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + g)
        w1 = tl.load(z_ptr.to(tl.pointer_type(tl.int16), bitcast=True) + g).to(tl.int32)
        w2 = w0
        w3 = w0
    return w0, w1, w2, w3


@triton.jit
def _half(w, h):
    """The f16 in half h (0 / 1, any shape) of the words w, as float32."""
    return ((w >> (16 * h)) & 0xFFFF).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _scales_from_words(FMT: tl.constexpr, w0, w1, w2, w3, c):
    """`_scales` of the words of `_scale_words` (entry c of [NTH, U, 4])."""
    h = c % 2
    if FMT == 7:
        a = _half(w2, h) * ((w0 >> (8 * c)) & 255).to(tl.float32)
        b = -(_half(w3, h) * ((w1 >> (8 * c)) & 255).to(tl.float32)) - 128.0 * a
    elif FMT == 9:      # int8 fields: shifted to the top, arithmetic shift back
        d = _half(w2, h)
        a = d * ((w0 << (24 - 8 * c)) >> 24).to(tl.float32)
        b = d * ((w1 << (24 - 8 * c)) >> 24).to(tl.float32)
    else:
        a = _half(w0, h)
        b = -(((w1 >> (8 * h)) & 255).to(tl.float32) * a) - 128.0 * a
    return a, b


@triton.jit
def _byte_float(v):
    """Bytes (uint8) as float32 through 2^23's mantissa (AWQ's zeros: fewer instructions than
    the conversion there; Q4_K's / Q6_K's scales convert with fewer the plain way)."""
    return (v.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _lo_offset(FMT: tl.constexpr, ch, WPC: tl.constexpr):
    """Offset (int32 words) of the low / only plane of chunks ch within a tile's words."""
    if FMT == 9:        # Q6_K: [chunk pairs, (lo 0, lo 1, crumbs), 32, 4]
        return (ch // 2) * 384 + (ch % 2) * 128
    else:
        return ch * WPC


@triton.jit
def _hi_offset(FMT: tl.constexpr, ch, WPC: tl.constexpr, first):
    """Offset of the high plane: Q8_0 after the low plane; Q6_K the crumbs of the chunk pair
    from `first` (even; [NTH, 1, 1]: one load serves both chunks of the pair)."""
    if FMT == 9:
        return (first // 2) * 384 + 256
    else:
        return ch * WPC + 128


@triton.jit
def _x_loads(x_base, x_base1, ch, NT: tl.constexpr, DIAG: tl.constexpr = False):
    """x of chunks ch as bf16 pairs [NTH, U, 4]: blocks 0 and 1 of x tile 0 (rows 0..7) and,
    with NT == 2, of x tile 1 (rows 8..15); DIAG: one load, the block of the chunk pair."""
    x00 = tl.load(x_base + ch * 32)
    if DIAG:
        x01 = x00
    else:
        x01 = tl.load(x_base + ch * 32 + 16)
    if NT == 2:
        x10 = tl.load(x_base1 + ch * 32)
        x11 = tl.load(x_base1 + ch * 32 + 16)
    else:
        x10 = x00
        x11 = x01
    return x00, x01, x10, x11


@triton.jit
def _mma_gemv_kernel(x_ptr, q_ptr, s_ptr, z_ptr, t_ptr, out_ptr, N, M, stride_x, stride_o, kch,
                     STEPS: tl.constexpr, S: tl.constexpr, U: tl.constexpr,
                     ASM: tl.constexpr, CONS: tl.constexpr, FMT: tl.constexpr, NT: tl.constexpr,
                     GPC: tl.constexpr = 1, AHEAD: tl.constexpr = 1,
                     XAHEAD: tl.constexpr = False, DIAG: tl.constexpr = False,
                     FILL: tl.constexpr = ""):
    """out[:M, tile] = x[:M] @ W.T for the 16-row tile of this program, its K split over S
    warps (STEPS steps of U chunks each), summed in the program. stride_x in int32 words
    (2 bf16), kch: chunks a row; NT: x tiles of 8 rows (M <= 8 NT). Thread i = 32 warp + lane
    of the [32 S, U, 4] tensors. DIAG: one row, lane p scales block p of a chunk pair
    (`quant_mma_diag`). FILL (NF4): the PTX filling the shared byte table
    (`quant_mma_nf4.fill_ptx`), run after the first loads."""
    pid = tl.program_id(0)
    NTH: tl.constexpr = S * 32
    PLANES: tl.constexpr = 2 if FMT == 4 or FMT == 9 else 1     # Q8_0, Q6_K
    SB: tl.constexpr = FMT == 7 or FMT == 9 or FMT == 11 or FMT == 10 or DIAG  # (NF4: tables)
    i = tl.arange(0, NTH)[:, None, None]
    lane = i % 32
    warp = i // 32
    # (as a tensor bounded by N: ptxas then keeps the loop in 62 registers, not 56 + a spill)
    tile = tl.minimum(pid + 0 * warp, N // 16 - 1).to(tl.int64)        # [NTH, 1, 1]
    part = warp
    r = lane // 4
    c = tl.arange(0, 4)[None, None, :]
    u = tl.arange(0, U)[None, :, None]
    if FMT == 9:    # Q6_K: x[4 p .. 4 p + 3] and x[16 + 4 p ..] of a block (a step each)
        xo = (lane % 4) * 2 + c % 2 + 8 * (c // 2)
    else:           # x[8 p .. 8 p + 7]
        xo = (lane % 4) * 4 + c
    x_i32 = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    x_base = x_i32 + tl.minimum(r, M - 1) * stride_x + xo                 # [NTH, 1, 4]
    x_base1 = x_i32 + tl.minimum(r + 8, M - 1) * stride_x + xo
    if DIAG:    # x of block r // 2 of the pair; the scales of block p: chunk and entry shifted
        x_base = x_i32 + (r // 4) * 32 + ((r // 2) % 2) * 16 + xo - (u % 2) * 32
        dsh = (lane % 4) // 2 - u % 2                                  # [NTH, U, 1]
        sc_c = 2 * (lane % 2) + c % 2                                  # [NTH, 1, 4]
    else:
        dsh = 0
        sc_c = c
    # int32 words a chunk of a tile (Q6_K: 384 a chunk pair, the high plane's crumbs last)
    WPC: tl.constexpr = 192 if FMT == 9 else 128 * PLANES
    q_base = q_ptr + tile * kch * WPC + lane * 4 + c
    ch = part * (STEPS * U) + u                                        # [NTH, U, 1]
    acc0 = tl.zeros((NTH, U, 4), tl.float32)
    acc1 = tl.zeros((NTH, U, 4), tl.float32)
    # the next step's words (and with AHEAD its scales) load before this step's math
    words = tl.load(q_base + _lo_offset(FMT, ch, WPC))
    if PLANES == 2:
        words2 = tl.load(q_base + _hi_offset(FMT, ch, WPC, part * (STEPS * U)))
    else:
        words2 = words
    WORDS: tl.constexpr = AHEAD == 2 and FMT != 0 and FMT != 4 and FMT != 10  # bytes as words
    if WORDS:
        f0, f1, f2, f3 = _scale_words(FMT, s_ptr, z_ptr, t_ptr, tile, kch, ch + dsh, r, GPC,
                                      part * (STEPS * U))
    else:
        f0, f1, f2, f3 = _scale_loads(FMT, s_ptr, z_ptr, t_ptr, tile, kch, ch + dsh, r, sc_c,
                                      GPC)
    x00, x01, x10, x11 = _x_loads(x_base, x_base1, ch, NT, DIAG)
    if FMT == 10 and FILL != "":    # the shared byte table's address (entry 0 of the operand):
        #                             a scalar operand, one instance (one table) a thread
        lut = tl.inline_asm_elementwise(
            FILL, "=r,l", [t_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + 256],
            dtype=tl.int32, is_pure=False, pack=1)
        tab = tl.full((NTH, U, 4), 0, tl.int32) + lut
    elif FMT == 10:     # NF4's lookup tables, operand entries 0..7 (U >= 2; `quant_mma_nf4`),
        #                 a copy a lane: from uniform registers ptxas would copy them every prmt
        tab = tl.load(t_ptr.to(tl.pointer_type(tl.int32), bitcast=True) + lane * 8
                      + (u * 4 + c) % 8)
    for it in range(STEPS):
        if not AHEAD:   # the scales of this step now (bytes carried ahead cost unpacking)
            f0, f1, f2, f3 = _scale_loads(FMT, s_ptr, z_ptr, t_ptr, tile, kch, ch + dsh, r, sc_c,
                                          GPC)
        if it + 1 < STEPS:
            nw = tl.load(q_base + _lo_offset(FMT, ch + U, WPC))
            if PLANES == 2:
                nw2 = tl.load(q_base + _hi_offset(FMT, ch + U, WPC,
                                                  part * (STEPS * U) + (it + 1) * U))
            else:
                nw2 = nw
            if WORDS:
                n0, n1, n2, n3 = _scale_words(FMT, s_ptr, z_ptr, t_ptr, tile, kch, ch + U + dsh,
                                              r, GPC, part * (STEPS * U) + (it + 1) * U)
            elif AHEAD:
                n0, n1, n2, n3 = _scale_loads(FMT, s_ptr, z_ptr, t_ptr, tile, kch,
                                              ch + U + dsh, r, sc_c, GPC)
            else:
                n0 = f0
                n1 = f1
                n2 = f2
                n3 = f3
        else:
            nw = words
            nw2 = words2
            n0 = f0
            n1 = f1
            n2 = f2
            n3 = f3
        if WORDS:
            sa, sb = _scales_from_words(FMT, f0, f1, f2, f3, sc_c)
        else:
            sa, sb = _scales(FMT, f0, f1, f2, f3)
        if FMT == 10:
            sb = tab
        if DIAG and FMT == 0:   # Q4_0 in the aff mode: d (128 + q) - 136 d
            sb = -136.0 * sa
        if XAHEAD:      # x of this step was loaded in the previous one
            if it + 1 < STEPS:
                y00, y01, y10, y11 = _x_loads(x_base, x_base1, ch + U, NT, DIAG)
            else:
                y00 = x00
                y01 = x01
                y10 = x10
                y11 = x11
        else:
            x00, x01, x10, x11 = _x_loads(x_base, x_base1, ch, NT, DIAG)
        acc0, acc1 = _mma_units(acc0, acc1, words, words2, x00, x01, x10, x11, sa, sb, ASM,
                                CONS, 4 * U, NT, PLANES, SB)
        if XAHEAD:
            x00 = y00
            x01 = y01
            x10 = y10
            x11 = y11
        words = nw
        words2 = nw2
        f0 = n0
        f1 = n1
        f2 = n2
        f3 = n3
        ch += U
    lj = tl.arange(0, 32)[:, None]
    e = tl.arange(0, 4)[None, :]
    if DIAG:    # entries 0 / 2 of even units: rows r / r + 8, summed over the row group's lanes
        tot = tl.sum(tl.where(u % 2 == 0, acc0, 0.0), axis=1)
        if S > 1:
            tot = tl.sum(tl.reshape(tot, (S, 32, 4)), axis=0)
        tot = tl.sum(tl.reshape(tot, (8, 4, 4)), axis=1)               # [8 (r), 4]
        n = pid * 16 + tl.arange(0, 8)[:, None] + 8 * (e // 2)
        tl.store(out_ptr + n, tot.to(out_ptr.dtype.element_ty), mask=(e % 2 == 0) & (n < N))
        return
    n = pid * 16 + lj // 4 + 8 * (e // 2)
    m = 2 * (lj % 4) + e % 2
    tot = tl.sum(acc0, axis=1)                                         # [NTH, 4]
    if S > 1:
        tot = tl.sum(tl.reshape(tot, (S, 32, 4)), axis=0)              # [32, 4]
    tl.store(out_ptr + m * stride_o + n, tot.to(out_ptr.dtype.element_ty),
             mask=(m < M) & (n < N))
    if NT == 2:
        tot = tl.sum(acc1, axis=1)
        if S > 1:
            tot = tl.sum(tl.reshape(tot, (S, 32, 4)), axis=0)
        tl.store(out_ptr + (m + 8) * stride_o + n, tot.to(out_ptr.dtype.element_ty),
                 mask=(m + 8 < M) & (n < N))


# ---- the repacked weight (`quant_mma_pack`) ------------------------------------------------
def mma_packable(fmt: int, i0: int, k: int, n: int) -> bool:
    if fmt not in MMA_FORMATS or k % CHUNK_K or n % TILE_N or n <= 0:
        return False
    if fmt == Q6_K:     # whole super-blocks, chunk pairs a warp (ksplit 4 or less)
        return k % 512 == 0
    if fmt == NF4:      # (2 chunks a step at least: `run_mma`)
        return i0 % CHUNK_K == 0 and k % i0 == 0 and k % (2 * CHUNK_K) == 0
    if fmt == AWQ:
        return i0 % CHUNK_K == 0 and k % i0 == 0
    return fmt not in (Q4_K, Q6_K) or k % 256 == 0


# ---- launch ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class MmaConfig:
    """A program a 16-row tile: ksplit warps share its K (summed in the program); units: chunks
    (64 K) a warp loads a step (the next step's words load before this step's math); ahead:
    the scales too (else loaded in their step)."""
    ksplit: int = 4
    units: int = 2
    ahead: int = 1      # scales a step ahead (2: Q4_K / Q6_K / AWQ's byte fields as words)
    xahead: int = 0     # x a step ahead too (16 rows: x comes from L2, not L1)
    diag: int = 0       # one row of Q4_K / AWQ: a lane scales one block (`quant_mma_diag`)
    lut: int = 0        # NF4: codes by loads from a shared-memory byte table (`quant_mma_nf4`)

    def tag(self) -> str:
        return (f"mma[k{self.ksplit},u{self.units}"
                + ("" if self.ahead == 1 else ",sn" if not self.ahead else ",sw")
                + (",xa" if self.xahead else "") + (",dg" if self.diag else "")
                + (",lut" if self.lut else "") + "]")


#: launch per format for one row of x, H200 N = K = 8192 bf16 CUDA-graph times
#: (bench_cuda_quant_gemv, warm / cold ms, the packed GEMV's in brackets; runs 1 and 2 of session 8
#: differ by up to ~6%): Q4_0 0.0105-0.0107 / 0.0147 (0.0183 / 0.0210; 4 chunks a step 0.0111 /
#: 0.0142, 2 warps a tile 0.0134; removed: 2 tiles a program on 4 warps 0.0174 and on 8 warps
#: 0.0123, Triton's cp.async pipeline instead of the register prefetch 0.209); Q8_0 0.0219-0.0220 /
#: 0.0216 (0.0281; 4 chunks 0.0294, 8 warps a tile 0.0311); AWQ 4 chunks, the byte scale fields a
#: step ahead as words 0.0113 / 0.0145 (0.0207; loaded in their step 0.0140 / 0.0182, 2 chunks
#: 0.0125); Q4_K 8 warps a tile, scales in their step 0.0171 / 0.0192 (0.0239; 4 warps 4 chunks
#: 0.0168-0.0178 / 0.0237-0.0240, words ahead 2 chunks 0.0178 / 0.0221, 4 chunks 0.0202, 8 warps
#: 0.0219); Q6_K words ahead 0.0228 / 0.0229 (0.0344; in their step 0.0235, carried as bytes
#: 0.0257). Byte-sized scale fields carried ahead as bytes cost their unpacking (sm_90 SASS of the
#: loop: Q4_K 4.42 instructions a weight, in their step 3.47, as words 2.81)
#: Session 9 run 2 (warm / cold): one lane a block (diag) on 4 warps, 4 chunks a step: Q4_K
#: scales in their step 0.0113 / 0.0139 (the session 8 default above 0.0170 / 0.0191; diag on 8
#: warps 2 chunks 0.0144, 4 warps 2 chunks 0.0120, words ahead 0.0117), AWQ scales in their step
#: 0.0101 / 0.0137 (words ahead 0.0113 / 0.0142, as the old default), Q4_0 0.0101 / 0.0129 (0.0106
#: / 0.0147; diag 2 chunks 0.0114). NF4 (bf16 codes by prmt lookups, `quant_mma_nf4`; the packed
#: GEMV 0.0226 / 0.0235): 4 chunks 0.0163-0.0164 / 0.0185-0.0186, 2 chunks 0.0180, 8 chunks
#: 0.0178, 8 warps 0.0184, scales in their step 0.0163 / 0.0185, with x ahead 0.0163 / 0.0176.
#: Session 10: NF4's codes from the shared byte table (lut), runs 1 / 2: 0.0130 / 0.0145 and
#: 0.0130 / 0.0144 (prmt 0.0164 / 0.0187 and 0.0166 / 0.0186; lut on 2 chunks 0.0130 / 0.0153,
#: 8 warps 0.0172, 8 chunks 0.0157, scales in their step 0.0142, x ahead 0.0164; removed after
#: run 2, tied: the table's entries decoded in registers instead of loaded 0.0131 / 0.0144, the
#: words past L1 (ld.global.cg) 0.0130 / 0.0144, and on the Q4_0 / Q4_K / AWQ defaults 0.0100 /
#: 0.0112 / 0.0101 against 0.0103 / 0.0113 / 0.0102, cold equal)
DEFAULT_MMA = {Q4_0: MmaConfig(units=4, diag=1), Q8_0: MmaConfig(),
               AWQ: MmaConfig(units=4, ahead=0, diag=1),
               Q4_K: MmaConfig(units=4, ahead=0, diag=1), Q6_K: MmaConfig(ahead=2),
               NF4: MmaConfig(units=4, lut=1)}
#: 2..16 rows (16 measured, the packed dot's session 7 times in brackets): Q4_0 with x a step ahead
#: 0.0160 / 0.0178 (0.0366 / 0.0373; without 0.0239 / 0.0431: 16 rows of x come from L2; 8 warps
#: 0.0249, 2 tiles a program (removed) 0.0192 / 0.0328), Q4_K words ahead 0.0284 / 0.0311 (0.0371 /
#: 0.0377), AWQ 0.0222 / 0.0367 (0.0366 / 0.0376), Q8_0 0.0342 / 0.0338 (0.0403 / 0.0407), Q6_K
#: 0.0326 / 0.0325 (0.0734 / 0.0737; scales in their step 0.0485-0.0510)
#: Run 3: AWQ / Q4_K with x ahead too 0.0182 / 0.0202 and 0.0207 / 0.0222 (without 0.0223 /
#: 0.0343 and 0.0204 / 0.0305); x ahead lost for Q8_0 (0.0369 vs 0.0334) and Q6_K (0.0470 vs
#: 0.0327). 8 rows: Q4_0 0.0113, AWQ 0.0133, Q4_K 0.0177, Q8_0 0.0231, Q6_K 0.0256 (warm)
#: Session 10, NF4 16 rows, runs 1 / 2: the shared byte table (lut) 0.0224 / 0.0227 and 0.0222 /
#: 0.0225 against the prmt lookups 0.0215 / 0.0283 and 0.0221 / 0.0279 (warm within noise, cold
#: 20% faster; lut on 4 chunks 0.0337, 8 warps 0.0372)
DEFAULT_MMA_ROWS = {Q4_0: MmaConfig(xahead=1), Q8_0: MmaConfig(),
                    AWQ: MmaConfig(ahead=2, xahead=1), Q4_K: MmaConfig(ahead=2, xahead=1),
                    Q6_K: MmaConfig(ahead=2), NF4: MmaConfig(lut=1)}


@functools.lru_cache(maxsize=None)
def _asm(fmt: int, units: int, nt: int = 1, one_row: bool = False,
         diag: bool = False, lut: bool = False) -> tuple[str, str]:
    """(PTX, operand constraints) of `units` chunks a thread, nt x tiles; lut: NF4's codes from
    the shared byte table."""
    mode = MODE[fmt]
    planes = 2 if mode in ("q8", "q6") else 1
    p = 4 * units
    cons = ["=f"] * (nt * p) + ["f"] * (nt * p) + ["r"] * ((planes + 2 * nt) * p) + \
        ["f"] * ((2 if mode in ("aff", "q6") else 1) * p)
    if mode == "nf4":       # the lookup tables
        cons += ["r"] * p
    if diag:    # (Q4_0 too, in the aff mode: sa, sb)
        cons = ["=f"] * p + ["f"] * p + ["r"] * 3 * p + ["f"] * 2 * p
        return ptx_diag(units), ",".join(cons)
    return _ptx(mode, units, nt, one_row, lut), ",".join(cons)


def mma_ok(fmt: int, x, i0: int, k: int, n: int, m: int) -> bool:
    """Whether the mma GEMV takes this call: its formats, bf16 x of at most 16 rows,
    N % 16 == 0 and K % 64 == 0 (Q4_K: 256; Q6_K: 512; AWQ: groups of 64k), compiled kernels."""
    return (x.dtype == torch.bfloat16 and 1 <= m <= 16 and not INTERPRET
            and mma_packable(fmt, i0, k, n))


#: formats whose default route for 1..N rows of bf16 x is this kernel (`quant.run`), by N
MMA_DEFAULT_ROWS: dict[int, int] = {Q4_0: 16, Q8_0: 16, AWQ: 16, Q4_K: 16, Q6_K: 16, NF4: 16}


def mma_default(fmt: int, x, i0: int, k: int, n: int, m: int) -> bool:
    """Whether `quant.run`'s default route takes the mma GEMV for this call."""
    return m <= MMA_DEFAULT_ROWS.get(fmt, 0) and mma_ok(fmt, x, i0, k, n, m)


def run_mma_cached(fmt: int, x, w0, w1, w2, i0: int, k: int, n: int,
                   config: MmaConfig | None = None):
    """`run_mma` on the weight's mma copy, made once and cached with the weight tensors."""
    from .quant_packed import packed_weight
    return run_mma(fmt, x, packed_weight(fmt, w0, w1, w2, i0, k, n, build=pack_mma), config)


def run_mma(fmt: int, x, mw: MmaWeight, config: MmaConfig | None = None):
    """x [..., K] (bf16, at most 16 rows in all) @ W.T -> [..., N] in x's dtype."""
    cfg = config or (DEFAULT_MMA if x.numel() == x.shape[-1] else DEFAULT_MMA_ROWS)[fmt]
    n, k = mw.n, mw.k
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    m = x2.shape[0]
    kch = k // CHUNK_K
    ksplit = cfg.ksplit
    while kch % ksplit:
        ksplit //= 2
    per_warp = kch // ksplit
    while fmt == NF4 and per_warp % 2:      # its tables ride in a 2-chunk operand
        ksplit //= 2
        per_warp = kch // ksplit
    diag = bool(cfg.diag) and m == 1 and (MODE[fmt] == "aff" or fmt == Q4_0)
    while diag and per_warp % 2:            # chunk pairs (`quant_mma_diag`)
        ksplit //= 2
        per_warp = kch // ksplit
    units = min(max(cfg.units, 2 if fmt == NF4 or diag else 1), per_warp)
    while per_warp % units:
        units //= 2
    if fmt == Q4_K and cfg.ahead == 2:      # a step within one super-block (`_scale_words`)
        units = min(units, 4)
    if fmt == Q6_K:     # a chunk pair a step (its crumbs share words)
        units = 2
        if per_warp % 2:
            raise ValueError("Q6_K: chunks a warp must be even (K / 64 / ksplit)")
    nt = 1 if m <= 8 else 2
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    lut = bool(cfg.lut) and fmt == NF4
    asm, cons = _asm(fmt, units, nt, m == 1, diag, lut)
    z = mw.zeros if mw.zeros is not None else mw.scales
    t = mw.table if mw.table is not None else mw.scales
    grid = (n // TILE_N,)
    _mma_gemv_kernel[grid](x2, mw.words, mw.scales, z, t, out, n, m, x2.stride(0) // 2,
                           out.stride(0), kch, STEPS=per_warp // units, S=ksplit,
                           U=units, ASM=asm, CONS=cons, FMT=fmt, NT=nt,
                           GPC=max(1, mw.group // CHUNK_K), AHEAD=cfg.ahead,
                           XAHEAD=bool(cfg.xahead), DIAG=diag,
                           FILL=nf4.fill_ptx(ksplit) if lut else "",
                           num_warps=ksplit, num_stages=1)
    return out.reshape(*x.shape[:-1], n)
