"""Checkpoints as safetensors files: `fg.save(state, path)` / `fg.load(path)`.

The file is plain safetensors (readable by `safetensors.torch.load_file` and every other
safetensors reader): one entry per tensor, dtype and shape kept (bfloat16 included). A nested
state (an optimizer's `state_dict()`, a dict holding a model's and an optimizer's) is stored
with dotted keys; its structure and non-tensor values (ints, floats, strings, lists, None) go
into the file's metadata as JSON, so `load` gives back the same nesting. A missing, truncated
or malformed file raises FuelGraphError."""
from __future__ import annotations

import json
import os

import numpy as np

from . import dtype as dt
from .errors import FuelGraphError
from .ir.tensor import Tensor, _leaf
from .ir.tensor import tensor as _tensor

_CODES = {dt.float32: "F32", dt.float64: "F64", dt.bfloat16: "BF16", dt.float16: "F16",
          dt.int64: "I64", dt.int32: "I32", dt.uint8: "U8", dt.uint32: "U32", dt.bool_: "BOOL"}
_FROM_CODE = {v: k for k, v in _CODES.items()}
_META_KEY = "fuelgraph.structure"


def _safetensors():
    try:
        import safetensors
        return safetensors
    except ImportError:
        raise FuelGraphError("save/load: the safetensors package is not installed "
                             "(pip install safetensors)") from None


def _host(v) -> tuple[np.ndarray, dt.DType]:
    if isinstance(v, Tensor):
        return np.asarray(v.numpy(), order="C"), v.dtype
    if type(v).__module__.startswith("torch"):
        t = _tensor(v)
        return np.asarray(t.numpy(), order="C"), t.dtype
    a = np.asarray(v, order="C")
    return a, dt.as_dtype(a.dtype)


def _split(obj, prefix, tensors, path=""):
    """(structure, tensors): tensors collected under dotted keys; the structure mirrors obj
    with {"__tensor__": key} in their place."""
    if isinstance(obj, (Tensor, np.ndarray)) or type(obj).__module__.startswith("torch"):
        key = path or "tensor"
        if key in tensors:
            raise FuelGraphError(f"save: two tensors map to the key {key!r}")
        tensors[key] = obj
        return {"__tensor__": key}
    if isinstance(obj, dict):
        out = {}
        for k, v in obj.items():
            sk = str(k)
            out[sk] = _split(v, prefix, tensors, f"{path}.{sk}" if path else sk)
        return {"__dict__": out, "__intkeys__": [str(k) for k in obj if isinstance(k, int)]}
    if isinstance(obj, (list, tuple)):
        return {"__list__": [_split(v, prefix, tensors, f"{path}.{i}" if path else str(i))
                             for i, v in enumerate(obj)], "__tuple__": isinstance(obj, tuple)}
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, np.generic):
        return obj.item()
    raise FuelGraphError(f"save: cannot store a {type(obj).__name__} (tensors, arrays, dicts, "
                         f"lists and Python scalars only)")


def _join(st, tensors):
    if isinstance(st, dict):
        if "__tensor__" in st:
            return tensors[st["__tensor__"]]
        if "__dict__" in st:
            ints = set(st.get("__intkeys__", ()))
            return {(int(k) if k in ints else k): _join(v, tensors)
                    for k, v in st["__dict__"].items()}
        if "__list__" in st:
            items = [_join(v, tensors) for v in st["__list__"]]
            return tuple(items) if st.get("__tuple__") else items
    return st


def save(state, path, metadata: dict | None = None) -> None:
    """Write `state` (a dict of tensors, e.g. `model.state_dict()`, possibly nested with
    Python values) to the safetensors file `path`. Tensors are copied to the host."""
    st = _safetensors()
    if not isinstance(state, dict):
        raise FuelGraphError(f"save: state must be a dict, got {type(state).__name__}")
    tensors: dict = {}
    structure = _split(state, "", tensors)
    flat = all(isinstance(v, dict) and "__tensor__" in v and v["__tensor__"] == k
               for k, v in structure["__dict__"].items())
    entries, keep = {}, []
    spec = getattr(st, "TensorSpec", None)     # safetensors >= 0.7 takes buffer specs
    for k, v in tensors.items():
        a, d = _host(v)
        if d not in _CODES:
            raise FuelGraphError(f"save: {k}: dtype {d.name} cannot be stored")
        if spec is not None:
            a = np.asarray(a, order="C")
            keep.append(a)
            entries[k] = spec(dtype=d.name, shape=list(a.shape), data_ptr=a.ctypes.data,
                              data_len=a.nbytes)
        else:
            entries[k] = {"dtype": _CODES[d], "shape": list(a.shape), "data": a.tobytes()}
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    if not flat:
        meta[_META_KEY] = json.dumps(structure)
    try:
        st.serialize_file(entries, os.fspath(path), metadata=meta or None)
    except Exception as e:
        raise FuelGraphError(f"save: could not write {path}: {e}") from None
    del keep


def load(path, device: str = "cpu") -> dict:
    """Read a safetensors file written by `save` (or by any safetensors writer) -> the state
    as saved (a dict of tensors, nested as it was), tensors on `device`."""
    st = _safetensors()
    p = os.fspath(path)
    if not os.path.exists(p):
        raise FuelGraphError(f"load: no such file {p}")
    try:
        with st.safe_open(p, framework="numpy") as f:
            meta = f.metadata() or {}
            keys = list(f.keys())
        raw = _read_raw(p)
    except FuelGraphError:
        raise
    except Exception as e:
        raise FuelGraphError(f"load: {p} is not a valid safetensors file ({e})") from None
    tensors = {}
    for k in keys:
        code, shape, data = raw[k]
        d = _FROM_CODE.get(code)
        if d is None:
            raise FuelGraphError(f"load: {k} has dtype {code}, which fuelgraph does not support")
        a = np.frombuffer(data, dtype=d.np).reshape(shape).copy()
        t = _leaf(a, d, "cpu", False)
        tensors[k] = t if device == "cpu" else t.to(device)
    if _META_KEY in meta:
        try:
            return _join(json.loads(meta[_META_KEY]), tensors)
        except (ValueError, KeyError) as e:
            raise FuelGraphError(f"load: {p} has a malformed structure record ({e})") from None
    return tensors


def _read_raw(path) -> dict:
    """{key: (dtype code, shape, bytes)} from the file's header and data section (the header
    was checked by safe_open; sizes are checked again here)."""
    with open(path, "rb") as f:
        blob = f.read()
    if len(blob) < 8:
        raise FuelGraphError(f"load: {path} is truncated")
    n = int.from_bytes(blob[:8], "little")
    if 8 + n > len(blob):
        raise FuelGraphError(f"load: {path} is truncated (header)")
    header = json.loads(blob[8:8 + n])
    base = 8 + n
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        if base + b > len(blob) or a > b:
            raise FuelGraphError(f"load: {path} is truncated (tensor {k})")
        code = v["dtype"]
        d = _FROM_CODE.get(code)
        if d is not None and (b - a) != int(np.prod(v["shape"], dtype=np.int64)) * d.itemsize:
            raise FuelGraphError(f"load: {path}: tensor {k} has {b - a} bytes for shape "
                                 f"{v['shape']} {code}")
        out[k] = (code, v["shape"], blob[base + a: base + b])
    return out
