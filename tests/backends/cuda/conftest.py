"""Fixtures shared by the CUDA backend tests (tests/backends/cuda/test_<family>.py). Kept free
of torch/triton imports at module level, so that a machine without them still collects (and
skips) these modules cleanly."""
import pytest


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh, reproducible random draws per test."""
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(abs(hash(request.node.name)) % (2**31))
