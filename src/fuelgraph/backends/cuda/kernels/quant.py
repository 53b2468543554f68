"""Quantized matmuls on the GPU (QMATMUL, NF4_MATMUL, AWQ_MATMUL and their gradients with
respect to the activations).

Dispatch (`run`), per format and number of activation rows by the table `ROUTES`, except:

* 1..16 rows of bf16 x of Q4_0, Q8_0, Q4_K, Q6_K, AWQ and NF4 take the tensor-core GEMV of
  `quant_mma` (inline PTX mma.sync on a cached copy of the weight in the mma's register order;
  `quant_mma.MMA_DEFAULT_ROWS`); shapes it rejects take the routes below.

* One row of Q4_0, Q8_0, Q4_K, Q6_K, NF4 and AWQ: the GEMV of `quant_packed` on a copy of the
  weight repacked once (cached with the weight tensor) into 16-byte-aligned code words and
  separate scales; shapes that layout rejects take the storage-order kernels below.
  `quant_packed_dot` runs tensor-core dots on the same copy for 2..16 rows of 16-bit x of
  all six (ROUTES, DOT_16), `quant_packed_gemm` a GEMM on it for many rows (the weight tile
  decoded in registers as the wgmma's register operand; PackedGemmConfig).
* Q4_0, Q8_0, Q4_K, Q6_K, NF4 and AWQ forward: the storage-order kernels of `quant_rows` (each
  weight byte read once, coalesced along K, unpacked in registers; one-row GEMV, CUDA-core and
  tl.dot variants, split-K by atomics; launch table `quant_rows.ROWS_TABLE` / `AWQ_TABLE`;
  `quant_gemv` loads a step ahead for one row), the fused dequantizing GEMM of `quant_gemm`
  (weight tiles joined back into K order next to the tensor-core dot), or a dense K-order copy
  of the weight in x's dtype (`quant_gemm.dequantize_natural`) and cuBLAS.
* The other GGUF formats and all gradients: the generic tile kernels below, which dequantize
  a [BR, BC] tile of B per element (`quant_tiles.b_tile`) next to the dot product (many rows:
  a dense copy and cuBLAS).

Generic tile kernels: with x [M, R] (R = reduction), the packed matrix B [R, C] (`out = x @ B`;
for the gradients `out = g @ B.T`), each program owns an output tile and walks its share of R:
M == 1 multiplies on the CUDA cores, 1 < M <= 16 uses tl.dot with the row tile padded to 16,
both split R (split-K, float32 atomics); larger M uses 64/128-row tensor-core tiles.

Activations are float32 (dot in IEEE float32), bfloat16 or float16 (the dequantized tile is
rounded to that dtype for the MMA, as the recipe does; accumulation in float32); float64 calls
lower to the recipe. `config=` (QConfig, RowConfig, GemmConfig, PackedConfig, PackedDotConfig,
PackedGemmConfig or a path name) lets benchmarks pick a path and sweep tile shapes
(`bench_cuda_quant.py --sweep`, `bench_cuda_quant_gemv.py`, `bench_cuda_quant_gemm.py`)."""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ....registry.core import FusedOps
from ....registry.quant import (AWQ_MATMUL_GRAD_A, NF4_CODE, NF4_MATMUL_GRAD_A, QMATMUL_GRAD_A,
                                qmatmul_nk)
from ....registry.quant_gguf import FORMATS
from ...base import Cost, kernel
from .common import HALF_AND_F32, num_sms
from .quant_gemm import GEMM_FORMATS, GemmConfig, dequantize_natural, run_gemm
from .quant_packed import PACKED_FORMATS, PackedConfig, packable, run_packed
from .quant_packed_dot import DOT_FORMATS, PackedDotConfig, run_packed_dot
from .quant_mma import MmaConfig, mma_default, mma_ok, run_mma_cached
from .quant_packed_gemm import GEMM_PACKED_FORMATS, PackedGemmConfig, run_packed_gemm
from .quant_gluon_gemm import GluonGemmConfig, gluon_ok, run_gluon_gemm
from .quant_rows import FAST_FORMATS, RowConfig, dequantize_rows, run_rows
from .quant_tiles import AWQ, GGUF_IDS, NF4, b_tile


@triton.jit
def _qmm_fwd_kernel(x_ptr, w0, w1, w2, i0, out_ptr, M, K, N, stride_x, stride_o,
                    STEPS: tl.constexpr, FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr,
                    ATOMIC: tl.constexpr):
    """out[M, N] (+)= x[M, K] @ B[K, N] over this program's K range."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    k_start = tl.program_id(2) * STEPS * BLOCK_K
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = (offs_m < M)[:, None]
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * stride_x
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for i in range(STEPS):
        k0 = k_start + i * BLOCK_K
        offs_k = k0 + tl.arange(0, BLOCK_K)
        w = b_tile(FMT, w0, w1, w2, i0, k0, pid_n * BLOCK_N, K, N, BLOCK_K, BLOCK_N)
        if USE_DOT:
            xt = tl.load(x_rows + offs_k[None, :], mask=m_ok & (offs_k < K)[None, :], other=0.0)
            acc = tl.dot(xt, w.to(x_ptr.dtype.element_ty), acc, input_precision=PREC)
        else:
            xc = tl.load(x_rows + offs_k[:, None], mask=(offs_k < K)[:, None], other=0.0)
            acc += tl.sum(w * xc.to(tl.float32), axis=0)[None, :]
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_o + offs_n[None, :]
    o_mask = m_ok & (offs_n < N)[None, :]
    if ATOMIC:
        tl.atomic_add(o_ptrs, acc, mask=o_mask)
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _qmm_grad_kernel(g_ptr, w0, w1, w2, i0, out_ptr, M, K, N, stride_g, stride_o,
                     STEPS: tl.constexpr, FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr, USE_DOT: tl.constexpr, PREC: tl.constexpr,
                     ATOMIC: tl.constexpr):
    """out[M, K] (+)= g[M, N] @ B[K, N].T over this program's N range (output tile along K)."""
    pid_m = tl.program_id(0)
    pid_k = tl.program_id(1)
    n_start = tl.program_id(2) * STEPS * BLOCK_N
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_ok = (offs_m < M)[:, None]
    g_rows = g_ptr + offs_m.to(tl.int64)[:, None] * stride_g
    acc = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
    for i in range(STEPS):
        n0 = n_start + i * BLOCK_N
        offs_n = n0 + tl.arange(0, BLOCK_N)
        w = b_tile(FMT, w0, w1, w2, i0, pid_k * BLOCK_K, n0, K, N, BLOCK_K, BLOCK_N)
        if USE_DOT:
            gt = tl.load(g_rows + offs_n[None, :], mask=m_ok & (offs_n < N)[None, :], other=0.0)
            acc = tl.dot(gt, tl.trans(w.to(g_ptr.dtype.element_ty)), acc, input_precision=PREC)
        else:
            gr = tl.load(g_rows + offs_n[None, :], mask=(offs_n < N)[None, :], other=0.0)
            acc += tl.sum(w * gr.to(tl.float32), axis=1)[None, :]
    o_ptrs = out_ptr + offs_m.to(tl.int64)[:, None] * stride_o + offs_k[None, :]
    o_mask = m_ok & (offs_k < K)[None, :]
    if ATOMIC:
        tl.atomic_add(o_ptrs, acc, mask=o_mask)
    else:
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty), mask=o_mask)


@triton.jit
def _dequant_kernel(w0, w1, w2, i0, out_ptr, K, N, FMT: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """out[K, N] = B (the dequantized packed matrix), in out's dtype."""
    k0 = tl.program_id(0) * BLOCK_K
    n0 = tl.program_id(1) * BLOCK_N
    w = b_tile(FMT, w0, w1, w2, i0, k0, n0, K, N, BLOCK_K, BLOCK_N)
    kk = k0 + tl.arange(0, BLOCK_K)[:, None]
    nn = n0 + tl.arange(0, BLOCK_N)[None, :]
    tl.store(out_ptr + kk.to(tl.int64) * N + nn, w.to(out_ptr.dtype.element_ty),
             mask=(kk < K) & (nn < N))


def dequantize(fmt_id: int, w0, w1, w2, i0: int, k: int, n: int, dtype=torch.float32):
    """The packed matrix B [K, N] as a dense tensor (W.T for GGUF / NF4, W for AWQ), rounded
    once to `dtype`: for checking the tile dequantizers, and for GEMMs that prefer cuBLAS."""
    out = torch.empty(k, n, dtype=dtype, device=w0.device)
    grid = (triton.cdiv(k, 64), triton.cdiv(n, 64))
    _dequant_kernel[grid](w0, w1, w2, i0, out, k, n, FMT=fmt_id, BLOCK_K=64, BLOCK_N=64,
                          num_warps=4, enable_fp_fusion=False)
    return out


# ---- launch ---------------------------------------------------------------------------------
#: above this many activation rows the product dequantizes once into a dense copy and calls
#: cuBLAS (see `run`); at or below it the weight is dequantized in registers next to the dot
DEQUANT_GEMM_MIN_M = 64

@dataclass(frozen=True)
class QConfig:
    """Tile of one program: block_m rows of x, block_c output columns, block_r reduction
    elements per step; `split` programs share each output tile's reduction (atomics)."""
    block_m: int
    block_c: int
    block_r: int
    split: int = 0          # 0: chosen from the grid size and the SM count
    num_warps: int = 4
    num_stages: int = 2

    @property
    def use_dot(self) -> bool:
        return self.block_m >= 16


def default_config(m: int, c: int, r: int, device) -> QConfig:
    """Tile shapes by rows: GEMV (M = 1), small M (<= 16, one padded 16-row MMA tile), GEMM."""
    if m == 1:
        base = QConfig(1, 64, 128, num_warps=4)
    elif m <= 16:
        base = QConfig(16, 64, 128, num_warps=4)
    elif m <= 64:
        base = QConfig(64, 128, 64, num_warps=4, num_stages=3)
    else:
        base = QConfig(128, 128, 64, num_warps=8, num_stages=3)
    return base


def _split(cfg: QConfig, m: int, c: int, r: int, device) -> tuple[int, int]:
    """(split, steps per split): small-M grids split R until ~4 programs per SM stream the
    weight; GEMM grids only when smaller than half the machine."""
    total = triton.cdiv(r, cfg.block_r)
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(c, cfg.block_c)
    split = cfg.split
    if split <= 0:
        sms = num_sms(device)
        want = 4 * sms if cfg.block_m <= 16 else (sms if tiles < sms // 2 else tiles)
        split = max(1, min(total, want // max(tiles, 1)))
    steps = triton.cdiv(total, split)
    return triton.cdiv(total, steps), steps


#: default path per format and activation rows (the first key >= M applies): "rows" (the
#: storage-order kernels of `quant_rows` with their launch table), a RowConfig / GemmConfig
#: (`quant_gemm`'s fused dequantizing GEMM; 16-bit x only, float32 x takes "dequant"), "tiles"
#: (the generic tile kernels below), "dequant" (dense K-order copy of the weight + cuBLAS),
#: "dequant_rows" (the copy written in storage order). H200, N = K = 8192, bf16:
#: * rows beat tiles at M = 1 (Q4_0 0.066 vs 0.133 ms, Q8_0 0.105 vs 0.143, Q4_K 0.077 vs 0.187)
#:   but lost at M = 16 (Q4_0 0.158 vs 0.086, Q8_0 0.247 vs 0.097, Q4_K 0.202 vs 0.132); NF4 and
#:   AWQ rows won at both (M = 16: 0.068 vs 0.741, 0.063 vs 0.886). Session 4 sweep: the fused
#:   GEMM with 16-row tiles lost to tiles at Q4_0 M = 16 (0.124 vs 0.086); the one-row prefetch
#:   GEMV tied the rows kernel (Q4_0 0.0589 vs 0.0585, CUDA-graph times).
#: * M = 256: AWQ's fused GEMM (128 x 256 tiles, split 2) 0.143 ms vs 0.370 (dense copy + cuBLAS);
#:   Q4_0's dense copy in storage order 0.126 vs 0.164 in K order vs 0.358 fused (its 18-byte
#:   blocks allow only 2-byte loads, which Triton does not pipeline). NF4's storage-order copy
#:   (every other element a store, 1.03 ms) is replaced by the K-order copy (16-byte stores).
#: * session 5 (CUDA-graph times, `cuda_quant_2026-12-01` --sweep packed): M = 1 takes "packed"
#:   (`quant_packed`: a cached copy of the weight in 16-byte-aligned chunk order, a GEMV with
#:   wide loads): Q4_0 0.0181 ms (rows 0.0586), AWQ 0.0207 (0.0319), NF4 0.0290 (0.0358), Q4_K
#:   ~0.027 (0.0674), Q8_0 0.0280 (0.0993), Q6_K 0.0352 (0.0859); shapes it rejects take "rows".
#:   M <= 16 of Q4_0 / Q8_0 / Q4_K: tensor-core dots on that copy (`quant_packed_dot`, 64 x 16
#:   tiles): 0.0478 / 0.0551 / 0.0628 vs tiles 0.0873 / 0.0967 / 0.131; NF4 and AWQ keep rows
#:   (0.057 / 0.051 vs 0.060 / 0.069); shapes the copy rejects take the tiles.
AWQ_GEMM = GemmConfig(128, 256, 64, 0, 8, 3)
#: * session 6 (bench_cuda_quant_gemv, CUDA graphs warm / cold): four planes side by side in one
#:   dot (join 4, one chunk a step, the words a step ahead) for Q4_0 0.0441 / 0.0463 (before
#:   0.0476 / 0.0503; without prefetch 0.0438-0.0442 / 0.0458-0.0461) and Q8_0 0.0477 / 0.0481
#:   (0.0549 / 0.0551): each dot is a wgmma behind a shared-memory store, fence and barriers.
#:   Q4_K lost with it (0.0774 vs 0.0628) and keeps 8 dots a step; all 8 planes in one dot lost
#:   (Q4_0 0.0779: the joined tile goes through more layout conversions)
#: * session 7 (same bench, one run, warm / cold): four planes a dot in K order (x read with
#:   16-byte loads), whole steps without masks (split 4 here), and for the affine 4-bit formats
#:   each plane's precomputed (a, b) pair (one load and one FMA a weight): Q4_0 0.0368 / 0.0374
#:   (the session 6 default 0.0437 / 0.0458 in the same run), AWQ 0.0372 / 0.0376 (its rows
#:   kernel 0.0526 / 0.0549), Q4_K 0.0373 / 0.0378 (0.0709 / 0.0731); NF4 with warp-shuffle
#:   code lookups 0.0406 / 0.0433 (0.0522 / 0.0545 with tl.gather; rows 0.057), Q8_0 0.0399 /
#:   0.0403 (0.0463), Q6_K (a scale per half plane) 0.0736 / 0.0739 (tile kernels 0.156). The
#:   session 6 launch on 4 splits lost (0.0528: 164 registers, 3 programs an SM for 512), and
#:   all loads of a step before its first dot (early, 168 registers) lost (0.0461)
PACKED_DOT_NAT = PackedDotConfig(64, 16, 1, 0, 4, 1, join=4, nat=1)
PACKED_DOT_AFF = PackedDotConfig(64, 16, 1, 0, 4, 1, join=4, nat=1, aff=1)
_GGUF_ROUTE = {1: "rows", DEQUANT_GEMM_MIN_M: "tiles", 1 << 62: "dequant_rows"}
_PACKED_GGUF_ROUTE = {1: "packed", DEQUANT_GEMM_MIN_M: "tiles", 1 << 62: "dequant_rows"}
#: 2..16 rows of 16-bit x: the packed dot's launch per format (float32 x keeps the rows kernels
#: of NF4 / AWQ and the tile kernels of the GGUF formats: the dots were measured for 16 bits).
#: Session 8: bf16 x of every format but NF4 takes quant_mma first (MMA_DEFAULT_ROWS); session 9:
#: NF4 too (16 rows 0.0215 ms against this dot's 0.0415)
DOT_16 = {GGUF_IDS["Q4_0"]: PACKED_DOT_AFF, GGUF_IDS["Q8_0"]: PACKED_DOT_NAT,
          GGUF_IDS["Q4_K"]: PACKED_DOT_AFF, GGUF_IDS["Q6_K"]: PACKED_DOT_NAT,
          AWQ: PACKED_DOT_AFF, NF4: PackedDotConfig(64, 16, 1, 0, 4, 1, join=4, nat=1, shfl=1)}


def _dot_gguf_route(dot):
    return {1: "packed", 16: dot, DEQUANT_GEMM_MIN_M: "tiles", 1 << 62: "dequant_rows"}


def _with_dot(fmt, route):
    """route with DOT_16's launch of the format for 2..16 rows, if it has one."""
    return route if fmt not in DOT_16 else {**route, 16: DOT_16[fmt]}


#: DEQUANT_GEMM_MIN_M + 1 .. PACKED_GEMM_MAX_M rows of 16-bit x: the GEMM on the packed copy
#: (`quant_packed_gemm`) for the formats listed (float32 x, shapes the copy rejects and, while
#: a CUDA graph is captured before the affine pairs exist, MANY_ROWS_FALLBACK)
#: H200, N = K = 8192, M = 256, bf16, CUDA-graph medians (bench_cuda_quant_gemm.py, session 8,
#: two runs; dense cuBLAS 0.0552 / 0.0538 ms): every load by TMA (tma=2, 128 x 128 tiles, 3
#: stages) Q4_0 0.0843 / 0.0856 ms (the dense copy + cuBLAS 0.1251 / 0.1238), AWQ 0.0862 (its
#: storage-order GEMM 0.1441), Q4_K 0.0897 (0.1220); Q8_0 with x by TMA and a step's scales in
#: one load 0.0886 (0.1234). NF4 (0.1151 vs its dense copy 0.1050) and Q6_K (0.1757 vs
#: 0.1305) keep the dense copy. The same loop without any decoding runs 0.0639 (the structure:
#: a shared-memory layout conversion of the decoded tile and CTA barriers a step), the decode
#: adds ~0.022. Lost: cp.async loads (Q4_0 0.0985, one load a plane 0.1224), 2 / 4 stages
#: (0.1373 / 0.0869), a chunk a step (0.1144), 64 x 128 tiles on 4 warps, two programs an SM
#: (0.1018), 64 x 256 (0.1184 / 0.1346), 128 x 256 split 2 (0.1003; meeting in the kernel
#: instead of atomics 0.1025), the pairs moved to the kernel's views once (0.0861), Triton's
#: warp-specialized loop (wrong results), x as the wgmma's left operand (Q4_0 0.0927). Third
#: run, these defaults: Q4_0 0.0861, AWQ 0.0854, Q4_K 0.0885, Q8_0 0.0881 (dense 0.0549); M =
#: 128: Q4_0 0.0522 (split 2) vs 0.1151. M = 1024: 0.3480 vs the dense copy's 0.2588: above
#: one wave of 128 x 128 tiles the dense copy + cuBLAS wins (estimated crossover below 512)
_GEMM_TMA = PackedGemmConfig(128, 128, 0, 8, 3, tma=2, vec=1)
PACKED_GEMM: dict = {GGUF_IDS["Q4_0"]: _GEMM_TMA, AWQ: _GEMM_TMA, GGUF_IDS["Q4_K"]: _GEMM_TMA,
                     GGUF_IDS["Q8_0"]: PackedGemmConfig(128, 128, 0, 8, 3, tma=1, vec=1)}
PACKED_GEMM_MAX_M = 256


#: sm_90 GPUs, 16-bit x, DEQUANT_GEMM_MIN_M + 1 .. PACKED_GEMM_MAX_M rows: the Gluon wgmma GEMM
#: on the fragment-order copy (`quant_gluon_gemm`), a launch per row bound (elsewhere, and for
#: shapes it rejects, the format's PACKED_GEMM launch or MANY_ROWS_FALLBACK). Session 10, H200,
#: N = K = 8192, bf16, CUDA-graph medians (three runs; dense cuBLAS 0.050-0.0575 ms): K split
#: in two (128 programs, each reading half of x) on 128 x 256 tiles (two warpgroups) with the
#: TMA producer warp; the 4-bit formats with the words and scales by TMA (wtma) and 5 stages:
#: Q4_0 0.0639, AWQ 0.0637, Q4_K 0.0665, NF4 0.0698 (4 stages: 0.0655-0.0659 / 0.0666 / 0.0678
#: / 0.0696); Q8_0 5 stages, words loaded by the threads, 0.0667 (6 stages 0.0675, wtma
#: 0.0699-0.0711); Q6_K 6 stages 0.0697 (5: 0.0710, wtma 0.0711). Session 9's 64 x 256 tiles
#: in the same runs: 0.0757 / 0.0781 / 0.0840 / 0.0857 / 0.0847 / 0.0826. M = 128, 128 x 128
#: tiles split in two with the producer warp: Q4_0 0.0493-0.0498 (packed GEMM 0.0518-0.0524),
#: AWQ 0.0502 (0.0514), Q4_K 0.0515 (0.0534), Q8_0 0.0513 (0.0524), NF4 0.0533 (64 x 128 tiles
#: 0.0675); Q6_K without the producer warp 0.0545 (64 x 128 0.0683). The first launch timed
#: after the dense anchor measured up to 30% slower in every run (whatever the launch): these
#: are the later positions.
#: Session 11: the decoded tiles as the wgmmas' register operands (`rega`, two steps an
#: iteration; no shared A tile: a step moves 96 KB through shared memory instead of 128), one
#: stage more where it fits. H200 round 1 (each launch timed twice, interleaved; dense
#: 0.0526-0.0565): M = 256 Q4_0 wtma 6 stages 0.0572-0.0576 (words loaded by the threads
#: 0.0575; session 10's default 0.0635-0.0636), AWQ wtma 5 stages 0.0595-0.0603 (0.0637-0.0638),
#: Q4_K 0.0617-0.0624 (0.0672), NF4 0.0631-0.0633 (0.0698-0.0707; 6 stages 0.0633-0.0638),
#: Q8_0 6 stages, words loaded, 0.0605-0.0608 (0.0665-0.0681; 7 stages 0.0611-0.0617, wtma
#: 0.0621-0.0629), Q6_K 0.0638-0.0643 (0.0715; 7 stages 0.0642-0.0644); M = 128 Q4_0 0.0430
#: (0.0490-0.0493; dense 0.0354). Register A with one step an iteration: wrong (NaN). Round 2
#: (these defaults against session 10's, twice each; dense 0.0533-0.0572 / 0.0365-0.0387):
#: M = 256 Q4_0 0.0579 / 0.0581 (0.0639 / 0.0644), AWQ 0.0617 / 0.0606 (0.0647 / 0.0653), Q4_K
#: 0.0645 / 0.0625 (0.0687 / 0.0684), NF4 0.0645 after a first 0.0744 (0.0706 / 0.0698), Q8_0
#: 0.0604 / 0.0634 (0.0704 / 0.0693), Q6_K 0.0632 (0.0718); words loaded by the threads, 6
#: stages, for the 4-bit ones: 0.0582-0.0657, the same within noise. M = 128: Q4_0 0.0436 /
#: 0.0432 (0.0490 / 0.0491), AWQ 0.0478 / 0.0466 (0.0503 / 0.0502), Q4_K 0.0493 / 0.0475
#: (0.0517 / 0.0515), NF4 0.0482 / 0.0466 (0.0540 / 0.0536), Q8_0 0.0497 / 0.0481 (0.0516 /
#: 0.0514), Q6_K 0.0497 / 0.0483 (0.0546 / 0.0545).
#: Decodes, round 2 on register A: Q4_0 / AWQ with the bf16x2 decode (h2, bf16 x; the scales
#: by broadcast loads) 0.0572-0.0575 / 0.0588-0.0590 against 0.0575-0.0578 / 0.0601-0.0604;
#: Q6_K with the code at bit 16 (no FADD) 0.0642-0.0658 against 0.0656-0.0671 (dense
#: 0.0541-0.0570).
_RW5 = GluonGemmConfig(8, 256, 5, 2, 1, split=2, wtma=1, rega=1)
_R128 = GluonGemmConfig(8, 128, 4, 2, 1, split=2, rega=1)
_R6 = GluonGemmConfig(8, 256, 6, 2, 1, split=2, rega=1)
GLUON_GEMM: dict = {
    GGUF_IDS["Q4_0"]: {128: _R128,
                       256: GluonGemmConfig(8, 256, 6, 2, 1, 1, split=2, wtma=1, rega=1)},
    AWQ: {128: _R128, 256: GluonGemmConfig(8, 256, 5, 2, 1, 1, split=2, wtma=1, rega=1)},
    **{fmt: {128: _R128, 256: _RW5} for fmt in (GGUF_IDS["Q4_K"], NF4)},
    **{GGUF_IDS[f]: {128: _R128, 256: _R6} for f in ("Q8_0", "Q6_K")}}


def _with_gemm(fmt, route):
    """route with GLUON_GEMM's launches, else PACKED_GEMM's, up to PACKED_GEMM_MAX_M rows."""
    if fmt in GLUON_GEMM:
        return {**route, **GLUON_GEMM[fmt]}
    return route if fmt not in PACKED_GEMM else {**route, PACKED_GEMM_MAX_M: PACKED_GEMM[fmt]}


ROUTES = {NF4: _with_dot(NF4, {1: "packed", DEQUANT_GEMM_MIN_M: "rows", 1 << 62: "dequant"}),
          AWQ: _with_dot(AWQ, {1: "packed", DEQUANT_GEMM_MIN_M: "rows", 1 << 62: AWQ_GEMM}),
          **{fmt: _dot_gguf_route(DOT_16[fmt]) if fmt in DOT_16 else
             _PACKED_GGUF_ROUTE if fmt in PACKED_FORMATS else _GGUF_ROUTE
             for fmt in FAST_FORMATS if fmt not in (NF4, AWQ)}}
ROUTES = {fmt: _with_gemm(fmt, route) for fmt, route in ROUTES.items()}


#: many rows where the packed GEMM cannot run (float32 x, unpackable shapes, no affine pairs
#: while a CUDA graph is captured): the previous defaults
MANY_ROWS_FALLBACK = {AWQ: AWQ_GEMM, NF4: "dequant"}


def default_route(fmt_id: int, m: int):
    """The default path (see ROUTES) for `m` rows of a format that has the fast kernels."""
    table = ROUTES[fmt_id]
    return table[min(key for key in table if m <= key)]


def _has_rows_kernel(fmt_id: int, i0: int) -> bool:
    """Formats of `quant_rows` (NF4 with a power-of-two block size >= 32, AWQ groups of 16k)."""
    if fmt_id == NF4:
        return i0 >= 32 and i0 & (i0 - 1) == 0
    if fmt_id == AWQ:
        return i0 % 16 == 0
    return fmt_id in FAST_FORMATS


def run(fmt_id: int, x, w0, w1, w2, i0: int, k: int, n: int, *, grad: bool = False,
        config: QConfig | RowConfig | GemmConfig | PackedConfig | PackedDotConfig | MmaConfig |
        PackedGemmConfig | GluonGemmConfig | str | None = None):
    """x [..., K] @ B [K, N] (or, with grad, x [..., N] @ B.T) for packed B of format fmt_id;
    returns [..., N] (or [..., K]) in x's dtype. config: None (defaults), a QConfig (the
    generic tile kernels), a RowConfig (the storage-order kernels of quant_rows), a GemmConfig
    (the fused dequantizing GEMM of quant_gemm), a PackedConfig or "packed" (one row: the GEMV
    on the cached chunk-layout copy of quant_packed; else, or for shapes it rejects, "rows"), a
    PackedDotConfig (any rows: tensor-core dots on that copy, quant_packed_dot), a
    PackedGemmConfig (many rows of 16-bit x: the GEMM on that copy, quant_packed_gemm), a
    GluonGemmConfig (many rows of 16-bit x on sm_90: the wgmma GEMM on the fragment-order
    copy of quant_gluon_gemm; elsewhere the format's PACKED_GEMM launch),
    "tiles", "rows", "dequant" (dense K-order copy of the weight + cuBLAS) or "dequant_rows"
    (the copy written in storage order). Configs a format / direction has no kernel for fall
    back to the tile kernels."""
    rows_ok = not grad and _has_rows_kernel(fmt_id, i0) and x.dtype != torch.float64
    m_all = x.numel() // max(x.shape[-1], 1)
    if m_all == 0:
        return torch.zeros(*x.shape[:-1], k if grad else n, dtype=x.dtype, device=x.device)
    if config is None and rows_ok and mma_default(fmt_id, x, i0, k, n, m_all):
        config = "mma"                  # few rows on tensor cores (quant_mma.MMA_DEFAULT_ROWS)
    if config is None:
        if rows_ok and fmt_id in ROUTES:
            config = default_route(fmt_id, m_all)
            if isinstance(config, GemmConfig) and x.dtype == torch.float32:
                config = "dequant"      # the GEMM tiles are sized for 16-bit operands
            elif isinstance(config, PackedDotConfig) and x.dtype == torch.float32:
                # (measured for 16-bit x; float32 dots spill)
                config = "rows" if fmt_id in (NF4, AWQ) else "tiles"
        else:
            config = "dequant" if m_all > DEQUANT_GEMM_MIN_M else "tiles"
    if isinstance(config, MmaConfig) or config == "mma":    # M <= 16 on tensor cores (quant_mma)
        if rows_ok and mma_ok(fmt_id, x, i0, k, n, m_all):
            return run_mma_cached(fmt_id, x, w0, w1, w2, i0, k, n,
                                  config if isinstance(config, MmaConfig) else None)
        config = "packed"
    if isinstance(config, GluonGemmConfig):
        if config.num_warps > 4 and n % config.block_n and n % 64 == 0:
            config = dataclasses.replace(config, num_warps=4)     # 64-row tiles fit N
        if rows_ok and gluon_ok(fmt_id, x, w0, w1, w2, i0, k, n, config):
            return run_gluon_gemm(fmt_id, x, w0, w1, w2, i0, k, n, config=config)
        config = PACKED_GEMM.get(fmt_id, MANY_ROWS_FALLBACK.get(fmt_id, "dequant_rows"))
    if isinstance(config, PackedGemmConfig):
        if rows_ok and fmt_id in GEMM_PACKED_FORMATS and packable(fmt_id, i0, k, n) and \
                x.dtype in (torch.bfloat16, torch.float16):
            out = run_packed_gemm(fmt_id, x, w0, w1, w2, i0, k, n, config=config)
            if out is not None:
                return out
        config = MANY_ROWS_FALLBACK.get(fmt_id, "dequant_rows")
        if isinstance(config, GemmConfig) and x.dtype == torch.float32:
            config = "dequant"
    if isinstance(config, PackedDotConfig):
        if rows_ok and fmt_id in DOT_FORMATS and packable(fmt_id, i0, k, n):
            return run_packed_dot(fmt_id, x, w0, w1, w2, i0, k, n, config=config)
        config = "rows" if fmt_id in (NF4, AWQ) else "tiles"
    if config == "packed" or isinstance(config, PackedConfig):
        if rows_ok and m_all == 1 and packable(fmt_id, i0, k, n):
            return run_packed(fmt_id, x, w0, w1, w2, i0, k, n,
                              config=config if isinstance(config, PackedConfig) else None)
        config = "rows"
    if isinstance(config, GemmConfig) and rows_ok and fmt_id in GEMM_FORMATS:
        return run_gemm(fmt_id, x, w0, w1, w2, i0, k, n, config=config)
    if config in ("dequant", "dequant_rows"):
        return _dequant_matmul(fmt_id, x, w0, w1, w2, i0, k, n, grad, rows_ok,
                               natural=config != "dequant_rows")
    if (config == "rows" or isinstance(config, RowConfig)) and rows_ok:
        return run_rows(fmt_id, x, w0, w1, w2, i0, k, n,
                        config=config if isinstance(config, RowConfig) else None)
    if not isinstance(config, QConfig):
        config = None
    red, cols = (n, k) if grad else (k, n)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, red)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    m = x2.shape[0]
    if m == 0:
        return torch.zeros(*lead, cols, dtype=x.dtype, device=x.device)
    cfg = config or default_config(m, cols, red, x.device)
    split, steps = _split(cfg, m, cols, red, x.device)
    atomic = split > 1
    out = torch.zeros(m, cols, dtype=torch.float32, device=x.device) if atomic else \
        torch.empty(m, cols, dtype=x.dtype, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(cols, cfg.block_c), split)
    kern = _qmm_grad_kernel if grad else _qmm_fwd_kernel
    bn, bk = (cfg.block_r, cfg.block_c) if grad else (cfg.block_c, cfg.block_r)
    kern[grid](x2, w0, w1, w2, i0, out, m, k, n, x2.stride(0), out.stride(0), STEPS=steps,
               FMT=fmt_id, BLOCK_M=cfg.block_m, BLOCK_N=bn, BLOCK_K=bk, USE_DOT=cfg.use_dot,
               PREC="ieee" if x.dtype == torch.float32 else "tf32", ATOMIC=atomic,
               num_warps=cfg.num_warps, num_stages=cfg.num_stages, enable_fp_fusion=False)
    if atomic and x.dtype != torch.float32:
        out = out.to(x.dtype)
    return out.reshape(*lead, cols)


def _dequant_matmul(fmt_id, x, w0, w1, w2, i0, k, n, grad, rows_ok, natural=True):
    """Many rows: a dense copy of the weight in x's dtype, then cuBLAS (H200, 2026-12-01, N = K =
    8192, M = 256, bf16, old tile kernels: Q4_0 0.13 ms vs 0.31 fused in registers, Q4_K 0.22 vs
    0.51, Q8_0 0.13 vs 0.28, Q6_K 0.16 vs 0.39). Row formats write W [N, K] in storage order."""
    if rows_ok and fmt_id != AWQ:
        deq = dequantize_natural if natural else dequantize_rows
        w = deq(fmt_id, w0, w1, w2, i0, k, n, dtype=x.dtype)                  # W [N, K]
        return x @ w.T
    b = dequantize(fmt_id, w0, w1, w2, i0, k, n, dtype=x.dtype)              # B [K, N]
    return x @ (b.T if grad else b)


def _aligned(t):
    """Byte tensors whose f16 fields the kernels read as 2-byte words must start 2-aligned."""
    return t if t.data_ptr() % 16 == 0 else t.clone()


@functools.lru_cache(maxsize=None)
def _nf4_code(device: str):
    return torch.tensor(NF4_CODE, device=device)


# ---- costs ----------------------------------------------------------------------------------
def _cost(bits, cols, red):
    """2 * M * R * C flops; bytes of x, out (2 bytes each) and the packed weight."""
    def cost(shapes, params=None):
        m = math.prod(shapes[0][:-1])
        r, c = red(shapes, params), cols(shapes, params)
        return Cost(2 * m * r * c, 2 * m * (r + c) + r * c * bits(shapes, params) / 8)
    return cost


def _nk(shapes, p, grad=False):
    return qmatmul_nk(p.quant_type, p.n, p.k, shapes[0], math.prod(shapes[1]), grad)


def _gguf_bits(shapes, p):
    return 8 * FORMATS[p.quant_type].type_size / FORMATS[p.quant_type].block


def _nf4_n(s, p):
    return s[1][0]


def _nf4_k(s, p):
    return 2 * s[1][1]


def _awq_n(s, p):
    return 8 * s[1][1]


def _awq_k(s, p):
    return s[1][0]


def _nf4_bits(s, p):
    return 4 + 32 / p.block_size


def _awq_bits(s, p):
    return 4 + 20 / p.group_size


# ---- kernels --------------------------------------------------------------------------------
@kernel(FusedOps.QMATMUL, "cuda", dtypes=HALF_AND_F32, name="triton.qmatmul",
        cost=_cost(_gguf_bits, lambda s, p: _nk(s, p)[0], lambda s, p: _nk(s, p)[1]),
        precision="fp32 accumulate")
def qmatmul(a, w_bytes, *, quant_type, n=None, k=None, config=None):
    n, k = qmatmul_nk(quant_type, n, k, a.shape, w_bytes.numel())
    w = _aligned(w_bytes)
    return run(GGUF_IDS[quant_type], a, w, w, w, FORMATS[quant_type].row_bytes(k), k, n,
               config=config)


@kernel(QMATMUL_GRAD_A, "cuda", dtypes=HALF_AND_F32, name="triton.qmatmul_grad_a",
        cost=_cost(_gguf_bits, lambda s, p: _nk(s, p, True)[1], lambda s, p: _nk(s, p, True)[0]),
        precision="fp32 accumulate")
def qmatmul_grad_a(g, w_bytes, *, quant_type, n=None, k=None, config=None):
    n, k = qmatmul_nk(quant_type, n, k, g.shape, w_bytes.numel(), grad=True)
    w = _aligned(w_bytes)
    return run(GGUF_IDS[quant_type], g, w, w, w, FORMATS[quant_type].row_bytes(k), k, n,
               grad=True, config=config)


@kernel(FusedOps.NF4_MATMUL, "cuda", dtypes=HALF_AND_F32, name="triton.nf4_matmul",
        cost=_cost(_nf4_bits, _nf4_n, _nf4_k), precision="fp32 accumulate")
def nf4_matmul(a, w_packed, absmax, *, block_size, config=None):
    n, k = w_packed.shape[0], 2 * w_packed.shape[1]
    return run(NF4, a, w_packed, absmax, _nf4_code(str(a.device)), block_size, k, n,
               config=config)


@kernel(NF4_MATMUL_GRAD_A, "cuda", dtypes=HALF_AND_F32, name="triton.nf4_matmul_grad_a",
        cost=_cost(_nf4_bits, _nf4_k, _nf4_n), precision="fp32 accumulate")
def nf4_matmul_grad_a(g, w_packed, absmax, *, block_size, config=None):
    n, k = w_packed.shape[0], 2 * w_packed.shape[1]
    return run(NF4, g, w_packed, absmax, _nf4_code(str(g.device)), block_size, k, n,
               grad=True, config=config)


@kernel(FusedOps.AWQ_MATMUL, "cuda", dtypes=HALF_AND_F32, name="triton.awq_matmul",
        cost=_cost(_awq_bits, _awq_n, _awq_k), precision="fp32 accumulate")
def awq_matmul(a, qweight, qzeros, scales, *, group_size, config=None):
    k, n = qweight.shape[0], 8 * qweight.shape[1]
    return run(AWQ, a, qweight, qzeros, scales, group_size, k, n, config=config)


@kernel(AWQ_MATMUL_GRAD_A, "cuda", dtypes=HALF_AND_F32, name="triton.awq_matmul_grad_a",
        cost=_cost(_awq_bits, _awq_k, _awq_n), precision="fp32 accumulate")
def awq_matmul_grad_a(g, qweight, qzeros, scales, *, group_size, config=None):
    k, n = qweight.shape[0], 8 * qweight.shape[1]
    return run(AWQ, g, qweight, qzeros, scales, group_size, k, n, grad=True, config=config)
