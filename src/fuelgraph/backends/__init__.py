"""Backends: `numpy` (CPU, always available, the reference) and `cuda` (torch + triton)."""
from __future__ import annotations

import math
import threading

from ..errors import FuelGraphError
from ..registry.core import RUNTIME_BASE, default_registry
from .base import KERNEL_FACTORIES, KERNELS, BackendImpl, accepts, register_kernel
from .cuda import cuda_unavailable_reason
from .numpy import NumpyBackend

_LOADED: dict[str, object] = {}
_LOCK = threading.RLock()


def backend_name(device: str) -> str:
    return "numpy" if device == "cpu" else "cuda"


def get_backend_by_name(name: str):
    if name in _LOADED:
        return _LOADED[name]
    with _LOCK:          # first use from several threads: one backend, kernels registered once
        return _load(name)


def _load(name: str):
    if name not in _LOADED:
        if name == "numpy":
            _LOADED[name] = NumpyBackend()
        elif name == "cuda":
            why = cuda_unavailable_reason()
            if why:
                raise FuelGraphError(f"backend cuda is unavailable: {why}")
            from .cuda.backend import CudaBackend   # needs torch + triton (optional extra)
            _LOADED[name] = CudaBackend()
        else:
            raise FuelGraphError(f"unknown backend {name!r}; expected 'numpy' or 'cuda'")
    return _LOADED[name]


def get_backend(device: str):
    return get_backend_by_name(backend_name(device))


def available_backends() -> dict[str, str | None]:
    """Backend name -> None when usable, else the reason it is not."""
    return {"numpy": None, "cuda": cuda_unavailable_reason()}


def kernels_for(identity, backend: str) -> list[BackendImpl]:
    """Every kernel `backend` registered for `identity` (loading the backend first). A
    run-time fused op with no kernel yet gets one from its family's kernel factory, once."""
    get_backend_by_name(backend)
    ks = KERNELS.get((identity, backend))
    if ks is None and isinstance(identity, int) and identity >= RUNTIME_BASE:
        ks = _generate(identity, backend)
    return ks or []


def _generate(identity: int, backend: str) -> list[BackendImpl]:
    with _LOCK:
        if (identity, backend) not in KERNELS:
            entry = default_registry().get(identity)
            factory = KERNEL_FACTORIES.get((entry.family, backend)) if entry else None
            spec = factory(entry) if factory else None
            if spec:
                register_kernel(identity, backend, **spec)
            KERNELS.setdefault((identity, backend), [])
        return KERNELS[(identity, backend)]


def select_kernel(identity, backend: str, in_shapes, dtypes, params=None) -> BackendImpl | None:
    """Cheapest registered kernel that accepts this call, or None."""
    best, best_t = None, math.inf
    for k in kernels_for(identity, backend):
        if not accepts(k, dtypes, in_shapes, params):
            continue
        t = k.cost(in_shapes, params).time()
        if t < best_t:
            best, best_t = k, t
    return best
