"""Zero-copy interop with torch and DLPack producers. A tensor made from external memory
shares it: the graph reads the producer's buffer at realize time."""
from __future__ import annotations

import numpy as np

from . import dtype as dt
from .backends import get_backend
from .errors import FuelGraphError
from .ir.tensor import _leaf
from .runtime.executor import realize_raw


def _torch():
    try:
        import torch
        return torch
    except ImportError:
        raise FuelGraphError("interop: torch is not installed") from None


def from_torch(t, requires_grad: bool = False):
    """A leaf sharing `t`'s memory (CPU tensors as NumPy views, CUDA tensors as themselves)."""
    torch = _torch()
    if not isinstance(t, torch.Tensor):
        raise FuelGraphError(f"from_torch: expected a torch.Tensor, got {type(t).__name__}")
    d = dt.as_dtype(str(t.dtype).replace("torch.", ""))
    t = t.detach()
    if t.device.type == "cuda":
        dev = f"cuda:{t.device.index or 0}"
        get_backend(dev)
        return _leaf(t.contiguous(), d, dev, requires_grad)
    t = t.contiguous()
    if t.dtype == torch.bfloat16:
        a = t.view(torch.int16).numpy().view(d.np)
    else:
        a = t.numpy()
    a = a.view()
    a.flags.writeable = False
    return _leaf(a, d, "cpu", requires_grad)


def from_dlpack(obj, requires_grad: bool = False):
    """A leaf sharing the memory of any DLPack producer (NumPy, torch, CuPy, JAX...)."""
    if isinstance(obj, np.ndarray):
        a = obj.view()
        a.flags.writeable = False
        return _leaf(np.asarray(a, order="C"), dt.as_dtype(a.dtype), "cpu", requires_grad)
    torch = _torch()
    return from_torch(torch.utils.dlpack.from_dlpack(obj), requires_grad)


def to_torch(t):
    """Realize `t` and return a torch tensor (no copy for CUDA results; NumPy results are
    wrapped without copying)."""
    torch = _torch()
    buf = realize_raw([t])[0]
    if isinstance(buf, torch.Tensor):
        return buf
    if buf.dtype.name == "bfloat16":
        return torch.from_numpy(np.asarray(buf, order="C").view(np.int16)).view(torch.bfloat16)
    if not buf.flags.writeable:
        buf = buf.copy()
    return torch.from_numpy(np.asarray(buf, order="C"))
