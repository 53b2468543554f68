"""NumPy kernels of the collectives (registry/collective.py): the arrays go to torch.distributed
as CPU tensors sharing their memory (gloo; the `cpu:gloo` part of a mixed group on a GPU
machine). Reductions of 16-bit floats are computed in float32 and rounded once (the same as a
16-bit reduction over two processes; over more, our result is the more accurate one); integer
sums in int64. Over one process every op is the identity and torch is never imported."""
from __future__ import annotations

import math
import warnings

import numpy as np

from ...registry.collective import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, REPLICATE, SHARD
from .. import comm
from ..base import Cost, kernel


def _comm_cost(shapes, params=None):
    n = sum(math.prod(s) for s in shapes)
    return Cost(n, 8 * n)


def _torch(a):
    """A torch tensor sharing `a`'s memory (gathers only read a read-only input)."""
    import torch
    if a.flags.writeable:
        return torch.from_numpy(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


def _bytes(a):
    """The bytes of contiguous `a`, flat (gathers move bits: any dtype, bfloat16 included)."""
    return a.reshape(-1).view(np.uint8)


def _acc(dt) -> np.dtype:
    dt = np.dtype(dt)
    if dt.kind == "f" or dt.name == "bfloat16":
        return np.dtype(np.float64) if dt == np.float64 else np.dtype(np.float32)
    return np.dtype(np.int64)


def _blocks(x, axis, world):
    """x [.., world * n, ..] viewed as [world, .., n, ..]."""
    s = x.shape
    return np.moveaxis(x.reshape(s[:axis] + (world, s[axis] // world) + s[axis + 1:]), axis, 0)


@kernel(ALL_REDUCE, "numpy", cost=_comm_cost, asynchronous=True)
def all_reduce(x, *, op, group, world, out=None):
    """x reduced in place (into `out` when given: the runtime may not overwrite x)."""
    if out is not None:
        out[...] = x
        x = out
    if world == 1:
        return None, x
    acc = _acc(x.dtype)
    if acc == x.dtype:
        return comm.Handle(comm.all_reduce(_torch(x), op, group), keep=(x,)), x
    a = x.astype(acc)

    def finish():
        x[...] = a.astype(x.dtype)
    return comm.Handle(comm.all_reduce(_torch(a), op, group), finish, (a,)), x


@kernel(ALL_GATHER, "numpy", cost=_comm_cost, asynchronous=True)
def all_gather(x, *, axis, grad, group, world):
    if world == 1:
        return None, x
    src = np.ascontiguousarray(x)
    stacked = np.empty((world,) + x.shape, x.dtype)
    work = comm.all_gather(_torch(_bytes(stacked)), _torch(_bytes(src)), group)
    shape = x.shape[:axis] + (world * x.shape[axis],) + x.shape[axis + 1:]
    if axis == 0:
        return comm.Handle(work, keep=(src,)), stacked.reshape(shape)
    out = np.empty(shape, x.dtype)

    def finish():
        _blocks(out, axis, world)[...] = stacked
    return comm.Handle(work, finish, (src, stacked)), out


@kernel(REDUCE_SCATTER, "numpy", cost=_comm_cost, asynchronous=True)
def reduce_scatter(x, *, axis, op, group, world):
    if world == 1:
        return None, x
    acc = _acc(x.dtype)
    src = np.ascontiguousarray(_blocks(x, axis, world), dtype=acc)   # [world, .., n, ..]
    red = np.empty(src.shape[1:], acc)                                  # x's shape, n at axis
    work = comm.reduce_scatter(_torch(red), _torch(src.reshape((-1,) + red.shape[1:])), op,
                               group)
    if acc == x.dtype:
        return comm.Handle(work, keep=(src,)), red
    out = np.empty(red.shape, x.dtype)

    def finish():
        out[...] = red.astype(x.dtype)
    return comm.Handle(work, finish, (src, red)), out


@kernel(SHARD, "numpy", strided_input=True)
def shard(x, *, axis, group, world):
    if world == 1:
        return x
    return np.ascontiguousarray(_blocks(x, axis, world)[comm.rank(group)])


@kernel(REPLICATE, "numpy", strided_input=True)
def replicate(x, *, group, world):
    return x
