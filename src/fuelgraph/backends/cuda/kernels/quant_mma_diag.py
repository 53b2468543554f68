"""One row of x on `quant_mma`'s tensor-core GEMV with a scale a 32-element block (Q4_K, and
AWQ's aff mode): each lane scales only the block whose sums it holds (`MmaConfig.diag`).

Why: with one row of x every column of the mma's B is the same x, so the 4 lanes of a row
group (p = lane % 4) hold the same sums, and each lane formed the (a, b) scale pair of all 4
(row, block) entries of a chunk (~10 instructions each: two byte fields, two f16, products) and
applied them with 8 FFMA: 1.25 instructions a weight of duplication. Here B's columns carry
different blocks: lane l holds column l // 4 of B and loads x of block l // 8 of a chunk pair,
so column n holds x of block n // 2, and the mma of block q (its own accumulator chain, q =
0..3) gives C_q[row, 2 p] = W_q[row] . x_p: the sums of block q sit in chain q's column 2 q.
Lane p takes them from chain p (3 selects a row), forms only the scale pairs of its rows r,
r + 8 in block p (`quant_mma` loads them with the chunk and entry shifted by p) and applies them
with 4 FFMA a chunk pair (16 before). The all-ones mma of the aff mode gives x's block sums in
the same columns, 2 a chunk pair (8 before). The row's result is the sum over the 4 lanes of
its row group, once after the loop."""
from __future__ import annotations


def ptx_diag(units: int) -> str:
    """PTX of `units` (even) chunks, aff mode (A = 128 + q; out += a C + b C1), one row of x:
    operands as `quant_mma._ptx`'s (out, acc, words, x of block 0 and 1, sa, sb; P = 4 units
    registers each) but x: per chunk pair (units 2 v, 2 v + 1), x[0] words 0..3 of pair v's
    block lane // 8 (elements 8 p .. 8 p + 7); sa / sb: per pair v, entries 0 / 1 = rows r /
    r + 8 of block p; out / acc entries 0 / 2 of unit 2 v hold the lane's rows r / r + 8."""
    assert units % 2 == 0
    p = 4 * units
    names = ["out0", "acc0", "w0", "x00", "x01", "sa", "sb"]
    base = {name: i * p for i, name in enumerate(names)}

    def op(name, u, j):
        return f"${base[name] + 4 * u + j}"
    mma = "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32"
    lines = ["{", ".reg .b32 %fq<16>, %ft, %fone, %fl;", ".reg .pred %fp<3>;",
             ".reg .f32 %fc<16>, %fd<4>, %fz, %fv;",
             "mov.b32 %fone, 0x3F803F80;", "mov.f32 %fz, 0f00000000;",
             "mov.u32 %fl, %laneid;", "and.b32 %fl, %fl, 3;"]
    lines += [f"setp.eq.u32 %fp{q}, %fl, {q};" for q in range(3)]
    ones = "{%fone, %fone, %fone, %fone}"
    zero = "%fz, %fz, %fz, %fz"
    d = "%fd0, %fd1, %fd2, %fd3"
    for v in range(units // 2):
        for s in range(2):      # the x sums of the block of column 2 p (lanes r = 2 p, 2 p + 1)
            b = f"{{{op('x00', 2 * v, 2 * s)}, {op('x00', 2 * v, 2 * s + 1)}}}"
            lines.append(f"{mma} {{{d}}}, {ones}, {b}, {{{zero if s == 0 else d}}};")
        for uu in range(2):
            u = 2 * v + uu
            for e in range(4):
                w = op("w0", u, e)
                lines.append(f"lop3.b32 %fq{4 * e}, {w}, 0x000F000F, 0x43004300, 0xEA;")
                for m in range(1, 4):
                    lines.append(f"shr.u32 %ft, {w}, {4 * m};")
                    lines.append(f"lop3.b32 %fq{4 * e + m}, %ft, 0x000F000F, 0x43004300, 0xEA;")
            for g in range(2):
                q = 2 * uu + g
                c = ", ".join(f"%fc{4 * q + j}" for j in range(4))
                for s in range(2):
                    b = f"{{{op('x00', 2 * v, 2 * s)}, {op('x00', 2 * v, 2 * s + 1)}}}"
                    a = [f"%fq{4 * (2 * g) + 2 * s}", f"%fq{4 * (2 * g + 1) + 2 * s}",
                         f"%fq{4 * (2 * g) + 2 * s + 1}", f"%fq{4 * (2 * g + 1) + 2 * s + 1}"]
                    lines.append(f"{mma} {{{c}}}, {{{', '.join(a)}}}, {b}, "
                                 f"{{{zero if s == 0 else c}}};")
        for j, h in ((0, 0), (2, 1)):   # c0: row r, c2: row r + 8; chain p: block p
            lines += [f"selp.f32 %fv, %fc{8 + j}, %fc{12 + j}, %fp2;",
                      f"selp.f32 %fv, %fc{4 + j}, %fv, %fp1;",
                      f"selp.f32 %fv, %fc{j}, %fv, %fp0;"]
            dst = op("out0", 2 * v, j)
            lines.append(f"fma.rn.f32 {dst}, %fv, {op('sa', 2 * v, h)}, {op('acc0', 2 * v, j)};")
            lines.append(f"fma.rn.f32 {dst}, %fd{j}, {op('sb', 2 * v, h)}, {dst};")
    lines.append("}")
    return "\n".join(lines)
