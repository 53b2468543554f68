"""The NumPy backend (CPU): every primitive plus a fused kernel per registered op."""
from __future__ import annotations

import inspect
import math

import numpy as np

from ...dtype import FLOATS
from ..base import Cost, elementwise_cost, register_kernel
from . import primitives


def _row_cost(flops_per_elem):
    def cost(shapes, params=None):
        n = sum(math.prod(s) for s in shapes)
        return Cost(flops_per_elem * n, 4 * 2 * n)
    return cost


def _matmul_cost(shapes, params=None):
    a, b = shapes[0], shapes[1]
    m = math.prod(a[:-1])
    return Cost(2 * m * a[-1] * b[-1], 4 * (math.prod(a) + math.prod(b) + m * b[-1]))


class NumpyBackend:
    """Buffers are NumPy arrays on the host."""
    name = "numpy"

    def __init__(self):
        for op_cls, fn in primitives.PRIMITIVES.items():
            cost = _matmul_cost if op_cls.__name__ == "MatMul" else elementwise_cost
            register_kernel(op_cls.__name__, "numpy", fn, cost=cost, strided_input=True,
                            name=f"numpy.{fn.__name__}")
        for op_id, fn, flops in _fused_kernels():
            op_id = ("fused", op_id) if isinstance(op_id, str) else op_id
            cost = flops if callable(flops) else _row_cost(flops)   # a Cost function, or
            register_kernel(op_id, "numpy", fn, dtypes=None, cost=cost,   # flops per element
                            name=f"numpy.{fn.__name__}",
                            takes_out="out" in inspect.signature(fn).parameters)

    @staticmethod
    def run_context():
        return np.errstate(all="ignore")

    @staticmethod
    def from_any(data, device="cpu"):
        if hasattr(data, "detach"):
            data = data.detach().cpu().numpy()
        return np.ascontiguousarray(data)

    @staticmethod
    def to_numpy(buf):
        return buf

    @staticmethod
    def contiguous(buf):
        return np.ascontiguousarray(buf)

    @staticmethod
    def writable_copy_needed(buf) -> bool:
        return not (buf.flags.writeable and buf.flags.c_contiguous)

    @staticmethod
    def empty_like(buf):
        return np.empty(buf.shape, buf.dtype)

    @staticmethod
    def copy(buf):
        return np.array(buf, copy=True, order="C")

    @staticmethod
    def is_contiguous(buf) -> bool:
        return buf.flags.c_contiguous


def _fused_kernels():
    """(fused id, kernel, flops per element) for every family that has NumPy kernels."""
    from ...registry.core import FusedOps as F
    from . import families, softmax
    return [(F.SOFTMAX_LAST_DIM, softmax.softmax_last_dim, 4),
            (F.SOFTMAX_LAST_DIM_BACKWARD, softmax.softmax_last_dim_backward, 4)] + families.KERNELS


__all__ = ["NumpyBackend", "FLOATS"]
