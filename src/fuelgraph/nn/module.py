"""`Module` and `Parameter`, as torch.nn has them: submodules and parameters found by attribute,
`parameters()`, `named_parameters()`, `state_dict()` / `load_state_dict()`, `train()` /
`eval()`, `to(device or dtype)`, `zero_grad()`, plus `Sequential`, `ModuleList`, `ModuleDict`.

A Parameter is a leaf tensor that requires grad and owns its buffer. It is updated in place
(optimizers, `p.copy_(v)`, `p -= lr * p.grad`, `load_state_dict`): the handle is rebound to the
new value, so modules, optimizers and traced steps holding the Parameter see the update, and
gradients keep flowing to it in the next backward()."""
from __future__ import annotations

from collections import OrderedDict
from typing import Iterator


from .. import dtype as dt
from ..api import bind_buffer, rebind
from ..api import tensor as _tensor
from ..backends import get_backend
from ..errors import FuelGraphError
from ..ir.tensor import OWNER, Tensor, _leaf
from ..jit import current_trace
from ..runtime.executor import realize_raw


def _owned_leaf(t: Tensor, data) -> None:
    """Initialize `t` as a leaf holding its own copy of `data` (a Tensor, array or list)."""
    src = data if isinstance(data, Tensor) else _tensor(data)
    buf = get_backend(src.device).copy(realize_raw([src.detach()])[0])
    Tensor.__init__(t, _leaf(buf, src.dtype, src.device, False).value)
    OWNER[t.value.node] = (t, "value")


class Parameter(Tensor):
    """A trainable leaf: requires grad (float dtypes), owns a copy of `data`."""
    __slots__ = ()

    def __init__(self, data, requires_grad: bool = True):
        _owned_leaf(self, data)
        if requires_grad:
            if not self.dtype.is_float:
                raise FuelGraphError(f"Parameter: requires_grad needs a float dtype, got "
                                     f"{self.dtype.name} (pass requires_grad=False)")
            self.requires_grad = True

    def __reduce_ex__(self, proto):
        return (Parameter, (self.numpy(), self.requires_grad))


class Buffer(Tensor):
    """A non-trainable module state tensor (e.g. running statistics), owning its buffer."""
    __slots__ = ()

    def __init__(self, data):
        _owned_leaf(self, data)


class Module:
    """Base class of layers and models: assign Parameters, Modules and (registered) buffers as
    attributes; implement `forward`; call the module."""

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "training", True)

    # ---- attributes ------------------------------------------------------------------------
    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise FuelGraphError(f"{type(self).__name__}: call super().__init__() before "
                                 f"assigning attributes")
        for d in (self._parameters, self._modules, self._buffers):
            d.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        elif isinstance(value, Buffer):
            self._buffers[name] = value
        else:
            object.__setattr__(self, name, value)
            return
        self.__dict__.pop(name, None)

    def __getattr__(self, name):
        d = self.__dict__
        for table in ("_parameters", "_modules", "_buffers"):
            if table in d and name in d[table]:
                return d[table][name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name):
        for table in (self._parameters, self._modules, self._buffers):
            if name in table:
                del table[name]
                return
        object.__delattr__(self, name)

    def register_parameter(self, name: str, p: Parameter | None):
        self.__setattr__(name, p)

    def register_buffer(self, name: str, t, persistent: bool = True):
        """Module state that is not trained (saved in state_dict when persistent)."""
        b = t if isinstance(t, Buffer) else Buffer(t)
        self.__setattr__(name, b)
        if not persistent:
            self.__dict__.setdefault("_nonpersistent", set()).add(name)

    def add_module(self, name: str, m: "Module"):
        self.__setattr__(name, m)

    # ---- traversal -------------------------------------------------------------------------
    def named_modules(self, prefix="") -> Iterator[tuple[str, "Module"]]:
        seen = set()
        stack = [(prefix, self)]
        while stack:
            name, m = stack.pop(0)
            if id(m) in seen:
                continue
            seen.add(id(m))
            yield name, m
            stack[0:0] = [((f"{name}.{k}" if name else k), c) for k, c in m._modules.items()
                          if c is not None]

    def modules(self):
        return (m for _, m in self.named_modules())

    def children(self):
        return (m for m in self._modules.values() if m is not None)

    def named_children(self):
        return ((k, m) for k, m in self._modules.items() if m is not None)

    def named_parameters(self, prefix="", recurse=True) -> Iterator[tuple[str, Parameter]]:
        seen = set()
        mods = self.named_modules(prefix) if recurse else [(prefix, self)]
        for name, m in mods:
            for k, p in m._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{name}.{k}" if name else k), p

    def parameters(self, recurse=True) -> Iterator[Parameter]:
        return (p for _, p in self.named_parameters(recurse=recurse))

    def named_buffers(self, prefix="", recurse=True):
        mods = self.named_modules(prefix) if recurse else [(prefix, self)]
        for name, m in mods:
            for k, b in m._buffers.items():
                if b is not None:
                    yield (f"{name}.{k}" if name else k), b

    def buffers(self, recurse=True):
        return (b for _, b in self.named_buffers(recurse=recurse))

    # ---- state -----------------------------------------------------------------------------
    def state_dict(self) -> "OrderedDict[str, Tensor]":
        """name -> tensor for every parameter and persistent buffer (the tensors as they are
        now: later updates rebind the module's tensors, not these)."""
        out = OrderedDict()
        for name, m in self.named_modules():
            skip = m.__dict__.get("_nonpersistent", ())
            for k, p in m._parameters.items():
                if p is not None:
                    out[f"{name}.{k}" if name else k] = Tensor(p.value)
            for k, b in m._buffers.items():
                if b is not None and k not in skip:
                    out[f"{name}.{k}" if name else k] = Tensor(b.value)
        return out

    def load_state_dict(self, state: dict, strict: bool = True):
        """Copy values into the parameters and buffers (same shapes; cast to their dtypes).
        With strict, missing and unexpected keys raise FuelGraphError. Returns (missing,
        unexpected) key lists."""
        own = OrderedDict(list(self.named_parameters()) + list(self.named_buffers()))
        missing = [k for k in own if k not in state]
        unexpected = [k for k in state if k not in own]
        if strict and (missing or unexpected):
            raise FuelGraphError(f"load_state_dict: missing keys {missing}, unexpected keys "
                                 f"{unexpected}")
        for k, t in own.items():
            if k not in state:
                continue
            v = state[k]
            v = v if isinstance(v, Tensor) else _tensor(v)
            if tuple(v.shape) != tuple(t.shape):
                raise FuelGraphError(f"load_state_dict: {k} has shape {tuple(v.shape)} in the "
                                     f"state dict, expected {tuple(t.shape)}")
            v = v.astype(t.dtype)
            if v.device != t.device:
                v = v.to(t.device)
            buf = get_backend(t.device).copy(realize_raw([v.detach()])[0])
            bind_buffer(t, buf)
        return missing, unexpected

    # ---- modes, devices --------------------------------------------------------------------
    def train(self, mode: bool = True):
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self):
        return self.train(False)

    def requires_grad_(self, flag: bool = True):
        for p in self.parameters():
            p.requires_grad = flag
        return self

    def zero_grad(self, set_to_none: bool = True):
        for p in self.parameters():
            p.grad = None if set_to_none or p.grad is None else p.grad * 0.0

    def to(self, *args, dtype=None, device=None):
        """Move parameters and buffers to a device and/or cast float ones to a dtype, keeping
        the Parameter objects (optimizers built on them stay valid)."""
        for a in args:
            if isinstance(a, str):
                device = a
            elif a is not None:
                dtype = a
        for t in list(self.parameters()) + list(self.buffers()):
            v = t.detach()
            if dtype is not None and t.dtype.is_float:
                v = v.astype(dtype)
            if device is not None:
                v = v.to(device)
            if v.dtype != t.dtype or v.device != t.device:
                buf = get_backend(v.device).copy(realize_raw([v])[0])
                rebind(t, _leaf(buf, v.dtype, v.device, False).value)
                t.grad = None
        return self

    def cuda(self, device=None):
        return self.to(device or "cuda")

    def cpu(self):
        return self.to("cpu")

    def half(self):
        return self.to(dtype=dt.float16)

    def bfloat16(self):
        return self.to(dtype=dt.bfloat16)

    def float(self):
        return self.to(dtype=dt.float32)

    def apply(self, fn):
        for m in self.modules():
            fn(m)
        return self

    # ---- calling ---------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        raise FuelGraphError(f"{type(self).__name__}: forward() is not implemented")

    def __call__(self, *args, **kwargs):
        tr = current_trace()
        if tr is not None:      # a traced step depends on the train/eval mode
            tr.guard(lambda m=self: m.training, self.training, key=("training", id(self)))
        return self.forward(*args, **kwargs)

    def extra_repr(self) -> str:
        return ""

    def __repr__(self):
        lines = [f"{type(self).__name__}({self.extra_repr()}"]
        kids = list(self._modules.items())
        if not kids:
            return lines[0] + ")"
        for k, m in kids:
            sub = repr(m).replace("\n", "\n  ")
            lines.append(f"  ({k}): {sub}")
        return "\n".join(lines) + "\n)"


class Sequential(Module):
    """Modules applied in order."""

    def __init__(self, *mods):
        super().__init__()
        if len(mods) == 1 and isinstance(mods[0], (dict, OrderedDict)):
            for k, m in mods[0].items():
                self.add_module(k, m)
        else:
            for i, m in enumerate(mods):
                self.add_module(str(i), m)

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x

    def __getitem__(self, i):
        return list(self._modules.values())[i]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class ModuleList(Module):
    def __init__(self, mods=()):
        super().__init__()
        for m in mods:
            self.append(m)

    def append(self, m):
        self.add_module(str(len(self._modules)), m)
        return self

    def extend(self, mods):
        for m in mods:
            self.append(m)
        return self

    def __getitem__(self, i):
        return list(self._modules.values())[i]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class ModuleDict(Module):
    def __init__(self, mods=None):
        super().__init__()
        for k, m in (mods or {}).items():
            self.add_module(k, m)

    def __getitem__(self, k):
        return self._modules[k]

    def __setitem__(self, k, m):
        self.add_module(k, m)

    def keys(self):
        return self._modules.keys()

    def items(self):
        return self._modules.items()

    def values(self):
        return self._modules.values()

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules)
