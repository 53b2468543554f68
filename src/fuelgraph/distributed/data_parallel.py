"""Data parallelism: every process holds the whole model and computes on its own shard of the
batch; gradients are averaged over the group, so every process applies the same update and
the parameters stay equal everywhere (the losses are those of one process on the whole batch).

    dp = DataParallel(model)                   # rank 0's parameters are broadcast
    step = dp.train_step(lambda x, y: F.cross_entropy(dp(x), y), opt)
    for x, y in batches:                       # the whole batch, the same on every process
        loss = step(*dp.shard_batch(x, y))     # this process's shard; returns the batch mean

The gradients are averaged in buckets of about `bucket_mb` MiB each, the last layers' first
(their gradients are computed first): one all_reduce per bucket over the flattened gradients.
Nothing runs until the step's plan runs: the backward, the all_reduces and the optimizer
update are one graph, and the plan starts each bucket's all_reduce as soon as its gradients
are computed, while the backward goes on computing the others (see
`fuelgraph.runtime.collectives`)."""
from __future__ import annotations

import numpy as np

from ..api import tensor
from ..errors import FuelGraphError
from ..ir.tensor import Tensor, cat
from ..jit import jit
from ..nn.module import Module
from ..registry.collective import all_reduce, group_info
from ..runtime.executor import group_gradients, realize
from .env import broadcast_


class DataParallel(Module):
    """Wraps `module` for data-parallel training over `group` (see the module docstring).
    Calling it calls the module. `backward(loss)` fills every parameter's `.grad` with the
    gradient averaged over the group; `train_step(loss_fn, optimizer)` makes a whole traced
    step. With `broadcast=True` every process starts from process 0's parameters and buffers."""

    def __init__(self, module: Module, group="world", bucket_mb: float = 25.0,
                 broadcast: bool = True):
        super().__init__()
        if not isinstance(module, Module):
            raise FuelGraphError(f"DataParallel: expected a fuelgraph.nn.Module, got "
                                 f"{type(module).__name__}")
        if not bucket_mb > 0:
            raise FuelGraphError(f"DataParallel: bucket_mb must be > 0, got {bucket_mb}")
        self.module = module
        g = group_info(group)
        self.group = g.name
        self.bucket_bytes = int(bucket_mb * (1 << 20))
        if broadcast:
            broadcast_(list(module.parameters()) + list(module.buffers()), 0, g.name)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def world_size(self) -> int:
        return group_info(self.group).size

    @property
    def rank(self) -> int:
        return group_info(self.group).rank

    # ---- gradients -----------------------------------------------------------------------------
    def buckets(self, params=None) -> list[list[Tensor]]:
        """The parameters that have a gradient, grouped in all-reduce buckets: in reverse order
        of registration (the order in which a backward computes their gradients), one dtype and
        device per bucket, each up to the bucket size (a larger parameter alone)."""
        params = [p for p in (params if params is not None else self.module.parameters())
                  if p.requires_grad and p.grad is not None]
        out: list[list[Tensor]] = []
        open_: dict = {}            # (dtype, device) -> (bucket, bytes)
        for p in reversed(params):
            key = (p.dtype, p.device)
            nb = p.numel() * p.dtype.itemsize
            b = open_.get(key)
            if b is None or b[1] + nb > self.bucket_bytes and b[0]:
                b = open_[key] = ([], 0)
                out.append(b[0])
            b[0].append(p)
            open_[key] = (b[0], b[1] + nb)
        return out

    def sync_gradients(self, root: Tensor | None = None) -> None:
        """Replace every parameter's `.grad` by its mean over the group (lazily: one all_reduce
        per bucket joins the graph). `root`: the tensor backward() started from; its gradients
        are then computed with it in one plan, whichever is read first."""
        if group_info(self.group).size == 1:
            return
        params = []
        for bucket in self.buckets():
            grads = [p.grad for p in bucket]
            flat = grads[0].reshape(-1) if len(grads) == 1 else \
                cat([g.reshape(-1) for g in grads])
            red = all_reduce(flat, "avg", self.group)
            off = 0
            for p in bucket:
                n = p.numel()
                p.grad = red[off:off + n].reshape(p.shape)
                off += n
            params += bucket
        if root is not None and params:
            group_gradients(root, params)

    def backward(self, loss: Tensor) -> None:
        """`loss.backward()` then `sync_gradients`: `.grad` holds the gradient of the mean of
        the processes' losses (of the whole batch's mean loss, for equal shards). To
        accumulate over micro-batches, call `loss.backward()` on all but the last."""
        loss.backward()
        self.sync_gradients(loss)

    def average(self, t: Tensor) -> Tensor:
        """The mean of `t` over the group (e.g. the shards' losses: the whole batch's loss)."""
        return all_reduce(t, "avg", self.group) if group_info(self.group).size > 1 else t

    # ---- batches and steps ---------------------------------------------------------------------
    def shard_batch(self, *batch, axis: int = 0):
        """This process's block of each of `batch` (arrays or tensors holding the whole batch,
        the same on every process) along `axis`, as new leaf tensors (arrays go to the
        model's device). The batch size must be divisible by the group size (equal shards
        keep the mean loss exact)."""
        g = group_info(self.group)
        out = []
        for x in batch:
            shape = tuple(x.shape) if isinstance(x, Tensor) else np.shape(x)
            if not -len(shape) <= axis < len(shape) or shape[axis] % g.size:
                raise FuelGraphError(f"DataParallel.shard_batch: batch of shape {shape}: axis "
                                     f"{axis} is missing or not divisible by {g.size} processes")
            n = shape[axis] // g.size
            idx = (slice(None),) * (axis % len(shape)) + (slice(g.rank * n, (g.rank + 1) * n),)
            if isinstance(x, Tensor):
                out.append(realize([x[idx]])[0])     # a leaf on x's device
            else:
                dev = next((p.device for p in self.module.parameters()), "cpu")
                out.append(tensor(np.ascontiguousarray(np.asarray(x)[idx]), device=dev))
        return out[0] if len(out) == 1 else tuple(out)

    def train_step(self, loss_fn, optimizer, traced: bool = True):
        """A training step on this process's shard: `loss = loss_fn(*shard)` (its mean loss),
        gradients averaged over the group in buckets while the backward runs, one optimizer
        step, gradients cleared. Returns the loss averaged over the group (for equal shards,
        the whole batch's mean loss, as one process computing the whole batch would report).
        Traced with fuelgraph.jit unless traced=False."""
        def step(*shard):
            loss = loss_fn(*shard)
            self.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            return self.average(loss.detach())
        step.__name__ = "data_parallel_step"
        return jit(step) if traced else step
