"""One process of a multi-process test run (started by tests/distributed/harness.py, or by
torchrun: `torchrun --nproc_per_node 2 -m tests.distributed.worker OUTDIR scenario ...`)."""
import pickle
import sys
import traceback
from pathlib import Path


def main(out_dir, *names):
    import fuelgraph.distributed as dist
    from tests.distributed import scenarios
    g = dist.init(timeout_s=120)
    res = {}
    for name in names:
        try:
            res[name] = getattr(scenarios, name)()
        except Exception:
            res[name] = {"error": traceback.format_exc()}
        dist.barrier()                   # one scenario's failure must not skew the next
    with open(Path(out_dir) / f"rank{g.rank}.pkl", "wb") as f:
        pickle.dump(res, f)
    dist.destroy()


if __name__ == "__main__":
    main(*sys.argv[1:])
