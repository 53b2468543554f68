"""Processes and groups: `init()` from torchrun's environment, ranks, devices, named groups,
broadcasting parameters. fuelgraph runs on torch.distributed's process groups (gloo for CPU
tensors, NCCL for CUDA tensors); nothing here is a communication engine of its own."""
from __future__ import annotations

import datetime
import os

import numpy as np

from ..api import bind_buffer
from ..backends import get_backend
from ..errors import FuelGraphError
from ..ir.tensor import Tensor
from ..registry.collective import ProcessGroup, group_info, register_group, unregister_group
from ..runtime.executor import realize_raw


def _dist():
    try:
        import torch.distributed as dist
    except ImportError:
        raise FuelGraphError("fuelgraph.distributed needs torch (pip install torch)") from None
    if not dist.is_available():
        raise FuelGraphError("fuelgraph.distributed: this torch build has no torch.distributed")
    return dist


def init(backend: str | None = None, timeout_s: float = 600.0) -> ProcessGroup:
    """Join the group of processes that torchrun started: rank, world size and the rendezvous
    address come from its environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
    MASTER_PORT). `backend` defaults to "cpu:gloo,cuda:nccl" where a GPU is visible (CPU tensors
    through gloo, CUDA tensors through NCCL, one group) and "gloo" elsewhere. On a GPU the
    current device becomes cuda:LOCAL_RANK (see `device()`). Without WORLD_SIZE in the
    environment (a plain `python script.py`) the program is one process and nothing is
    initialized. A process group the program initialized itself is adopted as it is.
    Returns the "world" group."""
    dist = _dist()
    if not dist.is_initialized():
        if "WORLD_SIZE" not in os.environ:
            return register_group("world", 1, 0, None)
        import torch
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank())
        dist.init_process_group(backend or ("cpu:gloo,cuda:nccl" if cuda else "gloo"),
                                timeout=datetime.timedelta(seconds=timeout_s))
    elif backend is not None and backend not in str(dist.get_backend()):
        raise FuelGraphError(f"distributed.init: torch.distributed is already initialized with "
                             f"backend {dist.get_backend()!r}, not {backend!r}")
    return register_group("world", dist.get_world_size(), dist.get_rank(), None)


def is_initialized() -> bool:
    """Whether this process is one of several (torch.distributed is initialized)."""
    try:
        import torch.distributed as dist
    except ImportError:
        return False
    return dist.is_available() and dist.is_initialized()


def destroy() -> None:
    """Leave the process group (torch.distributed.destroy_process_group) and forget the groups
    registered here."""
    from ..registry.collective import _GROUPS
    for name in list(_GROUPS):
        unregister_group(name)
    if is_initialized():
        _dist().destroy_process_group()


def rank(group="world") -> int:
    """This process's index in `group` (0 when there is one process)."""
    return group_info(group).rank


def world_size(group="world") -> int:
    """The number of processes in `group`."""
    return group_info(group).size


def local_rank() -> int:
    """This process's index on its machine (torchrun's LOCAL_RANK; 0 without torchrun)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def device() -> str:
    """The device this process computes on: "cuda:LOCAL_RANK" where a GPU is visible, else
    "cpu". Pass it to `fg.tensor(..., device=)` and `module.to()`."""
    try:
        import torch
    except ImportError:
        return "cpu"
    return f"cuda:{local_rank()}" if torch.cuda.is_available() else "cpu"


def new_group(ranks, name: str | None = None) -> str:
    """A group of the processes `ranks` (every process must call this, as for
    torch.distributed.new_group, in the same order). Returns its name, which the collectives
    and the parallel layers take as `group`; processes outside it get the name too but must
    not use it."""
    dist = _dist()
    ranks = sorted(int(r) for r in ranks)
    handle = dist.new_group(ranks)
    name = name or "ranks_" + "_".join(map(str, ranks))
    me = dist.get_rank()
    if me in ranks:
        register_group(name, len(ranks), ranks.index(me), handle)
    return name


def barrier(group="world") -> None:
    """Wait until every process of `group` gets here."""
    g = group_info(group)
    if g.size > 1:
        _dist().barrier(group=g.handle)


def broadcast_(tensors, src: int = 0, group="world") -> None:
    """Give every tensor in `tensors` (leaves updated in place: parameters, buffers) the value it
    has on process `src` of `group`, outside any graph (once, e.g. at start-up)."""
    g = group_info(group)
    if g.size == 1:
        return
    dist = _dist()
    src_global = src if g.handle is None else dist.get_global_rank(g.handle, src)
    for t in tensors:
        if not isinstance(t, Tensor):
            raise FuelGraphError(f"broadcast_: expected Tensors, got {type(t).__name__}")
        be = get_backend(t.device)
        buf = be.copy(realize_raw([t.detach()])[0])
        dist.broadcast(_as_torch(buf), src_global, group=g.handle)
        bind_buffer(t, buf)


def _as_torch(buf):
    """A torch tensor sharing `buf`'s memory (a contiguous NumPy array: its bytes, which gloo
    moves whatever the dtype; bfloat16 has no NumPy-native dtype torch would take)."""
    if isinstance(buf, np.ndarray):
        import torch
        return torch.from_numpy(buf.reshape(-1).view(np.uint8))
    return buf
