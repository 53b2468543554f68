"""Running multi-process scenarios from a test: `world` worker processes started as torchrun
starts them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT on a free local port), on
the CPU with gloo, each running the named scenarios of tests/distributed/scenarios.py and
pickling its results. The whole set runs once per pytest process (about ten seconds on two
shared cores) and every test file reads its part; a hung run is killed after `timeout` s."""
from __future__ import annotations

import functools
import os
import pickle
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ALL = {"cpu": ("collectives", "numpy_kernels", "schedule", "data_parallel", "tensor_parallel",
               "tensor_parallel_llama"),
       "cuda": ("collectives", "cuda_kernels", "schedule", "data_parallel", "tensor_parallel",
                "tensor_parallel_llama")}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_workers(scenarios, world: int = 2, timeout: float = 300.0, device: str = "cpu") \
        -> list[dict]:
    """Each rank's {scenario: result} (a scenario that raised gives {"error": traceback}).
    device "cuda": one GPU per process (cuda:LOCAL_RANK) and NCCL, NVLink multicast off."""
    for attempt in range(2):                     # a port taken between probe and bind: retry
        with tempfile.TemporaryDirectory() as tmp:
            port = free_port()
            procs = []
            for r in range(world):
                env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(world), LOCAL_RANK=str(r),
                           LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                           FUELGRAPH_NUM_THREADS="1", FUELGRAPH_CHECK_COLLECTIVES="1",
                           FG_TEST_DEVICE=device, NCCL_NVLS_ENABLE="0",
                           PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT)]))
                if device == "cpu":
                    env["CUDA_VISIBLE_DEVICES"] = ""
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "tests.distributed.worker", tmp, *scenarios],
                    cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
            logs = []
            try:
                for p in procs:
                    out, _ = p.communicate(timeout=timeout)
                    logs.append(out.decode(errors="replace"))
            except subprocess.TimeoutExpired:
                for p in procs:
                    p.kill()
                tails = [(p.communicate()[0] or b"").decode(errors="replace")[-3000:]
                         for p in procs]
                raise RuntimeError(f"distributed workers timed out after {timeout}s:\n"
                                   + "\n----\n".join(tails))
            if all(p.returncode == 0 for p in procs):
                res = []
                for r in range(world):
                    with open(Path(tmp) / f"rank{r}.pkl", "rb") as f:
                        res.append(pickle.load(f))
                return res
            text = "\n----\n".join(l[-4000:] for l in logs)
            if attempt == 0 and "ddress already in use" in text:
                continue
            raise RuntimeError(f"distributed workers failed (exit codes "
                               f"{[p.returncode for p in procs]}):\n{text}")
    raise AssertionError("unreachable")


@functools.lru_cache(maxsize=None)
def all_results(world: int = 2, device: str = "cpu") -> tuple:
    return tuple(run_workers(ALL[device], world, device=device))


def results(scenario: str, world: int = 2, device: str = "cpu") -> list:
    """Every rank's result of `scenario` (raising with the worker's traceback if it failed)."""
    out = []
    for r, per in enumerate(all_results(world, device)):
        v = per[scenario]
        if isinstance(v, dict) and "error" in v:
            raise AssertionError(f"scenario {scenario} failed on rank {r}:\n{v['error']}")
        out.append(v)
    return out
