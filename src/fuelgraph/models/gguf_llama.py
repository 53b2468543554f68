"""`from_gguf`: a Llama from a llama.cpp GGUF file, its quantized weights kept as they are in
the file and multiplied through `qmatmul` (dequantized block by block inside the kernel)."""
from __future__ import annotations

from .. import dtype as dt
from ..errors import FuelGraphError
from ..gguf import QuantWeight, open_gguf
from ..ir.tensor import Tensor
from ..nn import functional as F
from ..nn.module import Buffer, Module, Parameter
from ..registry.quant import qmatmul
from .llama import LlamaConfig, LlamaForCausalLM


class QuantLinear(Module):
    """y = x @ W.T for a GGUF weight W [out, in]: quantized (`qweight`, the file's bytes, run
    through qmatmul) or float (`weight`, a Parameter)."""

    def __init__(self, cin, cout, bias, dtype, device):
        super().__init__()
        if bias:
            raise FuelGraphError("from_gguf: projections with a bias are not supported")
        self.in_features, self.out_features = cin, cout
        self.quant_type = None
        self.weight = None
        self.qweight = None

    def set(self, w, dtype, dequantize: bool):
        if isinstance(w, QuantWeight):
            if (w.n, w.k) != (self.out_features, self.in_features):
                raise FuelGraphError(f"from_gguf: weight of shape {(w.n, w.k)}, expected "
                                     f"{(self.out_features, self.in_features)}")
            if dequantize:
                self.weight = Parameter(w.dequantize().astype(dtype))
            else:
                self.quant_type = w.quant_type
                self.qweight = Buffer(w.w_bytes)
            return
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise FuelGraphError(f"from_gguf: weight of shape {tuple(w.shape)}, expected "
                                 f"{(self.out_features, self.in_features)}")
        self.weight = Parameter(w.astype(dtype))

    def forward(self, x):
        if self.qweight is None:
            return F.linear(x, self.weight)
        return qmatmul(x, self.qweight, self.quant_type, self.out_features, self.in_features)

    def extra_repr(self):
        return f"{self.in_features} -> {self.out_features}, {self.quant_type or 'float'}"


_LAYER = {"attn_norm": "input_layernorm.weight", "ffn_norm": "post_attention_layernorm.weight",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def _config(md: dict, tensors: dict) -> LlamaConfig:
    get = lambda k, d=None: md.get(f"llama.{k}", d)       # noqa: E731
    need = ["embedding_length", "block_count", "feed_forward_length", "attention.head_count"]
    missing = [k for k in need if get(k) is None]
    if missing:
        raise FuelGraphError(f"from_gguf: metadata lacks llama.{missing[0]}")
    emb = tensors.get("token_embd.weight")
    if emb is None:
        raise FuelGraphError("from_gguf: the file has no token_embd.weight")
    heads = int(get("attention.head_count"))
    scaling = ()
    if get("rope.scaling.type") == "linear":
        scaling = (("factor", float(get("rope.scaling.factor"))), ("rope_type", "linear"))
    elif get("rope.scaling.type") not in (None, "none"):
        raise FuelGraphError(f"from_gguf: rope scaling {get('rope.scaling.type')!r} is not "
                             f"supported")
    hidden = int(get("embedding_length"))
    return LlamaConfig(
        vocab_size=int(emb.shape[0]), hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads, num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("attention.key_length", hidden // heads)),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(get("rope.freq_base", 10000.0)), rope_scaling=scaling,
        tie_word_embeddings="output.weight" not in tensors, rope_interleaved=True)


def _float(w, dtype) -> Tensor:
    return (w.dequantize() if isinstance(w, QuantWeight) else w).astype(dtype)


def from_gguf(path, dtype=None, device: str = "cpu", dequantize: bool = False):
    """A LlamaForCausalLM from a GGUF file (general.architecture "llama"). Quantized matrices
    stay quantized (their bytes on `device`, multiplied through `qmatmul`); with
    dequantize=True they become float Parameters instead (the model's float twin). Norm
    weights and the token embedding are float (a quantized embedding is dequantized once).
    llama.cpp stores q/k rows in the interleaved rotary layout, so the model rotates pairs
    (2i, 2i+1). dtype: float32 by default. Returns the model in eval mode."""
    f = open_gguf(path, device)
    arch = f.metadata.get("general.architecture")
    if arch != "llama":
        raise FuelGraphError(f"from_gguf: architecture {arch!r} of {path} is not supported "
                             f"(llama)")
    dtype = dt.float32 if dtype is None else dt.as_dtype(dtype)
    cfg = _config(f.metadata, f.tensors)
    if "rope_freqs.weight" in f.tensors:
        raise FuelGraphError("from_gguf: per-frequency rope factors (rope_freqs) are not "
                             "supported")
    model = LlamaForCausalLM(cfg, dtype=dtype, device=device, linear=QuantLinear)
    layers = model.model.layers
    for name, w in f.tensors.items():
        parts = name.split(".")
        if name == "token_embd.weight":
            model.model.embed_tokens.weight.copy_(_float(w, dtype))
        elif name == "output_norm.weight":
            model.model.norm.weight.copy_(_float(w, dtype))
        elif name == "output.weight":
            model.lm_head.set(w, dtype, dequantize)
        elif parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER:
            target = layers[int(parts[1])]
            for a in _LAYER[parts[2]].split("."):
                target = getattr(target, a)
            if isinstance(target, QuantLinear):
                target.set(w, dtype, dequantize)
            else:
                target.copy_(_float(w, dtype))
    empty = [n for n, m in model.named_modules() if isinstance(m, QuantLinear) and
             m.weight is None and m.qweight is None]
    if empty:
        raise FuelGraphError(f"from_gguf: {path} has no weight for {empty[:4]}")
    return model.eval()
