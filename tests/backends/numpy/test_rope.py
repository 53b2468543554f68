"""NumPy ROPE kernel (backends/numpy/rope.py), both layouts, vs torch. Shape errors (odd D,
tables not [S, D]) are the registry's job (build time): tests/registry/test_rope.py::
test_validation_errors."""
import numpy as np
import pytest
import torch

from fuelgraph.backends.numpy import rope

from .kernel_oracle import DTYPES, check, rand, t64, tdt


def _torch_rope(x, cos, sin, interleaved):
    if not interleaved:
        h = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin
    xe, xo = x[..., 0::2], x[..., 1::2]
    ye = xe * cos[..., 0::2] - xo * sin[..., 0::2]
    yo = xo * cos[..., 1::2] + xe * sin[..., 1::2]
    return torch.stack([ye, yo], -1).flatten(-2)


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape", [(1, 2), (5, 8), (2, 3, 5, 8), (1, 2, 7, 64), (3, 40, 6)])
def test_rope(dt, interleaved, shape, chunking):
    rng = np.random.default_rng(5)
    x = rand(rng, shape, dt, 3.0)
    cos, sin = rand(rng, shape[-2:], dt), rand(rng, shape[-2:], dt)   # general tables
    out = rope.rope(x, cos, sin, interleaved=interleaved)
    ref = _torch_rope(t64(x), t64(cos), t64(sin), interleaved)
    same = _torch_rope(tdt(x, dt), tdt(cos, dt), tdt(sin, dt), interleaved)
    check(out, ref, dt, same)


def test_rope_empty():
    assert rope.rope(np.ones((0, 3, 4), np.float32), np.ones((3, 4), np.float32),
                     np.ones((3, 4), np.float32), interleaved=False).shape == (0, 3, 4)


@pytest.mark.parametrize("block", [16, 96])
@pytest.mark.parametrize("per_batch", [False, True])
@pytest.mark.parametrize("dt", ["float32", "bfloat16"])
def test_rope_blocks(block, per_batch, dt, monkeypatch):
    """Blocks inside a span: rows of one sequence (16 elements) or two whole sequences (96),
    with one table or a table per batch entry; large enough for the pool (two spans)."""
    from fuelgraph.backends.numpy import common
    monkeypatch.setattr(rope, "BLOCK_ELEMS", block)
    monkeypatch.setattr(common, "PARALLEL_MIN_ELEMS", 0)
    rng = np.random.default_rng(7)
    x = rand(rng, (3, 4, 5, 8), dt, 3.0)
    tshape = (3, 1, 5, 8) if per_batch else (5, 8)
    cos, sin = rand(rng, tshape, dt), rand(rng, tshape, dt)
    for interleaved in (False, True):
        out = rope.rope(x, cos, sin, interleaved=interleaved)
        ref = _torch_rope(t64(x), t64(cos), t64(sin), interleaved)
        same = _torch_rope(tdt(x, dt), tdt(cos, dt), tdt(sin, dt),
                           interleaved)
        check(out, ref, dt, same)
