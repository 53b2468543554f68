"""Seeded random numbers: `fg.manual_seed`, `fg.rand`, `fg.randn`, `fg.randint`, `fg.dropout`.

Counter-based: the value at position i of a call is a hash of (seed, offset + i), computed on
the device by integer primitives, so no random state lives on the host and results do not
depend on the backend (the NumPy and CUDA backends give the same numbers) nor on how a graph is
fused. The generator's state (seed, offset) is a small tensor per device; each call reads it
and advances the offset by the numbers it drew. That makes random calls ordinary graph inputs:
a traced step (fuelgraph.jit) draws new numbers on every replay without tracing again."""
from __future__ import annotations

import math

import numpy as np

from . import dtype as dt
from .api import assign, bind_buffer
from .backends import get_backend
from .errors import FuelGraphError
from .ir.tensor import TRACE, Tensor, _leaf, _normalize_device, const, iota, where

_M32 = 0xFFFFFFFF
_DEFAULT_SEED = 0x5EED


class Generator:
    """Seed plus a per-device (seed, offset) int64 state tensor."""

    def __init__(self, seed: int = _DEFAULT_SEED):
        self.seed = int(seed)
        self.states: dict[str, Tensor] = {}

    def manual_seed(self, seed: int) -> "Generator":
        self.seed = int(seed) & ((1 << 63) - 1)
        for dev, st in self.states.items():
            bind_buffer(st, _state_buffer(self.seed, 0, dev))
        return self

    def state(self, device: str) -> Tensor:
        st = self.states.get(device)
        if st is None:
            # a leaf on its own device: a CPU node bound to a GPU buffer would mix devices
            st = Tensor(_leaf(_state_buffer(self.seed, 0, device), dt.int64, device, False).value)
            self.states[device] = st
        return st

    def draw(self, n: int, device: str) -> Tensor:
        """n uint32 hashes (as int64 in [0, 2^32)) and the state advanced past them."""
        st = self.state(device)
        seed, off = st[0], st[1]
        ctr = iota(n, dt.int64, device) + off
        lo, hi = ctr & _M32, (ctr >> 32) & _M32
        key = _mix((seed & _M32) ^ _mix(((seed >> 32) & _M32) ^ (hi * 0x9E3779B1 & _M32)))
        h = _mix(_mix(lo ^ key ^ 0x2545F491) ^ (key >> 3))
        nxt = st + const(np.array([0, n], np.int64), device)
        if TRACE[0] is not None:
            assign(st, nxt)
        else:
            bind_buffer(st, _state_buffer(self.seed, None, device, nxt))
        return h


def _state_buffer(seed, offset, device, nxt=None):
    be = get_backend(device)
    if nxt is not None:
        from .runtime.executor import realize_raw
        return be.copy(realize_raw([nxt])[0])
    return be.from_any(np.array([seed, offset], np.int64), device)


def _mix(h: Tensor) -> Tensor:
    """A 32-bit avalanche mix (xor-shift-multiply rounds), on int64 values in [0, 2^32)."""
    h = h ^ (h >> 16)
    h = (h * 0x7FEB352D) & _M32
    h = h ^ (h >> 15)
    h = (h * 0x846CA68B) & _M32
    return h ^ (h >> 16)


_GEN = Generator()


def default_generator() -> Generator:
    return _GEN


def manual_seed(seed: int) -> Generator:
    """Seed the default generator (every device): the same seed gives the same numbers."""
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise FuelGraphError(f"manual_seed: seed must be an int, got {seed!r}")
    return _GEN.manual_seed(int(seed))


def _shape(size) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    try:
        return tuple(int(s) for s in size)
    except (TypeError, ValueError):
        raise FuelGraphError(f"random: size must be integers, got {size!r}") from None


def _uniform_bits(shape, device, generator):
    g = generator or _GEN
    n = math.prod(shape)
    return g.draw(max(n, 1), device)[:n].reshape(shape)


def rand(*size, dtype=dt.float32, device="cpu", generator=None) -> Tensor:
    """Uniform numbers in [0, 1) (24 random bits each), of shape `size`."""
    shape, device = _shape(size), _normalize_device(device)
    d = dt.as_dtype(dtype)
    if not d.is_float:
        raise FuelGraphError(f"rand: dtype must be a float dtype, got {d.name}")
    bits = _uniform_bits(shape, device, generator)
    return ((bits >> 8).astype(dt.float32) * (1.0 / (1 << 24))).astype(d)


def randn(*size, dtype=dt.float32, device="cpu", generator=None) -> Tensor:
    """Standard normal numbers (Box-Muller on two 24-bit uniforms), of shape `size`."""
    shape, device = _shape(size), _normalize_device(device)
    d = dt.as_dtype(dtype)
    if not d.is_float:
        raise FuelGraphError(f"randn: dtype must be a float dtype, got {d.name}")
    n = math.prod(shape)
    bits = (generator or _GEN).draw(2 * max(n, 1), device).reshape(max(n, 1), 2)[:n]
    u1 = ((bits[:, 0] >> 8) + 1).astype(dt.float32) * (1.0 / (1 << 24))   # (0, 1]
    u2 = (bits[:, 1] >> 8).astype(dt.float32) * (1.0 / (1 << 24))
    z = (u1.log() * -2.0).sqrt() * (u2 * (2.0 * math.pi)).cos()
    return z.reshape(shape).astype(d)


def randint(low, high=None, size=(), dtype=dt.int64, device="cpu", generator=None) -> Tensor:
    """Integers uniform in [low, high) (torch's argument order; `randint(high, size)` too)."""
    if high is None:
        low, high = 0, low
    if high <= low:
        raise FuelGraphError(f"randint: empty range [{low}, {high})")
    shape, device = _shape((size,)), _normalize_device(device)
    bits = _uniform_bits(shape, device, generator)
    span = int(high) - int(low)
    if span <= (1 << 32):
        v = (bits * span) >> 32
    else:
        v = bits % span
    return (v + int(low)).astype(dtype)


def rand_like(t: Tensor, dtype=None) -> Tensor:
    return rand(t.shape, dtype=dtype or t.dtype, device=t.device)


def randn_like(t: Tensor, dtype=None) -> Tensor:
    return randn(t.shape, dtype=dtype or t.dtype, device=t.device)


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Zero each element with probability p and scale the rest by 1/(1-p) (identity when not
    training or p == 0)."""
    if not 0.0 <= p <= 1.0:
        raise FuelGraphError(f"dropout: p must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:
        return x * 0.0
    keep = rand(x.shape, device=x.device) >= p
    return where(keep, x * (1.0 / (1.0 - p)), 0.0)


def _uniform_(self, a=0.0, b=1.0):
    return self._inplace(rand(self.shape, dtype=self.dtype, device=self.device) * (b - a) + a)


def _normal_(self, mean=0.0, std=1.0):
    return self._inplace(randn(self.shape, dtype=self.dtype, device=self.device) * std + mean)


Tensor.uniform_ = _uniform_
Tensor.normal_ = _normal_
