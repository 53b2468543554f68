"""torch.distributed calls shared by the collective kernels of every backend (NumPy arrays go
through torch CPU tensors and gloo, CUDA tensors through NCCL). Every call is asynchronous: it
returns a `Handle` that the plan waits for before the first step that reads the result.
torch is imported only when a collective runs over more than one process."""
from __future__ import annotations

from ..registry.collective import group_info


class Handle:
    """A collective in flight: `wait()` blocks until it is done (a CUDA stream wait for NCCL),
    then runs `finish` (e.g. rounding a float32 sum into a 16-bit output). Keeps the buffers
    the communication reads or writes alive until then. Waiting twice is harmless."""
    __slots__ = ("work", "finish", "keep")

    def __init__(self, work, finish=None, keep=()):
        self.work, self.finish, self.keep = work, finish, keep

    def wait(self):
        w, self.work = self.work, None
        if w is None:
            return
        w.wait()
        f, self.finish = self.finish, None
        if f is not None:
            f()
        self.keep = ()


def _dist():
    import torch.distributed as dist
    return dist


def _op(op: str):
    dist = _dist()
    return dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.AVG


def rank(group: str) -> int:
    return group_info(group).rank


def all_reduce(t, op: str, group: str):
    """Start reducing torch tensor `t` in place over `group`; returns the torch Work."""
    return _dist().all_reduce(t, op=_op(op), group=group_info(group).handle, async_op=True)


def all_gather(out, t, group: str):
    """Start gathering `t` into `out` ([world, *t.shape], rank order)."""
    return _dist().all_gather_into_tensor(out, t, group=group_info(group).handle, async_op=True)


def reduce_scatter(out, t, op: str, group: str):
    """Start reducing `t` ([world, *out.shape]) and keeping block `rank` in `out`."""
    return _dist().reduce_scatter_tensor(out, t, op=_op(op), group=group_info(group).handle,
                                         async_op=True)
