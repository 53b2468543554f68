"""fuelgraph: a lazy tensor graph whose fused operations live in an open registry.

    import fuelgraph as fg, fuelgraph.functional as F
    x = fg.tensor(np.random.randn(4, 8), requires_grad=True)
    y = F.softmax_last_dim(x)          # or write softmax in primitives: it fuses
    y.sum().backward(); x.grad.numpy()
"""
from .dtype import (DType, bfloat16, bool_, float16, float32, float64, int32, int64, uint8,
                    uint32)
from .errors import FuelGraphError
from .ir.tensor import (Tensor, arange, broadcast_tensors, cat, const, full, iota, matmul, ones,
                        ones_like, stack, where, zeros, zeros_like)
from .api import tensor
from .autograd import grad
from .backends import available_backends
from .backends.base import kernel
from .interop import from_dlpack, from_torch
from .ir.scan import scan
from .registry.core import FusedOpId, FusedOps, default_registry
from .explain import explain, plan_report
from .runtime.executor import realize
from .opt.passes import optimize

bool = bool_  # noqa: A001  (fg.bool, as in torch)
__version__ = "0.1.0"

__all__ = ["DType", "bfloat16", "bool", "float16", "float32", "float64", "int32", "int64", "uint8",
           "uint32", "FuelGraphError", "Tensor", "arange", "broadcast_tensors", "cat", "const",
           "full", "iota", "matmul", "ones", "ones_like", "stack", "tensor", "where", "zeros",
           "zeros_like", "grad", "available_backends", "kernel", "from_dlpack", "from_torch", "scan", "FusedOpId", "FusedOps", "default_registry", "explain", "plan_report",
           "realize", "optimize"]
