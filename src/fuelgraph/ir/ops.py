"""The closed primitive basis. Every op is a frozen dataclass (its fields are part of the node's
structural key) with an `infer(srcs)` method returning (shapes, dtypes, device) after validating
its inputs. The IR is broadcast-free: binary ops need equal shapes, builders insert BroadcastTo."""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field

import numpy as np

from .. import dtype as dt
from ..dtype import DType
from ..errors import FuelGraphError

UNARY = ("neg", "exp", "log", "sqrt", "rsqrt", "recip", "abs", "tanh", "erf", "sin", "cos",
         "floor", "sign")
UNARY_ANY = ("neg", "abs", "sign")  # also defined on integers
BINARY_ARITH = ("add", "sub", "mul", "div", "pow", "maximum", "minimum", "rem")
BINARY_BITS = ("and", "or", "xor", "shl", "shr")
COMPARE = ("eq", "ne", "lt", "le", "gt", "ge")
REDUCE = ("sum", "max", "min", "prod")


def _err(op, msg):
    return FuelGraphError(f"{op}: {msg}")


def _device(name, srcs):
    devs = {s.node.device for s in srcs}
    if len(devs) > 1:
        raise _err(name, f"inputs live on different devices {sorted(devs)}; move them with .to()")
    return devs.pop() if devs else "cpu"


def _same(name, srcs, what="shape"):
    s0 = srcs[0]
    for i, s in enumerate(srcs[1:], 1):
        if what == "shape" and s.shape != s0.shape:
            raise _err(name, f"input {i} has shape {s.shape}, expected {s0.shape} (same as input 0)")
        if what == "dtype" and s.dtype != s0.dtype:
            raise _err(name, f"input {i} has dtype {s.dtype.name}, expected {s0.dtype.name}")


def _axis(name, axis, rank):
    if not -rank <= axis < max(rank, 1):
        raise _err(name, f"axis {axis} out of range for rank {rank}")
    return axis % rank if rank else 0


class Op:
    """Base of all ops; `name` is the op's short name used in errors and reports."""
    arity: int | None = None

    def device_of(self, srcs) -> str:
        return _device(self.name, srcs)

    @property
    def name(self) -> str:
        return getattr(self, "kind", None) or type(self).__name__.lower()

    def check_arity(self, srcs):
        if self.arity is not None and len(srcs) != self.arity:
            raise _err(self.name, f"expected {self.arity} inputs, got {len(srcs)}")


# ---- leaves --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Input(Op):
    """A leaf bound to a buffer at realize time (user data). Unique per tensor (uid)."""
    uid: int
    shape: tuple[int, ...]
    dtype: DType
    device: str = "cpu"

    def infer(self, srcs):
        return [self.shape], [self.dtype], self.device


@dataclass(frozen=True, eq=False)
class Const(Op):
    """A constant array baked into the graph; equal contents give equal nodes."""
    array: np.ndarray = field(repr=False)
    device: str = "cpu"

    def __post_init__(self):
        a = np.asarray(self.array, order="C")
        a.flags.writeable = False
        object.__setattr__(self, "array", a)
        object.__setattr__(self, "_key", (a.shape, str(a.dtype), self.device,
                                          hashlib.blake2b(a.tobytes(), digest_size=16).digest()))

    def __eq__(self, o):
        return isinstance(o, Const) and self._key == o._key

    def __hash__(self):
        return hash(self._key)

    def __repr__(self):
        return f"Const({self.array.shape}, {self.array.dtype})"

    def infer(self, srcs):
        return [self.array.shape], [dt.as_dtype(self.array.dtype)], self.device


@dataclass(frozen=True, eq=False)
class Full(Op):
    """A tensor filled with one scalar. -0.0 and 0.0 (and NaN) are distinct keys."""
    shape: tuple[int, ...]
    value: float | int | bool
    dtype: DType
    device: str = "cpu"

    def _key(self):
        return (self.shape, repr(self.value), self.dtype, self.device)

    def __eq__(self, o):
        return isinstance(o, Full) and self._key() == o._key()

    def __hash__(self):
        return hash(self._key())

    def infer(self, srcs):
        if any(d < 0 for d in self.shape):
            raise _err("full", f"negative dimension in shape {self.shape}")
        return [self.shape], [self.dtype], self.device


@dataclass(frozen=True)
class Iota(Op):
    """[0, 1, ..., n-1] as a 1-D tensor."""
    n: int
    dtype: DType
    device: str = "cpu"

    def infer(self, srcs):
        if self.n < 0:
            raise _err("iota", f"length must be >= 0, got {self.n}")
        return [(self.n,)], [self.dtype], self.device


# ---- elementwise ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Unary(Op):
    kind: str
    arity = 1

    def infer(self, srcs):
        self.check_arity(srcs)
        x = srcs[0]
        if not (x.dtype.is_float or (self.kind in UNARY_ANY and x.dtype.is_int)):
            raise _err(self.kind, f"input 0 has dtype {x.dtype.name}, expected a float dtype")
        return [x.shape], [x.dtype], _device(self.kind, srcs)


@dataclass(frozen=True)
class Binary(Op):
    kind: str
    arity = 2

    def infer(self, srcs):
        self.check_arity(srcs)
        _same(self.kind, srcs, "shape")
        _same(self.kind, srcs, "dtype")
        d = srcs[0].dtype
        if self.kind in BINARY_BITS and d.is_float:
            raise _err(self.kind, f"bitwise op needs integer or bool inputs, got {d.name}")
        if self.kind in BINARY_ARITH and d is dt.bool_:
            raise _err(self.kind, "arithmetic on bool inputs; cast them first")
        return [srcs[0].shape], [d], _device(self.kind, srcs)


@dataclass(frozen=True)
class Compare(Op):
    kind: str
    arity = 2

    def infer(self, srcs):
        self.check_arity(srcs)
        _same(self.kind, srcs, "shape")
        _same(self.kind, srcs, "dtype")
        return [srcs[0].shape], [dt.bool_], _device(self.kind, srcs)


@dataclass(frozen=True)
class Where(Op):
    arity = 3

    def infer(self, srcs):
        self.check_arity(srcs)
        _same("where", srcs, "shape")
        if srcs[0].dtype is not dt.bool_:
            raise _err("where", f"condition (input 0) must be bool, got {srcs[0].dtype.name}")
        _same("where", srcs[1:], "dtype")
        return [srcs[1].shape], [srcs[1].dtype], _device("where", srcs)


@dataclass(frozen=True)
class Cast(Op):
    dtype: DType
    arity = 1

    def infer(self, srcs):
        self.check_arity(srcs)
        return [srcs[0].shape], [self.dtype], _device("cast", srcs)


@dataclass(frozen=True)
class Bitcast(Op):
    dtype: DType
    arity = 1

    def infer(self, srcs):
        self.check_arity(srcs)
        if srcs[0].dtype.itemsize != self.dtype.itemsize:
            raise _err("bitcast", f"itemsize {srcs[0].dtype.itemsize} of input 0 differs from "
                                  f"{self.dtype.name}'s {self.dtype.itemsize}")
        return [srcs[0].shape], [self.dtype], _device("bitcast", srcs)


@dataclass(frozen=True)
class Detach(Op):
    """Identity whose gradient is zero (stop-gradient). Kept until lowering so autograd sees
    it; the lower pass removes it before execution."""
    arity = 1

    def infer(self, srcs):
        self.check_arity(srcs)
        return [srcs[0].shape], [srcs[0].dtype], _device("detach", srcs)


# ---- reductions and movement ---------------------------------------------------------------
@dataclass(frozen=True)
class Reduce(Op):
    kind: str
    axes: tuple[int, ...]
    keepdim: bool = False
    arity = 1

    def infer(self, srcs):
        self.check_arity(srcs)
        x = srcs[0]
        if any(not 0 <= a < len(x.shape) for a in self.axes) or len(set(self.axes)) != len(self.axes):
            raise _err(f"reduce_{self.kind}", f"bad axes {self.axes} for input of shape {x.shape}")
        if self.kind in ("max", "min") and any(x.shape[a] == 0 for a in self.axes):
            raise _err(f"reduce_{self.kind}", f"cannot reduce an empty axis of shape {x.shape}")
        shape = tuple((1 if i in self.axes else d) for i, d in enumerate(x.shape)
                      if self.keepdim or i not in self.axes)
        return [shape], [x.dtype], _device("reduce", srcs)


@dataclass(frozen=True)
class Reshape(Op):
    shape: tuple[int, ...]
    arity = 1

    def infer(self, srcs):
        self.check_arity(srcs)
        if math.prod(self.shape) != math.prod(srcs[0].shape) or any(d < 0 for d in self.shape):
            raise _err("reshape", f"cannot reshape {srcs[0].shape} to {self.shape}")
        return [self.shape], [srcs[0].dtype], _device("reshape", srcs)


@dataclass(frozen=True)
class Permute(Op):
    perm: tuple[int, ...]
    arity = 1

    def infer(self, srcs):
        self.check_arity(srcs)
        x = srcs[0]
        if sorted(self.perm) != list(range(len(x.shape))):
            raise _err("permute", f"{self.perm} is not a permutation of the axes of {x.shape}")
        return [tuple(x.shape[p] for p in self.perm)], [x.dtype], _device("permute", srcs)


@dataclass(frozen=True)
class BroadcastTo(Op):
    """Same-rank broadcast: every input axis equals the target or is 1."""
    shape: tuple[int, ...]
    arity = 1

    def infer(self, srcs):
        self.check_arity(srcs)
        x = srcs[0]
        if len(x.shape) != len(self.shape) or any(a not in (1, b) for a, b in zip(x.shape, self.shape)):
            raise _err("broadcast_to", f"cannot broadcast {x.shape} to {self.shape}")
        return [self.shape], [x.dtype], _device("broadcast_to", srcs)


@dataclass(frozen=True)
class Slice(Op):
    starts: tuple[int, ...]
    stops: tuple[int, ...]
    steps: tuple[int, ...]
    arity = 1

    def infer(self, srcs):
        self.check_arity(srcs)
        x = srcs[0]
        if not len(self.starts) == len(self.stops) == len(self.steps) == len(x.shape):
            raise _err("slice", f"needs one (start, stop, step) per axis of {x.shape}")
        shape = []
        for a, b, s, n in zip(self.starts, self.stops, self.steps, x.shape):
            if s < 1 or not 0 <= a <= b <= n:
                raise _err("slice", f"bad range {a}:{b}:{s} for axis of extent {n}")
            shape.append((b - a + s - 1) // s)
        return [tuple(shape)], [x.dtype], _device("slice", srcs)


@dataclass(frozen=True)
class Concat(Op):
    axis: int

    def infer(self, srcs):
        if not srcs:
            raise _err("cat", "needs at least one input")
        s0 = srcs[0]
        _same("cat", srcs, "dtype")
        for i, s in enumerate(srcs):
            if len(s.shape) != len(s0.shape) or any(
                    a != b for k, (a, b) in enumerate(zip(s.shape, s0.shape)) if k != self.axis):
                raise _err("cat", f"input {i} has shape {s.shape}, incompatible with {s0.shape} "
                                  f"along axes other than {self.axis}")
        shape = list(s0.shape)
        shape[self.axis] = sum(s.shape[self.axis] for s in srcs)
        return [tuple(shape)], [s0.dtype], _device("cat", srcs)


@dataclass(frozen=True, eq=False)
class Pad(Op):
    """Pad each axis with `lo` before, `hi` after and `interior` between elements."""
    lo: tuple[int, ...]
    hi: tuple[int, ...]
    interior: tuple[int, ...]
    value: float = 0.0
    arity = 1

    def _key(self):
        return (self.lo, self.hi, self.interior, repr(self.value))

    def __eq__(self, o):
        return isinstance(o, Pad) and self._key() == o._key()

    def __hash__(self):
        return hash(self._key())

    def out_shape(self, shape) -> tuple[int, ...]:
        return tuple(l + n + max(n - 1, 0) * i + h
                     for l, n, i, h in zip(self.lo, shape, self.interior, self.hi))

    def placement(self, shape) -> tuple[slice, ...]:
        """Where the input's elements land in the output (for kernels: out[placement] = x)."""
        return tuple(slice(l, l + (n - 1) * (i + 1) + 1 if n else l, i + 1)
                     for l, n, i in zip(self.lo, shape, self.interior))

    def infer(self, srcs):
        self.check_arity(srcs)
        x = srcs[0]
        if not len(self.lo) == len(self.hi) == len(self.interior) == len(x.shape) or \
                min(self.lo + self.hi + self.interior, default=0) < 0:
            raise _err("pad", f"needs non-negative (lo, hi, interior) per axis of {x.shape}")
        return [self.out_shape(x.shape)], [x.dtype], _device("pad", srcs)


# ---- indexing ------------------------------------------------------------------------------
def _check_index(name, idx):
    if not idx.dtype.is_int:
        raise _err(name, f"index (input 1) must be an integer tensor, got {idx.dtype.name}")


@dataclass(frozen=True)
class Gather(Op):
    """torch.gather: out[i][j] = x[i][index[i][j]] along `axis`; index has x's rank."""
    axis: int
    arity = 2

    def infer(self, srcs):
        self.check_arity(srcs)
        x, idx = srcs
        _check_index("gather", idx)
        if len(idx.shape) != len(x.shape) or any(
                b > a for k, (a, b) in enumerate(zip(x.shape, idx.shape)) if k != self.axis):
            raise _err("gather", f"index shape {idx.shape} must have the rank of input {x.shape} "
                                 f"and not exceed it off axis {self.axis}")
        return [idx.shape], [x.dtype], _device("gather", srcs)


@dataclass(frozen=True)
class Take(Op):
    """np.take / index_select: out = x.shape[:axis] + index.shape + x.shape[axis+1:]."""
    axis: int
    arity = 2

    def infer(self, srcs):
        self.check_arity(srcs)
        x, idx = srcs
        _check_index("take", idx)
        shape = x.shape[:self.axis] + idx.shape + x.shape[self.axis + 1:]
        return [shape], [x.dtype], _device("take", srcs)


@dataclass(frozen=True)
class ScatterAdd(Op):
    """torch.scatter_add: out = base; out[..index[i]..] += src[i] along `axis`."""
    axis: int
    arity = 3

    def infer(self, srcs):
        self.check_arity(srcs)
        base, idx, src = srcs
        _check_index("scatter_add", idx)
        if idx.shape != src.shape or len(src.shape) != len(base.shape):
            raise _err("scatter_add", f"index {idx.shape} and src {src.shape} must match and have "
                                      f"the rank of base {base.shape}")
        if src.dtype != base.dtype:
            raise _err("scatter_add", f"src dtype {src.dtype.name} != base dtype {base.dtype.name}")
        big = [d for d in range(len(base.shape)) if d != self.axis and idx.shape[d] > base.shape[d]]
        if big:
            raise _err("scatter_add", f"index {idx.shape} exceeds base {base.shape} along axis "
                                      f"{big[0]} (only the scatter axis {self.axis} may differ)")
        return [base.shape], [base.dtype], _device("scatter_add", srcs)


@dataclass(frozen=True)
class MatMul(Op):
    """Batched matmul [..., M, K] @ [..., K, N] with equal batch dims."""
    arity = 2

    def infer(self, srcs):
        self.check_arity(srcs)
        a, b = srcs
        if len(a.shape) < 2 or len(b.shape) != len(a.shape) or a.shape[:-2] != b.shape[:-2] \
                or a.shape[-1] != b.shape[-2]:
            raise _err("matmul", f"cannot multiply {a.shape} by {b.shape}")
        _same("matmul", srcs, "dtype")
        if not a.dtype.is_float:
            raise _err("matmul", f"needs float inputs, got {a.dtype.name}")
        return [a.shape[:-1] + b.shape[-1:]], [a.dtype], _device("matmul", srcs)


# ---- control -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Body:
    """A closed sub-graph: placeholder Input values and output values."""
    inputs: tuple
    outputs: tuple


@dataclass(frozen=True)
class Scan(Op):
    """Recurrence. srcs = init carries (n_carry), xs (n_xs, each [L, ...]), consts (rest).
    body(carries, x_t, consts) -> (new carries, y_t). Outputs: final carries, then ys [L, ...].
    `reverse` walks t = L-1 .. 0 (ys stay indexed by t)."""
    body: Body
    n_carry: int
    n_xs: int
    length: int
    reverse: bool = False

    def infer(self, srcs):
        b = self.body
        if len(srcs) != len(b.inputs):
            raise _err("scan", f"expected {len(b.inputs)} inputs, got {len(srcs)}")
        for i, (s, p) in enumerate(zip(srcs, b.inputs)):
            want = ((self.length,) + p.shape) if self.n_carry <= i < self.n_carry + self.n_xs else p.shape
            if s.shape != want or s.dtype != p.dtype:
                raise _err("scan", f"input {i} is {s.shape} {s.dtype.name}, body expects "
                                   f"{want} {p.dtype.name}")
        outs = b.outputs
        for i in range(self.n_carry):
            if outs[i].shape != b.inputs[i].shape or outs[i].dtype != b.inputs[i].dtype:
                raise _err("scan", f"carry {i} changes from {b.inputs[i].shape} to {outs[i].shape}")
        shapes = [o.shape for o in outs[:self.n_carry]] + \
                 [(self.length,) + o.shape for o in outs[self.n_carry:]]
        return shapes, [o.dtype for o in outs], _device("scan", srcs)


#: fused-op id -> registry name, filled by the registry as it declares entries (the IR knows
#: no registry; the name is only for messages and reports)
FUSED_NAMES: dict[int, str] = {}


@dataclass(frozen=True)
class Fused(Op):
    """A registered fused op: `id` is a FusedOpId, `params` its (hashable) params dataclass.
    Its output shapes and dtypes come from the registry entry: build fused nodes with
    `registry.core.fused_node` / `call_fused`, which pass them to `make_node`."""
    id: int
    params: object = None

    @property
    def name(self) -> str:
        return FUSED_NAMES.get(int(self.id), f"fused_{self.id}")

    def infer(self, srcs):
        raise _err(self.name, "fused nodes are built through the registry (call_fused), which "
                              "supplies their output shapes and dtypes")

    def __repr__(self):
        return f"Fused({self.name}, {self.params})"
