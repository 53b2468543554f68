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


def _fix_interpreter_fma():
    """The interpreter's tl.fma rounds twice (x * y, then + z, in the operands' dtype); the GPU's
    is fused. Form it in float64 (a float32 product is exact there) and round once more: the
    fused result wherever the sum is representable, as the kernels that rely on it arrange."""
    try:
        import numpy as np
        from triton.runtime import interpreter as itp
    except ImportError:
        return
    builder = itp.InterpreterBuilder
    if getattr(builder.create_fma, "_fuelgraph_fixed", False):
        return

    def create_fma(self, x, y, z):
        exact = x.data.astype(np.float64) * y.data.astype(np.float64) + z.data
        return itp.TensorHandle(exact.astype(z.data.dtype), z.dtype.scalar)
    create_fma._fuelgraph_fixed = True
    builder.create_fma = create_fma


if os.environ.get("TRITON_INTERPRET", "0") == "1":
    _fix_interpreter_index()
    _fix_interpreter_fma()


@pytest.fixture(autouse=True)
def _seed(request):
    """Fresh, reproducible random draws per test."""
    try:
        import torch
    except ImportError:
        return
    torch.manual_seed(abs(hash(request.node.name)) % (2**31))
