"""Read `.gguf` files (llama.cpp's model format) with the `gguf` package's reader.

    from fuelgraph import gguf
    f = gguf.open_gguf("model.gguf", device="cuda")
    w = f.tensors["blk.0.attn_q.weight"]          # a QuantWeight (quantized) or a Tensor (float)
    y = w.matmul(x)                                 # = F.qmatmul(x, *w): x [..., k] -> [..., n]

Quantized tensors come as `QuantWeight(w_bytes, quant_type, n, k)`: the raw bytes as a uint8
fuelgraph tensor (copied from the memory-mapped file, unchanged) plus what `F.qmatmul` needs,
in its argument order, so `F.qmatmul(x, *w)` works. A tensor of more than two dimensions (e.g.
stacked experts [E, N, K]) is n = E * N rows of k; `shape` keeps its logical shape. Float
tensors (F32, F16, BF16, F64) come as fuelgraph tensors of their logical shape. GGUF lists
dimensions innermost first; shapes here are NumPy order (rows first, K last)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from .errors import FuelGraphError
from .ir.tensor import Tensor, tensor
from .registry.quant import dequantize_gguf, qmatmul

__all__ = ["QuantWeight", "GGUFFile", "open_gguf"]


@dataclass(frozen=True)
class QuantWeight:
    """A quantized GGUF weight W [n, k] (ggml blocks along k); iterating gives
    (w_bytes, quant_type, n, k), so `F.qmatmul(x, *w)` works. `shape` is the logical shape."""
    w_bytes: Tensor
    quant_type: str
    n: int
    k: int
    shape: tuple = ()

    def __iter__(self):
        return iter((self.w_bytes, self.quant_type, self.n, self.k))

    def matmul(self, x):
        """x [..., k] @ W.T -> [..., n] in x's dtype."""
        return qmatmul(x, self.w_bytes, self.quant_type, self.n, self.k)

    def dequantize(self):
        """float32 [n, k] (lazy; bit-exact with gguf-py)."""
        return dequantize_gguf(self.w_bytes, self.quant_type, self.n, self.k)


@dataclass
class GGUFFile:
    """A read GGUF file: `tensors` by name (QuantWeight or Tensor) and the key/value `metadata`
    (scalars, strings and lists as Python values)."""
    path: str
    tensors: dict[str, Any]
    metadata: dict[str, Any]


_FLOAT_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64,
                "BF16": ml_dtypes.bfloat16}


def _field_value(field):
    from gguf import GGUFValueType
    if not field.types:
        return None
    parts = [field.parts[i] for i in field.data]
    if field.types[0] == GGUFValueType.STRING:
        vals = [bytes(p).decode("utf-8", errors="replace") for p in parts]
    else:
        vals = [p.tolist()[0] if len(p) == 1 else p.tolist() for p in parts]
    return vals if field.types[0] == GGUFValueType.ARRAY else (vals[0] if vals else None)


def open_gguf(path, device="cpu") -> GGUFFile:
    """Read every tensor of the GGUF file at `path` onto `device` (see the module doc)."""
    try:
        from gguf import GGML_QUANT_SIZES, GGUFReader
    except ImportError:  # pragma: no cover - gguf is an optional dependency
        raise FuelGraphError("gguf: reading .gguf files needs the gguf package "
                             "(pip install gguf)") from None
    try:
        reader = GGUFReader(str(path), "r")
    except (OSError, ValueError) as e:
        raise FuelGraphError(f"gguf: cannot read {path}: {e}") from None
    tensors = {}
    for t in reader.tensors:
        kind = t.tensor_type.name
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if kind in _FLOAT_TYPES:
            data = np.asarray(t.data)
            if kind == "BF16":
                data = data.view(np.uint8).view(ml_dtypes.bfloat16)
            tensors[t.name] = tensor(np.ascontiguousarray(data).reshape(shape), device=device)
            continue
        if t.tensor_type not in GGML_QUANT_SIZES:
            raise FuelGraphError(f"gguf: tensor {t.name} has unknown type {kind}")
        k = shape[-1]
        n = math.prod(shape[:-1])
        raw = np.ascontiguousarray(np.asarray(t.data).view(np.uint8)).reshape(-1)
        tensors[t.name] = QuantWeight(tensor(raw, device=device), kind, n, k, shape)
    metadata = {name: _field_value(f) for name, f in reader.fields.items()
                if not name.startswith("GGUF.")}
    return GGUFFile(str(path), tensors, metadata)
