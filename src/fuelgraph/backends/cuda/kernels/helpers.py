"""Shared launch utilities plus three small fused helpers (spec §10, §15, §16).

Public kernels here:

* ``reduce_max_to_backward(x, grad)`` -- "fair share" gradient of ``ReduceMaxTo`` (§10); the
  last-axis keepdim case (``grad.shape == x.shape[:-1] + (1,)``) runs a Triton row kernel, every
  other target shape falls back to a torch implementation of the same formula. Matches torch
  ``amax`` backward (Appendix H.15): ties share evenly, a window containing NaN gets NaN.
* ``powi_backward(x, grad, *, exp)`` -- ``exp * x**(exp-1) * grad`` with an integer power by
  binary exponentiation in float32; ``exp == 0`` returns zeros (Appendix H.18).
* ``inplace_affine(x, *, mul, add)`` -- ``x <- mul*x + add`` in x's own storage, float32 multiply
  then add (two roundings, no FMA contraction, as §16 specifies); returns ``x``.

Launch conventions shared by every module of this package (the ``_``-prefixed utilities):
inputs are made contiguous, compute is float32, results are stored in the input dtype.
float64 inputs are computed by the torch reference formulas in float64 (no Triton kernel);
tensors that are not on a CUDA device are also routed to the torch formulas unless the Triton
CPU interpreter is active (``TRITON_INTERPRET=1``, used for development and CPU tests).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from fuelgraph.errors import fail

__all__ = ["reduce_max_to_backward", "powi_backward", "inplace_affine"]

# --------------------------------------------------------------------------------------------
# shared utilities
# --------------------------------------------------------------------------------------------

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FLOAT_DTYPES = KERNEL_DTYPES + (torch.float64,)

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


def use_triton(t: torch.Tensor) -> bool:
    """True when ``t`` should go through a Triton kernel (CUDA, or CPU under the interpreter)."""
    if t.dtype not in KERNEL_DTYPES:
        return False
    return t.is_cuda or (INTERPRET and t.device.type == "cpu")


def check_float(op: str, name: str, t: torch.Tensor) -> None:
    if not isinstance(t, torch.Tensor):
        raise fail(op, f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise fail(op, f"{name} must be float32, float64, bfloat16 or float16, got {t.dtype}")


def check_same(op: str, a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise fail(op, f"{b_name} shape {tuple(b.shape)} must equal {a_name} shape {tuple(a.shape)}")
    if a.dtype != b.dtype:
        raise fail(op, f"{b_name} dtype {b.dtype} must equal {a_name} dtype {a.dtype}")
    if a.device != b.device:
        raise fail(op, f"{b_name} is on {b.device}, {a_name} on {a.device}")


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of ``device`` (4 under the CPU interpreter, to exercise split paths)."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    return 4


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


# --------------------------------------------------------------------------------------------
# REDUCE_MAX_TO_BACKWARD (§10)
# --------------------------------------------------------------------------------------------


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


@triton.jit
def _rmax_bwd_rows_kernel(x_ptr, g_ptr, dx_ptr, R, N,
                          BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr):
    mask, offs = row_tile(R, N, BLOCK_R, BLOCK_N)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < R
    x = tl.load(x_ptr + offs, mask=mask, other=float("-inf")).to(tl.float32)
    g = tl.load(g_ptr + rows, mask=rmask, other=0.0).to(tl.float32)
    isnan = (x != x).to(tl.int32)
    has_nan = tl.max(isnan, 1) > 0
    m = tl.max(x, 1)
    hit = (x == m[:, None]) & mask
    cnt = tl.sum(hit.to(tl.float32), 1)
    share = g / cnt
    dx = tl.where(hit, share[:, None], 0.0)
    dx = tl.where(has_nan[:, None], float("nan"), dx)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rmax_bwd_loop_kernel(x_ptr, g_ptr, dx_ptr, N, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = row * N
    m = float("-inf")
    cnt = 0.0
    nan = 0
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        nan = tl.maximum(nan, tl.max((x != x).to(tl.int32), 0))
        bm = tl.max(x, 0)
        bc = tl.sum(((x == bm) & mask).to(tl.float32), 0)
        cnt = tl.where(bm > m, bc, tl.where(bm == m, cnt + bc, cnt))
        m = tl.maximum(m, bm)
    g = tl.load(g_ptr + row).to(tl.float32)
    share = g / cnt
    for start in range(0, N, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < N
        x = tl.load(x_ptr + base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        dx = tl.where(x == m, share, 0.0)
        dx = tl.where(nan > 0, float("nan"), dx)
        tl.store(dx_ptr + base + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _reduce_max_to_backward_torch(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    xs = tuple(x.shape)
    gs = (1,) * (len(xs) - grad.dim()) + tuple(grad.shape)
    axes = tuple(i for i in range(len(xs)) if gs[i] == 1 and xs[i] != 1)
    g = grad.reshape(gs)
    if not axes:
        return g.expand(xs).to(x.dtype).contiguous()
    m = torch.amax(x, dim=axes, keepdim=True)
    mask = (x == m).to(x.dtype)
    cnt = mask.sum(dim=axes, keepdim=True)
    return (mask * (g.to(x.dtype) / cnt)).contiguous()


def reduce_max_to_backward(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """Gradient of ``ReduceMaxTo(grad.shape)(x)``: positions equal to their window's maximum get
    ``grad / #ties``, others 0; a window holding a NaN gets NaN everywhere (torch ``amax``).

    ``grad``'s shape is the forward target: broadcast-compatible with ``x`` (right-aligned).
    The last-axis keepdim case runs on Triton, other targets on torch.
    """
    op = "reduce_max_to_backward"
    check_float(op, "x", x)
    check_float(op, "grad", grad)
    if grad.dim() > x.dim():
        raise fail(op, f"grad rank {grad.dim()} exceeds x rank {x.dim()}")
    xs = tuple(x.shape)
    gs = (1,) * (x.dim() - grad.dim()) + tuple(grad.shape)
    for i, (a, b) in enumerate(zip(xs, gs)):
        if b != 1 and b != a:
            raise fail(op, f"grad shape {tuple(grad.shape)} is not a reduction target of x shape {xs}")
    keepdim_last = (x.dim() >= 1 and grad.dim() == x.dim() and gs[:-1] == xs[:-1]
                    and gs[-1] == 1 and xs[-1] > 1)
    if not keepdim_last or not use_triton(x) or x.numel() == 0:
        return _reduce_max_to_backward_torch(x, grad)
    x, r, n = flat_rows(x)
    g = grad.contiguous()
    dx = torch.empty_like(x)
    if n <= MAX_FUSED_N:
        block_r, block_n, nw = row_config(n)
        _rmax_bwd_rows_kernel[(triton.cdiv(r, block_r),)](
            x, g, dx, r, n, BLOCK_R=block_r, BLOCK_N=block_n, num_warps=nw)
    else:
        _rmax_bwd_loop_kernel[(r,)](x, g, dx, n, BLOCK=LOOP_BLOCK, num_warps=8)
    return dx


# --------------------------------------------------------------------------------------------
# POWI_BACKWARD (§15)
# --------------------------------------------------------------------------------------------

EW_BLOCK = 4096
EW_WARPS = 8


@triton.jit
def _powi_bwd_kernel(x_ptr, g_ptr, dx_ptr, numel, expf,
                     M_ABS: tl.constexpr, M_NEG: tl.constexpr, NBITS: tl.constexpr,
                     BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    acc = tl.full((BLOCK,), 1.0, tl.float32)
    base = x
    for i in tl.static_range(NBITS):
        if (M_ABS >> i) & 1:
            acc = acc * base
        if i + 1 < NBITS:
            base = base * base
    if M_NEG:
        acc = 1.0 / acc
    dx = expf * acc * g
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=mask)


def _powi_torch(x: torch.Tensor, m: int) -> torch.Tensor:
    acc = torch.ones_like(x)
    base = x
    k = abs(m)
    while k:
        if k & 1:
            acc = acc * base
        k >>= 1
        if k:
            base = base * base
    return 1.0 / acc if m < 0 else acc


def powi_backward(x: torch.Tensor, grad: torch.Tensor, *, exp: int) -> torch.Tensor:
    """``dx = exp * x**(exp-1) * grad`` elementwise (float32 compute); ``exp == 0`` gives zeros."""
    op = "powi_backward"
    check_float(op, "x", x)
    check_same(op, "x", x, "grad", grad)
    if isinstance(exp, bool) or not isinstance(exp, int):
        raise fail(op, f"exp must be an int, got {exp!r}")
    if exp == 0:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    m = exp - 1
    if not use_triton(x):
        return (float(exp) * _powi_torch(x, m) * grad).contiguous()
    x = x.contiguous()
    g = grad.contiguous()
    dx = torch.empty_like(x)
    numel = x.numel()
    if numel == 0:
        return dx
    m_abs = abs(m)
    _powi_bwd_kernel[(triton.cdiv(numel, EW_BLOCK),)](
        x, g, dx, numel, float(exp),
        M_ABS=m_abs, M_NEG=m < 0, NBITS=max(1, m_abs.bit_length()),
        BLOCK=EW_BLOCK, num_warps=EW_WARPS)
    return dx


# --------------------------------------------------------------------------------------------
# INPLACE_AFFINE (§16)
# --------------------------------------------------------------------------------------------


@triton.jit
def _affine_kernel(x_ptr, numel, mul, add, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = x * mul + add          # launched with enable_fp_fusion=False: multiply, then add
    tl.store(x_ptr + offs, y.to(x_ptr.dtype.element_ty), mask=mask)


def inplace_affine(x: torch.Tensor, *, mul: float, add: float) -> torch.Tensor:
    """``x <- mul*x + add`` written into ``x``'s storage; returns ``x`` itself.

    float32/bf16/f16: float32 math with ``mul``/``add`` narrowed to float32; float64 in float64.
    A non-contiguous ``x`` is updated in place through torch.
    """
    op = "inplace_affine"
    check_float(op, "x", x)
    mul = float(mul)
    add = float(add)
    if x.numel() == 0:
        return x
    if not use_triton(x) or not x.is_contiguous():
        if x.dtype == torch.float64:
            x.mul_(mul).add_(add)
        else:
            xf = x.float()
            m32 = torch.tensor(mul, dtype=torch.float32).item()
            a32 = torch.tensor(add, dtype=torch.float32).item()
            x.copy_((xf * m32) + a32)
        return x
    numel = x.numel()
    _affine_kernel[(triton.cdiv(numel, EW_BLOCK),)](
        x, numel, mul, add, BLOCK=EW_BLOCK, num_warps=EW_WARPS, enable_fp_fusion=False)
    return x
