"""Fixtures shared by the CUDA backend tests (tests/backends/cuda/test_<family>.py). Kept free
of torch/triton imports at module level, so that a machine without them still collects (and
skips) these modules cleanly."""
import os

import pytest


def _fix_interpreter_index():
    """Triton 3.6's CPU interpreter turns a scalar tensor (a loop bound read from memory or
    passed as an argument) into a Python int with int() of a 1-element array, which NumPy 2.4
    refuses; read the element instead. Interpreter runs only: compiled kernels are unaffected."""
    try:
        from triton.runtime import interpreter as itp
    except ImportError:
        return
    orig = itp._patch_lang_tensor
    if getattr(orig, "_fuelgraph_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(self.handle.data.reshape(-1)[0]))
    patched._fuelgraph_fixed = True
    itp._patch_lang_tensor = patched


if os.environ.get("TRITON_INTERPRET", "0") == "1":
    _fix_interpreter_index()


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh, reproducible random draws per test."""
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(abs(hash(request.node.name)) % (2**31))
