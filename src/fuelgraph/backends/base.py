"""One kernel table for every backend, keyed by (op identity, backend). The identity of a
primitive is its op class name ("Binary", "Reduce", ...); of a fused op, its integer id.
Each kernel declares the dtypes it takes, a cost estimate and its precision."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Cost:
    flops: float
    bytes: float

    def time(self, flops_per_s=5e10, bytes_per_s=1e10) -> float:
        return max(self.flops / flops_per_s, self.bytes / bytes_per_s)


def elementwise_cost(shapes, params=None, itemsize=4, flops_per_elem=1) -> Cost:
    n = sum(math.prod(s) for s in shapes)
    return Cost(flops_per_elem * n, itemsize * 2 * n)


@dataclass(frozen=True)
class BackendImpl:
    """kernel(*arrays, **params) -> array or tuple of arrays."""
    kernel: Callable
    dtypes: tuple | None = None            # float dtypes it takes (None: any)
    cost: Callable = elementwise_cost      # (input shapes, params) -> Cost
    precision: str = "acc(T)"              # how it accumulates, for reports
    strided_input: bool = False            # True: takes non-contiguous inputs
    takes_out: bool = False                # destructive kernels: accepts out= (a fresh buffer)
    revision: int = 1
    name: str = ""


KERNELS: dict[tuple, list[BackendImpl]] = {}


def register_kernel(identity, backend: str, kernel: Callable, **kw) -> BackendImpl:
    """identity: primitive op class name, fused id, or ("fused", registry name)."""
    impl = BackendImpl(kernel, **kw)
    if isinstance(identity, tuple):
        from ..registry.core import default_registry
        identity = default_registry().entry(identity[1]).id
    key = (int(identity) if not isinstance(identity, str) else identity, backend)
    KERNELS.setdefault(key, []).append(impl)
    return impl


def _ensure_loaded(backend: str):
    from . import get_backend_by_name
    get_backend_by_name(backend)


def kernels_for(identity, backend: str) -> list[BackendImpl]:
    _ensure_loaded(backend)
    return KERNELS.get((identity, backend), [])


def accepts(k: BackendImpl, dtypes) -> bool:
    """A kernel's dtype list constrains its float inputs (index inputs are always allowed)."""
    return k.dtypes is None or all(d in k.dtypes for d in dtypes if d.is_float)


def select_kernel(identity, backend: str, in_shapes, dtypes, params=None) -> BackendImpl | None:
    """Cheapest registered kernel that accepts these dtypes, or None."""
    best, best_t = None, math.inf
    for k in kernels_for(identity, backend):
        if not accepts(k, dtypes):
            continue
        t = k.cost(in_shapes, params).time()
        if t < best_t:
            best, best_t = k, t
    return best


def op_identity(op):
    from ..ir import ops
    return int(op.id) if isinstance(op, ops.Fused) else type(op).__name__
