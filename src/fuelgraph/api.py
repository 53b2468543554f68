"""Public-API behaviour of `Tensor` that needs the layers above the IR: realizing (running the
optimized plan), device moves, torch interop, `backward()`, in-place updates of leaves and the
value-showing repr. The methods are bound onto `Tensor` here (the IR itself imports nothing
above it); `fuelgraph/__init__` imports this."""
from __future__ import annotations

import numpy as np

from . import dtype as dt
from .autograd import backward as _backward
from .backends import get_backend
from .errors import FuelGraphError
from .interop import from_torch, to_torch
from .ir import ops
from .ir.node import Value
from .ir.tensor import _DATA, GRAD_LEAVES, OWNER, REALIZED, TRACE, Tensor, _leaf, _normalize_device
from .ir.tensor import tensor as _ir_tensor
from .runtime.executor import group_gradients, realize_raw


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


# ---- realizing ---------------------------------------------------------------------------------
def _buffer(t: Tensor):
    """The device buffer holding t's value (computed now if it is not yet)."""
    return realize_raw([t])[0]


def _numpy(self) -> np.ndarray:
    """Realize and return the value as a NumPy array: the one host copy (from the GPU for
    CUDA tensors; on the CPU the computed buffer itself when nothing can write it). The array
    is read-only, as in JAX: tensors are values. Reading it again costs nothing."""
    c = self._cache
    if c is not None and c[0] == self.value:
        return c[1]
    buf = _buffer(self)
    a = get_backend(self.device).to_numpy(buf)
    if a is buf and a.flags.writeable:      # a buffer an optimizer may update in place later
        a = a.copy()
    a = a.view()
    a.flags.writeable = False
    self._cache = (self.value, a)
    return a


def _realize(self) -> Tensor:
    """Compute this tensor now on its device (no host copy); its value is kept for later reads
    and for graphs built on it. Returns self."""
    _buffer(self)
    return self


def _item(self):
    """The value of a one-element tensor as a Python number (a host copy)."""
    if self.numel() != 1:
        raise FuelGraphError(f"item: tensor of shape {self.shape} has {self.numel()} elements, "
                             f"expected one")
    return self.numpy().item()


def _tolist(self):
    return self.numpy().tolist()


def _array(self, dtype=None, copy=None):
    a = self.numpy()
    if dtype is not None:
        return a.astype(dtype)
    return a.copy() if copy else a


def _bool(self):
    if self.numel() != 1:
        raise FuelGraphError("bool: truth value of a tensor with more than one element is "
                             "ambiguous; use .any() or .all()")
    return bool(self.item())


def _float(self):
    return float(self.item())


def _int(self):
    return int(self.item())


# ---- devices and dtypes -----------------------------------------------------------------------
def _move(self, device) -> Tensor:
    device = _normalize_device(device)
    if device == self.device:
        return self
    op = self.value.node.op
    if (TRACE[0] is not None and isinstance(op, ops.Input) and op.uid >= TRACE[0].first_uid
            and self.value.node in _DATA):
        data = _DATA[self.value.node]   # a constant the traced step made: copied in, not computed
    else:
        data = _buffer(self)
    return _leaf(get_backend(device).from_any(data, device), self.dtype, device,
                 self.requires_grad)


def _to(self, *args, dtype=None, device=None, **kw) -> Tensor:
    """torch's `to`: `t.to('cuda')`, `t.to(fg.bfloat16)`, `t.to('cuda', fg.bfloat16)`,
    `t.to(other)` (other's device and dtype), keywords `device=`, `dtype=`. A device move
    realizes this tensor and copies it; a dtype change is a lazy cast."""
    for a in args:
        if isinstance(a, Tensor):
            device, dtype = a.device, a.dtype
        elif isinstance(a, str) or type(a).__name__ == "device":
            device = str(a)
        elif a is not None:
            dtype = a
    t = self
    if dtype is not None:
        t = t.astype(dtype)
    if device is not None:
        t = _move(t, device)
    return t


def _to_torch(self):
    """Realize and return a torch tensor (zero-copy where possible: CUDA results are the
    computed buffer itself; a parameter's buffer is shared and changes with its updates)."""
    return to_torch(self)


# ---- autograd ---------------------------------------------------------------------------------
def _backward_method(self, grad: Tensor | None = None):
    """Reverse-mode: accumulate d(self)/d(leaf) into `.grad` of every leaf with
    requires_grad=True that self depends on. Without `grad`, self must be a scalar. The
    gradients are lazy; reading any of them computes all of them (and self) in one plan."""
    leaves = _backward(self, grad)
    group_gradients(self, leaves)


# ---- in-place updates -------------------------------------------------------------------------
def rebind(t: Tensor, value: Value) -> None:
    """Point the handle `t` at `value` (the old value is untouched: tensors computed from it
    keep it). Keeps the requires_grad leaf table and the jit's trace in step."""
    old = t.value
    tr = TRACE[0]
    if tr is not None:
        tr.rebound(t, "value", old)
    t.value = value
    t._cache = None
    if t._requires_grad:
        if GRAD_LEAVES.get(old) is t:
            del GRAD_LEAVES[old]
        GRAD_LEAVES[value] = t
    if isinstance(value.node.op, ops.Input):
        OWNER[value.node] = (t, "value")


def bind_buffer(t: Tensor, buf) -> None:
    """Make `t` a leaf holding `buf` (a buffer on t's device that nothing else holds)."""
    rebind(t, _leaf(buf, t.dtype, t.device, False).value)


def assign(t: Tensor, new: Tensor) -> None:
    """Give the leaf `t` (a parameter, optimizer state, any requires_grad leaf) the value of
    `new`, keeping t's identity (modules, optimizers and traced steps keep referring to it).
    Not differentiated: this is an update, as torch's `with no_grad(): p -= ...`. Computed
    now outside a traced step (into a buffer of t's own); recorded as part of the step inside
    one."""
    if TRACE[0] is not None:
        rebind(t, new.detach().value)
        return
    be = get_backend(t.device)
    bind_buffer(t, be.copy(_buffer(new.detach())))


def _inplace(self, new: Tensor, op: str = "in-place") -> Tensor:
    """Rebind this handle to `new` (same shape; cast to this tensor's dtype, as torch's
    in-place ops). A leaf that requires grad, or a parameter/optimizer state, is updated as a
    leaf (see `assign`); any other tensor simply takes the new lazy value."""
    if not isinstance(new, Tensor):
        new = self._lift(new)
    if new.shape != self.shape:
        try:
            new = new.broadcast_to(self.shape)
        except FuelGraphError:
            raise FuelGraphError(f"{op}: result of shape {new.shape} cannot be written into a "
                                 f"tensor of shape {self.shape}") from None
    if new.dtype != self.dtype:
        if new.dtype.is_float and not self.dtype.is_float:
            raise FuelGraphError(f"{op}: result type {new.dtype.name} cannot be written into a "
                                 f"{self.dtype.name} tensor (cast it explicitly)")
        new = new.astype(self.dtype)
    if self.is_leaf and (self._requires_grad or self.value.node in OWNER):
        assign(self, new)
    else:
        rebind(self, new.value)
    return self


# ---- repr ---------------------------------------------------------------------------------------
REPR_MAX_ELEMENTS = 1000


def _repr(self) -> str:
    """Values like torch: small tensors are computed to be shown; a large one is summarized
    (its corners when already computed, else its shape)."""
    extras = []
    if self.dtype not in (dt.float32, dt.int64, dt.bool_):
        extras.append(f"dtype=fg.{self.dtype.name}")
    if self.device != "cpu":
        extras.append(f"device='{self.device}'")
    if self._requires_grad:
        extras.append("requires_grad=True")
    computed = isinstance(self.value.node.op, (ops.Input, ops.Const)) or \
        self.value.node in REALIZED
    if TRACE[0] is not None or (self.numel() > REPR_MAX_ELEMENTS and not computed):
        where = "being traced" if TRACE[0] is not None else "not computed yet: .numpy() or " \
            ".realize() computes it"
        return f"tensor(<shape {tuple(self.shape)}, {where}>" + \
            "".join(", " + e for e in extras) + ")"
    try:
        a = self.numpy()
    except FuelGraphError as e:
        return f"tensor(<shape {tuple(self.shape)}, cannot be computed: {e}>" + \
            "".join(", " + e for e in extras) + ")"
    if a.dtype.itemsize == 2 and a.dtype.kind == "V" or a.dtype.name == "bfloat16":
        a = a.astype(np.float32)
    body = np.array2string(a, separator=", ", prefix="tensor(", threshold=REPR_MAX_ELEMENTS,
                           edgeitems=3, precision=4)
    return "tensor(" + body + "".join(", " + e for e in extras) + ")"


for _name, _fn in {"numpy": _numpy, "realize": _realize, "item": _item, "tolist": _tolist,
                   "__array__": _array, "__bool__": _bool, "__float__": _float,
                   "__int__": _int, "to": _to, "to_torch": _to_torch,
                   "cpu": lambda self: _move(self, "cpu"),
                   "cuda": lambda self, device=None: _move(self, device or "cuda"),
                   "backward": _backward_method, "_inplace": _inplace,
                   "__repr__": _repr, "__str__": _repr}.items():
    setattr(Tensor, _name, _fn)
