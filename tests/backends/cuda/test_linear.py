"""FUSED_LINEAR on the CUDA backend (cuBLAS through torch, backends/cuda/kernels/linear.py),
through fuelgraph on device="cuda" against torch. There is no Triton kernel to test in the
interpreter: the module needs a GPU."""
from __future__ import annotations

import pytest

from .cuda_oracle import DT, F64, ON_GPU, close, np_rand, on, torch

pytestmark = ON_GPU

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402


@pytest.mark.parametrize("dtype", list(DT))
def test_fused_linear_vs_torch(dtype):
    tol = DT[dtype][2]
    x, xt = on(np_rand((64, 96)), dtype)
    w, wt = on(np_rand((96, 32), 3), dtype)
    bias, bt = on(np_rand((32,), 4), dtype)
    close(F.fused_linear(x, w, bias).numpy(), torch.addmm(bt.float(), xt.float(), wt.float()),
          tol * 4)


def test_fused_linear_batched_float64():
    """cuBLAS takes float64 too: batched b broadcasts like torch.matmul."""
    a = torch.randn(2, 1, 5, 8, dtype=F64, device="cuda")
    b = torch.randn(3, 8, 4, dtype=F64, device="cuda")
    bias = torch.randn(4, dtype=F64, device="cuda")
    y = F.fused_linear(fg.from_torch(a), fg.from_torch(b), fg.from_torch(bias))
    assert fg.explain(y).fused_ops == {"fused_linear": 1}
    torch.testing.assert_close(y.to_torch(), a @ b + bias, rtol=1e-12, atol=1e-12)
