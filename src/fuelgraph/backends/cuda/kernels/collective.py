"""CUDA kernels of the collectives (registry/collective.py) through torch.distributed's NCCL
communicator (the `cuda:nccl` part of the group). NCCL runs on its own stream: a kernel only
enqueues the collective and returns its handle; waiting for it (before the first step reading
the result) makes the compute stream wait, with no host synchronization, so communication
overlaps the kernels scheduled in between. All-reduce works in place in x's buffer when the
runtime hands it over (no copy: an all-reduce through the graph moves what
`torch.distributed.all_reduce` moves). 16-bit reductions are NCCL's (in the input dtype, as
torch.distributed; over two processes that is one rounding of the exact sum). Gathers and
scatters along an axis other than 0 add one transposing copy."""
from __future__ import annotations

import math

import torch

from ....registry.collective import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, REPLICATE, SHARD
from ... import comm
from ...base import Cost, kernel


def _comm_cost(shapes, params=None):
    n = sum(math.prod(s) for s in shapes)
    return Cost(n, 4 * n)


def _blocks(x, axis, world):
    """x [.., world * n, ..] viewed as [world, .., n, ..]."""
    s = tuple(x.shape)
    return x.reshape(s[:axis] + (world, s[axis] // world) + s[axis + 1:]).movedim(axis, 0)


@kernel(ALL_REDUCE, "cuda", cost=_comm_cost, asynchronous=True, precision="T (NCCL)")
def all_reduce(x, *, op, group, world, out=None):
    """x reduced in place (into `out` when given: the runtime may not overwrite x)."""
    if out is not None:
        out.copy_(x)
        x = out
    if world == 1:
        return None, x
    return comm.Handle(comm.all_reduce(x, op, group), keep=(x,)), x


@kernel(ALL_GATHER, "cuda", cost=_comm_cost, asynchronous=True)
def all_gather(x, *, axis, grad, group, world):
    if world == 1:
        return None, x
    stacked = torch.empty((world,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    work = comm.all_gather(stacked.view((-1,) + tuple(x.shape[1:])), x, group)
    shape = tuple(x.shape[:axis]) + (world * x.shape[axis],) + tuple(x.shape[axis + 1:])
    if axis == 0:
        return comm.Handle(work, keep=(x,)), stacked.view(shape)
    out = torch.empty(shape, dtype=x.dtype, device=x.device)

    def finish():       # on the compute stream, after it waited for NCCL's
        _blocks(out, axis, world).copy_(stacked)
    return comm.Handle(work, finish, (x, stacked)), out


@kernel(REDUCE_SCATTER, "cuda", cost=_comm_cost, asynchronous=True, precision="T (NCCL)")
def reduce_scatter(x, *, axis, op, group, world):
    if world == 1:
        return None, x
    src = _blocks(x, axis, world).contiguous() if axis else x      # [world, .., n, ..]
    out = torch.empty(tuple(src.shape[1:]) if axis else
                      (x.shape[0] // world,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    work = comm.reduce_scatter(out, src.reshape((-1,) + tuple(out.shape[1:])), op, group)
    return comm.Handle(work, keep=(src,)), out


@kernel(SHARD, "cuda", strided_input=True)
def shard(x, *, axis, group, world):
    if world == 1:
        return x
    return _blocks(x, axis, world)[comm.rank(group)].contiguous()


@kernel(REPLICATE, "cuda", strided_input=True)
def replicate(x, *, group, world):
    return x
