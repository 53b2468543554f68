"""Plumbing shared by the NumPy kernel modules: `acc_dtype` (float32 for 16/32-bit floats,
float64 for float64), `row_spans` and `run_spans`, which process a 2-D row view in chunks split
over a small thread pool (NumPy releases the GIL inside ufunc loops, so two cores give up to ~2x
on large arrays). Every per-row result is independent of the chunking and of the thread count,
so kernels stay bit-stable on one machine. `FUELGRAPH_NUM_THREADS=1` in the environment disables
the pool. `to_acc` / `store` widen and narrow halves; float16 goes through integer-op casts that
are bit-identical to NumPy's but avoid its very slow path for float16 subnormal results."""
from __future__ import annotations

import ctypes
import math
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np


_F32 = np.dtype(np.float32)
_F64 = np.dtype(np.float64)
_F16 = np.dtype(np.float16)
_U32 = np.uint32
#: elements per chunk (2 MiB of float32). Chunks are large on purpose: each NumPy call costs
#: ~1 us of GIL-holding Python and every GIL hand-off between threads a wake-up, so small
#: chunks lose more than they gain from L2 residency (the machine's L3 holds these arrays).
CHUNK_ELEMS = 1 << 19
#: below this many elements a kernel runs on the calling thread only
PARALLEL_MIN_ELEMS = 1 << 18
try:
    NUM_THREADS = max(1, min(8, len(os.sched_getaffinity(0))))
except AttributeError:  # pragma: no cover - non-Linux
    NUM_THREADS = max(1, min(8, os.cpu_count() or 1))
NUM_THREADS = int(os.environ.get("FUELGRAPH_NUM_THREADS", NUM_THREADS))
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def _forget_pool() -> None:                 # a forked child has no pool threads: start afresh
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)

#: glibc malloc returns blocks of >= 128 KiB (a threshold it moves as blocks are freed) to the
#: OS on free and trims its heap tops, so the arrays every kernel call allocates fault their
#: pages in afresh, ~1-2 us per 4 KiB page on the VM: a third of a flash_attn forward and
#: backward at the Llama training shape (2 cores, separate processes alternating: backward
#: 20.5-23 -> 11.6-13.4 ms, forward 8.8-10.5 -> 5.6-6.1 ms). Kept instead: blocks up to
#: HEAP_MMAP_THRESHOLD come from the heap, and up to HEAP_TRIM_THRESHOLD of free heap stays
#: with the process. Opt-in (FUELGRAPH_KEEP_HEAP=1): it changes malloc for the whole process,
#: and whole Llama training steps on the quiet VM showed no gain beyond the noise (torch in
#: the same process gets faster too). The user's own MALLOC_*_THRESHOLD_ / glibc tunables win.
HEAP_MMAP_THRESHOLD = 32 << 20
HEAP_TRIM_THRESHOLD = 1 << 30


def _keep_freed_memory() -> bool:
    """Set the two glibc malloc thresholds above (once, at import) when FUELGRAPH_KEEP_HEAP=1;
    False where not asked for, not glibc, or the user set malloc up already."""
    env = os.environ
    if env.get("FUELGRAPH_KEEP_HEAP", "0") != "1" or "GLIBC_TUNABLES" in env or \
            "MALLOC_MMAP_THRESHOLD_" in env or "MALLOC_TRIM_THRESHOLD_" in env:
        return False
    try:
        import platform
        if platform.libc_ver()[0] != "glibc":
            return False
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, ValueError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    m_trim_threshold, m_mmap_threshold = -1, -3                     # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, HEAP_MMAP_THRESHOLD)) and \
        bool(mallopt(m_trim_threshold, HEAP_TRIM_THRESHOLD))


HEAP_KEPT = _keep_freed_memory()


# ---- kernel outputs from blocks the backend keeps --------------------------------------------
#: Large kernel outputs come from blocks of memory that this module keeps for reuse: an array
#: freshly malloc'd for every output faults its pages in on first write (~1.3 us per 4 KiB page
#: on the VM: filling 2 MiB of fresh memory took 747 us against 95 us reused), and a training
#: step's activations are freed and allocated again every step (glibc returns the freed heap to
#: the OS: ~33K faults per Llama benchmark step). Unlike FUELGRAPH_KEEP_HEAP this changes nothing
#: for the rest of the process. A block is free again when no array refers to it (the arrays
#: made from it are views whose base is the block: its reference count says whether any is
#: alive). FUELGRAPH_RECYCLE=0 turns it off; `release_kept_memory()` drops the free blocks.
RECYCLE = os.environ.get("FUELGRAPH_RECYCLE", "1") != "0"
#: outputs below this size come from malloc (its heap serves them without page faults)
RECYCLE_MIN_BYTES = 1 << 18
#: at most this many bytes in kept blocks (free or in use); beyond, outputs come from malloc
#: and free blocks are dropped first, largest first (a decode loop whose sizes change every step
#: would otherwise hold many dead sizes)
try:
    RECYCLE_CAP_BYTES = min(2 << 30, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 8)
except (ValueError, OSError, AttributeError):   # pragma: no cover - non-POSIX
    RECYCLE_CAP_BYTES = 1 << 30
_blocks: dict = {}                  # nbytes -> [uint8 block, ...]
_blocks_bytes = 0
_blocks_lock = threading.Lock()


def _refs_of_free_block() -> int:
    """The reference count `_take` sees for a block no array uses (the list's, the loop
    variable's and the call's own), measured the same way `_take` measures, so that an
    interpreter counting differently turns recycling off instead of reusing a live block."""
    blocks = [np.empty(16, np.uint8)]
    for block in blocks:
        free = sys.getrefcount(block)
    view = blocks[0].view(np.float32)
    for block in blocks:
        used = sys.getrefcount(block)
    del view
    return free if used == free + 1 else -1


_FREE_REFS = _refs_of_free_block()


def _take(blocks):
    """A free block of the list, or None (caller holds the lock)."""
    for block in blocks:
        if sys.getrefcount(block) == _FREE_REFS:
            return block
    return None


def new_output(shape, dtype) -> np.ndarray:
    """An uninitialised C-contiguous array for a kernel's output (`np.empty`), from a kept block
    when it is large (see RECYCLE)."""
    dtype = np.dtype(dtype)
    nbytes = math.prod(shape) * dtype.itemsize
    if not RECYCLE or nbytes < RECYCLE_MIN_BYTES or _FREE_REFS < 0:
        return np.empty(shape, dtype)
    global _blocks_bytes
    with _blocks_lock:
        blocks = _blocks.setdefault(nbytes, [])
        block = _take(blocks)
        if block is None:
            if _blocks_bytes + nbytes > RECYCLE_CAP_BYTES:
                _drop_free(_blocks_bytes + nbytes - RECYCLE_CAP_BYTES)
            if _blocks_bytes + nbytes > RECYCLE_CAP_BYTES:
                return np.empty(shape, dtype)
            block = np.empty(nbytes, np.uint8)
            blocks.append(block)
            _blocks_bytes += nbytes
        return block.view(dtype).reshape(shape)


def _drop_free(want: int) -> None:
    """Drop free blocks (largest sizes first) until `want` bytes are gone or none is free."""
    global _blocks_bytes
    for nbytes in sorted(_blocks, reverse=True):
        blocks = _blocks[nbytes]
        keep = []
        for block in blocks:
            if want > 0 and sys.getrefcount(block) == _FREE_REFS:
                want -= nbytes
                _blocks_bytes -= nbytes
            else:
                keep.append(block)
        blocks[:] = keep
        if want <= 0:
            return


def release_kept_memory() -> None:
    """Give every free kept block back (blocks still used by an array stay)."""
    with _blocks_lock:
        _drop_free(1 << 62)


def acc_dtype(dt) -> np.dtype:
    """Accumulation dtype: float64 for float64 inputs, float32 for float32/float16/bfloat16."""
    return _F64 if np.dtype(dt) == _F64 else _F32


def _f16_to_f32(src):
    """Exact float16 -> float32 with integer ops (NumPy's own cast is ~3x slower here)."""
    h = src.view(np.uint16).astype(_U32)
    sign = np.bitwise_and(h, _U32(0x8000))
    np.left_shift(sign, _U32(16), out=sign)
    np.bitwise_and(h, _U32(0x7FFF), out=h)
    special = h.max(initial=0) >= 0x7C00
    np.left_shift(h, _U32(13), out=h)
    out = np.multiply(h.view(np.float32), np.float32(2.0 ** 112))   # rebias; exact, subnormals too
    if special:                                                       # inf / NaN
        np.copyto(out.view(_U32), np.bitwise_or(h, _U32(0x7F800000)), where=h >= _U32(0x7C00 << 13))
    np.bitwise_or(out.view(_U32), sign, out=out.view(_U32))
    return out


def _f32_to_f16(src, dst):
    """float32 -> float16 with round-to-nearest-even, bit-identical to NumPy's cast (F. Giesen's
    float_to_half_fast3_rtne, vectorised). NumPy's cast takes ~80 ns per element whose result is
    a float16 subnormal (it raises the underflow flag per element); this stays ~3 ns."""
    u = src.view(_U32)
    a = np.bitwise_and(u, _U32(0x7FFFFFFF))
    n = np.right_shift(a, _U32(13))
    np.bitwise_and(n, _U32(1), out=n)                                 # lsb: ties to even
    n += _U32((((15 - 127) << 23) + 0xFFF) & 0xFFFFFFFF)
    n += a
    np.right_shift(n, _U32(13), out=n)                                # normal results
    if a.size and a.min() < (113 << 23):                              # zero / subnormal results
        with np.errstate(invalid="ignore"):
            sub = np.add(a.view(np.float32), np.float32(0.5)).view(_U32)   # FPU rounds to 2^-24
        sub -= _U32(0x3F000000)
        np.copyto(n, sub, where=a < _U32(113 << 23))
    if a.size and a.max() >= 0x47800000:                              # overflow to inf, NaN
        np.copyto(n, np.where(a > _U32(0x7F800000), _U32(0x7E00), _U32(0x7C00)),
                  where=a >= _U32(0x47800000))
    np.right_shift(u, _U32(16), out=a)
    np.bitwise_and(a, _U32(0x8000), out=a)
    np.bitwise_or(n, a, out=dst.view(np.uint16), casting="unsafe")


def to_acc(a, acc):
    """`a` in dtype acc: `a` itself if it already is, else a fresh converted array."""
    if a.dtype == acc:
        return a
    if a.dtype == _F16 and acc == _F32:
        return _f16_to_f32(a).reshape(a.shape)
    return a.astype(acc)


def store(dst, src) -> None:
    """`dst[...] = src` (round to nearest even), with a fast float32 -> float16 path."""
    if dst.dtype == _F16 and src.dtype == _F32 and dst.shape == src.shape:
        _f32_to_f16(src, dst)
    else:
        dst[...] = src


def row_spans(nrows: int, row_elems: int, chunk: int | None = None) -> list[tuple[int, int]]:
    """Split `nrows` rows of `row_elems` elements into consecutive `(r0, r1)` spans of about
    `chunk` elements (at least one row each, at least `NUM_THREADS` spans for large jobs)."""
    step = max(1, (chunk or CHUNK_ELEMS) // max(1, row_elems))
    if NUM_THREADS > 1 and nrows * row_elems >= PARALLEL_MIN_ELEMS:
        step = max(1, min(step, -(-nrows // NUM_THREADS)))
    return [(r, min(r + step, nrows)) for r in range(0, nrows, step)]


def _get_pool() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(NUM_THREADS - 1, thread_name_prefix="fuelgraph-np")
        return _pool


def row_bufsize(row_elems: int | None) -> int | None:
    """NumPy ufunc buffer size (elements) for elementwise ops over rows of `row_elems`, or None
    to keep the default (8192). A row-broadcast operand (`a - m[:, None]`) cannot be coalesced
    with the rows, so with the default buffer NumPy copies it into a buffer spanning several
    rows of 1-4 Ki elements: ~3x the cost of a scalar multiply. A buffer no longer than a row
    makes it pass the operand with stride 0 instead. Only elementwise speed changes: results are
    bit-identical (a reduction over a row is split by the row length, not by the buffer)."""
    if row_elems is None or not 768 <= row_elems < 8192:
        return None
    return row_elems - row_elems % 16


def run_spans(fn, spans, total_elems: int, *, row_elems: int | None = None) -> None:
    """Call `fn(r0, r1)` for every span. Large jobs run on the calling thread and the pool
    threads together, each taking the next span from a shared queue as it finishes one: a thread
    slowed down (another process on its core) takes fewer spans instead of holding everyone up.
    The caller's `np.errstate` applies in every thread; with `row_elems` (the row length of the
    kernel's row view) the ufunc buffer size is `row_bufsize(row_elems)` while `fn` runs.
    Exceptions propagate."""
    bufsize = row_bufsize(row_elems)
    nthr = min(NUM_THREADS, len(spans))
    if nthr <= 1 or total_elems < PARALLEL_MIN_ELEMS:     # on this thread: its own errstate
        if not bufsize:
            for r0, r1 in spans:
                fn(r0, r1)
            return
        old = np.setbufsize(bufsize)
        try:
            for r0, r1 in spans:
                fn(r0, r1)
        finally:
            np.setbufsize(old)
        return
    err = np.geterr()
    queue = iter(spans)
    lock = threading.Lock()
    failed: list = []

    def spans_left():
        while not failed:
            with lock:
                span = next(queue, None)
            if span is None:
                return
            fn(*span)

    def worker():
        with np.errstate(**err):
            old = np.setbufsize(bufsize) if bufsize else None
            try:
                # one BLAS thread each: the pool already fills the cores, and BLAS threads of
                # their own inside the parts (the SSD kernels' small batched products) made the
                # SSD backward ~2x slower on 2 cores
                blas_single(spans_left)
            except BaseException as e:      # stop the others early, re-raise on the caller
                failed.append(e)
                raise
            finally:
                if bufsize:
                    np.setbufsize(old)

    futures = [_get_pool().submit(worker) for _ in range(nthr - 1)]
    try:
        worker()
    finally:
        for f in futures:
            f.result()


def run_flat(fn, n: int) -> None:
    """`run_spans` over a flat buffer of `n` elements: `fn(i0, i1)` handles elements [i0, i1)."""
    run_spans(fn, row_spans(n, 1), n)


def span_scratch(temps: int):
    """`@kernel(workspace=...)` of a row kernel that holds `temps` accumulation-dtype arrays of
    one span while `run_spans` works (up to NUM_THREADS spans at once); the first input is the
    [..., row] array it walks."""
    def workspace(shapes, dtypes, params=None) -> int:
        shape = shapes[0]
        row = shape[-1] if shape else 1
        nrows = math.prod(shape[:-1]) if shape else 1
        spans = row_spans(nrows, row)
        if not spans:
            return 0
        rows = min(nrows, sum(r1 - r0 for r0, r1 in spans[:NUM_THREADS]))
        return temps * rows * row * acc_dtype(dtypes[0].np).itemsize
    return workspace


# ---- BLAS threads ---------------------------------------------------------------------------
def _find_set_local():
    """OpenBLAS's per-thread thread-count setter (0.3.27+), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "openblas" in line.lower()}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).openblas_set_num_threads_local
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    return None


_set_local = None
_set_local_lock = threading.Lock()
_set_local_done = False


def has_blas_single() -> bool:
    """Whether `blas_single` can limit this thread's BLAS (OpenBLAS 0.3.27+ is loaded)."""
    global _set_local, _set_local_done
    if not _set_local_done:
        with _set_local_lock:
            _set_local, _set_local_done = _find_set_local(), True
    return _set_local is not None


def blas_single(fn):
    """Run fn() with this thread's OpenBLAS limited to one thread (when it can be). The limit
    is OpenBLAS's per-thread one: setting the process-wide count instead around every call
    (threadpoolctl) made two pooled GEMM halves as slow as one single-threaded GEMM."""
    global _set_local, _set_local_done
    if not _set_local_done:
        with _set_local_lock:
            _set_local, _set_local_done = _find_set_local(), True
    if _set_local is None:
        return fn()
    old = _set_local(1)
    try:
        return fn()
    finally:
        _set_local(old if old > 0 else 0)
