"""Quantizers and dequantizers for the quantized matmuls (`F.qmatmul`, `F.nf4_matmul`,
`F.awq_matmul`): turn a float weight into each packed format, or a packed weight back into
floats.

    w_packed, absmax = quantize_nf4(w)              # w [N, K]: then F.nf4_matmul(a, w_packed, absmax)
    qweight, qzeros, scales = quantize_awq(w, 128)  # w [K, N]: then F.awq_matmul(a, ...)
    w_bytes = quantize_gguf(w, "Q8_0")              # w [N, K]: then F.qmatmul(a, w_bytes, "Q8_0", N, K)

The quantizers run on the host (NumPy) and return fuelgraph tensors (on `device`). They accept
NumPy arrays, fuelgraph tensors or torch tensors. The dequantizers build lazy tensors (the ops'
own dequantization, in primitives) on the packed tensors' device."""
from __future__ import annotations

import numpy as np

from .errors import FuelGraphError
from .ir.tensor import Tensor, tensor
from .registry.quant import (AWQ_ORDER, NF4_CODE, dequantize_awq, dequantize_gguf,
                             dequantize_nf4)
from .registry.quant_gguf import FORMATS, gguf_format

__all__ = ["quantize_nf4", "quantize_awq", "quantize_gguf", "dequantize_nf4", "dequantize_awq",
           "dequantize_gguf", "NF4_CODE", "AWQ_ORDER", "FORMATS"]


def _host_float(w, name: str, rank: int = 2) -> np.ndarray:
    if isinstance(w, Tensor):
        w = w.numpy()
    elif hasattr(w, "detach") and type(w).__module__.startswith("torch"):
        w = w.detach().float().cpu().numpy()
    a = np.asarray(w, dtype=np.float32)
    if a.ndim != rank:
        raise FuelGraphError(f"{name}: expected a rank-{rank} float weight, got shape {a.shape}")
    return a


def quantize_nf4(w, block_size: int = 64, device="cpu"):
    """NF4-quantize a weight w [N, K] (the `W` of `a @ W.T`, nn.Linear's layout) exactly as
    bitsandbytes' `quantize_4bit(quant_type="nf4")` does: per block of `block_size` elements
    of each row, absmax = max |w|; each w / absmax (clamped to [-1, 1]) takes the code of the
    nearest NF4 value (a value exactly halfway takes the lower code).

    K must be a positive multiple of block_size (and even). Returns (w_packed uint8 [N, K/2],
    element 2j in the high nibble of byte j; absmax float32 [N, K / block_size])."""
    a = _host_float(w, "quantize_nf4")
    n, k = a.shape
    if not isinstance(block_size, int) or block_size < 1 or k == 0 or k % block_size or k % 2:
        raise FuelGraphError(f"quantize_nf4: K = {k} must be an even, positive multiple of "
                             f"block_size {block_size!r}")
    blocks = a.reshape(n, k // block_size, block_size)
    absmax = np.abs(blocks).max(axis=-1)
    inv = np.float32(1.0) / np.maximum(absmax, np.float32(1e-38))
    scaled = np.clip(blocks * inv[..., None], -1, 1).reshape(n, k)
    mids = (NF4_CODE[:-1] + NF4_CODE[1:]) / np.float32(2)
    codes = np.searchsorted(mids, scaled, side="left").astype(np.uint8)
    packed = (codes[:, 0::2] << 4) | codes[:, 1::2]
    return tensor(packed, device=device), tensor(absmax.astype(np.float32), device=device)


def _awq_pack(q):
    """uint8 codes [R, N] -> int32 [R, N/8]: logical column 8c + AWQ_ORDER[i] in nibble i."""
    r, n = q.shape
    q3 = q.reshape(r, n // 8, 8).astype(np.uint32)
    word = np.zeros((r, n // 8), np.uint32)
    for i, e in enumerate(AWQ_ORDER):
        word |= q3[:, :, e] << np.uint32(4 * i)
    return word.view(np.int32)


def quantize_awq(w, group_size: int = 128, device="cpu"):
    """AWQ-quantize (asymmetric 4-bit, AutoAWQ's zero-point scheme) a weight w [K, N] (the `W`
    of `a @ W`, i.e. nn.Linear's weight transposed) into AutoAWQ GEMM checkpoint tensors. Per
    output column and group of `group_size` rows of K: s = fp16((max - min) / 15) (at least
    1e-5 / 15), z = clamp(round(-min / s), 0, 15), q = clamp(round(w / s) + z, 0, 15) (round
    half to even), so W ~ (q - z) * s. group_size -1 means one group over all of K.

    N must be a multiple of 8 and K of group_size. Returns (qweight int32 [K, N/8], qzeros
    int32 [K/G, N/8], scales float16 [K/G, N]) in AutoAWQ's packing (nibble order
    0,2,4,6,1,3,5,7 along N). AWQ's activation-aware search of the scales is not done here:
    this is the plain round-to-nearest quantizer its format uses."""
    a = _host_float(w, "quantize_awq")
    k, n = a.shape
    if group_size == -1:
        group_size = k
    if not isinstance(group_size, int) or group_size < 1 or k == 0 or k % group_size or \
            n == 0 or n % 8:
        raise FuelGraphError(f"quantize_awq: w has shape {a.shape}; K must be a positive multiple "
                             f"of group_size {group_size!r} and N a positive multiple of 8")
    g = a.reshape(k // group_size, group_size, n)
    hi, lo = g.max(axis=1), g.min(axis=1)
    s16 = (np.maximum(hi - lo, np.float32(1e-5)) / np.float32(15)).astype(np.float16)
    s = s16.astype(np.float32)
    z = np.clip(np.round(-lo / s), 0, 15)
    q = np.clip(np.round(g / s[:, None, :]) + z[:, None, :], 0, 15).astype(np.uint8)
    return (tensor(_awq_pack(q.reshape(k, n)), device=device),
            tensor(_awq_pack(z.astype(np.uint8)), device=device),
            tensor(s16, device=device))


def quantize_gguf(w, quant_type, device="cpu"):
    """Quantize w [N, K] to a GGUF type with gguf-py's own quantizer (Q4_0, Q4_1, Q5_0, Q5_1,
    Q8_0; gguf-py has none for the K-quants). Returns the raw bytes, uint8 [N, row bytes], as
    `F.qmatmul` takes them."""
    fmt = gguf_format(quant_type, "quantize_gguf")
    a = _host_float(w, "quantize_gguf")
    try:
        from gguf import GGMLQuantizationType, quants
    except ImportError:  # pragma: no cover - gguf is a test dependency
        raise FuelGraphError("quantize_gguf: needs the gguf package (pip install gguf)") from None
    if a.shape[1] % fmt.block:
        raise FuelGraphError(f"quantize_gguf: K = {a.shape[1]} is not a multiple of the "
                             f"{fmt.name} block of {fmt.block}")
    try:
        data = quants.quantize(a, GGMLQuantizationType(fmt.code))
    except NotImplementedError:
        raise FuelGraphError(f"quantize_gguf: gguf-py has no quantizer for {fmt.name}") from None
    return tensor(np.ascontiguousarray(data, dtype=np.uint8), device=device)
