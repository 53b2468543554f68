"""Real models written with fuelgraph tensors, and their loaders.

    import fuelgraph.models as M
    model = M.from_pretrained("dir")      # a Hugging Face checkpoint: config.json + safetensors
    model = M.from_gguf("model.gguf")     # a llama.cpp GGUF file of a Llama (kept quantized)
    logits = model(ids)                   # [B, S, V]
    ids_out = model.generate(ids, max_new_tokens=16)

Architectures: LlamaForCausalLM (llama.py), Mamba2ForCausalLM (mamba2.py); a ResNet-style CNN
(resnet.py) for images."""
from __future__ import annotations

from ..errors import FuelGraphError
from .config import (init_random, load_safetensors, read_config, resolve_dtype,
                     save_pretrained)
from .gguf_llama import from_gguf
from .llama import LlamaConfig, LlamaForCausalLM
from .mamba2 import Mamba2Config, Mamba2ForCausalLM
from .resnet import BasicBlock, BatchNorm2d, ResNet

ARCHITECTURES = {"LlamaForCausalLM": (LlamaConfig, LlamaForCausalLM),
                 "Mamba2ForCausalLM": (Mamba2Config, Mamba2ForCausalLM)}


def from_pretrained(directory, dtype=None, device: str = "cpu"):
    """The model of a Hugging Face checkpoint directory: `config.json` names the architecture
    (LlamaForCausalLM or Mamba2ForCausalLM) and its sizes; the weights come from
    `model.safetensors` (or the shards of `model.safetensors.index.json`), read with the
    safetensors package. dtype None: float32; "auto": the checkpoint's dtype; or a fuelgraph
    dtype. Returns the model in eval mode (call `.train()` to train it)."""
    cfg = read_config(directory)
    arch = (cfg.get("architectures") or [None])[0]
    if arch not in ARCHITECTURES:
        raise FuelGraphError(f"from_pretrained: architecture {arch!r} of {directory} is not "
                             f"supported (one of {sorted(ARCHITECTURES)})")
    config_cls, model_cls = ARCHITECTURES[arch]
    model = model_cls(config_cls.from_hf(cfg), dtype=resolve_dtype(dtype, cfg), device=device)
    model.load_hf_state(load_safetensors(directory))
    return model.eval()


__all__ = ["from_pretrained", "from_gguf", "save_pretrained", "init_random", "LlamaConfig",
           "LlamaForCausalLM", "Mamba2Config",
           "Mamba2ForCausalLM", "BasicBlock", "BatchNorm2d", "ResNet", "ARCHITECTURES"]
