"""NumPy kernels for the primitive basis. Half types (bfloat16, float16) are computed in
float32 and rounded once per primitive."""
from __future__ import annotations

import math

import numpy as np

from ...errors import FuelGraphError
from ...ir import ops
from ..base import scan_loop
from . import common

_HALF = {np.dtype("float16")}
try:
    import ml_dtypes
    _HALF.add(np.dtype(ml_dtypes.bfloat16))
except ImportError:  # pragma: no cover
    pass


def _up(a):
    return a.astype(np.float32) if a.dtype in _HALF else a


def _down(r, like):
    return r.astype(like, copy=False) if r.dtype != like else r


def _erf(x):
    try:
        from scipy.special import erf  # optional: faster when present
        return erf(x)
    except ImportError:
        v = np.vectorize(math.erf, otypes=[x.dtype])
        return v(x)


_UNARY = {
    "neg": np.negative, "exp": np.exp, "log": np.log, "sqrt": np.sqrt,
    "rsqrt": lambda x: 1.0 / np.sqrt(x), "recip": lambda x: 1.0 / x, "abs": np.abs,
    "tanh": np.tanh, "erf": _erf, "sin": np.sin, "cos": np.cos, "floor": np.floor,
    "sign": np.sign,
}
_BINARY = {
    "add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide, "pow": np.power,
    "maximum": np.maximum, "minimum": np.minimum, "rem": np.remainder, "and": np.bitwise_and,
    "or": np.bitwise_or, "xor": np.bitwise_xor, "shl": np.left_shift, "shr": np.right_shift,
}
_COMPARE = {"eq": np.equal, "ne": np.not_equal, "lt": np.less, "le": np.less_equal,
            "gt": np.greater, "ge": np.greater_equal}
_REDUCE = {"sum": np.sum, "max": np.max, "min": np.min, "prod": np.prod}


# floating-point warnings are silenced once per plan run (Plan.run), not per kernel
def unary(x, *, op):
    return _down(_UNARY[op.kind](_up(x)), x.dtype)


def binary(a, b, *, op):
    if op.kind == "div" and a.dtype.kind in "iu":
        return np.floor_divide(a, b)
    if op.kind == "pow" and a.dtype.kind in "iu" and (b < 0).any():
        raise FuelGraphError("pow: negative integer exponent on an integer tensor")
    f = _BINARY[op.kind]
    if a.dtype in _HALF or a.dtype != b.dtype or max(a.size, b.size) < common.PARALLEL_MIN_ELEMS \
            or common.NUM_THREADS < 2:
        if a.dtype == b.dtype and a.dtype.kind == "f" and a.dtype not in _HALF:
            return f(a, b, out=common.new_output(np.broadcast_shapes(a.shape, b.shape), a.dtype))
        return _down(f(_up(a), _up(b)), a.dtype)
    return _split_elementwise(f, a, b)


def _split_elementwise(f, a, b):
    """`f(a, b)` (same dtype, broadcasting) into a fresh array, in blocks of the first axis
    with at least NUM_THREADS entries, over the pool; elementwise results are the same
    whatever the split."""
    shape = np.broadcast_shapes(a.shape, b.shape)
    out = common.new_output(shape, a.dtype)
    ax = next((i for i, d in enumerate(shape) if d >= common.NUM_THREADS), None)
    if ax is None:
        return f(a, b, out=out)
    a, b = np.broadcast_to(a, shape), np.broadcast_to(b, shape)
    lead = (slice(None),) * ax

    def work(r0, r1):
        sl = lead + (slice(r0, r1),)
        f(a[sl], b[sl], out=out[sl])
    common.run_spans(work, common.row_spans(shape[ax], math.prod(shape[ax + 1:])), out.size)
    return out


def compare(a, b, *, op):
    return _COMPARE[op.kind](_up(a), _up(b))


def where(c, a, b, *, op):
    return np.where(c, a, b)


def cast(x, *, op):
    return x.astype(op.dtype.np)


def bitcast(x, *, op):
    return np.asarray(x, order="C").view(op.dtype.np)


def reduce(x, *, op):
    if x.dtype in _HALF:
        r = _REDUCE[op.kind](x.astype(np.float32), axis=op.axes, keepdims=op.keepdim)
        return np.asarray(r).astype(x.dtype)
    if op.kind == "sum" and x.dtype.kind in "iub":
        return np.asarray(np.sum(x, axis=op.axes, keepdims=op.keepdim, dtype=x.dtype))
    return np.asarray(_REDUCE[op.kind](x, axis=op.axes, keepdims=op.keepdim))


def reshape(x, *, op):
    return x.reshape(op.shape)


def permute(x, *, op):
    return x.transpose(op.perm)


def broadcast_to(x, *, op):
    return np.broadcast_to(x, op.shape)


def slice_(x, *, op):
    return x[tuple(slice(a, b, s) for a, b, s in zip(op.starts, op.stops, op.steps))]


def concat(*xs, op):
    return np.concatenate(xs, axis=op.axis)


def pad(x, *, op):
    out = np.full(op.out_shape(x.shape), op.value, dtype=x.dtype)
    out[op.placement(x.shape)] = x
    return out


def _check_bounds(name, idx, n):
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        bad = idx[(idx < 0) | (idx >= n)].flat[0]
        raise FuelGraphError(f"{name}: index {bad} out of range for an axis of size {n}")


def gather(x, idx, *, op):
    _check_bounds("gather", idx, x.shape[op.axis])
    if idx.shape != x.shape:
        x = x[tuple(slice(0, d) if a != op.axis else slice(None) for a, d in enumerate(idx.shape))]
    return np.take_along_axis(x, idx.astype(np.intp, copy=False), axis=op.axis)


def take(x, idx, *, op):
    _check_bounds("take", idx, x.shape[op.axis])
    return np.take(x, idx.astype(np.intp, copy=False), axis=op.axis)


def scatter_add(base, idx, src, *, op):
    ax = op.axis
    if idx.ndim > 1 and idx.shape == src.shape and \
            all(st == 0 for a, st in enumerate(idx.strides) if a != ax):
        # one index per slice along the axis (an embedding gradient): whole slices added
        rows = idx[tuple(slice(None) if a == ax else 0 for a in range(idx.ndim))]
        _check_bounds("scatter_add", rows, base.shape[ax])
        out = _up(base).copy()
        sub = out[tuple(slice(None) if a == ax else slice(0, d) for a, d in enumerate(idx.shape))]
        _add_slices(np.moveaxis(sub, ax, 0), rows.astype(np.intp, copy=False),
                    np.moveaxis(_up(src), ax, 0))
        return _down(out, base.dtype)
    _check_bounds("scatter_add", idx, base.shape[ax])
    out = _up(base).copy()
    full = list(np.indices(idx.shape, sparse=True))
    full[op.axis] = idx.astype(np.intp, copy=False)
    np.add.at(out, tuple(full), _up(src))
    return _down(out, base.dtype)


def _add_slices(out, rows, src) -> None:
    """`out[rows[i]] += src[i]` for every i, repeated rows added in the order of i (as
    np.add.at, bit for bit), but whole slices at a time: pass k adds the k-th occurrence of
    every row, so each pass is one fancy-indexed add without repeats (np.add.at over the
    elements is ~6x slower)."""
    if not rows.size:
        return
    order = np.argsort(rows, kind="stable")
    s = rows[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])
    rank = np.arange(s.size) - np.repeat(starts, np.diff(np.r_[starts, s.size]))
    for k in range(int(rank.max()) + 1):
        sel = rank == k
        out[s[sel]] += src[order[sel]]


def matmul(a, b, *, op):
    if a.dtype in _HALF:
        return matmul(a.astype(np.float32), b.astype(np.float32), op=op).astype(a.dtype)
    return gemm(a, b)


#: products at least this large are split over fuelgraph's thread pool (below: one BLAS call)
PARALLEL_GEMM_FLOPS = 2e7
#: parts per pool thread of a split product: 2 lets a thread slowed by another process take
#: fewer parts, and keeps each part large (every part packs the whole other operand again)
GEMM_PARTS_PER_THREAD = 2
_BLAS = []


def _one_blas_thread():
    """A context holding NumPy's BLAS to the calling thread, or None without threadpoolctl."""
    if not _BLAS:
        try:
            from threadpoolctl import ThreadpoolController
            _BLAS.append(ThreadpoolController())
        except ImportError:
            _BLAS.append(None)
    c = _BLAS[0]
    return c.limit(limits=1, user_api="blas") if c is not None else None


#: products with at most this many rows against a transposed weight take the W @ x.T form
SMALL_M_ROWS = 16
#: ... and from this size on run as blocks of the weight's rows (one BLAS call each):
#: OpenBLAS's small-M GEMM repacks the whole weight on every call ([4, 512] x [512, 32000]
#: head: 13.7 ms as one call on a 2-core VM)
SMALL_M_POOL_FLOPS = 4e6
#: ... or whose weight has at least this many bytes: the whole-weight repack is what costs,
#: whatever M (2 threads, interleaved, weights cycled through 40 MiB so they come from
#: memory as in a decode step: 4 x 512 @ [512, 512].T blocks 0.70x the time of one W @ x.T,
#: 2 x 512 @ [512, 1024].T 0.56x; with 512 KiB weights about even)
SMALL_M_POOL_BYTES = 1 << 20
#: ... of at most about this many bytes of the weight: OpenBLAS packs a block it has just read
#: into L2 (one thread, [4, 512] x [512, 2048]: 128-row blocks 0.28 ms, the whole weight 1.0 ms)
WEIGHT_BLOCK_BYTES = 1 << 18
#: ... on the calling thread (False) or split over the pool (True). With L2-sized blocks one
#: thread streams the weight about as fast as two (the VM's bandwidth, not its cores, bounds
#: it), and the pool's hand-offs cost more than they gained: Llama B4 generate (2 threads,
#: interleaved, min of 10-16 rounds) 254 / 283 / 302 ms on the calling thread against
#: 252 / 357 / 331 ms on the pool; Mamba-2 B4 319 against 324 ms
WEIGHT_ROWS_ON_POOL = False


def gemm(a, b, out=None):
    """`np.matmul(a, b, out=out)` for float arrays (a [..., M, K], b [..., K, N]), large
    products split over fuelgraph's pool (see `_pool_matmul`). Each output element is one BLAS
    dot product of the same operands whatever the split, so results do not depend on the
    thread count beyond what BLAS kernels themselves do per block."""
    m, k, n = a.shape[-2], a.shape[-1], b.shape[-1]
    batch = 1 if a.ndim == b.ndim == 2 else \
        math.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    # small products take one BLAS thread: BLAS's threads gain little there, and while another
    # process holds a core they wait for each other (measured: ~10 ms per 4-MFLOP product on a
    # loaded 2-core machine instead of 0.05 ms)
    small = 2.0 * batch * m * k * n < PARALLEL_GEMM_FLOPS and common.NUM_THREADS > 1
    if 1 < m <= SMALL_M_ROWS and a.ndim == 2 and b.ndim == 2 and b.strides[0] < b.strides[1] \
            and out is None and a.dtype.kind == "f":
        # x @ W.T with few rows (a decode step): OpenBLAS is up to 2x faster computing W @ x.T
        if 2.0 * m * k * n >= SMALL_M_POOL_FLOPS or k * n * b.itemsize >= SMALL_M_POOL_BYTES:
            pooled = _weight_row_blocks(a, b.T, n)
            if pooled is not None:
                return pooled

        def product():
            return np.ascontiguousarray(np.matmul(b.T, a.T).T)
        return common.blas_single(product) if small else product()
    if small:
        return common.blas_single(lambda: np.matmul(a, b, out=out))
    if common.NUM_THREADS < 2 or a.dtype.kind != "f":
        return np.matmul(a, b, out=out)
    return _pool_matmul(a, b, m, n, out)


def _weight_row_blocks(x, w, n):
    """x [M, K] @ w.T for a row-major weight w [N, K] and few rows M, as w @ x.T by blocks of
    w's rows of about WEIGHT_BLOCK_BYTES, one single-threaded BLAS call each, on the calling
    thread (over the pool with WEIGHT_ROWS_ON_POOL): [M, N], or None when the pool's BLAS
    threads cannot be limited."""
    out_t = np.empty((n, x.shape[0]), np.result_type(x, w))
    xt = x.T
    rows = max(64, WEIGHT_BLOCK_BYTES // max(1, w.shape[1] * w.itemsize) // 16 * 16)

    def work(r0, r1):
        np.matmul(w[r0:r1], xt, out=out_t[r0:r1])
    if WEIGHT_ROWS_ON_POOL and common.NUM_THREADS > 1:
        parts = max(GEMM_PARTS_PER_THREAD * common.NUM_THREADS, -(-n // rows))
        if not _pooled_one_blas_thread(work, _even_spans(n, parts, 64)):
            return None
    else:
        common.blas_single(lambda: [work(r, min(n, r + rows)) for r in range(0, n, rows)])
    return np.ascontiguousarray(out_t.T)


def _pool_matmul(a, b, m, n, out=None):
    """A large product split over fuelgraph's pool, each part one single-threaded BLAS call:
    batches of a stacked product, or blocks of rows (of columns when N > M: a part packs the
    operand it does not split, so the smaller one is packed again). BLAS's own threads
    spin-wait between calls, which takes cores from whatever runs next and collapses a step
    when another process competes for the cores; the pool's threads sleep instead."""
    lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    if out is None:
        out = common.new_output(lead + (m, n), np.result_type(a, b))
    parts = GEMM_PARTS_PER_THREAD * common.NUM_THREADS
    if lead and lead[0] >= common.NUM_THREADS and a.ndim == b.ndim:
        # stacked products: split the first batch axis (slices of broadcast views copy nothing)
        a = np.broadcast_to(a, lead + a.shape[-2:])
        b = np.broadcast_to(b, lead + b.shape[-2:])
        spans = _even_spans(lead[0], parts, 1, 1)
        work = lambda i0, i1: np.matmul(a[i0:i1], b[i0:i1], out=out[i0:i1])  # noqa: E731
    elif not lead and max(m, n) >= 2 * common.NUM_THREADS:
        if m >= n:
            spans = _even_spans(m, parts, 64)
            work = lambda r0, r1: np.matmul(a[r0:r1], b, out=out[r0:r1])  # noqa: E731
        else:
            spans = _even_spans(n, parts, 64)
            work = lambda c0, c1: np.matmul(a, b[:, c0:c1], out=out[:, c0:c1])  # noqa: E731
    else:
        return np.matmul(a, b, out=out)
    if not _pooled_one_blas_thread(work, spans):
        np.matmul(a, b, out=out)
    return out


def _pooled_one_blas_thread(work, spans) -> bool:
    """Run work(i0, i1) over `spans` on the pool, each part with one BLAS thread. False (nothing
    run) when this BLAS's threads cannot be limited: the caller then runs the work whole."""
    if common.has_blas_single():
        # the calling thread's limit set once (run_spans holds its pool threads to one too)
        common.blas_single(lambda: common.run_spans(work, spans, common.PARALLEL_MIN_ELEMS))
        return True
    ctx = _one_blas_thread()
    if ctx is None:
        return False
    with ctx:
        common.run_spans(work, spans, common.PARALLEL_MIN_ELEMS)
    return True


def groupable_product(node) -> bool:
    """A MatMul node worth running with other products in one step (`gemm_group`): 2-D,
    float32/float64, large enough to be split over the pool on its own."""
    if common.NUM_THREADS < 2 or not isinstance(node.op, ops.MatMul):
        return False
    (a, b), dt = (s.shape for s in node.srcs), node.srcs[0].dtype.np
    return len(a) == 2 and np.dtype(dt) in (np.float32, np.float64) and \
        2.0 * a[0] * a[1] * b[1] >= PARALLEL_GEMM_FLOPS


def gemm_group(pairs, outs=None) -> list:
    """[a @ b for (a, b) in pairs] for independent 2-D products, run together over the pool:
    each product whole, or in row/column blocks when it is larger than a thread's share of the
    group, one single-threaded BLAS call per part, parts taken from a shared queue (largest
    first). A part packs the whole operand it does not split, ~6% more work per extra part
    (measured), so whole products sharing the threads beat each product split in four.
    `outs`: arrays to write the products into (default: new C-contiguous ones)."""
    if outs is None:
        outs = [common.new_output((a.shape[0], b.shape[1]), np.result_type(a, b))
                for a, b in pairs]
    flops = [a.shape[0] * a.shape[1] * b.shape[1] for a, b in pairs]
    share = sum(flops) / common.NUM_THREADS
    items = []
    for (a, b), out, f in zip(pairs, outs, flops):
        m, n = out.shape
        parts = max(1, round(f / share))
        if parts > 1 and m >= n:
            for r0, r1 in _even_spans(m, parts, 64):
                items.append((f * (r1 - r0) / m, a[r0:r1], b, out[r0:r1]))
        elif parts > 1:
            for c0, c1 in _even_spans(n, parts, 64):
                items.append((f * (c1 - c0) / n, a, b[:, c0:c1], out[:, c0:c1]))
        else:
            items.append((f, a, b, out))
    items.sort(key=lambda it: -it[0])

    def work(i0, i1):
        for _, a, b, out in items[i0:i1]:
            np.matmul(a, b, out=out)
    if not _pooled_one_blas_thread(work, [(i, i + 1) for i in range(len(items))]):
        work(0, len(items))
    return outs


def _even_spans(n: int, parts: int, least: int, align: int = 16) -> list[tuple[int, int]]:
    """[0, n) in at most `parts` consecutive near-equal spans of at least `least` (one span
    when n < 2 * least); inner edges are rounded up to multiples of `align` (whole SIMD blocks
    of BLAS's packed panels)."""
    parts = max(1, min(parts, n // max(1, least)))
    edges = [0] + [min(n, -(-(n * i // parts) // align) * align) for i in range(1, parts)] + [n]
    return [(e0, e1) for e0, e1 in zip(edges, edges[1:]) if e1 > e0]


def full(*, op):
    """A read-only broadcast view of one scalar: a constant costs no memory whatever its
    shape (consumers that need contiguous data copy it when they run)."""
    with np.errstate(over="ignore"):
        return np.broadcast_to(np.asarray(op.value).astype(op.dtype.np), op.shape)


def iota(*, op):
    return np.arange(op.n, dtype=op.dtype.np)


def const(*, op):
    return op.array


def scan(*args, op, run_body):
    return scan_loop(op, args, lambda shape, d: np.empty(shape, d.np), run_body)


PRIMITIVES = {
    ops.Unary: unary, ops.Binary: binary, ops.Compare: compare, ops.Where: where,
    ops.Cast: cast, ops.Bitcast: bitcast, ops.Reduce: reduce, ops.Reshape: reshape,
    ops.Permute: permute, ops.BroadcastTo: broadcast_to, ops.Slice: slice_, ops.Concat: concat,
    ops.Pad: pad, ops.Gather: gather, ops.Take: take, ops.ScatterAdd: scatter_add,
    ops.MatMul: matmul, ops.Full: full, ops.Iota: iota, ops.Const: const, ops.Scan: scan,
}
# numpy returns views for these: the planner treats their outputs as aliases of input 0
VIEW_OPS = (ops.Reshape, ops.Permute, ops.BroadcastTo, ops.Slice, ops.Bitcast)
