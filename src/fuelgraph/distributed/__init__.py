"""Training and inference over several processes (one per GPU, or several CPU processes), on
torch.distributed's process groups: launch with `torchrun --nproc_per_node N script.py` and
call `init()` first.

* Collectives as graph ops (`fuelgraph.functional.all_reduce`, `all_gather`,
  `reduce_scatter`, `shard`, `replicate`; also re-exported here): they are scheduled with the
  rest of the plan, in the same order on every process, and overlap with compute.
* `DataParallel`: each process computes on its shard of the batch; gradients are averaged in
  buckets while the backward runs.
* Tensor parallelism (Megatron style): `ColumnParallelLinear`, `RowParallelLinear`,
  `parallelize(model, plan)` (turns a model's Linear layers into parallel ones and divides
  its attention heads; `llama_plan()` for fuelgraph.models' Llama) and
  `load_sharded(model, checkpoint)` (each process reads only its slices of a full checkpoint).

    import fuelgraph.distributed as dist
    dist.init()                            # rank, world size, device from torchrun's env
    model = build().to(dist.device())
"""
from ..registry.collective import (ProcessGroup, all_gather, all_reduce, group_info,
                                   reduce_scatter, replicate, shard)
from .data_parallel import DataParallel
from .env import (barrier, broadcast_, destroy, device, init, is_initialized, local_rank,
                  new_group, rank, world_size)
from .tensor_parallel import (Column, ColumnParallelLinear, Heads, Row, RowParallelLinear,
                              llama_plan, load_sharded, parallelize)

__all__ = ["ProcessGroup", "all_gather", "all_reduce", "group_info", "reduce_scatter",
           "replicate", "shard", "DataParallel", "barrier", "broadcast_", "destroy", "device",
           "init", "is_initialized", "local_rank", "new_group", "rank", "world_size", "Column",
           "ColumnParallelLinear", "Heads", "Row", "RowParallelLinear", "llama_plan",
           "load_sharded", "parallelize"]
