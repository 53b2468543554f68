"""Collectives over a group of processes (torch.distributed: gloo on CPUs, NCCL on GPUs) as
fused ops (collective block of built-in ids, 0x170-0x17f). Every process of the group runs the
same program (SPMD) and so builds the same graph; each process holds its own value of x.

* ALL_REDUCE (0x170)     x -> the sum (op "sum") or mean (op "avg") over the group of every
                         process's x; same shape and dtype, the same value on every process.
* ALL_GATHER (0x171)     x [.., n, ..] -> the processes' x concatenated along `axis` in rank
                         order: [.., n * world, ..].
* REDUCE_SCATTER (0x172) x [.., n * world, ..] -> block `rank` (along `axis`) of the sum / mean
                         over the group: [.., n, ..].
* SHARD (0x173)          x [.., n * world, ..] -> this process's block along `axis` (no
                         communication: x is the same on every process).
* REPLICATE (0x174)      x -> x (no communication): marks a value that is the same on every
                         process as the input of work that differs per process.

Gradients follow the convention of tensor-parallel training (Megatron's): the loss is computed
once, identically on every process, and backward() runs on every process from it. A value is
then either *replicated* (the same on every process, and so is its gradient) or *partial* (each
process holds a part whose sum over the group is the value; each part's gradient is the value's
gradient) or *sharded* (each process holds one block). So:

* all_reduce: partial -> replicated. Backward: the replicated cotangent itself (identity; for
  op "avg", divided by the group size), through `replicate` so that second order works.
* replicate: replicated -> consumed per process. Backward: the processes' partial cotangents are
  summed (all_reduce).
* all_gather: sharded -> gathered. Backward: with grad="reduce_scatter" (default) the gathered
  value's consumers differ per process (e.g. a column-parallel layer after it, as in sequence
  parallelism), so its cotangent is partial: reduce_scatter. With grad="shard" the consumers
  are replicated (e.g. logits gathered for a loss computed on every process): each process
  keeps its own block of the cotangent.
* reduce_scatter: partial -> sharded. Backward: all_gather of the sharded cotangents.
* shard: replicated -> sharded. Backward: all_gather (grad="shard").

Ordering: every process must issue the same collectives in the same order. Plans derive that
order from the graph's structure alone (see `fuelgraph.runtime.collectives`), never from the
memory addresses or timing of one process.

Recipes: over one process (world == 1) every op here is the identity, and that is its recipe.
Over several processes no composition of primitives computes it (it needs the other processes'
data): the recipe then raises FuelGraphError instead of silently computing the single-process
value, so `lower_all=True` and a backend without a kernel fail loudly. Kernels exist on every
backend (NumPy through torch CPU tensors and gloo; CUDA through NCCL).

Process groups are named: "world" is every process (torch.distributed's default group); others
are registered by `fuelgraph.distributed.new_group`. Params carry the group's name and size
(shapes depend on the size), never the rank: every process builds the very same graph, and the
kernels read the rank of their process when they run."""
from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np

from ..errors import FuelGraphError
from .core import BackwardKind, FusedOpEntry, FusedOpId, call_fused
from .rules import check_arity, same_as_input0

ALL_REDUCE = FusedOpId(0x170)
ALL_GATHER = FusedOpId(0x171)
REDUCE_SCATTER = FusedOpId(0x172)
SHARD = FusedOpId(0x173)
REPLICATE = FusedOpId(0x174)

#: the ops that exchange data between processes (shard and replicate do not): plans order these
COMMUNICATING = frozenset({int(ALL_REDUCE), int(ALL_GATHER), int(REDUCE_SCATTER)})
REDUCE_OPS = ("sum", "avg")
GATHER_GRADS = ("reduce_scatter", "shard")


# ---- process groups -------------------------------------------------------------------------
@dataclass(frozen=True)
class ProcessGroup:
    """A named group of `size` processes; `rank` is this process's index in it. `handle` is
    the communicator the kernels use (a torch.distributed ProcessGroup; None: torch's default
    group)."""
    name: str
    size: int
    rank: int
    handle: object = field(default=None, compare=False, hash=False, repr=False)


_GROUPS: dict[str, ProcessGroup] = {}


def register_group(name: str, size: int, rank: int, handle=None) -> ProcessGroup:
    """Make `name` usable as the `group` of the collectives (replacing an earlier group of
    that name)."""
    if not isinstance(name, str) or not name:
        raise FuelGraphError(f"register_group: the name must be a non-empty string, got {name!r}")
    if not (isinstance(size, int) and size >= 1 and isinstance(rank, int) and 0 <= rank < size):
        raise FuelGraphError(f"register_group({name!r}): size {size!r} and rank {rank!r} must be "
                             f"integers with 0 <= rank < size")
    g = _GROUPS[name] = ProcessGroup(name, size, rank, handle)
    return g


def unregister_group(name: str) -> None:
    _GROUPS.pop(name, None)


def group_info(group="world") -> ProcessGroup:
    """The registered group `group` (a name or a ProcessGroup). "world" needs no registration:
    it is torch.distributed's default group when the program has initialized one, else the
    single process itself (size 1)."""
    if isinstance(group, ProcessGroup):
        group = group.name
    g = _GROUPS.get(group)
    if g is not None:
        return g
    if group == "world":
        td = sys.modules.get("torch.distributed")   # never imported here: only if in use
        if td is not None and td.is_available() and td.is_initialized():
            return register_group("world", td.get_world_size(), td.get_rank(), None)
        return ProcessGroup("world", 1, 0)
    raise FuelGraphError(f"collective: no process group named {group!r} (known: "
                         f"{sorted(set(_GROUPS) | {'world'})}); create it with "
                         f"fuelgraph.distributed.new_group")


# ---- params ---------------------------------------------------------------------------------
@dataclass(frozen=True)
class AllReduceParams:
    """op: "sum" or "avg"; group: the group's name; world: its size."""
    op: str = "sum"
    group: str = "world"
    world: int = 1


@dataclass(frozen=True)
class AllGatherParams:
    """axis (>= 0) the blocks are concatenated along; grad: "reduce_scatter" (the gathered
    value's cotangent is partial) or "shard" (it is replicated); group, world."""
    axis: int = 0
    grad: str = "reduce_scatter"
    group: str = "world"
    world: int = 1


@dataclass(frozen=True)
class ReduceScatterParams:
    """axis (>= 0) split into `world` blocks; op: "sum" or "avg"; group, world."""
    axis: int = 0
    op: str = "sum"
    group: str = "world"
    world: int = 1


@dataclass(frozen=True)
class ShardParams:
    """axis (>= 0) split into `world` blocks; group, world."""
    axis: int = 0
    group: str = "world"
    world: int = 1


@dataclass(frozen=True)
class ReplicateParams:
    """group, world."""
    group: str = "world"
    world: int = 1


# ---- validation -------------------------------------------------------------------------------
def _check_group(name, p):
    if not isinstance(p.group, str) or not p.group:
        raise FuelGraphError(f"{name}: param group must be a group name, got {p.group!r}")
    if isinstance(p.world, bool) or not isinstance(p.world, int) or p.world < 1:
        raise FuelGraphError(f"{name}: param world must be an int >= 1, got {p.world!r}")


def _check_op(name, p, x):
    if p.op not in REDUCE_OPS:
        raise FuelGraphError(f"{name}: param op is {p.op!r}, expected one of {REDUCE_OPS}")
    if x.dtype.kind == "b" or (p.op == "avg" and not x.dtype.is_float):
        raise FuelGraphError(f"{name}: x has dtype {x.dtype.name}; op {p.op!r} needs "
                             f"{'a float' if p.op == 'avg' else 'a numeric'} dtype")


def _check_axis(name, p, x, divisible):
    if isinstance(p.axis, bool) or not isinstance(p.axis, int) or not 0 <= p.axis < len(x.shape):
        raise FuelGraphError(f"{name}: param axis is {p.axis!r}, expected an axis of x (shape "
                             f"{tuple(x.shape)}; negative axes are normalized by the builder)")
    if divisible and x.shape[p.axis] % p.world:
        raise FuelGraphError(f"{name}: x has shape {tuple(x.shape)}: axis {p.axis} (size "
                             f"{x.shape[p.axis]}) is not divisible by the group size {p.world}")


def _validate_all_reduce(srcs, p):
    check_arity("all_reduce", srcs, 1)
    _check_group("all_reduce", p)
    _check_op("all_reduce", p, srcs[0])


def _validate_all_gather(srcs, p):
    check_arity("all_gather", srcs, 1)
    _check_group("all_gather", p)
    _check_axis("all_gather", p, srcs[0], False)
    if p.grad not in GATHER_GRADS:
        raise FuelGraphError(f"all_gather: param grad is {p.grad!r}, expected one of "
                             f"{GATHER_GRADS}")


def _validate_reduce_scatter(srcs, p):
    check_arity("reduce_scatter", srcs, 1)
    _check_group("reduce_scatter", p)
    _check_op("reduce_scatter", p, srcs[0])
    _check_axis("reduce_scatter", p, srcs[0], True)


def _validate_shard(srcs, p):
    check_arity("shard", srcs, 1)
    _check_group("shard", p)
    _check_axis("shard", p, srcs[0], True)


def _validate_replicate(srcs, p):
    check_arity("replicate", srcs, 1)
    _check_group("replicate", p)


def _scaled_axis(factor):
    def rule(shapes, p):
        s = list(shapes[0])
        s[p.axis] = s[p.axis] * p.world if factor > 0 else s[p.axis] // p.world
        return [tuple(s)]
    return rule


# ---- recipes: the single-process meaning ------------------------------------------------------
def _one_process(name, world):
    if world != 1:
        raise FuelGraphError(
            f"{name}: over a group of {world} processes this op moves data between processes, "
            f"which no composition of primitives can do: it runs only as its kernel. It was "
            f"lowered to its recipe (lower_all=True, or no kernel took this call), which would "
            f"silently compute the single-process value instead; run it without lower_all")


def all_reduce_recipe(x, op, group, world):
    _one_process("all_reduce", world)
    return x


def all_gather_recipe(x, axis, grad, group, world):
    _one_process("all_gather", world)
    return x


def reduce_scatter_recipe(x, axis, op, group, world):
    _one_process("reduce_scatter", world)
    return x


def shard_recipe(x, axis, group, world):
    _one_process("shard", world)
    return x


def replicate_recipe(x, group, world):
    _one_process("replicate", world)
    return x


# ---- gradients (the convention of the module docstring) ---------------------------------------
def _all_reduce_vjp(xs, ys, gs, p):
    g = call_fused(REPLICATE, gs[0], group=p.group, world=p.world)
    return [g * (1.0 / p.world) if p.op == "avg" and p.world > 1 else g]


def _replicate_vjp(xs, ys, gs, p):
    return [call_fused(ALL_REDUCE, gs[0], op="sum", group=p.group, world=p.world)]


def _all_gather_vjp(xs, ys, gs, p):
    if p.grad == "shard":
        return [call_fused(SHARD, gs[0], axis=p.axis, group=p.group, world=p.world)]
    return [call_fused(REDUCE_SCATTER, gs[0], axis=p.axis, op="sum", group=p.group,
                       world=p.world)]


def _reduce_scatter_vjp(xs, ys, gs, p):
    g = call_fused(ALL_GATHER, gs[0], axis=p.axis, grad="reduce_scatter", group=p.group,
                   world=p.world)
    return [g * (1.0 / p.world) if p.op == "avg" and p.world > 1 else g]


def _shard_vjp(xs, ys, gs, p):
    return [call_fused(ALL_GATHER, gs[0], axis=p.axis, grad="shard", group=p.group,
                       world=p.world)]


def _sample(rng):
    return [rng.standard_normal((4, 6)).astype(np.float32)]


def declare(reg):
    reg.add(FusedOpEntry(
        id=ALL_REDUCE, name="all_reduce", family="collective", params=AllReduceParams,
        shape_rule=same_as_input0, dtype_rule=same_as_input0, validate=_validate_all_reduce,
        decompose=all_reduce_recipe, backward=BackwardKind.fused(REPLICATE),
        vjp=_all_reduce_vjp, destructive_inputs=(0,), pattern_variants=None, sample=_sample,
        doc="Sum (op 'sum') or mean (op 'avg') of x over the processes of a group: x any "
            "shape, a numeric dtype (float for 'avg') -> same shape and dtype, the same value "
            "on every process. Backward: identity (the cotangent is the same on every "
            "process), divided by the group size for 'avg'. Overwrites x's buffer when nothing "
            "else reads it. Over one process it is the identity (its recipe); over several its "
            "recipe raises: it runs only as its kernel."))
    reg.add(FusedOpEntry(
        id=ALL_GATHER, name="all_gather", family="collective", params=AllGatherParams,
        shape_rule=_scaled_axis(+1), dtype_rule=same_as_input0,
        validate=_validate_all_gather, decompose=all_gather_recipe,
        backward=BackwardKind.fused(REDUCE_SCATTER), vjp=_all_gather_vjp,
        pattern_variants=None, sample=_sample,
        doc="The processes' x [.., n, ..] (any dtype, rank >= 1) concatenated along axis in "
            "rank order -> [.., n * world, ..]. Backward: reduce_scatter of the cotangent "
            "(grad='reduce_scatter': consumers differ per process) or this process's block of "
            "it (grad='shard': consumers replicated)."))
    reg.add(FusedOpEntry(
        id=REDUCE_SCATTER, name="reduce_scatter", family="collective",
        params=ReduceScatterParams, shape_rule=_scaled_axis(-1), dtype_rule=same_as_input0,
        validate=_validate_reduce_scatter, decompose=reduce_scatter_recipe,
        backward=BackwardKind.fused(ALL_GATHER), vjp=_reduce_scatter_vjp,
        pattern_variants=None, sample=_sample,
        doc="Block `rank` along axis of the sum (or mean) over the group: x [.., n * world, ..] "
            "(numeric dtype; float for 'avg') -> [.., n, ..]. Backward: all_gather of the "
            "cotangent (divided by the group size for 'avg')."))
    reg.add(FusedOpEntry(
        id=SHARD, name="shard", family="collective", params=ShardParams,
        shape_rule=_scaled_axis(-1), dtype_rule=same_as_input0, validate=_validate_shard,
        decompose=shard_recipe, backward=BackwardKind.fused(ALL_GATHER), vjp=_shard_vjp,
        pattern_variants=None, sample=_sample,
        doc="This process's block along axis of x [.., n * world, ..] (the same on every "
            "process; any dtype) -> [.., n, ..]; no communication. Backward: all_gather of the "
            "cotangent blocks (the gradient of the replicated x)."))
    reg.add(FusedOpEntry(
        id=REPLICATE, name="replicate", family="collective", params=ReplicateParams,
        shape_rule=same_as_input0, dtype_rule=same_as_input0, validate=_validate_replicate,
        decompose=replicate_recipe, backward=BackwardKind.fused(ALL_REDUCE),
        vjp=_replicate_vjp, pattern_variants=None, sample=_sample,
        doc="Identity on x (the same on every process; any shape and dtype), marking it as "
            "the input of work that differs per process (e.g. a column-parallel layer). "
            "Backward: all_reduce (sum) of the processes' cotangents."))


# ---- builders (re-exported by fuelgraph.functional) -----------------------------------------
def _axis(x, axis, name):
    nd = len(x.shape)
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)) or not -nd <= axis < nd:
        raise FuelGraphError(f"{name}: axis {axis!r} is out of range for x of shape "
                             f"{tuple(x.shape)}")
    return int(axis) % nd


def all_reduce(x, op: str = "sum", group="world"):
    """Sum (op="sum") or mean (op="avg") of x over the processes of `group` (a name or a
    ProcessGroup; "world": every process). x: any shape, numeric dtype (float for "avg") ->
    same shape and dtype, the same on every process. Gradient: the cotangent itself (the
    consumers of the result are assumed identical on every process), / size for "avg"."""
    g = group_info(group)
    return call_fused(ALL_REDUCE, x, op=op, group=g.name, world=g.size)


def all_gather(x, axis: int = 0, group="world", grad: str = "reduce_scatter"):
    """Every process's x [.., n, ..] concatenated along `axis` in rank order ->
    [.., n * size, ..] (any dtype). Gradient: grad="reduce_scatter" sums the processes'
    cotangents and keeps this process's block (consumers differ per process); grad="shard"
    keeps this process's block of its own cotangent (consumers identical on every process)."""
    g = group_info(group)
    return call_fused(ALL_GATHER, x, axis=_axis(x, axis, "all_gather"), grad=grad,
                      group=g.name, world=g.size)


def reduce_scatter(x, axis: int = 0, op: str = "sum", group="world"):
    """Block `rank` along `axis` of the sum (or mean) of x over the group: x [.., n * size, ..]
    (numeric dtype) -> [.., n, ..]. Gradient: all_gather of the cotangent."""
    g = group_info(group)
    return call_fused(REDUCE_SCATTER, x, axis=_axis(x, axis, "reduce_scatter"), op=op,
                      group=g.name, world=g.size)


def shard(x, axis: int = 0, group="world"):
    """This process's block along `axis` of x [.., n * size, ..], which is the same on every
    process -> [.., n, ..] (no communication; any dtype). Gradient: all_gather."""
    g = group_info(group)
    return call_fused(SHARD, x, axis=_axis(x, axis, "shard"), group=g.name, world=g.size)


def replicate(x, group="world"):
    """x itself, marked as a value that is the same on every process and feeds work that
    differs per process: its gradient is the sum over the group of the processes' cotangents
    (all_reduce). No communication in the forward."""
    g = group_info(group)
    return call_fused(REPLICATE, x, group=g.name, world=g.size)
