"""Launch plumbing shared by the Triton kernel modules: row tiling (`row_config`, `row_tile`,
`launch_rows`), `flat_rows`, `next_pow2`, `num_sms`, the split launches' `arrival_counters`.
Conventions of every module of this package: inputs arrive contiguous (the planner makes them so), compute is float32, results are
stored in the input dtype. Kernels declare the dtypes they take (float64 is never one: those
calls lower to the op's recipe) and need CUDA tensors, or CPU tensors under the Triton CPU
interpreter (`TRITON_INTERPRET=1`, used for development and CPU tests)."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .... import dtype as _dt

# --------------------------------------------------------------------------------------------
# shared utilities
# --------------------------------------------------------------------------------------------

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"

#: True while fuelgraph warms up for and captures a CUDA graph (backend.GraphedPlan and
#: GraphedStep). A kernel choice that differs under capture reads this instead of the stream
#: state, so the warm-up launches (and compiles) the very kernels the capture records: a
#: kernel first loaded during a capture invalidates it.
GRAPH_CAPTURE = [False]
#: the fuelgraph dtypes the Triton kernels take (float64 lowers to the recipe)
HALF_AND_F32 = (_dt.float32, _dt.bfloat16, _dt.float16)

# elementwise kernels: elements per program and warps
EW_BLOCK = 4096
EW_WARPS = 8
# widest row held whole in registers; wider rows use the looped (chunked) kernels
MAX_FUSED_N = 16384
# chunk width of the looped kernels
LOOP_BLOCK = 4096
# cache hint for the streamed (read-once) loads of the whole-row kernels: "" or "evict_first".
# Measured on an H200 (2026-11-30, bf16 32768x4096): "evict_first" made softmax / rms_norm ~5%
# slower (3817 -> 3982 and 3786 -> 3997 GB/s without it), so the default is no hint.
ROW_EVICT = ""


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of ``device`` (4 under the CPU interpreter, to exercise split paths)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


#: arrival counters of split launches (the programs of a tile meet in the kernel; the last to
#: arrive resets the counter to zero, so the next launch finds zeros). Eager launches share one
#: buffer per device and stream: stream order keeps back-to-back launches apart, and launches
#: on two streams at once get two buffers. Launches captured in CUDA graphs (which may replay
#: on any stream, next to eager work) get a distinct range each from the device's graph pool.
_EAGER_COUNTERS: dict = {}
_GRAPH_COUNTERS: dict = {}
GRAPH_COUNTERS = 1 << 16


def arrival_counters(device: torch.device, n: int, capturing: bool) -> torch.Tensor:
    """int32 zeros (at least n) for a split launch's tile counters. capturing (a CUDA graph is
    being captured): a 16-byte aligned range of the graph pool that an eager launch zeroed and
    every replay leaves at zero (no memset in the graph); with the pool used up or not made
    yet, fresh zeros the graph sets before each replay."""
    key = (device.type, device.index)
    if capturing:
        pool = _GRAPH_COUNTERS.get(key)
        take = -(-n // 4) * 4
        if pool is not None and pool[1] + take <= pool[0].numel():
            pool[1] += take
            return pool[0][pool[1] - take:pool[1]]
        return torch.zeros(n, dtype=torch.int32, device=device)
    if key not in _GRAPH_COUNTERS:
        _GRAPH_COUNTERS[key] = [torch.zeros(GRAPH_COUNTERS, dtype=torch.int32, device=device), 0]
    skey = stream_key(device)
    have = _EAGER_COUNTERS.get(skey)
    if have is None or have.numel() < n:
        have = _EAGER_COUNTERS[skey] = torch.zeros(max(n, 1 << 12), dtype=torch.int32,
                                                   device=device)
    return have


def stream_key(device: torch.device) -> tuple:
    """(device type, index, current stream): the key of scratch that eager launches reuse."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    return device.type, device.index, stream


def row_config(n: int, *, target: int = 4096, max_rows: int = 64) -> tuple[int, int, int]:
    """(BLOCK_R, BLOCK_N, num_warps) for a whole-row-in-registers kernel over rows of ``n``.

    Small rows are packed several to a program so each program moves ``target`` elements;
    about 16 elements per thread (two 16-byte vectors of bf16) at ``target`` = 4096.
    """
    block_n = next_pow2(n)
    block_r = max(1, min(max_rows, target // block_n))
    elems = block_r * block_n
    num_warps = max(1, min(16, elems // 512))
    return block_r, block_n, num_warps


def flat_rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """Contiguous ``x`` viewed as [R, N] (N = last extent)."""
    x = x.contiguous()
    n = x.shape[-1] if x.dim() > 0 else 1
    r = x.numel() // n if n > 0 else 0
    return x, r, n


def launch_rows(rows_kernel, loop_kernel, ptrs, n_rows, n, scalars=(), *, block_r=None,
                num_warps=None, target=4096, evict=None):
    """Run a row-wise op over `n_rows` rows of `n` elements: the whole-row-in-registers kernel
    over tiles of rows when a row fits (n <= MAX_FUSED_N), else the looped kernel, one program
    per row. Kernel signatures: rows(*ptrs, R, N, *scalars, BLOCK_R, BLOCK_N, EVICT) and
    loop(*ptrs, N, *scalars, BLOCK)."""
    if n <= MAX_FUSED_N:
        br, bn, nw = row_config(n, target=target)
        br = block_r or br
        rows_kernel[(triton.cdiv(n_rows, br),)](
            *ptrs, n_rows, n, *scalars, BLOCK_R=br, BLOCK_N=bn,
            EVICT=ROW_EVICT if evict is None else evict, num_warps=num_warps or nw)
    else:
        loop_kernel[(n_rows,)](*ptrs, n, *scalars, BLOCK=LOOP_BLOCK, num_warps=num_warps or 8)


@triton.jit
def row_tile(R, N, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    """The [BLOCK_R, BLOCK_N] tile of a row-major [R, N] array that this program owns: (mask,
    int64 element offsets). Shared by every whole-row-in-registers kernel."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_N)
    mask = (rows < R)[:, None] & (cols < N)[None, :]
    return mask, rows.to(tl.int64)[:, None] * N + cols[None, :]
