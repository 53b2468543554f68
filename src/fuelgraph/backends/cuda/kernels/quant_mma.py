"""Few-row quantized matmul (`out = x @ W.T`, x [M, K] 16-bit with M <= 8, W [N, K]) on the
tensor cores through `mma.sync.m16n8k16` written as inline PTX, on a copy of the weight repacked
once into the mma's own register order (Q4_0).

Why: the CUDA-core GEMV of `quant_packed` spends ~4 SASS instructions a weight (unpack, scale,
multiply-add; sm_90) and is issue-bound next to the weight stream. Here a 16 x 16 weight tile is
the mma's A operand with x as B (its 8 columns are x's rows, clamped to the last one), so one
instruction multiplies 256 weights and a weight costs its unpacking only: a nibble pair into a
bf16x2 register by one LOP3 (the nibble ORed into the mantissa of 128.0), one bf16x2 FMA to
q - 8 (exact small integers), about 1.4 instructions a weight. The products q x are exact and
summed in float32 by the tensor core over each 32-element block; the block's scale d then
multiplies the block's sum in float32 (one FFMA per output and block). x is read as bf16 where
it lies (no conversion kernel), and the output is written by the program that owns the rows
(no split-K atomics, no zeroed float32 buffer): one launch a call.

Register order (`pack_mma`): rows in tiles of 16, K in chunks of 64 (two Q4_0 blocks). Lane l of
a warp (r = l // 4, p = l % 4) holds, per chunk, four int32 words (one 16-byte load, the warp's
512 bytes contiguous): entry e = 2 g + h is row r + 8 h of block g, elements 8 p .. 8 p + 7 of the
block, element 2 m in bits 4 m and 2 m + 1 in bits 16 + 4 m (so (word >> 4 m) & 0x000F000F is
the bf16x2 pair the mma wants). In mma step s of block g the lane's A registers are pairs 2 s,
2 s + 1 of entries (2 g, 2 g + 1) and its B registers x[8 p + 4 s .. + 3] of that block: the
mma's k-slots (2 p, 2 p + 1, 2 p + 8, 2 p + 9) are the elements 8 p + 4 s + (0, 1, 2, 3), one
16-byte x load a block. Scales [tiles, chunks, 8, 4] f16: lane (r, .) reads its four d at once.

The layout of every tensor here is [threads, U, 4] (the thread index i = 32 warp + lane, U
chunks a step in a thread, 4 registers), loaded with 16-byte vectors: Triton lays that out as
sizePerThread [1, 1, 4], threadsPerWarp [32, 1, 1], warpsPerCTA [warps, 1, 1], which is what the
PTX assumes of its operands (checked in the compiled TTGIR by bench/sass_quant_mma.py). Runs on
sm_80+ GPUs only (no interpreter: the PTX is warp-collective)."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .quant_tiles import Q4_0

MMA_FORMATS = frozenset({Q4_0})
CHUNK_K = 64        # elements of a row a chunk (two 32-element blocks)
TILE_N = 16         # rows a tile (the mma's M)


def _q4_0_ptx(units: int) -> str:
    """PTX of `units` chunks for one thread: operands (P = 4 units) $0..P-1 the new sums,
    then P each of: old sums, words, x of block 0, x of block 1 (bf16x2), scales (float32)."""
    p = 4 * units

    def op(kind, u, j):
        return f"${p * kind + 4 * u + j}"
    lines = ["{", ".reg .b32 %fq<16>, %ft, %fone, %fneg;", ".reg .f32 %fc<4>, %fz;",
             "mov.b32 %fone, 0x3F803F80;",       # bf16x2 (1, 1)
             "mov.b32 %fneg, 0xC308C308;",       # bf16x2 (-136, -136): 128 + q - 136 = q - 8
             "mov.f32 %fz, 0f00000000;"]
    for u in range(units):
        for e in range(4):
            w = op(2, u, e)
            lines.append(f"lop3.b32 %fq{4 * e}, {w}, 0x000F000F, 0x43004300, 0xEA;")
            for m in range(1, 4):
                lines.append(f"shr.u32 %ft, {w}, {4 * m};")
                lines.append(f"lop3.b32 %fq{4 * e + m}, %ft, 0x000F000F, 0x43004300, 0xEA;")
        for i in range(16):
            lines.append(f"fma.rn.bf16x2 %fq{i}, %fq{i}, %fone, %fneg;")
        for g in range(2):
            x = 3 + g
            for s in range(2):
                a = [f"%fq{4 * (2 * g) + 2 * s}", f"%fq{4 * (2 * g + 1) + 2 * s}",
                     f"%fq{4 * (2 * g) + 2 * s + 1}", f"%fq{4 * (2 * g + 1) + 2 * s + 1}"]
                b = [op(x, u, 2 * s), op(x, u, 2 * s + 1)]
                c = "%fz, %fz, %fz, %fz" if s == 0 else "%fc0, %fc1, %fc2, %fc3"
                lines.append("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                             f"{{%fc0, %fc1, %fc2, %fc3}}, {{{', '.join(a)}}}, "
                             f"{{{', '.join(b)}}}, {{{c}}};")
            for j in range(4):      # c0, c1: row r; c2, c3: row r + 8
                src = op(1, u, j) if g == 0 else op(0, u, j)
                lines.append(f"fma.rn.f32 {op(0, u, j)}, %fc{j}, {op(5, u, 2 * g + j // 2)}, "
                             f"{src};")
    lines.append("}")
    return "\n".join(lines)


@triton.jit
def _q4_0_units(acc, words, xa, xb, sc, ASM: tl.constexpr, CONS: tl.constexpr,
                P: tl.constexpr):
    return tl.inline_asm_elementwise(ASM, CONS, [acc, words, xa, xb, sc], dtype=tl.float32,
                                     is_pure=True, pack=P)


@triton.jit
def _mma_gemv_kernel(x_ptr, q_ptr, s_ptr, out_ptr, N, M, stride_x, stride_o, kch,
                     STEPS: tl.constexpr, T: tl.constexpr, S: tl.constexpr, U: tl.constexpr,
                     PREFETCH: tl.constexpr, STAGES: tl.constexpr, ASM: tl.constexpr,
                     CONS: tl.constexpr):
    """out[:M, tiles] = x[:M] @ W.T for T 16-row tiles of this program, each tile's K split
    over S warps (STEPS steps of U chunks each), summed in the program. stride_x in int32
    words (2 bf16), kch: chunks a row. Thread i = 32 warp + lane of the [32 T S, U, 4] tensors."""
    pid = tl.program_id(0)
    NTH: tl.constexpr = T * S * 32
    i = tl.arange(0, NTH)[:, None, None]
    lane = i % 32
    warp = i // 32
    tile = tl.minimum(pid * T + warp % T, N // 16 - 1).to(tl.int64)     # (a partial last
    #                                                       program repeats the last tile)
    part = warp // T
    r = lane // 4
    c = tl.arange(0, 4)[None, None, :]
    u = tl.arange(0, U)[None, :, None]
    xrow = tl.minimum(r, M - 1)
    x_i32 = x_ptr.to(tl.pointer_type(tl.int32), bitcast=True)
    x_base = x_i32 + xrow * stride_x + (lane % 4) * 4 + c             # [NTH, 1, 4]
    q_base = q_ptr + tile * kch * 128 + lane * 4 + c
    s_base = s_ptr + tile * kch * 32 + r * 4 + c
    ch = part * (STEPS * U) + u                                        # [NTH, U, 1]
    acc = tl.zeros((NTH, U, 4), tl.float32)
    if PREFETCH:
        words = tl.load(q_base + ch * 128)
        sc = tl.load(s_base + ch * 32)
        for it in range(STEPS):
            if it + 1 < STEPS:
                nw = tl.load(q_base + (ch + U) * 128)
                ns = tl.load(s_base + (ch + U) * 32)
            else:
                nw = words
                ns = sc
            xa = tl.load(x_base + ch * 32)
            xb = tl.load(x_base + ch * 32 + 16)
            acc = _q4_0_units(acc, words, xa, xb, sc.to(tl.float32), ASM, CONS, 4 * U)
            words = nw
            sc = ns
            ch += U
    else:
        for it in tl.range(STEPS, num_stages=STAGES):
            cc = ch + it * U
            words = tl.load(q_base + cc * 128)
            sc = tl.load(s_base + cc * 32)
            xa = tl.load(x_base + cc * 32)
            xb = tl.load(x_base + cc * 32 + 16)
            acc = _q4_0_units(acc, words, xa, xb, sc.to(tl.float32), ASM, CONS, 4 * U)
    tot = tl.sum(acc, axis=1)                                          # [NTH, 4]
    if S > 1:
        tot = tl.sum(tl.reshape(tot, (S, T * 32, 4)), axis=0)          # [32 T, 4]
    j = tl.arange(0, T * 32)[:, None]
    e = tl.arange(0, 4)[None, :]
    lj = j % 32
    n = (pid * T + j // 32) * 16 + lj // 4 + 8 * (e // 2)
    m = 2 * (lj % 4) + e % 2
    tl.store(out_ptr + m * stride_o + n, tot.to(out_ptr.dtype.element_ty),
             mask=(m < M) & (n < N))


# ---- the repacked weight --------------------------------------------------------------------
@dataclass(frozen=True)
class MmaWeight:
    """words int32 [N / 16, K / 64, 32, 4] and scales f16 [N / 16, K / 64, 8, 4] (module
    docstring); n, k of the weight."""
    fmt: int
    words: torch.Tensor
    scales: torch.Tensor
    n: int
    k: int


def mma_packable(fmt: int, i0: int, k: int, n: int) -> bool:
    return fmt in MMA_FORMATS and k % CHUNK_K == 0 and n % TILE_N == 0 and n > 0


def _words_from_codes(q: torch.Tensor) -> torch.Tensor:
    """Codes q [N, K] (0..15) -> int32 [N / 16, K / 64, 32 lanes, 4 entries] (module docstring)."""
    n, k = q.shape
    v = q.to(torch.int64).reshape(n // 16, 2, 8, k // 64, 2, 4, 4, 2)   # t h r c g p m odd
    sh = (4 * torch.arange(4, device=q.device)).view(4, 1) + \
        16 * torch.arange(2, device=q.device).view(1, 2)
    w = (v << sh).sum(dim=(-2, -1))                                     # t h r c g p
    w = w.permute(0, 3, 2, 5, 4, 1).reshape(n // 16, k // 64, 32, 4)   # t c (r p) (g h)
    return (w - ((w >> 31) << 32)).to(torch.int32)                      # wrap to int32


def _scales_order(d: torch.Tensor) -> torch.Tensor:
    """Block scales [N, K / 32] -> [N / 16, K / 64, 8, 4] (entry 2 g + h: row r + 8 h, block g)."""
    n, nb = d.shape
    return d.reshape(n // 16, 2, 8, nb // 2, 2).permute(0, 3, 2, 4, 1).reshape(
        n // 16, nb // 2, 8, 4).contiguous()


def pack_mma(fmt: int, w0, w1, w2, i0: int, k: int, n: int) -> MmaWeight:
    """The mma register order of a weight given as `quant.run` takes it (Q4_0: bytes)."""
    if fmt == Q4_0:
        raw = w0.reshape(n, k // 32, 18)
        d = raw[..., :2].contiguous().view(torch.float16).reshape(n, k // 32)
        qs = raw[..., 2:]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).reshape(n, k)
        return MmaWeight(fmt, _words_from_codes(q).contiguous(), _scales_order(d), n, k)
    raise ValueError(f"no mma layout for format {fmt}")


# ---- launch ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class MmaConfig:
    """tiles: 16-row tiles a program (a warp group each); ksplit: warps sharing a tile's K
    (summed in the program); units: chunks (64 K) a warp loads a step; prefetch: the next
    step's words in registers (else `stages` > 1: Triton's cp.async pipeline)."""
    tiles: int = 1
    ksplit: int = 4
    units: int = 2
    prefetch: int = 1
    stages: int = 1

    def tag(self) -> str:
        return (f"mma[t{self.tiles},k{self.ksplit},u{self.units}"
                + (",pf" if self.prefetch else f",st{self.stages}") + "]")


DEFAULT_MMA = MmaConfig()


@functools.lru_cache(maxsize=None)
def _asm(fmt: int, units: int) -> tuple[str, str]:
    """(PTX, operand constraints) of `units` chunks a thread."""
    p = 4 * units
    return _q4_0_ptx(units), ",".join(["=f"] * p + ["f"] * p + ["r"] * (3 * p) + ["f"] * p)


def mma_ok(fmt: int, x, i0: int, k: int, n: int, m: int) -> bool:
    """Whether the mma GEMV takes this call: Q4_0, bf16 x of at most 8 rows, N % 16 == 0 and
    K % 64 == 0."""
    return x.dtype == torch.bfloat16 and 1 <= m <= 8 and mma_packable(fmt, i0, k, n)


def run_mma_cached(fmt: int, x, w0, w1, w2, i0: int, k: int, n: int,
                   config: MmaConfig | None = None):
    """`run_mma` on the weight's mma copy, made once and cached with the weight tensors."""
    from .quant_packed import packed_weight
    return run_mma(fmt, x, packed_weight(fmt, w0, w1, w2, i0, k, n, build=pack_mma), config)


def run_mma(fmt: int, x, mw: MmaWeight, config: MmaConfig | None = None):
    """x [..., K] (bf16 / f16, at most 8 rows in all) @ W.T -> [..., N] in x's dtype."""
    cfg = config or DEFAULT_MMA
    n, k = mw.n, mw.k
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    m = x2.shape[0]
    kch = k // CHUNK_K
    per_warp = -(-kch // cfg.ksplit)
    units = min(cfg.units, per_warp)
    steps = per_warp // units
    if steps * units * cfg.ksplit != kch:
        raise ValueError("chunks a row must split evenly over ksplit x units")
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    asm, cons = _asm(fmt, units)
    grid = (-(-(n // TILE_N) // cfg.tiles),)
    _mma_gemv_kernel[grid](x2, mw.words, mw.scales, out, n, m, x2.stride(0) // 2, out.stride(0),
                           kch, STEPS=steps, T=cfg.tiles, S=cfg.ksplit, U=units,
                           PREFETCH=bool(cfg.prefetch), STAGES=cfg.stages, ASM=asm, CONS=cons,
                           num_warps=cfg.tiles * cfg.ksplit, num_stages=1)
    return out.reshape(*x.shape[:-1], n)
