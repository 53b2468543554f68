"""Backends: `numpy` (CPU, always available, the reference) and `cuda` (torch + triton)."""
from __future__ import annotations

from ..errors import FuelGraphError

_LOADED: dict[str, object] = {}


def backend_name(device: str) -> str:
    return "numpy" if device == "cpu" else "cuda"


def get_backend_by_name(name: str):
    if name not in _LOADED:
        if name == "numpy":
            from .numpy import NumpyBackend
            _LOADED[name] = NumpyBackend()
        elif name == "cuda":
            from .cuda import CudaBackend, cuda_unavailable_reason
            why = cuda_unavailable_reason()
            if why:
                raise FuelGraphError(f"backend cuda is unavailable: {why}")
            _LOADED[name] = CudaBackend()
        else:
            raise FuelGraphError(f"unknown backend {name!r}; expected 'numpy' or 'cuda'")
    return _LOADED[name]


def get_backend(device: str):
    return get_backend_by_name(backend_name(device))


def available_backends() -> dict[str, str | None]:
    """Backend name -> None when usable, else the reason it is not."""
    from .cuda import cuda_unavailable_reason
    return {"numpy": None, "cuda": cuda_unavailable_reason()}
