"""Many-row quantized matmul (`out = x @ W.T`, x [M, K] bf16 / f16 with M in the hundreds,
W [N, K]; Q4_0, AWQ, Q4_K, Q8_0, NF4, Q6_K) as a Gluon kernel for Hopper (sm_90): each thread
loads the packed words that hold exactly its elements of the wgmma A fragment, decodes them
in registers, and the tile feeds an async `warpgroup_mma` (weight as A, the x tile as B from
shared memory by TMA) with no layout conversion.

Why: the Triton GEMM of `quant_packed_gemm` decodes the weight tile in a blocked layout and
the compiler moves it through shared memory into the wgmma operand (layout conversion, CTA
barriers every step), so decode and tensor cores hardly overlap (H200, N = K = 8192, M = 256:
0.064 ms with a one-shift decode against dense cuBLAS's 0.055). Here step i's decode runs
while the wgmma of step i - 1 is in flight (issue, then wait with one group outstanding).

Layout: `quant_gluon_pack`.

Decode (bit for bit the format's dequantizer, then rounded once to x's dtype as the other
GEMMs do): v = 2^23 + 2^SH q as float32 (the code moved to bit SH = 12 / 16 (4-bit: one
shift a nibble pair, one LOP3 a weight) or 8 (bytes: one PRMT a weight) and OR-ed into 2^23's
mantissa, exact); Q4_0 / AWQ / Q8_0: W = fma(v, a, b) with a = s 2^-SH and
b = o - s 2^(23 - SH) exact (`quant_gluon_pack.wgmma_pairs`), so the fused result is the
exact product s (q - z); Q4_K: fma(v - 2^23, a, b) = (d sc) q - dmin m rounded once, and Q6_K
(SH = 16, q + 32 < 64) fma(v, a, -160 d sc) = (d sc) (q - 32) rounded once, as gguf-py; NF4:
code[q] by a warp shuffle from the lanes' registers, times absmax; Q4_0 / AWQ with bf16 x
(`h2`, the defaults): bf16x2 pairs, fma(q - z, dh, dl (q - z)) with s = dh + dl
(`quant_gluon_pack.h2_scales`). The decodes: `quant_gluon_decode`.

Kernel: a program owns BLOCK_N = 16 warps weight rows and BLOCK_M rows of x (acc [BLOCK_N,
BLOCK_M] float32 in the wgmma layout, one warpgroup per 64 rows); x tiles [BLOCK_M, 64] in a
ring of STAGES shared-memory buffers filled by TMA (an mbarrier each); the packed words and
scales of the next iteration are loaded into the registers just decoded. The decoded
[BLOCK_N, 64] tile is a join / permute / reshape of the word planes whose layout is the
DotOperandLayout up to register order (`convert_layout` moves no data: checked in the SASS by
bench/sass_quant_gluon.py). It reaches the wgmma through a shared-memory A buffer (stmatrix,
two buffers alternating, one CTA barrier a step), or (`rega`) as its register operand. Then
an iteration has two steps, two distinct tiles: with one, the PTX itself rewrites the tile's
registers (the next iteration's decode) while its wgmma is still in flight (`wait_group 1`
retires only the one before), which no ptxas can keep apart (session 9's wrong register-A
results on the H200, one step an iteration; CUDA 12.8's and 13.0's ptxas give the same SASS:
bench/sass_wgmma_regs.py checks that no instruction writes an HGMMA's A registers before
the DEPBAR that retires it; `quant_gluon_rega`). ptxas serializes the wgmmas (`DEPBAR.LE
gsb0, 0x0` after each) for some code shapes (a layout conversion in the epilogue, a zero-trip
path that defines the accumulator): bench/sass_quant_gluon.py flags it. Runs on sm_90 only
(Gluon has no interpreter).

H200, N = K = 8192, M = 256 (session 9; dense cuBLAS 0.0511 ms): 64 x 256 tiles Q4_0 0.0769,
AWQ 0.0760, Q4_K 0.0786, Q8_0 0.0775, NF4 0.0821, Q6_K 0.0785 ms. They read x 128 times from
L2 (512 MB); 128 x 128 tiles (half the x traffic, every weight decoded twice) 0.080-0.093.

Split K (`split=2`, session 10): 128 x 256 tiles (two warpgroups, 128 float32 acc registers a
thread) over half of K each are again 128 programs, but each reads only its half of x: 256 MB
from L2 instead of 512, and each weight is still decoded once. The two programs of a tile meet
after their loops (`_split_epilogue`): the first to arrive writes its float32 partial, the
second adds it to its own and stores; a + b is commutative, so the result does not depend on
which came first. A tile counter a launch (zeroed again by the second program) orders them;
the first never waits, so the meeting cannot deadlock whatever runs at once. With the producer
warp and the words and scales brought by TMA into the x ring (`wtma`: no global load, so the
A fences wait for none) and 5 stages, H200 M = 256: Q4_0 0.0639, AWQ 0.0637, Q4_K 0.0665,
NF4 0.0698; the 8-bit formats (whose wtma rings do not fit 5 stages) with the words loaded by
the threads, Q8_0 5 stages 0.0667, Q6_K 6 stages 0.0697 (quant.GLUON_GEMM; dense cuBLAS
0.050-0.057 in those runs). That left mostly shared-memory traffic: a step of a 128 x 256
tile moved 128 KB through shared memory (the two warpgroups' wgmma operand reads, the x tile
by TMA, the decoded A tile by stmatrix and its wgmma read) for 1024 cycles of tensor-core
work, about the 128 bytes a cycle an SM has. Lost on these tiles (session 10, round 1): late
loads (Q4_0 0.0706 / Q8_0 0.0761 against 0.0668 / 0.0721), rotated K (Q4_0 0.0687), the
look-ahead loads right after each A fence (0.0708 / 0.0747; removed).

Register A (`rega`, session 11, the defaults): no A tile in shared memory (96 KB a step),
no stmatrix, no proxy fence, and the freed 32 KB a sixth stage. H200 M = 256 (two runs;
dense cuBLAS 0.053-0.057): Q4_0 0.057-0.058, AWQ 0.060-0.062, Q4_K 0.062-0.064, NF4
0.063-0.065, Q8_0 0.060-0.063, Q6_K 0.063-0.064 (session 10's 0.064-0.072 in the same runs);
M = 128 (dense 0.037-0.039) 0.043-0.050 (0.049-0.055). It needs no particular ptxas: the PTX
no longer writes an in-flight operand (the SASS check above, CUDA 12.8 and 13.0)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                              warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

# (the copy's names re-exported: tests and bench/sass_quant_gluon.py read them here)
from .quant_gluon_pack import (_BFA, _BITS, _KIND, _PAIRS, GLUON_FORMATS, H2_MAGIC, MAGIC,
                               STEP_K, WgmmaWeight, h2_scales, pack_wgmma)
from .common import arrival_counters
from .quant_gluon_decode import B_OVER_A, _decode, _load_step, _smem_step  # noqa: F401
from .quant_gluon_rega import fit_stages, operand_path
from .quant_gluon_split import _split_epilogue
from .quant_packed import packed_weight
from .quant_tiles import AWQ, NF4, Q4_0, Q6_K


def gluon_ok(fmt: int, x, w0, w1, w2, i0: int, k: int, n: int, cfg: "GluonGemmConfig") -> bool:
    """Whether this kernel takes the call: a format of GLUON_FORMATS, 16-bit x on an sm_90 GPU
    (wgmma), N a multiple of the launch's block_n, K of 64, AWQ groups of 32k; not while a CUDA
    graph is captured before the weight's copy exists (it would live in the graph's pool)."""
    if fmt not in GLUON_FORMATS or n % cfg.block_n or k % STEP_K or \
            x.dtype not in (torch.bfloat16, torch.float16) or not x.is_cuda or \
            torch.cuda.get_device_capability(x.device)[0] != 9:
        return False
    if fmt in (AWQ, NF4) and not (i0 >= 32 and i0 % 32 == 0 and k % i0 == 0):
        return False
    if fmt == Q6_K and k % 256:
        return False
    return not torch.cuda.is_current_stream_capturing() or \
        packed_weight(fmt, w0, w1, w2, i0, k, n, build=pack_wgmma, make=False) is not None


# ---- kernel ---------------------------------------------------------------------------------
@gluon.constexpr_function
def _mma_layout(T, block_m):
    """The wgmma accumulator layout of a [16 T, block_m] tile, 16 rows a warp."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[T, 1],
                                     instr_shape=[16, block_m, 16])


@gluon.constexpr_function
def _thread_run_layout(run, T):
    """A flat layout over T warps, `run` contiguous elements a thread (its words or pairs)."""
    return gl.BlockedLayout([run], [32], [T], [0])


@gluon.jit
def _xk(step, rot, steps, ROT: gl.constexpr, k0=0):
    """Column of x of the program's step (ROT: K walked from step rot on, wrapping; k0: the
    first step of the program's K range, split K)."""
    if ROT:
        return ((step + rot) % steps + k0) * 64
    return (step + k0) * 64


@gluon.jit
def _issue(i, ok, x_smem, ready, x_desc, m0, steps, STAGES: gl.constexpr, rot,
           ROT: gl.constexpr, k0, wt, tile, WTMA: gl.constexpr):
    """The TMA copies of step i into ring buffer i % STAGES (predicated on ok), completing on
    its `ready` barrier: the x tile and, WTMA (1; 2: with b), the weight tile's words and
    scales (wt: their descriptors and rings; tile: the program's first 16-row tile)."""
    sn = i % STAGES
    col = _xk(i, rot, steps, ROT, k0)
    if WTMA:
        q_desc, a_desc, b_desc, q_ring, sa_ring, sb_ring = wt
        HAS_B: gl.constexpr = WTMA == 2
        nb: gl.constexpr = x_desc.block_type.nbytes + q_desc.block_type.nbytes + \
            a_desc.block_type.nbytes + (b_desc.block_type.nbytes if HAS_B else 0)
        mbarrier.expect(ready.index(sn), nb, pred=ok)
        ks = col // 64
        tma.async_copy_global_to_shared(q_desc, [tile, ks * q_desc.block_type.shape[1]],
                                        ready.index(sn), q_ring.index(sn), pred=ok)
        tma.async_copy_global_to_shared(a_desc, [tile, ks * a_desc.block_type.shape[1]],
                                        ready.index(sn), sa_ring.index(sn), pred=ok)
        if HAS_B:
            tma.async_copy_global_to_shared(b_desc, [tile, ks * b_desc.block_type.shape[1]],
                                            ready.index(sn), sb_ring.index(sn), pred=ok)
    else:
        mbarrier.expect(ready.index(sn), x_desc.block_type.nbytes, pred=ok)
    tma.async_copy_global_to_shared(x_desc, [m0, col], ready.index(sn), x_smem.index(sn),
                                    pred=ok)


@gluon.jit
def _refill(done, x_smem, ready, x_desc, m0, steps, STAGES: gl.constexpr, rot, ROT: gl.constexpr,
            k0, wt, tile, WTMA: gl.constexpr):
    """Ring buffer of step `done` (retired) takes step done + STAGES, if both exist
    (predicated, no branch: a branch between a wgmma and its wait makes ptxas serialize the
    wgmmas)."""
    _issue(done + STAGES, (done >= 0) & (done + STAGES < steps), x_smem, ready, x_desc, m0,
           steps, STAGES, rot, ROT, k0, wt, tile, WTMA)


@gluon.jit
def _x_producer(x_desc, x_smem, ready, empty, m0, steps, STAGES: gl.constexpr, rot,
                ROT: gl.constexpr, k0, wt, tile, WTMA: gl.constexpr):
    """The TMA warp (WS): the ring's steps STAGES.. (`_issue`), each once its buffer's
    `empty` barrier says the consumers retired the step that used it before."""
    for i in range(STAGES, steps):
        mbarrier.wait(empty.index(i % STAGES), ((i // STAGES) - 1) & 1)
        _issue(i, True, x_smem, ready, x_desc, m0, steps, STAGES, rot, ROT, k0, wt, tile, WTMA)


@gluon.jit
def _publish(t, step, a_smem, REGA: gl.constexpr = False):
    """The decoded tile t [BLOCK_N, 64] of `step` into the A buffer step % 2 (stmatrix), then
    the proxy fence for the wgmma's reads (`_launch`). The fence (MEMBAR.ALL.CTA) also waits
    for the thread's global loads in flight. REGA: nothing (t is the wgmma's register A)."""
    if not REGA:
        a_smem.index(step % 2).store(t)
        fence_async_shared()


@gluon.jit
def _launch(acc, step, a_smem, x_smem, ready, empty, x_desc, m0, steps,
            STAGES: gl.constexpr, NREF: gl.constexpr, WS: gl.constexpr, rot,
            ROT: gl.constexpr, k0, wt=0, tile=0, WTMA: gl.constexpr = False, t=0,
            REGA: gl.constexpr = False):
    """acc += A buffer step % 2 (`_publish`ed) [BLOCK_N, 64] @ x tile of `step` (async;
    returns with one wgmma in flight): a CTA barrier, then the wgmma reads the A buffer from
    shared memory; REGA: the decoded tile t itself is the register operand (read until the
    next step's wait: the caller decodes the next step into other registers, two steps an
    iteration; `quant_gluon_rega`). The barrier also
    tells that the steps before step - 1 are retired in every warp: the x buffers of the NREF
    steps before step - 1 are refilled (the TMA issue costs barriers of its own, so with two
    steps an iteration both at once) or, WS, handed to the producer warp by their `empty`
    mbarrier."""
    gl.thread_barrier()
    for r in gl.static_range(NREF):
        done = step - 1 - NREF + r
        if WS:
            mbarrier.arrive(empty.index((done + STAGES) % STAGES),
                            pred=(done >= 0) & (done + STAGES < steps))
        else:
            _refill(done, x_smem, ready, x_desc, m0, steps, STAGES, rot, ROT, k0, wt, tile,
                    WTMA)
    if not WTMA:    # (WTMA: waited for before the decode)
        mbarrier.wait(ready.index(step % STAGES), (step // STAGES) & 1)
    if REGA:
        acc = warpgroup_mma(t, x_smem.index(step % STAGES).permute((1, 0)), acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, t))[0]
    else:
        acc = warpgroup_mma(a_smem.index(step % 2), x_smem.index(step % STAGES).permute((1, 0)),
                            acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=1, deps=(acc, ))
    return acc


@gluon.jit
def _consumer(q_ptr, a_ptr, b_ptr, c_ptr, pid_n, magic, a_smem, x_smem, ready, empty, x_desc,
              m0, steps, KIND: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
              SUB: gl.constexpr, BFA: gl.constexpr, WS: gl.constexpr, T: gl.constexpr, rot,
              ROT: gl.constexpr, LATE: gl.constexpr, ksteps, k0, REGA: gl.constexpr = False):
    """The main loop of a program (`_gluon_gemm_kernel`, T warps) over its `steps` steps of
    64, from step k0 of the ksteps of K: loads, decode, A buffer (REGA: none), wgmma. Returns
    (acc [16 T, BLOCK_M] float32, all wgmmas retired,)."""
    BLOCK_N: gl.constexpr = 16 * T
    WORDS: gl.constexpr = 8 if KIND == 2 or KIND == 4 else 4
    PAIRS: gl.constexpr = 8 if KIND == 4 else 4
    HAS_B: gl.constexpr = (KIND < 3 or KIND == 5) and not BFA
    dtype: gl.constexpr = x_desc.dtype
    mma_layout: gl.constexpr = _mma_layout(T, BLOCK_M)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    w_layout: gl.constexpr = _thread_run_layout(WORDS, T)
    s_layout: gl.constexpr = _thread_run_layout(PAIRS, T)
    # flat offsets of a thread's words (contiguous) and pairs (lanes 4 r .. 4 r + 3 share)
    q_off = gl.arange(0, T * 32 * WORDS, layout=w_layout)
    i = gl.arange(0, T * 32 * PAIRS, layout=s_layout)
    s_off = (i // (32 * PAIRS)) * (ksteps * 8 * PAIRS) + ((i // (4 * PAIRS)) % 8) * PAIRS \
        + i % PAIRS
    s_off = gl.max_contiguous(gl.multiple_of(s_off, PAIRS), PAIRS)
    q_off = (q_off // (32 * WORDS)) * (ksteps * 32 * WORDS) + q_off % (32 * WORDS)
    q_off = gl.max_contiguous(gl.multiple_of(q_off, WORDS), WORDS)
    tile = pid_n * T
    tile_q = (tile.to(gl.int64) * ksteps + k0) * (32 * WORDS)
    tile_s = (tile.to(gl.int64) * ksteps + k0) * (8 * PAIRS)
    if KIND == 3:   # NF4: code[lane % 16] as int32 bits in the words' layout (shuffle source)
        lane = gl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [q_off],
                                         dtype=gl.int32, is_pure=True, pack=1)
        codes = gl.load(c_ptr + (lane & 15)).to(gl.int32, bitcast=True)
    else:
        codes = 0
    w0, a0, b0 = _load_step(q_ptr, a_ptr, b_ptr, tile_q, tile_s, 0, q_off, s_off, WORDS,
                            PAIRS, HAS_B, rot, steps, ROT)
    if SUB == 2:
        w1, a1, b1 = _load_step(q_ptr, a_ptr, b_ptr, tile_q, tile_s, 1, q_off, s_off, WORDS,
                                PAIRS, HAS_B, rot, steps, ROT)
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
    for it in range(steps // SUB):
        st = it * SUB
        # decode the step's words, reload them for the next iteration (the registers just
        # freed: no moves), then the async wgmma on its x buffer; the previous one retires.
        # LATE: the reloads after the iteration's last A fence: the proxy fence (MEMBAR)
        # waits for the thread's loads in flight, so each load before a fence puts its
        # latency on the loop's path; after the last one it overlaps the wgmma (H200, 128 x 256
        # split 2: Q4_0 0.0706 ms against 0.0668; loads right after each fence, held there by
        # a CTA fence, 0.0708)
        t0 = _decode(KIND, w0, a0, codes if KIND == 3 else b0, magic, dtype, T, a_layout,
                     BFA)
        if not LATE:
            w0, a0, b0 = _load_step(q_ptr, a_ptr, b_ptr, tile_q, tile_s, st + SUB, q_off,
                                    s_off, WORDS, PAIRS, HAS_B, rot, steps, ROT)
        _publish(t0, st, a_smem, REGA)
        acc = _launch(acc, st, a_smem, x_smem, ready, empty, x_desc, m0, steps, STAGES,
                      2 - SUB, WS, rot, ROT, k0, t=t0, REGA=REGA)
        if SUB == 2:
            t1 = _decode(KIND, w1, a1, codes if KIND == 3 else b1, magic, dtype, T,
                         a_layout, BFA)
            if not LATE:
                w1, a1, b1 = _load_step(q_ptr, a_ptr, b_ptr, tile_q, tile_s, st + 3, q_off,
                                        s_off, WORDS, PAIRS, HAS_B, rot, steps, ROT)
            _publish(t1, st + 1, a_smem, REGA)
            acc = _launch(acc, st + 1, a_smem, x_smem, ready, empty, x_desc, m0, steps,
                          STAGES, 2, WS, rot, ROT, k0, t=t1, REGA=REGA)
        if LATE:
            w0, a0, b0 = _load_step(q_ptr, a_ptr, b_ptr, tile_q, tile_s, st + SUB, q_off,
                                    s_off, WORDS, PAIRS, HAS_B, rot, steps, ROT)
            if SUB == 2:
                w1, a1, b1 = _load_step(q_ptr, a_ptr, b_ptr, tile_q, tile_s, st + 3, q_off,
                                        s_off, WORDS, PAIRS, HAS_B, rot, steps, ROT)
    return (warpgroup_mma_wait(num_outstanding=0, deps=(acc, )), )


@gluon.jit
def _consumer_tma(c_ptr, pid_n, magic, a_smem, x_smem, ready, empty, x_desc, m0, steps,
                  KIND: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                  SUB: gl.constexpr, BFA: gl.constexpr, WS: gl.constexpr, T: gl.constexpr, rot,
                  ROT: gl.constexpr, k0, wt, WTMA: gl.constexpr, REGA: gl.constexpr = False):
    """`_consumer` with the weight tile's words and scales brought by TMA into the x ring's
    buffers (WTMA): no global load in the loop, so the A fences wait for none."""
    BLOCK_N: gl.constexpr = 16 * T
    WORDS: gl.constexpr = 8 if KIND == 2 or KIND == 4 else 4
    PAIRS: gl.constexpr = 8 if KIND == 4 else 4
    dtype: gl.constexpr = x_desc.dtype
    mma_layout: gl.constexpr = _mma_layout(T, BLOCK_M)
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma_layout, k_width=2)
    w_layout: gl.constexpr = _thread_run_layout(WORDS, T)
    s_layout: gl.constexpr = _thread_run_layout(PAIRS, T)
    i = gl.arange(0, T * 32 * PAIRS, layout=s_layout)
    src = 4 * (((i // PAIRS) % 32) // 4) + (i % PAIRS) // (PAIRS // 4)
    tile = pid_n * T
    if KIND == 3:   # NF4: code[lane % 16] as int32 bits in the words' layout (shuffle source)
        lane = gl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r",
                                         [gl.arange(0, T * 32 * WORDS, layout=w_layout)],
                                         dtype=gl.int32, is_pure=True, pack=1)
        codes = gl.load(c_ptr + (lane & 15)).to(gl.int32, bitcast=True)
    else:
        codes = 0
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=mma_layout)
    # (at least one iteration: else the zero-trip path's acc, placed after the loop, makes
    # ptxas serialize the wgmmas; LLVM does not infer steps // 2 >= 1 from the assume)
    gl.assume(steps >= SUB)
    iters = steps
    if SUB == 2:
        iters = gl.maximum(steps // 2, 1)
    for it in range(iters):
        st = it * SUB
        mbarrier.wait(ready.index(st % STAGES), (st // STAGES) & 1)
        w0, a0, b0 = _smem_step(wt, st % STAGES, src, T, WORDS, PAIRS, w_layout, s_layout,
                                WTMA, KIND == 5)
        t0 = _decode(KIND, w0, a0, codes if KIND == 3 else b0, magic, dtype, T, a_layout,
                     BFA)
        _publish(t0, st, a_smem, REGA)
        acc = _launch(acc, st, a_smem, x_smem, ready, empty, x_desc, m0, steps, STAGES,
                      2 - SUB, WS, rot, ROT, k0, wt, tile, WTMA, t0, REGA)
        if SUB == 2:
            mbarrier.wait(ready.index((st + 1) % STAGES), ((st + 1) // STAGES) & 1)
            w1, a1, b1 = _smem_step(wt, (st + 1) % STAGES, src, T, WORDS, PAIRS, w_layout,
                                    s_layout, WTMA, KIND == 5)
            t1 = _decode(KIND, w1, a1, codes if KIND == 3 else b1, magic, dtype, T,
                         a_layout, BFA)
            _publish(t1, st + 1, a_smem, REGA)
            acc = _launch(acc, st + 1, a_smem, x_smem, ready, empty, x_desc, m0, steps,
                          STAGES, 2, WS, rot, ROT, k0, wt, tile, WTMA, t1, REGA)
    return (warpgroup_mma_wait(num_outstanding=0, deps=(acc, )), )


@gluon.jit
def _gluon_gemm_kernel(x_desc, q_desc, a_desc, b_desc, q_ptr, a_ptr, b_ptr, c_ptr, out_ptr,
                       part_ptr, cnt_ptr, M, N, K, stride_o, magic,
                       KIND: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                       SUB: gl.constexpr, num_warps: gl.constexpr, BFA: gl.constexpr = False,
                       WS: gl.constexpr = False, ROT: gl.constexpr = False,
                       LATE: gl.constexpr = False, SPLIT: gl.constexpr = 1,
                       WTMA: gl.constexpr = False, REGA: gl.constexpr = False):
    """out[M, N] = x[M, K] @ W.T for W's rows [pid_n * BLOCK_N, ...) (BLOCK_N = 16 num_warps)
    and x's rows [pid_m * BLOCK_M, ...); x_desc: TMA descriptor of x in [BLOCK_M, 64] blocks;
    q_ptr / a_ptr / b_ptr: the fragment-order codes and pairs (`pack_wgmma`, padded by two
    steps: the loads run SUB steps ahead unclamped; BFA: no b, b = a B_OVER_A); c_ptr: NF4's
    code table (float32 [16]); magic: 0x4B000000 (a register operand of the decode's LOP3 /
    PRMT). SUB (1 or 2, dividing K / 64 / SPLIT) steps of 64 an iteration. WS: one more warp
    issues the x TMA copies (the main loop then has no TMA code and its barriers). ROT: program
    n walks its K range from step n % steps on, wrapping, so that the programs do not all read
    the same x tile (the same L2 lines) at once. LATE: the next iteration's words and scales
    loaded after its last A fence (`_consumer`).
    SPLIT (1 or 2, program_id(2)): each program does K / SPLIT; the two meet in
    `_split_epilogue` (part_ptr: float32 workspace of BLOCK_N x BLOCK_M a tile; cnt_ptr: int32
    counter a tile, zero between launches). WTMA: the words and scales come by TMA with the x
    tiles (q_desc / a_desc / b_desc: the copies as [N / 16, K / 64 * 32 * WORDS] /
    [N / 16, K / 64 * 8 * PAIRS] in [num_warps, ...] blocks; b_desc = a_desc without b).
    REGA: the decoded tile is the wgmma's register operand (no A buffer; `quant_gluon_rega`)."""
    BLOCK_N: gl.constexpr = 16 * num_warps
    dtype: gl.constexpr = x_desc.dtype
    pid_n = gl.program_id(0)
    pid_m = gl.program_id(1)
    ksteps = K // 64
    steps = ksteps // SPLIT
    k0 = gl.program_id(2) * steps
    m0 = pid_m * BLOCK_M
    rot = pid_n % steps
    x_smem = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_M, 64], x_desc.layout)
    if REGA:
        a_smem = x_smem     # (unused)
    else:
        a_smem = gl.allocate_shared_memory(
            dtype, [2, BLOCK_N, 64], gl.NVMMASharedLayout.get_default_for([BLOCK_N, 64], dtype))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)
    tile = pid_n * num_warps
    HAS_B: gl.constexpr = (KIND < 3 or KIND == 5) and not BFA
    WT: gl.constexpr = (2 if HAS_B else 1) if WTMA else 0      # (1: no b, 2: with b)
    if WTMA:
        q_ring = gl.allocate_shared_memory(gl.int32, [STAGES, num_warps,
                                                      q_desc.block_type.shape[1]], q_desc.layout)
        sa_ring = gl.allocate_shared_memory(gl.float32, [STAGES, num_warps,
                                                         a_desc.block_type.shape[1]],
                                            a_desc.layout)
        if HAS_B:
            sb_ring = gl.allocate_shared_memory(gl.float32, [STAGES, num_warps,
                                                             b_desc.block_type.shape[1]],
                                                b_desc.layout)
        else:
            sb_ring = sa_ring
        wt = (q_desc, a_desc, b_desc, q_ring, sa_ring, sb_ring)
    else:
        wt = 0
    for s in gl.static_range(STAGES):
        if s < steps:
            _issue(s, True, x_smem, ready, x_desc, m0, steps, STAGES, rot, ROT, k0, wt, tile, WT)
    if WTMA:
        if WS:
            acc = gl.warp_specialize([(_consumer_tma, (c_ptr, pid_n, magic, a_smem, x_smem,
                                                       ready, empty, x_desc, m0, steps, KIND,
                                                       BLOCK_M, STAGES, SUB, BFA, WS,
                                                       num_warps, rot, ROT, k0, wt, WT, REGA)),
                                      (_x_producer, (x_desc, x_smem, ready, empty, m0, steps,
                                                     STAGES, rot, ROT, k0, wt, tile, WT))],
                                     [1], [40])[0]
        else:
            acc = _consumer_tma(c_ptr, pid_n, magic, a_smem, x_smem, ready, empty, x_desc, m0,
                                steps, KIND, BLOCK_M, STAGES, SUB, BFA, WS, num_warps, rot, ROT,
                                k0, wt, WT, REGA)[0]
    elif WS:
        acc = gl.warp_specialize([(_consumer, (q_ptr, a_ptr, b_ptr, c_ptr, pid_n, magic, a_smem,
                                               x_smem, ready, empty, x_desc, m0, steps, KIND,
                                               BLOCK_M, STAGES, SUB, BFA, WS, num_warps, rot,
                                               ROT, LATE, ksteps, k0, REGA)),
                                  (_x_producer, (x_desc, x_smem, ready, empty, m0, steps,
                                                 STAGES, rot, ROT, k0, wt, tile, WT))],
                                 [1], [40])[0]
    else:
        acc = _consumer(q_ptr, a_ptr, b_ptr, c_ptr, pid_n, magic, a_smem, x_smem, ready, empty,
                        x_desc, m0, steps, KIND, BLOCK_M, STAGES, SUB, BFA, WS, num_warps, rot,
                        ROT, LATE, ksteps, k0, REGA)[0]
    for s in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(s))
        mbarrier.invalidate(empty.index(s))
    # out[m, n] = acc[n, m], stored from the wgmma layout (8 lanes: 8 consecutive n). A
    # layout conversion here (through shared memory) makes ptxas serialize the loop's wgmmas
    mma_layout: gl.constexpr = _mma_layout(num_warps, BLOCK_M)
    offs_n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout))
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_layout))
    ptrs = out_ptr + offs_m.to(gl.int64)[None, :] * stride_o + offs_n[:, None]
    mask = (offs_m < M)[None, :]
    if SPLIT == 1:
        gl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        _split_epilogue(acc, out_ptr, pid_n * BLOCK_N, m0, M, stride_o, part_ptr, cnt_ptr,
                        pid_m * gl.num_programs(0) + pid_n, BLOCK_N, BLOCK_M, mma_layout)


# ---- launch ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class GluonGemmConfig:
    """block_n = 16 num_warps weight rows (one warpgroup a 64) x block_m rows of x a program
    (acc [block_n, block_m] float32), `stages` x tiles of [block_m, 64] in flight, `sub` steps
    of 64 an iteration (2: the x refills of both after the second; 1 lets ptxas serialize the
    wgmmas for some formats), ws: one more warp issues the x copies, h2: Q4_0's / AWQ's
    bf16x2 decode for bf16 x (with wtma: the scales by broadcast loads), rot: each program
    starts K at its own step (spreads the x reads),
    late: the next iteration's loads after the last A fence of the iteration, split: K in
    that many parts (1 or 2) a program each, summed in the kernel (`_split_epilogue`): 128 x
    256 tiles with split 2 are 128 programs that read x half as often as 64 x 256 ones;
    wtma: the words and scales by TMA with the x tiles (no global load in the loop; one step
    an iteration, unless rega); rega: the decoded tiles as the wgmmas' register operands (no A
    buffer) where an iteration has two steps (`quant_gluon_rega.operand_path`), else through
    the shared A buffer."""
    num_warps: int = 4
    block_m: int = 256
    stages: int = 4
    sub: int = 2
    ws: int = 0
    h2: int = 0
    rot: int = 0
    late: int = 0
    split: int = 1
    wtma: int = 0
    rega: int = 0

    @property
    def block_n(self) -> int:
        return 16 * self.num_warps

    def tag(self) -> str:
        return (f"gluon_gemm[n{self.block_n},m{self.block_m},st{self.stages}"
                + (f",sub{self.sub}" if self.sub > 1 else "") + (",ws" if self.ws else "")
                + (",h2" if self.h2 else "") + (",rot" if self.rot else "")
                + (",late" if self.late else "")
                + (f",split{self.split}" if self.split > 1 else "")
                + (",wtma" if self.wtma else "") + (",regA" if self.rega else "") + "]")


#: shared-memory layout of the WTMA word and scale tiles (no swizzle: each thread reads its
#: own 16 or 32 contiguous bytes)
PLAIN32 = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def weight_descs(fmt: int, pw: WgmmaWeight, sa, sb, num_warps: int):
    """TMA descriptors of the words, a and b (WTMA; b: a's without b) as [N / 16, K / 64 * 32
    * WORDS] / [N / 16, K / 64 * 8 * PAIRS] in [num_warps, ...] blocks (the copies without
    their padding)."""
    words = 32 * (8 if _BITS[fmt] == 8 else 4)
    pairs = 8 * _PAIRS[_KIND[fmt]]
    tiles, steps = pw.n // 16, pw.k // STEP_K

    def desc(t, per):
        return TensorDescriptor.from_tensor(t[: tiles * steps * per].view(tiles, steps * per),
                                            [num_warps, per], PLAIN32)

    a = desc(sa, pairs)
    return desc(pw.codes, words), a, desc(sb, pairs) if sb.numel() else a


def x_layout(block_m: int, dtype) -> gl.NVMMASharedLayout:
    """Shared-memory layout of an x tile [block_m, 64] (128-byte swizzle)."""
    return gl.NVMMASharedLayout.get_default_for([block_m, STEP_K], dtype)


def run_gluon_gemm(fmt: int, x, w0, w1, w2, i0: int, k: int, n: int,
                   config: GluonGemmConfig | None = None):
    """x [..., K] (bf16 / f16, CUDA, sm_90) @ W.T through the fragment-order copy of the
    weight (arguments as `quant.run`). Returns [..., N] in x's dtype."""
    cfg = config or GluonGemmConfig()
    pw = packed_weight(fmt, w0, w1, w2, i0, k, n, build=pack_wgmma)
    x2 = x.reshape(-1, k)
    if not x2.is_contiguous() or x2.data_ptr() % 16:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    gdt = gl.bfloat16 if x.dtype == torch.bfloat16 else gl.float16
    desc = TensorDescriptor.from_tensor(x2, [cfg.block_m, STEP_K], x_layout(cfg.block_m, gdt))
    grid = (n // cfg.block_n, (m + cfg.block_m - 1) // cfg.block_m)
    table = w2 if fmt == NF4 else pw.a
    h2 = bool(cfg.h2) and fmt in (Q4_0, AWQ) and x.dtype == torch.bfloat16
    sa, sb = h2_scales(pw) if h2 else (pw.a, pw.b)
    wtma = bool(cfg.wtma)
    wd = weight_descs(fmt, pw, sa, sb, cfg.num_warps) if wtma else (desc, desc, desc)
    split = cfg.split if cfg.split == 2 and (k // STEP_K) % 2 == 0 else 1
    steps = k // STEP_K // split
    cnt = (arrival_counters(x.device, grid[0] * grid[1],
                            torch.cuda.is_current_stream_capturing()) if split > 1 else None)
    if cnt is None:
        split, steps = 1, k // STEP_K
        cnt = part = out
    else:
        part = torch.empty(grid[0] * grid[1] * cfg.block_n * cfg.block_m, dtype=torch.float32,
                           device=x.device)
    sub, rega = operand_path(cfg, steps, wtma)
    # (a stage: the x tile, wtma: the words and pairs; without rega: the two A buffers)
    words, pairs = 32 * (8 if _BITS[fmt] == 8 else 4), 8 * _PAIRS[_KIND[fmt]]
    has_b = _KIND[fmt] < 3 and fmt not in _BFA
    ring = 2 * cfg.block_m * STEP_K + (4 * cfg.num_warps * (words + pairs * (1 + has_b))
                                       if wtma else 0)
    stages = fit_stages(cfg.stages, ring, 0 if rega else 4 * cfg.block_n * STEP_K)
    _gluon_gemm_kernel[grid + (split, )](desc, *wd, pw.codes, sa, sb, table, out, part, cnt, m,
                                         n, k, out.stride(0), H2_MAGIC if h2 else MAGIC,
                                         KIND=5 if h2 else _KIND[fmt],
                                         BLOCK_M=cfg.block_m, STAGES=stages, SUB=sub,
                                         BFA=fmt in _BFA, WS=bool(cfg.ws),
                                         ROT=bool(cfg.rot), LATE=bool(cfg.late), SPLIT=split,
                                         WTMA=wtma, REGA=rega, num_warps=cfg.num_warps)
    return out.reshape(*x.shape[:-1], n)
