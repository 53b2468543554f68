"""Public-API behaviour of `Tensor` that needs the layers above the IR: realizing (running the
optimized plan), device moves, torch interop and `backward()`. The methods are bound onto
`Tensor` here (the IR itself imports nothing above it); `fuelgraph/__init__` imports this."""
from __future__ import annotations

import numpy as np

from .autograd import backward as _backward
from .backends import get_backend
from .errors import FuelGraphError
from .interop import from_torch, to_torch
from .ir.tensor import Tensor, _leaf, _normalize_device
from .ir.tensor import tensor as _ir_tensor
from .runtime.executor import realize, realize_raw


def tensor(data, dtype=None, device="cpu", requires_grad=False) -> Tensor:
    """Create a leaf tensor from array-like data (a NumPy array, nested lists, a scalar, a
    torch tensor, or another Tensor's values), copied, on `device` ('cpu', 'cuda',
    'cuda:N'). Python floats default to float32 and ints to int64."""
    if hasattr(data, "__dlpack__") and type(data).__module__.startswith("torch"):
        t = from_torch(data.detach().clone())          # a copy, never the caller's memory
        if t.device == "cpu":
            return _ir_tensor(t.numpy(), dtype, device, requires_grad)
        t = (t.astype(dtype) if dtype is not None else t).to(device)
        t = _leaf(realize_raw([t])[0], t.dtype, t.device, False)
        t.requires_grad = requires_grad
        return t
    return _ir_tensor(data, dtype, device, requires_grad)


def _numpy(self) -> np.ndarray:
    """Realize and return a NumPy array (a copy from the device for GPU tensors). The array is
    read-only, as in JAX: tensors are values, and it is cached for later calls."""
    if self._cache is None:
        a = realize([self])[0]
        a.flags.writeable = False
        self._cache = a
    return self._cache


def _realize(self) -> Tensor:
    """Run the graph under this tensor now (its value is kept for later reads)."""
    self.numpy()
    return self


def _item(self):
    return self.numpy().item()


def _tolist(self):
    return self.numpy().tolist()


def _array(self, dtype=None, copy=None):
    a = self.numpy()
    return a.astype(dtype) if dtype is not None else a


def _bool(self):
    if self.size() != 1:
        raise FuelGraphError("bool: truth value of a tensor with more than one element")
    return bool(self.item())


def _float(self):
    return float(self.item())


def _int(self):
    return int(self.item())


def _to(self, device) -> Tensor:
    """Move to `device` ('cpu', 'cuda', 'cuda:N'). Realizes this tensor."""
    device = _normalize_device(device)
    if device == self.device:
        return self
    data = realize_raw([self])[0]
    return _leaf(get_backend(device).from_any(data, device), self.dtype, device,
                 self.requires_grad)


def _to_torch(self):
    """Realize and return a torch tensor (zero-copy where possible)."""
    return to_torch(self)


def _backward_method(self, grad: Tensor | None = None):
    """Reverse-mode: accumulate d(self)/d(leaf) into `.grad` of every leaf with
    requires_grad=True that self depends on. Without `grad`, self must be a scalar."""
    _backward(self, grad)


for _name, _fn in {"numpy": _numpy, "realize": _realize, "item": _item, "tolist": _tolist,
                   "__array__": _array, "__bool__": _bool, "__float__": _float,
                   "__int__": _int, "to": _to, "to_torch": _to_torch,
                   "backward": _backward_method}.items():
    setattr(Tensor, _name, _fn)
