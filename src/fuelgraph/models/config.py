"""Reading Hugging Face `config.json` files and safetensors checkpoints (no torch needed)."""
from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .. import dtype as dt
from ..checkpoint import load
from ..errors import FuelGraphError

_DTYPES = {"float32": dt.float32, "float16": dt.float16, "bfloat16": dt.bfloat16,
           "float64": dt.float64}


def _decode(obj):
    """transformers writes non-finite floats as {"__float__": "Infinity"}; older files use the
    bare JSON token (which json reads already)."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"}:
            return float(obj["__float__"])
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def read_config(directory) -> dict:
    """config.json of a checkpoint directory as a dict."""
    p = Path(directory) / "config.json"
    if not p.is_file():
        raise FuelGraphError(f"from_pretrained: {directory} has no config.json")
    with open(p) as f:
        return _decode(json.load(f))


def resolve_dtype(dtype, cfg: dict):
    """dtype=None: float32; "auto": the checkpoint's own dtype; else a fuelgraph dtype."""
    if dtype is None:
        return dt.float32
    if isinstance(dtype, str) and dtype == "auto":
        name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        if name not in _DTYPES:
            raise FuelGraphError(f"from_pretrained: unsupported checkpoint dtype {name!r}")
        return _DTYPES[name]
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise FuelGraphError(f"from_pretrained: dtype {dtype!r} is not one of "
                                 f"{sorted(_DTYPES)} or 'auto'")
        return _DTYPES[dtype]
    return dt.as_dtype(dtype)


def load_safetensors(directory) -> dict:
    """name -> Tensor over every safetensors file of the checkpoint (a single
    model.safetensors, or the shards listed by model.safetensors.index.json)."""
    d = Path(directory)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif (d / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        files = sorted(p.name for p in d.glob("*.safetensors"))
    if not files:
        raise FuelGraphError(f"from_pretrained: no .safetensors file in {directory} (weights "
                             f"saved as pytorch_model.bin are not read: save with "
                             f"safe_serialization=True)")
    state = {}
    for name in files:
        state.update(load(os.fspath(d / name)))
    return state


def inf_or(value, default=math.inf) -> float:
    return default if value is None else float(value)


def load_into(model, state: dict, drop=()) -> None:
    """Copy a checkpoint's tensors into the model's parameters (cast to their dtype). Keys
    ending in one of `drop` are skipped (buffers a checkpoint may carry, a tied head); a
    parameter without a tensor, or a tensor without a parameter, raises FuelGraphError."""
    state = {k: v for k, v in state.items() if not k.endswith(tuple(drop))}
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise FuelGraphError(f"from_pretrained: the checkpoint does not match "
                             f"{type(model).__name__}: missing {missing[:8]}, unexpected "
                             f"{unexpected[:8]}")


def save_pretrained(model, directory) -> str:
    """Write `model` as a Hugging Face checkpoint directory: config.json (the architecture and
    its config fields) and model.safetensors (the state dict, names as transformers uses
    them), readable by `from_pretrained` here and by transformers."""
    from dataclasses import asdict
    from ..checkpoint import save
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in asdict(model.config).items() if k not in ("extra",)}
    cfg.update(model.hf_config_extra())
    cfg["architectures"] = [type(model).__name__]
    cfg["dtype"] = model.dtype.name
    with open(d / "config.json", "w") as f:
        json.dump(cfg, f, indent=2, default=lambda v: list(v) if isinstance(v, tuple) else v)
    save(dict(model.state_dict()), os.fspath(d / "model.safetensors"), metadata={"format": "pt"})
    return os.fspath(d)


def init_random(model, seed: int = 0):
    """Fill a model with random weights of sensible scale (NumPy generator `seed`): matrices
    N(0, 1/fan_in), embeddings N(0, 0.02), norm weights 1, biases 0, and for Mamba-2 the usual
    A_log = log(1..H), D = 1, dt_bias = softplus^-1 of log-uniform steps in [1e-3, 0.1].
    Returns the model."""
    import numpy as np
    rng = np.random.default_rng(seed)
    state = {}
    for name, p in model.named_parameters():
        shape, leaf = tuple(p.shape), name.rsplit(".", 1)[-1]
        if leaf == "A_log":
            a = np.log(np.arange(1, shape[0] + 1, dtype=np.float64))
        elif leaf == "D" or (leaf == "weight" and len(shape) == 1):
            a = np.ones(shape)
        elif leaf == "dt_bias":
            step = np.exp(rng.uniform(np.log(1e-3), np.log(0.1), shape))
            a = step + np.log(-np.expm1(-step))
        elif leaf == "bias":
            a = np.zeros(shape)
        elif "embed" in name:
            a = rng.standard_normal(shape) * 0.02
        else:
            fan_in = int(np.prod(shape[1:]))
            a = rng.standard_normal(shape) / np.sqrt(fan_in)
        state[name] = a.astype(np.float32)
    model.load_state_dict(state, strict=False)
    return model
