"""References for the multi-process tests, computed in one process from every rank's inputs
(drawn again from the scenarios' seeds) with NumPy / torch in float64; shared by the CPU (gloo)
and GPU (NCCL) test files."""
import numpy as np
import torch

from tests.distributed import scenarios as S
from tests.oracle import assert_close_dtype

WORLD = 2
TORCH = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
         "float16": torch.float16}


def _blocks(a, axis, n):
    return np.split(a, n, axis=axis)


def _reference(case, kw, xs, ws, rank):
    """(y, x.grad) on `rank` for inputs xs and cotangents ws of every rank (float64)."""
    if case.startswith("all_reduce"):
        y = sum(xs) / (WORLD if kw["op"] == "avg" else 1)
        g = ws[rank] / (WORLD if kw["op"] == "avg" else 1)
    elif case.startswith("all_gather"):
        ax = kw["axis"] % xs[0].ndim
        y = np.concatenate(xs, ax)
        g = _blocks(ws[rank], ax, WORLD)[rank] if kw.get("grad") == "shard" else \
            sum(_blocks(w, ax, WORLD)[rank] for w in ws)
    elif case.startswith("reduce_scatter"):
        ax = kw["axis"]
        y = _blocks(sum(xs), ax, WORLD)[rank] / (WORLD if kw["op"] == "avg" else 1)
        g = np.concatenate(ws, ax) / (WORLD if kw["op"] == "avg" else 1)
    elif case.startswith("shard"):
        y = _blocks(xs[rank], kw["axis"], WORLD)[rank]
        g = np.concatenate(ws, kw["axis"])
    else:   # replicate
        y, g = xs[rank], sum(ws)
    return y, g


def _same_dtype(v64, dtype):
    """The float64 reference rounded through torch in `dtype` (the same-dtype reference of
    the 16-bit rule: one rounding, as a torch reduction of two values)."""
    return torch.tensor(np.asarray(v64)).to(TORCH[dtype]).double().numpy()


def check_collective_case(res, case, kw, shape, dtype):
    """Every rank's value and x.grad of one case of scenarios.collectives."""
    xs = [np.asarray(S.rank_input(r, shape, dtype, 1), np.float64) for r in range(WORLD)]
    for r in range(WORLD):
        y, gx, yshape = res[r][(case, dtype)]
        ws = [np.asarray(S.rank_input(q, yshape, dtype, 2), np.float64) for q in range(WORLD)]
        ry, rg = _reference(case, kw, xs, ws, r)
        assert y.shape == ry.shape and gx.shape == rg.shape == xs[r].shape
        assert_close_dtype(y, ry, _same_dtype(ry, dtype), dtype)
        assert_close_dtype(gx, rg, _same_dtype(rg, dtype), dtype)


def check_chain(res):
    """scenarios.collectives' plan mixing three collectives with compute."""
    a = [torch.tensor(S.rank_input(r, (4, 6), "float32", 3), dtype=torch.float64)
         for r in range(WORLD)]
    b = sum(x * 2.0 for x in a)
    c = torch.cat([b.sum(0, keepdim=True) + 1.0] * WORLD, 0)
    for r in range(WORLD):
        d = torch.chunk(sum(c @ x.T for x in a), WORLD, 1)[r]
        for got, want in zip(res[r]["chain"], (b, c, d)):
            np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-4)
