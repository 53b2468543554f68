"""The split-K meeting of the Gluon GEMM (`quant_gluon_gemm`, `split=2`): the two programs of
a [BLOCK_N, BLOCK_M] tile, each with its float32 acc over half of K, sum them in the kernel
(`_split_epilogue`) through a float32 workspace and a counter a tile."""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def _halves(t):
    """t [R, C] -> its column halves [R, C / 2] (register moves only: in the wgmma layout the
    top column bit is a register bit)."""
    R: gl.constexpr = t.shape[0]
    C: gl.constexpr = t.shape[1]
    return gl.split(gl.permute(gl.reshape(t, [R, 2, C // 2]), [0, 2, 1]))


@gluon.jit
def _add_chunk(acc, c0, out_ptr, n0, m0, M, stride_o, part_ptr, tile_id, TOTAL_M: gl.constexpr):
    """out[m0 + c0 + j, n0 + i] = acc[i, j] + the partial's (i, c0 + j) (the tile's float32
    partial is [BLOCK_N, TOTAL_M] row-major), for a column chunk acc [BLOCK_N, C]."""
    lay: gl.constexpr = acc.type.layout
    rows = gl.arange(0, acc.shape[0], layout=gl.SliceLayout(1, lay))
    cols = gl.arange(0, acc.shape[1], layout=gl.SliceLayout(0, lay))
    pp = part_ptr + tile_id.to(gl.int64) * (acc.shape[0] * TOTAL_M) + rows[:, None] * TOTAL_M \
        + (c0 + cols)[None, :]
    part = gl.load(pp, cache_modifier=".cg")
    offs_m = m0 + c0 + cols
    ptrs = out_ptr + offs_m.to(gl.int64)[None, :] * stride_o + (n0 + rows)[:, None]
    gl.store(ptrs, (acc + part).to(out_ptr.dtype.element_ty), mask=(offs_m < M)[None, :])


@gluon.jit
def _split_epilogue(acc, out_ptr, n0, m0, M, stride_o, part_ptr, cnt_ptr, tile_id,
                    BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, mma_layout: gl.constexpr):
    """Split K in two: the two programs of a tile meet here. The first to arrive (one atomic
    on the tile's counter, +1) writes its float32 acc to the workspace and releases the
    counter (+2: 4 = both arrived and the partial written, in either order); the second (+1)
    waits for it (the first is past
    its main loop, so the wait cannot block on a program not yet started), adds the partial
    (a + b: the same bits whichever came first) in four column chunks (the whole partial
    next to acc would not fit the registers), stores the result, then resets the counter for
    the next launch."""
    rows = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma_layout))
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma_layout))
    cnt = cnt_ptr + tile_id
    if gl.atomic_add(cnt, 1, sem="acq_rel", scope="gpu") == 0:
        pp = part_ptr + tile_id.to(gl.int64) * (BLOCK_N * BLOCK_M) + rows[:, None] * BLOCK_M \
            + cols[None, :]
        gl.store(pp, acc, cache_modifier=".cg")
        gl.thread_barrier()
        gl.atomic_add(cnt, 2, sem="release", scope="gpu")
    else:
        while gl.atomic_add(cnt, 0, sem="acquire", scope="gpu") != 4:
            pass
        gl.thread_barrier()
        lo, hi = _halves(acc)
        q0, q1 = _halves(lo)
        q2, q3 = _halves(hi)
        Q: gl.constexpr = BLOCK_M // 4
        _add_chunk(q0, 0, out_ptr, n0, m0, M, stride_o, part_ptr, tile_id, BLOCK_M)
        _add_chunk(q1, Q, out_ptr, n0, m0, M, stride_o, part_ptr, tile_id, BLOCK_M)
        _add_chunk(q2, 2 * Q, out_ptr, n0, m0, M, stride_o, part_ptr, tile_id, BLOCK_M)
        _add_chunk(q3, 3 * Q, out_ptr, n0, m0, M, stride_o, part_ptr, tile_id, BLOCK_M)
        gl.thread_barrier()
        gl.atomic_xchg(cnt, 0, sem="relaxed", scope="gpu")
