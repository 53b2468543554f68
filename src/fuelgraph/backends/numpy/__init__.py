"""The NumPy backend (CPU): every primitive plus the fused kernels that the modules of this
package declare with `@kernel(..., "numpy")` (imported here, so no list of ops exists)."""
from __future__ import annotations

import math
import os

import numpy as np

from ..base import Cost, elementwise_cost, import_kernel_modules, register_kernel
from . import common, primitives


def _matmul_cost(shapes, params=None):
    a, b = shapes[0], shapes[1]
    m = math.prod(a[:-1])
    return Cost(2 * m * a[-1] * b[-1], 4 * (math.prod(a) + math.prod(b) + m * b[-1]))


class NumpyBackend:
    """Buffers are NumPy arrays on the host."""
    name = "numpy"
    view_ops = primitives.VIEW_OPS

    def __init__(self):
        for op_cls, fn in primitives.PRIMITIVES.items():
            cost = _matmul_cost if op_cls.__name__ == "MatMul" else elementwise_cost
            register_kernel(op_cls.__name__, "numpy", fn, cost=cost, strided_input=True,
                            name=f"numpy.{fn.__name__}")
        import_kernel_modules(__name__)

    @staticmethod
    def groups_product(node) -> bool:
        """Whether the planner may run this node with other independent products in one step
        (`run_products`): large 2-D float products when the pool has threads."""
        return primitives.groupable_product(node)

    @staticmethod
    def run_products(pairs) -> list:
        """[(a, b), ...] -> [a @ b, ...] for independent products, computed together."""
        return primitives.gemm_group(pairs)

    @staticmethod
    def run_context():
        return np.errstate(all="ignore")

    @staticmethod
    def from_any(data, device="cpu"):
        if hasattr(data, "detach"):
            data = data.detach().cpu().numpy()
        return np.asarray(data, order="C")

    @staticmethod
    def to_numpy(buf):
        return buf

    @staticmethod
    def contiguous(buf):
        if buf.flags.c_contiguous:
            return buf
        out = common.new_output(buf.shape, buf.dtype)     # a kept block when large
        np.copyto(out, buf)
        return out

    @staticmethod
    def writable_copy_needed(buf) -> bool:
        return not (buf.flags.writeable and buf.flags.c_contiguous)

    @staticmethod
    def empty_like(buf):
        return common.new_output(buf.shape, buf.dtype)

    @staticmethod
    def copy(buf):
        out = common.new_output(buf.shape, buf.dtype)
        np.copyto(out, buf)
        return out

    @staticmethod
    def is_contiguous(buf) -> bool:
        return buf.flags.c_contiguous

    @staticmethod
    def storage(buf):
        """Identity of the memory `buf` views (the root of its .base chain)."""
        while isinstance(getattr(buf, "base", None), np.ndarray):
            buf = buf.base
        return id(buf)

    @staticmethod
    def storage_nbytes(buf) -> int:
        while isinstance(getattr(buf, "base", None), np.ndarray):
            buf = buf.base
        return int(buf.nbytes)

    @staticmethod
    def capacity_bytes() -> int:
        try:
            return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):   # pragma: no cover - non-POSIX
            return 1 << 40
