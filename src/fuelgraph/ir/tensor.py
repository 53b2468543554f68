"""The lazy `Tensor`: a handle on one graph value. Operators and methods build nodes with
NumPy-style broadcasting (the IR itself is broadcast-free); `.numpy()` realizes."""
from __future__ import annotations

import itertools
import math
import weakref
from typing import Sequence

import numpy as np

from .. import dtype as dt
from ..dtype import DType
from ..errors import FuelGraphError
from . import ops
from .node import Node, Value, apply, make_node

_DATA: "weakref.WeakKeyDictionary[Node, object]" = weakref.WeakKeyDictionary()
#: graph value -> the requires_grad tensor holding it (what backward() fills .grad of)
GRAD_LEAVES: "weakref.WeakValueDictionary" = weakref.WeakValueDictionary()
#: node -> {slot: Input node bound to the computed buffer}: values already computed. Realizing
#: keeps them, and later graphs read the buffer instead of recomputing (nodes are immutable
#: values, so a computed value never goes stale)
REALIZED: "weakref.WeakKeyDictionary[Node, dict]" = weakref.WeakKeyDictionary()
#: Input node -> (tensor, "value" | "grad"): the mutable tensor (a parameter, optimizer state,
#: a gradient) that currently holds this leaf; what a traced step reads and rebinds
OWNER: "weakref.WeakKeyDictionary[Node, tuple]" = weakref.WeakKeyDictionary()
#: the active trace (fuelgraph.jit) or None; it records rebinds of tensors that existed before
TRACE: list = [None]
_INPUT_UID = itertools.count()


def bound_data(node: Node):
    """The buffer bound to an Input node."""
    try:
        return _DATA[node]
    except KeyError:
        raise FuelGraphError(f"realize: input %{node.uid} {node.op.shape} has no data (a traced "
                             f"placeholder, e.g. inside a scan body, cannot be realized)") from None


def _normalize_device(device) -> str:
    d = str(device or "cpu")
    if d == "cuda":
        return "cuda:0"
    if d == "cpu" or (d.startswith("cuda:") and d[5:].isdigit()):
        return d
    raise FuelGraphError(f"tensor: unknown device {device!r}; expected 'cpu', 'cuda' or 'cuda:N'")


class Tensor:
    """A lazy tensor: a handle on one immutable graph value (`value`). In-place operations
    (`x += 1`, `x[i] = v`, `x.copy_(y)`) rebind the handle to a new value; other tensors that
    were computed from the old value keep it. `grad` is filled by `backward()`."""
    __slots__ = ("value", "_requires_grad", "_grad", "_cache", "__weakref__")
    __array_priority__ = 1000  # numpy scalars defer to our reflected operators

    def __init__(self, value: Value, requires_grad: bool = False):
        self.value, self._grad, self._cache = value, None, None
        self._requires_grad = False
        if requires_grad:
            self.requires_grad = True

    @property
    def grad(self):
        """The gradient accumulated by `backward()` (None before). Only leaves get one: reading
        `.grad` of a tensor computed from tensors that require grad raises, naming the fix."""
        g = self._grad
        tr = TRACE[0]
        if tr is not None:
            tr.read_grad(self)
        if g is None and self._requires_grad is False and not self.is_leaf and \
                _depends_on_grad_leaf(self.value):
            raise FuelGraphError(
                "grad: this tensor is not a leaf: it was computed from tensors that require grad "
                "(e.g. `w = w - lr * w.grad` builds a new tensor, and backward() fills the .grad "
                "of the original leaf). Update parameters in place instead (`w -= lr * w.grad`, "
                "`w.copy_(...)`, or an optimizer from fuelgraph.optim), or start a new leaf with "
                "`w = (w - lr * w.grad).detach().requires_grad_()`")
        return g

    @grad.setter
    def grad(self, g):
        if g is not None and not isinstance(g, Tensor):
            raise FuelGraphError(f"grad: expected a Tensor or None, got {type(g).__name__}")
        if g is not None and g.shape != self.shape:
            raise FuelGraphError(f"grad: shape {g.shape} differs from the tensor's {self.shape}")
        tr = TRACE[0]
        if tr is not None:
            tr.rebound(self, "grad", self._grad)
        self._grad = g
        if g is not None and isinstance(g.value.node.op, ops.Input):
            OWNER[g.value.node] = (self, "grad")

    @property
    def is_leaf(self) -> bool:
        """True for tensors made from data (fuelgraph.tensor, parameters), False for results of
        operations."""
        return isinstance(self.value.node.op, ops.Input)

    def requires_grad_(self, flag: bool = True) -> "Tensor":
        self.requires_grad = flag
        return self

    @property
    def requires_grad(self) -> bool:
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, flag: bool):
        if flag and not self.dtype.is_float:
            raise FuelGraphError(f"requires_grad: needs a float dtype, got {self.dtype.name}")
        self._requires_grad = bool(flag)
        if flag:
            GRAD_LEAVES[self.value] = self
        elif GRAD_LEAVES.get(self.value) is self:      # frozen: backward() skips it
            del GRAD_LEAVES[self.value]

    # ---- metadata ------------------------------------------------------------------------
    shape = property(lambda self: self.value.shape)
    dtype = property(lambda self: self.value.dtype)
    device = property(lambda self: self.value.node.device)
    ndim = property(lambda self: len(self.value.shape))
    node = property(lambda self: self.value.node)

    def size(self, dim=None):
        """The shape (torch's `size()`), or the extent of axis `dim`."""
        if dim is None:
            return Size(self.shape)
        return self.shape[self._axes(dim, "size")[0]]

    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)
    nelement = numel

    def dim(self) -> int:
        """Number of axes (torch's `dim()`; also `ndim`)."""
        return len(self.shape)
    ndimension = dim

    def element_size(self) -> int:
        return self.dtype.itemsize

    def __len__(self):
        if not self.shape:
            raise FuelGraphError("len: tensor is 0-d")
        return self.shape[0]

    def __repr__(self):   # fuelgraph.api binds the value-showing repr
        return f"Tensor(shape={self.shape}, dtype={self.dtype.name}, device={self.device!r})"

    __hash__ = object.__hash__

    # ---- realization, device moves, interop and backward are public-API behaviour: the
    # methods numpy, realize, item, tolist, __array__, __bool__, __float__, __int__, to,
    # to_torch and backward are bound onto Tensor by `fuelgraph.api` (the IR imports nothing
    # above it)

    def detach(self) -> "Tensor":
        """The same values with no gradient flowing back (torch's detach / jax stop_gradient)."""
        return self._new(ops.Detach(), self)

    # ---- building helpers ----------------------------------------------------------------
    def _new(self, op, *srcs: "Tensor") -> "Tensor":
        return Tensor(apply(op, *(s.value for s in srcs)))

    def _scalar(self, v) -> "Tensor":
        return full((), v, self.dtype, self.device)

    def _lift(self, other) -> "Tensor":
        if isinstance(other, Tensor):
            return other
        if isinstance(other, (bool, int, float, np.number, np.bool_)):
            # a Python scalar is weakly typed (torch's rule): it takes the tensor's dtype unless
            # its category (bool < int < float) is higher, then the default of its category
            v = other.item() if isinstance(other, np.generic) else other
            d = self.dtype
            cat = 2 if isinstance(v, float) else 0 if isinstance(v, bool) else 1
            if cat > _category(d):
                d = dt.float32 if cat == 2 else dt.int64
            return full((), v, d, self.device)
        if isinstance(other, np.ndarray):
            return tensor(other, device=self.device)
        if type(other).__module__.startswith("torch"):
            raise FuelGraphError(
                f"operand: cannot combine a fuelgraph Tensor with a {type(other).__name__}: "
                f"convert it first with fuelgraph.from_torch(t) (shares its memory) or "
                f"fuelgraph.tensor(t) (copies); fuelgraph results go back with .to_torch()")
        raise FuelGraphError(f"operand: cannot combine a Tensor with {type(other).__name__}")

    def _binary(self, kind, other, reverse=False, cls=ops.Binary):
        a, b = self, self._lift(other)
        if reverse:
            a, b = b, a
        a, b = promote(a, b, kind)
        a, b = broadcast_tensors(a, b, op=kind)
        return a._new(cls(kind), a, b)

    # ---- arithmetic ----------------------------------------------------------------------
    def __add__(self, o): return self._binary("add", o)
    def __radd__(self, o): return self._binary("add", o, True)
    def __sub__(self, o): return self._binary("sub", o)
    def __rsub__(self, o): return self._binary("sub", o, True)
    def __mul__(self, o): return self._binary("mul", o)
    def __rmul__(self, o): return self._binary("mul", o, True)
    def __truediv__(self, o): return self._float()._binary("div", o)
    def __rtruediv__(self, o): return self._float()._binary("div", o, True)
    def __mod__(self, o): return self._binary("rem", o)
    def __pow__(self, o): return self._binary("pow", o)
    def __rpow__(self, o): return self._binary("pow", o, True)
    def __and__(self, o): return self._binary("and", o)
    def __or__(self, o): return self._binary("or", o)
    def __xor__(self, o): return self._binary("xor", o)
    def __lshift__(self, o): return self._binary("shl", o)
    def __rshift__(self, o): return self._binary("shr", o)
    def __neg__(self): return self._new(ops.Unary("neg"), self)
    def __floordiv__(self, o): return self._floordiv(o)
    def __rfloordiv__(self, o): return self._floordiv(o, True)

    def _floordiv(self, o, reverse=False):
        """Floor division (Python's //, torch.floor_divide): integers divide exactly with the
        quotient rounded toward -inf; floats give floor(a / b)."""
        a, b = self, self._lift(o)
        if reverse:
            a, b = b, a
        a, b = promote(a, b, "floordiv")
        if a.dtype is dt.bool_:
            a, b = a.astype(dt.int64), b.astype(dt.int64)
        if a.dtype.is_float:
            return (a / b).floor()
        a, b = broadcast_tensors(a, b, op="floordiv")
        return a._new(ops.Binary("div"), a, b)   # integer Binary div floors (both backends)

    def __invert__(self):
        """Logical not for bool tensors, bitwise not (two's complement) for integers."""
        if self.dtype is dt.bool_:
            return self ^ True
        if not self.dtype.is_int:
            raise FuelGraphError(f"invert (~): needs a bool or integer tensor, got {self.dtype.name}")
        ones = int(np.iinfo(self.dtype.np).max) if self.dtype.kind == "u" else -1
        return self ^ ones

    def __iter__(self):
        """Iterate over the first axis (`q, k, v = qkv`, `for row in t`)."""
        if not self.shape:
            raise FuelGraphError("iter: iteration over a 0-d tensor")
        return (self[i] for i in range(self.shape[0]))
    def __matmul__(self, o): return matmul(self, self._lift(o))
    def __rmatmul__(self, o): return matmul(self._lift(o), self)
    def __lt__(self, o): return self._binary("lt", o, cls=ops.Compare)
    def __le__(self, o): return self._binary("le", o, cls=ops.Compare)
    def __gt__(self, o): return self._binary("gt", o, cls=ops.Compare)
    def __ge__(self, o): return self._binary("ge", o, cls=ops.Compare)
    def __eq__(self, o): return self._binary("eq", o, cls=ops.Compare)  # type: ignore[override]
    def __ne__(self, o): return self._binary("ne", o, cls=ops.Compare)  # type: ignore[override]

    def maximum(self, o): return self._binary("maximum", o)
    def minimum(self, o): return self._binary("minimum", o)
    # torch-style method spellings of the operators
    def add(self, o): return self.__add__(o)
    def sub(self, o): return self.__sub__(o)
    def mul(self, o): return self.__mul__(o)
    def div(self, o): return self.__truediv__(o)
    def pow(self, o): return self.__pow__(o)
    def neg(self): return self.__neg__()

    def _float(self) -> "Tensor":
        return self if self.dtype.is_float else self.astype(dt.float32)

    def _unary(self, kind) -> "Tensor":
        return self._new(ops.Unary(kind), self._float() if kind not in ops.UNARY_ANY else self)

    def exp(self): return self._unary("exp")
    def log(self): return self._unary("log")
    def sqrt(self): return self._unary("sqrt")
    def rsqrt(self): return self._unary("rsqrt")
    def reciprocal(self): return self._unary("recip")
    def abs(self): return self._unary("abs")
    def tanh(self): return self._unary("tanh")
    def erf(self): return self._unary("erf")
    def sin(self): return self._unary("sin")
    def cos(self): return self._unary("cos")
    def floor(self): return self._unary("floor")
    def sign(self): return self._unary("sign")
    __abs__ = abs

    # sugar over the basis
    def square(self): return self * self
    def relu(self): return where(self <= 0, 0.0, self)  # grad 0 at 0 (torch); NaN stays NaN
    def sigmoid(self): return 1.0 / (1.0 + (-self).exp())
    def silu(self): return self * self.sigmoid()
    def softplus(self): return self.relu() + (1.0 + (-self.abs()).exp()).log()
    def gelu(self): return 0.5 * self * (1.0 + (self * (1.0 / math.sqrt(2.0))).erf())
    def log_softmax(self, axis=-1):
        s = self - self.max(axis, keepdim=True)
        return s - s.exp().sum(axis, keepdim=True).log()
    def softmax(self, axis=-1):
        e = (self - self.max(axis, keepdim=True)).exp()
        return e / e.sum(axis, keepdim=True)

    def astype(self, dtype) -> "Tensor":
        d = dt.as_dtype(dtype)
        return self if d == self.dtype else self._new(ops.Cast(d), self)
    cast = astype

    def bitcast(self, dtype) -> "Tensor":
        d = dt.as_dtype(dtype)
        return self if d == self.dtype else self._new(ops.Bitcast(d), self)

    # ---- reductions ----------------------------------------------------------------------
    def _axes(self, axis, name) -> tuple[int, ...]:
        if axis is None:
            return tuple(range(self.ndim))
        axes = (axis,) if isinstance(axis, (int, np.integer)) else \
            tuple(axis) if isinstance(axis, (tuple, list)) else None
        if axes is None or any(isinstance(a, bool) or not isinstance(a, (int, np.integer))
                               for a in axes):
            raise FuelGraphError(f"{name}: axis must be an int or a tuple of ints, got {axis!r}")
        r = self.ndim
        for a in axes:
            if not -r <= a < r:
                raise FuelGraphError(f"{name}: axis {a} out of range for shape {self.shape}")
        out = tuple(sorted(a % r for a in axes))
        if len(set(out)) != len(out):
            raise FuelGraphError(f"{name}: repeated axis in {axis}")
        return out

    def _reduce(self, kind, axis, keepdim):
        axes = self._axes(axis, kind)
        # integer and bool sums and products widen to int64, as in torch (no silent wrap)
        x = self.astype(dt.int64) if kind in ("sum", "prod") and not self.dtype.is_float \
            else self
        if not axes:
            return x
        return x._new(ops.Reduce(kind, axes, keepdim), x)

    def sum(self, axis=None, keepdim=False): return self._reduce("sum", axis, keepdim)
    def max(self, axis=None, keepdim=False): return self._reduce("max", axis, keepdim)
    def min(self, axis=None, keepdim=False): return self._reduce("min", axis, keepdim)
    def prod(self, axis=None, keepdim=False): return self._reduce("prod", axis, keepdim)
    amax, amin = max, min

    def mean(self, axis=None, keepdim=False):
        """Mean over `axis`; 16-bit floats are summed and divided in float32 (no overflow of
        the intermediate sum), then rounded back."""
        x = self._float()
        axes = x._axes(axis, "mean")
        n = math.prod(x.shape[a] for a in axes)
        if x.dtype.itemsize < 4:
            return (x.astype(dt.float32).sum(axis, keepdim) / float(n)).astype(x.dtype)
        return x.sum(axis, keepdim) / float(n)

    def var(self, axis=None, keepdim=False, correction=1):
        xc = self - self.mean(axis, keepdim=True)
        n = math.prod(self.shape[a] for a in self._axes(axis, "var"))
        return (xc * xc).sum(axis, keepdim) / float(max(n - correction, 0))

    # ---- movement ------------------------------------------------------------------------
    def reshape(self, *shape) -> "Tensor":
        shape = _shape_arg(shape)
        if shape.count(-1) > 1:
            raise FuelGraphError(f"reshape: more than one -1 in {shape}")
        if -1 in shape:
            known = math.prod(d for d in shape if d != -1)
            if known == 0 or self.numel() % known:
                raise FuelGraphError(f"reshape: cannot infer -1 reshaping {self.shape} to {shape}")
            shape = tuple(self.numel() // known if d == -1 else d for d in shape)
        if shape == self.shape:
            return self
        return self._new(ops.Reshape(tuple(shape)), self)
    view = reshape

    def flatten(self, start=0, end=-1):
        s, e = start % max(self.ndim, 1), end % max(self.ndim, 1)
        return self.reshape(self.shape[:s] + (math.prod(self.shape[s:e + 1]),) + self.shape[e + 1:])

    def permute(self, *perm) -> "Tensor":
        perm = tuple(p % self.ndim if -self.ndim <= p < self.ndim else p for p in _shape_arg(perm))
        if perm == tuple(range(self.ndim)):
            return self
        return self._new(ops.Permute(perm), self)

    def transpose(self, a=-2, b=-1) -> "Tensor":
        p = list(range(self.ndim))
        a, b = self._axes(a, "transpose")[0], self._axes(b, "transpose")[0]
        p[a], p[b] = p[b], p[a]
        return self.permute(*p)

    @property
    def T(self):
        return self.permute(*reversed(range(self.ndim)))

    @property
    def mT(self):
        return self.transpose(-2, -1)

    def broadcast_to(self, *shape) -> "Tensor":
        shape = _shape_arg(shape)
        out = broadcast_shapes(self.shape, shape, op="broadcast_to")
        if out != shape:
            raise FuelGraphError(f"broadcast_to: cannot broadcast {self.shape} to {shape}")
        x = self.reshape((1,) * (len(shape) - self.ndim) + self.shape) if self.ndim < len(shape) else self
        if x.shape == shape:
            return x
        if isinstance(x.node.op, ops.Full) and x.node.op.shape == x.shape:
            f = x.node.op
            return full(shape, f.value, f.dtype, f.device)
        return x._new(ops.BroadcastTo(shape), x)
    expand = broadcast_to

    def unsqueeze(self, axis) -> "Tensor":
        if not isinstance(axis, (int, np.integer)) or not -self.ndim - 1 <= axis <= self.ndim:
            raise FuelGraphError(f"unsqueeze: axis {axis!r} out of range for shape {self.shape}")
        axis = axis % (self.ndim + 1)
        return self.reshape(self.shape[:axis] + (1,) + self.shape[axis:])

    def squeeze(self, axis=None) -> "Tensor":
        if axis is None:
            return self.reshape(tuple(d for d in self.shape if d != 1))
        axes = self._axes(axis, "squeeze")
        for a in axes:
            if self.shape[a] != 1:
                raise FuelGraphError(f"squeeze: axis {a} of {self.shape} is not 1")
        return self.reshape(tuple(d for i, d in enumerate(self.shape) if i not in axes))

    def contiguous(self):
        return self

    def flip(self, axis) -> "Tensor":
        x = self
        for a in self._axes(axis, "flip"):
            n = x.shape[a]
            x = x.take(arange(n - 1, -1, -1, dtype=dt.int64, device=self.device), a)
        return x

    def pad(self, pads: Sequence[tuple[int, int]], value=0.0) -> "Tensor":
        """Pad per axis with (lo, hi); negative entries crop."""
        try:
            pads = [(int(l), int(h)) for l, h in pads]
        except (TypeError, ValueError):
            raise FuelGraphError(f"pad: pads must be one (lo, hi) pair of ints per axis, got "
                                 f"{pads!r}") from None
        if len(pads) != self.ndim:
            raise FuelGraphError(f"pad: needs {self.ndim} (lo, hi) pairs, got {len(pads)}")
        for (l, h), n in zip(pads, self.shape):
            if l + h + n < 0:
                raise FuelGraphError(f"pad: cropping ({l}, {h}) exceeds an axis of size {n}")
        x = self
        if any(l < 0 or h < 0 for l, h in pads):
            x = x[tuple(slice(max(-l, 0), n - max(-h, 0)) for (l, h), n in zip(pads, x.shape))]
        lo = tuple(max(l, 0) for l, _ in pads)
        hi = tuple(max(h, 0) for _, h in pads)
        if not any(lo) and not any(hi):
            return x
        return x._new(ops.Pad(lo, hi, (0,) * x.ndim, float(value)), x)

    def __getitem__(self, idx) -> "Tensor":
        return _getitem(self, idx)

    # ---- indexing ------------------------------------------------------------------------
    def gather(self, axis, index: "Tensor") -> "Tensor":
        """torch.gather: out[i][j] = self[i][index[i][j]] (for axis=1)."""
        axis = self._axes(axis, "gather")[0]
        return self._new(ops.Gather(axis), self, _as_index(index, self.device, "gather"))

    def take(self, index, axis=0) -> "Tensor":
        """index_select along `axis` (np.take)."""
        axis = self._axes(axis, "take")[0]
        return self._new(ops.Take(axis), self, _as_index(index, self.device, "take"))
    index_select = lambda self, axis, index: self.take(index, axis)  # noqa: E731

    def scatter_add(self, axis, index, src) -> "Tensor":
        axis = self._axes(axis, "scatter_add")[0]
        return self._new(ops.ScatterAdd(axis), self, _as_index(index, self.device, "scatter_add"),
                         src)

    def where(self, cond, other) -> "Tensor":
        return where(cond, self, other)


# ---- module-level builders -----------------------------------------------------------------
class Size(tuple):
    """A shape, as torch's `torch.Size`: a tuple of ints with `numel()`."""

    def numel(self) -> int:
        return math.prod(self)


def _depends_on_grad_leaf(value: Value) -> bool:
    """Whether a requires_grad leaf is under `value` (only walked when .grad of a non-leaf is
    read, an error path)."""
    seen, stack = set(), [value.node]
    while stack:
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        if isinstance(n.op, ops.Input):
            if Value(n, 0) in GRAD_LEAVES:
                return True
            continue
        if isinstance(n.op, ops.Detach):
            continue
        stack.extend(s.node for s in n.srcs)
    return False


def _shape_arg(shape) -> tuple[int, ...]:
    if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
        shape = shape[0]
    try:
        return tuple(int(d) for d in shape)
    except (TypeError, ValueError):
        raise FuelGraphError(f"shape: expected integers, got {shape!r}") from None


def _as_index(index, device, op="index") -> Tensor:
    t = index if isinstance(index, Tensor) else tensor(np.asarray(index), device=device)
    if not t.dtype.is_int:
        raise FuelGraphError(f"{op}: index (input 1) must be an integer tensor, got "
                             f"{t.dtype.name} of shape {t.shape}")
    return t


def _leaf(data, dtype: DType, device: str, requires_grad: bool) -> Tensor:
    op = ops.Input(next(_INPUT_UID), tuple(int(d) for d in data.shape), dtype, device)
    node = make_node(op, ())
    _DATA[node] = data
    return Tensor(node.out(0), requires_grad)


def tensor(data, dtype=None, device="cpu", requires_grad=False) -> Tensor:
    """Create a leaf tensor from array-like data (copied). A device other than the CPU is
    reached through `.to(device)`, which the public layer binds."""
    device = _normalize_device(device)
    if isinstance(data, Tensor):
        data = data.numpy()
    d = dt.as_dtype(dtype) if dtype is not None else None
    try:
        a = np.asarray(data)
    except (TypeError, ValueError) as e:
        raise FuelGraphError(f"tensor: cannot make an array of {type(data).__name__}: {e}") from None
    if a.dtype == object:
        raise FuelGraphError(f"tensor: data of type {type(data).__name__} is not numeric")
    if d is None:
        # Python floats and ints take the default dtypes (float32, int64); NumPy arrays and
        # NumPy scalars keep theirs
        typed = isinstance(data, (np.ndarray, np.generic))
        d = dt.float32 if a.dtype == np.float64 and not typed else \
            dt.int64 if a.dtype.kind in "iu" and not typed else dt.as_dtype(a.dtype)
    a = np.array(a, dtype=d.np, copy=True, order="C")
    a.flags.writeable = False  # graph inputs are never written; outputs that alias them copy
    if requires_grad and not d.is_float:
        raise FuelGraphError(f"tensor: requires_grad needs a float dtype, got {d.name}")
    if device != "cpu":
        t = _leaf(a, d, "cpu", False).to(device)
        t.requires_grad = requires_grad
        return t
    return _leaf(a, d, device, requires_grad)


def full(shape, value, dtype=dt.float32, device="cpu") -> Tensor:
    """A tensor of `shape` filled with the scalar `value` (checked to fit `dtype`)."""
    d = dt.as_dtype(dtype)
    if isinstance(value, Tensor) or not isinstance(value, (bool, int, float, np.number, np.bool_)):
        raise FuelGraphError(f"full: value must be a Python or NumPy scalar, got "
                             f"{type(value).__name__}")
    if d.is_int and isinstance(value, (float, np.floating)) and not math.isfinite(value):
        raise FuelGraphError(f"full: value {value!r} cannot be represented as {d.name}")
    try:
        v = bool(value) if d is dt.bool_ else int(value) if d.is_int else float(value)
    except (TypeError, ValueError, OverflowError):
        raise FuelGraphError(f"full: value {value!r} is not a {d.name} scalar") from None
    if d.is_int and not np.iinfo(d.np).min <= v <= np.iinfo(d.np).max:
        raise FuelGraphError(f"full: value {value!r} does not fit {d.name}")
    return Tensor(apply(ops.Full(_shape_arg((shape,)), v, d, _normalize_device(device))))


def zeros(shape, dtype=dt.float32, device="cpu"): return full(shape, 0, dtype, device)
def ones(shape, dtype=dt.float32, device="cpu"): return full(shape, 1, dtype, device)
def zeros_like(t: Tensor): return full(t.shape, 0, t.dtype, t.device)
def ones_like(t: Tensor): return full(t.shape, 1, t.dtype, t.device)


def const(array, device="cpu") -> Tensor:
    """A constant baked into the graph (use `tensor` for data you feed). The array is copied:
    the caller's array stays writable and later changes to it do not reach the graph."""
    return Tensor(apply(ops.Const(np.array(array, copy=True), _normalize_device(device))))


def iota(n, dtype=dt.int64, device="cpu") -> Tensor:
    return Tensor(apply(ops.Iota(int(n), dt.as_dtype(dtype), _normalize_device(device))))


def arange(start, stop=None, step=1, dtype=dt.int64, device="cpu") -> Tensor:
    if stop is None:
        start, stop = 0, start
    if step == 0:
        raise FuelGraphError("arange: step must not be zero")
    d = dt.as_dtype(dtype)
    if d is dt.bool_:
        raise FuelGraphError("arange: dtype bool is not a numeric range; use an integer or "
                             "float dtype")
    if any(isinstance(v, float) for v in (start, stop, step)) and not d.is_float:
        raise FuelGraphError(f"arange: float bounds {start, stop, step} need a float dtype, "
                             f"got {d.name}")
    if d.is_float:
        n = max(0, math.ceil((stop - start) / step))
        t = iota(n, d, device)
        return t * step + start if (step != 1 or start) else t
    n = max(0, -(-(stop - start) // step))
    t = iota(n, dtype, device)
    if step != 1:
        t = t * step
    return t + start if start else t


def broadcast_shapes(*shapes, op="broadcast") -> tuple[int, ...]:
    r = max((len(s) for s in shapes), default=0)
    out = []
    for i in range(r):
        dims = {s[len(s) - r + i] for s in shapes if len(s) - r + i >= 0}
        dims.discard(1)
        if len(dims) > 1:
            raise FuelGraphError(f"{op}: shapes {' and '.join(map(str, shapes))} are not broadcastable")
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def broadcast_tensors(*ts: Tensor, op="broadcast") -> list[Tensor]:
    shape = broadcast_shapes(*(t.shape for t in ts), op=op)
    return [t.broadcast_to(shape) for t in ts]


def _category(d: DType) -> int:
    return 0 if d is dt.bool_ else 1 if d.is_int else 2


def promote(a: Tensor, b: Tensor, op: str = "op") -> tuple[Tensor, Tensor]:
    """The common dtype of a binary op, torch's rules: categories bool < int < float; a 0-d
    operand (a Python scalar, or any 0-d tensor) beside a dimensioned one of the same category
    takes the dimensioned operand's dtype, of a higher category keeps its own; otherwise
    `dtype.result_type`."""
    if a.dtype == b.dtype:
        return a, b
    d = None
    for x, y in ((a, b), (b, a)):
        if x.ndim == 0 and y.ndim > 0:
            d = y.dtype if _category(x.dtype) <= _category(y.dtype) else x.dtype
            if isinstance(x.node.op, ops.Full) and d == y.dtype:   # a scalar: retype, no cast
                w = full((), x.node.op.value, d, y.device)
                return (w, b) if x is a else (a, w)
    if d is None:
        d = dt.result_type(a.dtype, b.dtype)
    return a.astype(d), b.astype(d)


def where(cond, a, b) -> Tensor:
    """Elementwise select with broadcasting; `cond` must be bool."""
    ref = next((t for t in (a, b, cond) if isinstance(t, Tensor)), None)
    if ref is None:
        raise FuelGraphError("where: at least one argument must be a Tensor")
    a = ref._lift(a) if not isinstance(a, Tensor) else a
    b = (a if isinstance(a, Tensor) else ref)._lift(b) if not isinstance(b, Tensor) else b
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        raise FuelGraphError("where: a and b must be tensors or scalars")
    cond = full((), cond, dt.bool_, ref.device) if isinstance(cond, (bool, np.bool_)) \
        else ref._lift(cond)
    if cond.dtype is not dt.bool_:
        raise FuelGraphError(f"where: condition must be bool, got {cond.dtype.name}")
    a, b = promote(a, b, "where")
    cond, a, b = broadcast_tensors(cond, a, b, op="where")
    return a._new(ops.Where(), cond, a, b)


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """NumPy matmul semantics: 1-D operands are promoted and squeezed, batch dims broadcast."""
    for name, t in (("a", a), ("b", b)):
        if not isinstance(t, Tensor):
            raise FuelGraphError(f"matmul: operand {name} must be a Tensor, got {type(t).__name__}")
    if a.ndim == 0 or b.ndim == 0:
        raise FuelGraphError(f"matmul: operands must be at least 1-D, got {a.shape} and {b.shape}")
    a, b = promote(a, b, "matmul")
    a2 = a.reshape(1, a.shape[0]) if a.ndim == 1 else a
    b2 = b.reshape(b.shape[0], 1) if b.ndim == 1 else b
    if a2.shape[-1] != b2.shape[-2]:
        raise FuelGraphError(f"matmul: inner dimensions differ: {a.shape} @ {b.shape}")
    batch = broadcast_shapes(a2.shape[:-2], b2.shape[:-2],
                             op=f"matmul: batch dims of {a.shape} @ {b.shape}")
    a2 = a2.broadcast_to(batch + a2.shape[-2:])
    b2 = b2.broadcast_to(batch + b2.shape[-2:])
    out = a2._new(ops.MatMul(), a2, b2)
    if a.ndim == 1:
        out = out.squeeze(-2)
    if b.ndim == 1:
        out = out.squeeze(-1)
    return out


def cat(tensors: Sequence[Tensor], axis=0, *, dim=None) -> Tensor:
    """Concatenate along `axis` (torch: `dim`; dtypes promoted)."""
    if dim is not None:
        axis = dim
    ts = list(tensors)
    ref = next((t for t in ts if isinstance(t, Tensor)), None)
    if ref is None:
        raise FuelGraphError("cat: needs at least one Tensor")
    ts = [t if isinstance(t, Tensor) else ref._lift(t) for t in ts]
    for t in ts[1:]:
        if t.ndim != ts[0].ndim:
            raise FuelGraphError(f"cat: rank mismatch {ts[0].shape} vs {t.shape}")
    d = ts[0].dtype
    for t in ts[1:]:
        d = dt.result_type(d, t.dtype)
    axis = ts[0]._axes(axis, "cat")[0]
    ts = [t.astype(d) for t in ts]
    if len(ts) == 1:
        return ts[0]
    return ts[0]._new(ops.Concat(axis), *ts)


def stack(tensors: Sequence[Tensor], axis=0, *, dim=None) -> Tensor:
    """Stack along a new axis `axis` (torch: `dim`)."""
    if dim is not None:
        axis = dim
    ts = list(tensors)
    if not ts:
        raise FuelGraphError("stack: needs at least one tensor")
    return cat([t.unsqueeze(axis) for t in ts], axis)


def _getitem(x: Tensor, idx) -> Tensor:
    if not isinstance(idx, tuple):
        idx = (idx,)
    if any(isinstance(i, (Tensor, list, np.ndarray)) for i in idx):
        if any((isinstance(i, Tensor) and i.dtype is dt.bool_) or
               (isinstance(i, np.ndarray) and i.dtype == np.bool_) for i in idx):
            raise FuelGraphError(
                "getitem: a boolean mask selects a data-dependent number of elements, which a "
                "graph cannot shape; keep the shape with where(mask, x, 0) or "
                "x.masked_fill(~mask, v), write through it with x[mask] = v, or reduce with "
                "(x * mask).sum()")
        if len(idx) == 1:
            return x.take(idx[0], 0)
        raise FuelGraphError("getitem: advanced indexing supports one index tensor on axis 0; "
                             "use take/gather")
    n_ell = sum(i is Ellipsis for i in idx)
    if n_ell > 1:
        raise FuelGraphError("getitem: more than one ellipsis")
    n_real = sum(i is not None and i is not Ellipsis for i in idx)
    if n_real > x.ndim:
        raise FuelGraphError(f"getitem: too many indices ({n_real}) for shape {x.shape}")
    full_idx = []
    for i in idx:
        if i is Ellipsis:
            full_idx.extend([slice(None)] * (x.ndim - n_real))
        else:
            full_idx.append(i)
    full_idx.extend([slice(None)] * (x.ndim - sum(i is not None for i in full_idx)))
    starts, stops, steps, out_shape, flips = [], [], [], [], []
    ax = 0
    for i in full_idx:
        if i is None:
            out_shape.append(1)
            continue
        n = x.shape[ax]
        if isinstance(i, slice):
            if i.step == 0:
                raise FuelGraphError(f"getitem: slice step cannot be zero (axis {ax})")
            a, b, s = i.indices(n)
            cnt = len(range(a, b, s))
            if s < 0:  # select ascending, then flip the axis
                flips.append(len(out_shape))
                lo = a + (cnt - 1) * s if cnt else 0
                starts.append(lo); stops.append(a + 1 if cnt else 0); steps.append(-s)
                out_shape.append(cnt)
            else:
                starts.append(a); stops.append(a + (cnt - 1) * s + 1 if cnt else a); steps.append(s)
                out_shape.append(cnt)
        elif isinstance(i, (int, np.integer)) and not isinstance(i, (bool, np.bool_)):
            j = int(i)
            if not -n <= j < n:
                raise FuelGraphError(f"getitem: index {j} out of range for axis {ax} of size {n}")
            j %= n
            starts.append(j); stops.append(j + 1); steps.append(1)
        else:
            raise FuelGraphError(f"getitem: unsupported index {i!r}")
        ax += 1
    y = x
    if (tuple(starts), tuple(stops)) != ((0,) * x.ndim, x.shape) or any(s != 1 for s in steps):
        y = x._new(ops.Slice(tuple(starts), tuple(stops), tuple(steps)), x)
    y = y.reshape(tuple(out_shape))
    return y.flip(tuple(flips)) if flips else y


from . import methods as _methods  # noqa: E402,F401  (binds the torch-named API onto Tensor)
