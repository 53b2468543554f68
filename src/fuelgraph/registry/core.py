"""The fused-op registry: ids, entries (every facet of an op in one declaration), backward
kinds and run-time registration."""
from __future__ import annotations

import dataclasses
import importlib
import pkgutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from ..errors import FuelGraphError
from ..ir import ops
from ..ir.node import Node, Value, make_node, structural_key, toposort
from ..ir.scan import placeholder
from ..ir.tensor import Tensor, tensor

RUNTIME_BASE = 0x8000


class FusedOpId(int):
    """A fused-op id. 0 is UNASSIGNED; ids >= 0x8000 are registered at run time."""

    def is_runtime(self) -> bool:
        return self >= RUNTIME_BASE

    def __repr__(self) -> str:
        e = default_registry().get(self)
        return f"FusedOpId({int(self)}{', ' + e.name if e else ''})"


class FusedOps:
    """The 25 well-known ids, with their fixed values. Built-in ops beyond these (backward
    helpers, multi-output variants) take fixed ids from 0x100 up, declared as constants in
    their family module (e.g. `registry.loss.FUSED_SOFTMAX_CROSS_ENTROPY_BACKWARD`), so an
    id never depends on import order; 0x8000 and up are allocated at run time."""
    UNASSIGNED = FusedOpId(0)
    SOFTMAX_LAST_DIM = FusedOpId(1)
    FUSED_LINEAR = FusedOpId(2)
    RMS_NORM_LAST_DIM = FusedOpId(3)
    LAYER_NORM_LAST_DIM = FusedOpId(4)
    ROPE = FusedOpId(5)
    CONV2D = FusedOpId(6)
    SOFTMAX_LAST_DIM_BACKWARD = FusedOpId(7)
    LAYER_NORM_LAST_DIM_BACKWARD = FusedOpId(8)
    RMS_NORM_LAST_DIM_BACKWARD = FusedOpId(9)
    REDUCE_MAX_TO_BACKWARD = FusedOpId(10)
    CONV_TRANSPOSE2D = FusedOpId(11)
    FLASH_ATTN = FusedOpId(12)
    PAGED_ATTN = FusedOpId(13)
    QMATMUL = FusedOpId(14)
    POWI_BACKWARD = FusedOpId(15)
    INPLACE_AFFINE = FusedOpId(16)
    FUSED_SOFTMAX_CROSS_ENTROPY = FusedOpId(17)
    CAUSAL_CONV1D = FusedOpId(18)
    SELECTIVE_SCAN = FusedOpId(19)
    SSD_CHUNK_SCAN = FusedOpId(20)
    NF4_MATMUL = FusedOpId(21)
    FLASH_ATTN_BACKWARD_Q = FusedOpId(22)
    FLASH_ATTN_BACKWARD_K = FusedOpId(23)
    FLASH_ATTN_BACKWARD_V = FusedOpId(24)
    AWQ_MATMUL = FusedOpId(25)

    @classmethod
    def well_known(cls) -> dict[str, FusedOpId]:
        return {k: v for k, v in vars(cls).items() if isinstance(v, FusedOpId) and 0 < v <= 25}


@dataclass(frozen=True)
class BackwardKind:
    """How autograd differentiates a fused op: `fused(id)` emits helper op `id` through the
    entry's `vjp`; DECOMPOSE differentiates the recipe; NOT_DIFFERENTIABLE raises."""
    kind: str
    helper: int | None = None

    @staticmethod
    def fused(helper_id: int) -> "BackwardKind":
        return BackwardKind("fused", FusedOpId(helper_id))

    def __str__(self) -> str:
        if self.kind == "fused":
            e = default_registry().get(self.helper)
            return f"fused({e.name if e else self.helper})"
        return self.kind


BackwardKind.DECOMPOSE = BackwardKind("decompose")
BackwardKind.NOT_DIFFERENTIABLE = BackwardKind("not_differentiable")


@dataclass(frozen=True)
class NoParams:
    """Params of ops without parameters."""


@dataclass
class FusedOpEntry:
    """Everything about one fused op, declared in one place.

    shape_rule(shapes, params) -> list of output shapes; dtype_rule(dtypes, params) -> list of
    output dtypes; validate(srcs, params) raises FuelGraphError (srcs expose .shape/.dtype);
    decompose(*tensors, **params) is the recipe over primitives (returns a Tensor or a tuple);
    pattern_variants lists the discrete-param settings whose recipes the fuser matches;
    extra_patterns are alternative spellings (same signature as decompose), each a function
    or a (function, discrete params dict) pair like one pattern variant; vjp(ins, outs,
    grads, params) builds the backward for BackwardKind.fused; sample(rng) returns example
    input arrays used to derive patterns and by the registry-wide tests."""
    id: FusedOpId
    name: str
    family: str
    params: type
    shape_rule: Callable
    dtype_rule: Callable
    validate: Callable
    decompose: Callable
    backward: BackwardKind
    sample: Callable
    outputs: tuple[str, ...] = ("out",)
    destructive_inputs: tuple[int, ...] = ()
    pattern_variants: tuple[dict, ...] | None = ({},)
    extra_patterns: tuple = ()   # Callable | (Callable, dict)
    vjp: Callable | None = None
    read_params: Callable | None = None
    # op types (primitives) every pattern of the op holds: a graph without one of them cannot
    # match, so the fuser does not even derive the patterns (they cost time on first use)
    pattern_needs: tuple = ()
    # fuse only where no other entry's pattern took the nodes: a small idiom that larger
    # patterns hold (silu(g) * u: a conv's silu times the next op's input) is matched last
    fuse_late: bool = False
    recipe_only: tuple[str, ...] = ()
    doc: str = ""
    body: "ops.Body | None" = None   # entries registered from a graph: the sub-graph itself

    def infer(self, srcs, params):
        self.validate(srcs, params)
        shapes = self.shape_rule([s.shape for s in srcs], params)
        dtypes = self.dtype_rule([s.dtype for s in srcs], params)
        return shapes, dtypes

    @property
    def has_pattern(self) -> bool:
        return bool(self.pattern_variants) or bool(self.extra_patterns)

    def lower(self, srcs, params):
        """Run the recipe on tensors `srcs`; returns a tuple of output tensors."""
        out = self.decompose(*srcs, **dataclasses.asdict(params))
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class FusedOpRegistry:
    """Id -> entry. Iteration is in id order; ids are never reused. `validators` are called on
    every entry registered at run time before it becomes visible (the optimizer adds one that
    rejects recipes whose pattern would match anything); one that raises rejects the entry."""
    validators: list[Callable] = []

    def __init__(self):
        self._entries: dict[int, FusedOpEntry] = {}
        self._by_name: dict[str, int] = {}
        self._next_runtime = RUNTIME_BASE
        self._runtime_keys: dict[Any, FusedOpId] = {}
        self._lock = threading.RLock()

    def add(self, entry: FusedOpEntry) -> FusedOpEntry:
        if entry.id in self._entries or entry.name in self._by_name:
            raise FuelGraphError(f"registry: id {entry.id} or name {entry.name!r} already registered")
        self._entries[int(entry.id)] = entry
        self._by_name[entry.name] = int(entry.id)
        ops.FUSED_NAMES[int(entry.id)] = entry.name
        return entry

    def get(self, key) -> FusedOpEntry | None:
        if isinstance(key, str):
            key = self._by_name.get(key.lower())
            if key is None:
                return None
        return self._entries.get(int(key)) if key is not None else None

    def entry(self, key) -> FusedOpEntry:
        e = self.get(key)
        if e is None:
            raise FuelGraphError(f"registry: no fused op registered for {key!r}")
        return e

    def __iter__(self) -> Iterator[FusedOpEntry]:
        return iter([self._entries[k] for k in sorted(self._entries)])

    def __len__(self):
        return len(self._entries)

    def __contains__(self, key):
        return self.get(key) is not None

    def next_runtime_id(self) -> FusedOpId:
        """Allocate the next id >= 0x8000 (append-only, never reused)."""
        with self._lock:
            fid = FusedOpId(self._next_runtime)
            self._next_runtime += 1
        return fid

    def register(self, name: str, recipe: Callable, sample: Callable, *, family="forward",
                 backward: BackwardKind = BackwardKind.DECOMPOSE, doc: str = "") -> FusedOpId:
        """Register a run-time fused op defined by `recipe(*tensors)` (primitives only, no
        params). `sample(rng)` returns example input arrays. Returns a fresh id >= 0x8000, or
        the existing id when a structurally identical recipe is already registered. The op
        then fuses from its idiom and runs through its recipe until a kernel is registered for
        it (`fuelgraph.kernel(fid, backend)` decorating a function of the input arrays)."""
        where = f"registry.register({name!r})"
        if not isinstance(name, str) or not name.isidentifier():
            raise FuelGraphError(f"{where}: the name must be an identifier string")
        if not callable(recipe) or not callable(sample):
            raise FuelGraphError(f"{where}: recipe and sample must be callables")
        traced = _checked_trace(where, recipe, sample)
        key = structural_key(traced.outputs, order_inputs=traced.inputs)
        with self._lock:
            if key in self._runtime_keys:
                return self._runtime_keys[key]
            if name.lower() in self._by_name:
                raise FuelGraphError(f"{where}: name {name!r} is already taken")
            out_meta = [(o.shape, o.dtype) for o in traced.outputs]
            in_meta = [(p.shape, p.dtype) for p in traced.inputs]

            def validate(srcs, params, _in=in_meta, _n=name):
                if len(srcs) != len(_in):
                    raise FuelGraphError(f"{_n}: expected {len(_in)} inputs, got {len(srcs)}")
                for i, (s, (shp, d)) in enumerate(zip(srcs, _in)):
                    if s.dtype != d or len(s.shape) != len(shp):
                        raise FuelGraphError(f"{_n}: input {i} is {s.shape} {s.dtype.name}, "
                                             f"expected rank {len(shp)} {d.name}")

            def shape_rule(shapes, params, _r=recipe):
                return [o.shape for o in _trace_meta(_r, shapes, in_meta)]

            def dtype_rule(dtypes, params, _o=out_meta):
                return [d for _, d in _o]

            entry = FusedOpEntry(
                id=FusedOps.UNASSIGNED, name=name.lower(), family=family, params=NoParams, shape_rule=shape_rule,
                dtype_rule=dtype_rule, validate=validate,
                decompose=lambda *xs, _r=recipe: _r(*xs), backward=backward, sample=sample,
                outputs=tuple(f"out{i}" for i in range(len(out_meta))),
                doc=doc or (recipe.__doc__ or f"run-time fused op {name}"))
            for check in self.validators:
                check(entry)
            entry.id = fid = self.next_runtime_id()
            self.add(entry)
            self._runtime_keys[key] = fid
        return fid


    def register_graph(self, prefix: str, inputs, outputs, *, family: str, doc: str = "") -> FusedOpId:
        """Register a run-time fused op whose recipe IS the sub-graph from placeholder `inputs`
        (values of Input leaves bound to no data, in the fused node's input order) to `outputs`
        (primitives only). Keyed by structure: a structurally identical sub-graph returns the
        id it got first, so the same region across layers or steps shares one entry (and one
        kernel). The entry is shape-specific (input shapes and dtypes must match exactly), has
        no pattern (the pass that registers it places its nodes) and is differentiated through
        its recipe; `entry.body` keeps the sub-graph for backends that generate kernels from it
        (see `backends.base.kernel_factory`). Its name is `<prefix>_<hex id>`."""
        inputs, outputs = tuple(inputs), tuple(outputs)
        key = structural_key(outputs, order_inputs=inputs)
        with self._lock:
            fid = self._runtime_keys.get(key)
            if fid is not None:
                return fid
            fid = self.next_runtime_id()
            name = f"{prefix}_{int(fid):x}"
            in_meta = tuple((p.shape, p.dtype) for p in inputs)
            out_meta = tuple((o.shape, o.dtype) for o in outputs)
            body = ops.Body(inputs, outputs)
            entry = FusedOpEntry(
                id=fid, name=name, family=family, params=NoParams,
                shape_rule=lambda shapes, params, _o=out_meta: [s for s, _ in _o],
                dtype_rule=lambda dtypes, params, _o=out_meta: [d for _, d in _o],
                validate=_exact_inputs(name, in_meta),
                decompose=lambda *xs, _b=body: replay(_b, xs),
                backward=BackwardKind.DECOMPOSE, sample=_sample_like(in_meta),
                outputs=tuple(f"out{i}" for i in range(len(outputs))), pattern_variants=None,
                doc=doc or f"run-time fused op replaying a sub-graph of {len(inputs)} inputs",
                body=body)
            for check in self.validators:
                check(entry)
            self.add(entry)
            self._runtime_keys[key] = fid
        return fid


def _exact_inputs(name, in_meta):
    def validate(srcs, params):
        if len(srcs) != len(in_meta):
            raise FuelGraphError(f"{name}: expected {len(in_meta)} inputs, got {len(srcs)}")
        for i, (s, (shp, d)) in enumerate(zip(srcs, in_meta)):
            if s.dtype != d or tuple(s.shape) != shp:
                raise FuelGraphError(f"{name}: input {i} is {tuple(s.shape)} {s.dtype.name}, "
                                     f"expected {shp} {d.name}")
    return validate


def _sample_like(in_meta):
    def sample(rng):
        out = []
        for shp, d in in_meta:
            if d.is_float:
                out.append(rng.standard_normal(shp).astype(d.np))
            elif d.kind == "b":
                out.append(rng.random(shp) < 0.5)
            else:
                out.append(rng.integers(1, 5, shp).astype(d.np))
        return out
    return sample


def replay(body: "ops.Body", tensors) -> tuple:
    """The outputs of sub-graph `body` rebuilt on `tensors` (one per body input): every node is
    applied again to the new sources; constant leaves move to the tensors' device."""
    vals = [t.value if isinstance(t, Tensor) else t for t in tensors]
    env: dict[Node, Node] = {p.node: v.node for p, v in zip(body.inputs, vals)}
    slot = {p.node: v.slot for p, v in zip(body.inputs, vals)}
    device = vals[0].node.device if vals else None
    for n in toposort(body.outputs):
        if n in env:
            continue
        op = n.op
        if not n.srcs and device is not None and getattr(op, "device", device) != device:
            op = dataclasses.replace(op, device=device)
        env[n] = make_node(op, tuple(Value(env[s.node], slot.get(s.node, s.slot))
                                     for s in n.srcs))
    return tuple(Tensor(Value(env[o.node], slot.get(o.node, o.slot))) for o in body.outputs)


def _checked_trace(where: str, recipe, sample) -> "Traced":
    """Trace a run-time recipe, turning every way it can be unusable into a clear error."""
    try:
        arrays = sample(np.random.default_rng(0))
        arrays = [np.asarray(a) for a in arrays]
    except Exception as e:
        raise FuelGraphError(f"{where}: sample(rng) must return a list of arrays ({e!r})") from None
    try:
        traced = trace_recipe(recipe, lambda rng: arrays)
    except Exception as e:
        raise FuelGraphError(f"{where}: the recipe raised {type(e).__name__}: {e} on the sample "
                             f"inputs") from None
    if not traced.outputs or any(not isinstance(o, Value) for o in traced.outputs):
        raise FuelGraphError(f"{where}: the recipe must return a Tensor or a tuple of Tensors")
    if any(o in traced.inputs for o in traced.outputs):
        raise FuelGraphError(f"{where}: the recipe returns one of its inputs unchanged: "
                             f"there is nothing to fuse")
    return traced


@dataclass
class Traced:
    inputs: list
    outputs: list


def trace_recipe(recipe, sample, params=None) -> Traced:
    """Trace `recipe` on fresh placeholder inputs shaped and typed like `sample(rng)`."""
    rng = np.random.default_rng(0)
    xs = [tensor(a) for a in sample(rng)]
    # a pattern for the form without trailing optional inputs takes only the first n_inputs
    xs = xs[:getattr(recipe, "n_inputs", len(xs))]
    out = recipe(*xs, **(params or {}))
    outs = list(out) if isinstance(out, (tuple, list)) else [out]
    return Traced([x.value for x in xs], [getattr(o, "value", o) for o in outs])


def _trace_meta(recipe, shapes, in_meta):
    """Output values of `recipe` traced on data-free placeholders of the given shapes."""
    xs = [placeholder(s, d) for s, (_, d) in zip(shapes, in_meta)]
    out = recipe(*xs)
    return out if isinstance(out, (tuple, list)) else (out,)


_DEFAULT: FusedOpRegistry | None = None
_DEFAULT_LOCK = threading.Lock()


def default_registry() -> FusedOpRegistry:
    """The process-wide registry, with every built-in family loaded: each module of this
    package that defines `declare(registry)` declares its entries (no list of families). It
    becomes visible only once filled, so first use from several threads is safe."""
    global _DEFAULT
    if _DEFAULT is None:
        with _DEFAULT_LOCK:
            if _DEFAULT is None:
                reg = FusedOpRegistry()
                for m in pkgutil.iter_modules(_package_path()):
                    mod = importlib.import_module(f"{__package__}.{m.name}")
                    if callable(getattr(mod, "declare", None)):
                        mod.declare(reg)
                _DEFAULT = reg
    return _DEFAULT


def _package_path():
    return [str(Path(__file__).resolve().parent)]


def id_by_label(label: str) -> FusedOpId | None:
    """The id a kernel declaration names: a `FusedOps` attribute, or a module-level id constant
    of a registry family module (e.g. `FUSED_SOFTMAX_CROSS_ENTROPY_BACKWARD`)."""
    fid = getattr(FusedOps, label, None)
    if isinstance(fid, FusedOpId):
        return fid
    default_registry()
    for m in pkgutil.iter_modules(_package_path()):
        v = getattr(importlib.import_module(f"{__package__}.{m.name}"), label, None)
        if isinstance(v, FusedOpId):
            return v
    return None


def fused_node(op: "ops.Fused", srcs: tuple) -> Node:
    """The node applying fused op `op` to values `srcs`; its output shapes and dtypes come
    from the registry entry (which validates the inputs first)."""
    e = default_registry().entry(op.id)
    shapes, dtypes = e.infer(srcs, op.params)
    return make_node(op, srcs, (shapes, dtypes))


def call_fused(op_id, *srcs, **params):
    """Build a fused node on tensors `srcs`; returns a Tensor or a tuple for multi-output ops."""
    e = default_registry().entry(op_id)
    for i, s in enumerate(srcs):
        if not isinstance(s, Tensor):
            raise FuelGraphError(f"{e.name}: input {i} must be a Tensor, got {type(s).__name__}")
    try:
        p = e.params(**params)
    except TypeError as exc:
        raise FuelGraphError(f"{e.name}: bad parameters {params}: {exc}") from None
    try:
        hash(p)
    except TypeError:
        raise FuelGraphError(f"{e.name}: parameters must be scalars, got {params}") from None
    node = fused_node(ops.Fused(e.id, p), tuple(s.value for s in srcs))
    outs = tuple(Tensor(node.out(i)) for i in range(node.nout))
    return outs[0] if len(outs) == 1 else outs
