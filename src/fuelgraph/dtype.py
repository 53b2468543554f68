"""Dtypes: a small closed set with NumPy (ml_dtypes for bfloat16) and torch mappings."""
from __future__ import annotations

from dataclasses import dataclass

import ml_dtypes
import numpy as np

from .errors import FuelGraphError


@dataclass(frozen=True, eq=False)
class DType:
    name: str
    itemsize: int
    kind: str  # "f" float, "i" signed int, "u" unsigned int, "b" bool

    @property
    def is_float(self) -> bool:
        return self.kind == "f"

    @property
    def is_int(self) -> bool:
        return self.kind in ("i", "u")

    @property
    def np(self) -> np.dtype:
        return _TO_NP[self]

    @property
    def acc(self) -> "DType":
        """Accumulation dtype: float32 for 16/32-bit floats, float64 for float64."""
        return float64 if self is float64 else float32 if self.is_float else self

    @property
    def torch(self):
        import torch
        return getattr(torch, self.name)

    @property
    def dtype(self) -> np.dtype:
        """The NumPy dtype (lets NumPy take a DType wherever it takes a dtype:
        `np.zeros(3, fg.float32)`, `np.dtype(fg.bfloat16)`)."""
        return _TO_NP[self]

    def __eq__(self, other) -> bool:
        """Equal to the same DType, and to the NumPy dtype or scalar type it stands for
        (`t.numpy().dtype == t.dtype`, `t.dtype == np.float32`), so that arrays and computed
        tensors compare alike. The hash is the DType's own: key dicts by DType."""
        if isinstance(other, DType):
            return self.name == other.name
        if isinstance(other, np.dtype) or (isinstance(other, type) and
                                           issubclass(other, np.generic)):
            try:
                return _TO_NP[self] == np.dtype(other)
            except TypeError:
                return False
        return NotImplemented

    def __hash__(self) -> int:
        return hash(("fuelgraph.dtype", self.name))

    def __repr__(self) -> str:
        return f"fg.{self.name}"


float32 = DType("float32", 4, "f")
float64 = DType("float64", 8, "f")
bfloat16 = DType("bfloat16", 2, "f")
float16 = DType("float16", 2, "f")
uint8 = DType("uint8", 1, "u")
uint32 = DType("uint32", 4, "u")
int32 = DType("int32", 4, "i")
int64 = DType("int64", 8, "i")
bool_ = DType("bool", 1, "b")

ALL = (float32, float64, bfloat16, float16, uint8, uint32, int32, int64, bool_)
FLOATS = (float32, float64, bfloat16, float16)
_TO_NP = {float32: np.dtype(np.float32), float64: np.dtype(np.float64),
          bfloat16: np.dtype(ml_dtypes.bfloat16), float16: np.dtype(np.float16),
          uint8: np.dtype(np.uint8), uint32: np.dtype(np.uint32), int32: np.dtype(np.int32),
          int64: np.dtype(np.int64), bool_: np.dtype(np.bool_)}
_FROM_NP = {v: k for k, v in _TO_NP.items()}
_BY_NAME = {d.name: d for d in ALL}


def as_dtype(x) -> DType:
    """Accept a DType, a name, a NumPy dtype/type or a torch dtype."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str) and x in _BY_NAME:
        return _BY_NAME[x]
    name = getattr(x, "__module__", "") == "torch" and str(x).replace("torch.", "")
    if name and name in _BY_NAME:
        return _BY_NAME[name]
    try:
        npd = np.dtype(x)
    except TypeError:
        npd = None
    if npd is not None and npd in _FROM_NP:
        return _FROM_NP[npd]
    raise FuelGraphError(f"dtype: unsupported dtype {x!r}; expected one of {[d.name for d in ALL]}")


def round_scalar(v: float, d: DType) -> float:
    """The Python float `v` as stored in float dtype `d` (e.g. 70000.0 in float16 is inf)."""
    with np.errstate(over="ignore"):
        return float(np.asarray(v, dtype=np.float64).astype(d.np))


def result_type(a: DType, b: DType) -> DType:
    """Binary promotion (JAX-like, small): equal -> same; float beats int; wider float wins;
    bfloat16 with float16 -> float32."""
    if a == b:
        return a
    if a.is_float and b.is_float:
        if {a, b} == {bfloat16, float16}:
            return float32
        return a if a.itemsize > b.itemsize else b
    if a.is_float:
        return a
    if b.is_float:
        return b
    if a is bool_:
        return b
    if b is bool_:
        return a
    npd = np.promote_types(a.np, b.np)
    return _FROM_NP.get(npd, int64)
