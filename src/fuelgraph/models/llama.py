"""A Llama-family decoder written with fuelgraph tensors: RMS norm with a weight, rotary
embeddings (rope_theta, and the linear and llama3 frequency scalings), grouped-query attention
through `flash_attn` (prefill and training) and `paged_attn` over a `PagedKVCache` (decode), a
SwiGLU MLP and a tied or separate output head. Parameter names are those of Hugging Face's
LlamaForCausalLM, so its safetensors files load as they are.

    model = fuelgraph.models.from_pretrained("path/to/llama")     # config.json + safetensors
    logits = model(ids)                                           # [B, S, V]
    loss = model(ids, labels=ids)                                 # next-token cross-entropy
    out = model.generate(ids, max_new_tokens=32)                  # NumPy [B, S + 32]
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .. import dtype as dt
from .. import functional as FF
from ..errors import FuelGraphError
from ..api import bind_buffer
from ..backends import get_backend
from ..ir.tensor import OWNER, Tensor, _leaf, arange, tensor
from ..jit import jit
from ..nn import functional as F
from ..nn.kv_cache import PagedKVCache
from ..nn.layers import Embedding, Linear
from ..nn.module import Module, ModuleList, Parameter
from ..runtime.executor import realize_raw
from .config import load_into, save_pretrained
from .generation import GenerationMixin, replay_greedy

KV_BLOCK_SIZE = 16


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of a Hugging Face Llama config.json that the model uses."""
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: tuple = ()              # sorted (key, value) pairs; () = none
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    hidden_act: str = "silu"
    rope_interleaved: bool = False        # GPT-J pairs (GGUF's q/k layout) instead of halves
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    @property
    def kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @classmethod
    def from_hf(cls, cfg: dict) -> "LlamaConfig":
        """From a config.json dict: rope parameters in either layout (transformers >= 5's
        `rope_parameters`, or `rope_theta` + `rope_scaling`)."""
        rp = dict(cfg.get("rope_parameters") or {})
        scaling = dict(cfg.get("rope_scaling") or {})
        theta = rp.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling.update(rp)
        kind = scaling.pop("rope_type", scaling.pop("type", "default"))
        if cfg.get("hidden_act", "silu") != "silu":
            raise FuelGraphError(f"llama: hidden_act {cfg.get('hidden_act')!r} is not supported "
                                 f"(silu only)")
        names = {f for f in cls.__dataclass_fields__ if f not in ("rope_scaling", "extra",
                                                                   "rope_theta")}
        kw = {k: cfg[k] for k in names if k in cfg and cfg[k] is not None}
        sc = () if kind == "default" else tuple(sorted({**scaling, "rope_type": kind}.items()))
        return cls(rope_theta=float(theta), rope_scaling=sc, **kw)


# ---- rotary embeddings ----------------------------------------------------------------------
def rope_inv_freq(cfg: LlamaConfig) -> np.ndarray:
    """Inverse frequencies [D/2] (float32, computed as transformers does), scaled by the config's
    rope_scaling: none, "linear" (divided by factor) or "llama3" (low frequencies divided by
    factor, a smooth blend between low_freq_factor and high_freq_factor)."""
    dim = cfg.dim_head
    inv = (np.float32(1.0) / (np.float32(cfg.rope_theta) **
                              (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))))
    sc = dict(cfg.rope_scaling)
    kind = sc.get("rope_type", "default")
    if kind == "default":
        return inv
    if kind == "linear":
        return (inv / np.float32(sc["factor"])).astype(np.float32)
    if kind == "llama3":
        factor, lo, hi = sc["factor"], sc["low_freq_factor"], sc["high_freq_factor"]
        old = sc["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        blended = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return np.where(medium, blended, scaled).astype(np.float32)
    raise FuelGraphError(f"llama: rope_type {kind!r} is not supported (default, linear, llama3)")


class RopeTables:
    """Host tables cos/sin [positions, D] (rotate-half layout: the D/2 angles twice), grown on
    demand; `at(start, n, dtype, device)` gives the [n, D] tensors for positions start..."""

    def __init__(self, cfg: LlamaConfig):
        self.inv = rope_inv_freq(cfg)
        self.interleaved = cfg.rope_interleaved
        self.cos = self.sin = np.zeros((0, 2 * self.inv.size), np.float32)
        self._tensors: dict = {}

    def _grow(self, n):
        n = max(n, 2 * self.cos.shape[0], 64)
        ang = np.arange(n, dtype=np.float32)[:, None] * self.inv[None, :]      # float32, as HF
        ang = np.repeat(ang, 2, -1) if self.interleaved else np.concatenate([ang, ang], -1)
        self.cos = np.cos(ang.astype(np.float64)).astype(np.float32)
        self.sin = np.sin(ang.astype(np.float64)).astype(np.float32)
        self._tensors.clear()

    def at(self, start: int, n: int, dtype, device) -> tuple[Tensor, Tensor]:
        if start + n > self.cos.shape[0]:
            self._grow(start + n)
        key = (start, n, dtype, device)
        got = self._tensors.get(key)
        if got is None:
            got = tuple(tensor(t[start:start + n], device=device).astype(dtype)
                        for t in (self.cos, self.sin))
            if len(self._tensors) > 4096:
                self._tensors.clear()
            self._tensors[key] = got
        return got


# ---- layers ---------------------------------------------------------------------------------
class LlamaRMSNorm(Module):
    """x / sqrt(mean(x^2) + eps) * weight (the norm in float32 for 16-bit x, then rounded, as
    transformers does)."""

    def __init__(self, hidden, eps, dtype=dt.float32, device="cpu"):
        super().__init__()
        self.eps = float(eps)
        self.weight = Parameter(np.ones(hidden, dtype.np))
        if device != "cpu":
            self.to(device)

    def forward(self, x):
        return F.rms_norm(x, None, self.weight, self.eps)


def _linear(cin, cout, bias, dtype, device):
    return Linear(cin, cout, bias=bias, dtype=dtype, device=device)


class LlamaAttention(Module):
    def __init__(self, cfg: LlamaConfig, dtype, device, linear=_linear):
        super().__init__()
        h, hq, hkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_heads, cfg.dim_head
        self.hq, self.hkv, self.d = hq, hkv, d
        self.scale = d ** -0.5
        self.interleaved = cfg.rope_interleaved
        b = cfg.attention_bias
        self.q_proj = linear(h, hq * d, b, dtype, device)
        self.k_proj = linear(h, hkv * d, b, dtype, device)
        self.v_proj = linear(h, hkv * d, b, dtype, device)
        self.o_proj = linear(hq * d, h, b, dtype, device)

    def forward(self, x, shape, cos, sin, kv=None, layer=0):
        """x [B*S, hidden] (the tokens of `shape` = (B, S), flattened); cos/sin [S, D] (or
        [B, 1, S, D]) for the S positions. Without `kv`: causal attention over x itself. With a
        `PagedStep`: the S new tokens' k/v go into its cache and attend what it holds (q, k and
        v by one product and q, k rotated by one rope when it has their merged weight)."""
        b, s = shape
        heads = lambda t, n: t.reshape(b, s, n, self.d).permute(0, 2, 1, 3)   # noqa: E731
        w = kv.merged(layer, "qkv", b * s) if kv is not None else None
        if w is not None:                     # [B, Hq + 2 Hkv, S, D]: q and k share the tables
            t = heads(F.linear(x, w), self.hq + 2 * self.hkv)
            qk = FF.rope(t[:, :self.hq + self.hkv], cos, sin, self.interleaved)
            q, k, v = qk[:, :self.hq], qk[:, self.hq:], t[:, self.hq + self.hkv:]
        else:
            q = FF.rope(heads(self.q_proj(x), self.hq), cos, sin, self.interleaved)
            k = FF.rope(heads(self.k_proj(x), self.hkv), cos, sin, self.interleaved)
            v = heads(self.v_proj(x), self.hkv)
        if kv is None:
            o = FF.flash_attn(q, k, v, softmax_scale=self.scale, causal=True)
        else:
            o = kv.attend(layer, q, k, v, self.scale)
        return self.o_proj(o.permute(0, 2, 1, 3).reshape(b * s, self.hq * self.d))


class LlamaMLP(Module):
    def __init__(self, cfg: LlamaConfig, dtype, device, linear=_linear):
        super().__init__()
        h, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = linear(h, f, b, dtype, device)
        self.up_proj = linear(h, f, b, dtype, device)
        self.down_proj = linear(f, h, b, dtype, device)

    def forward(self, x, kv=None, layer=0):
        """x [N, hidden] -> [N, hidden]; with a `PagedStep` holding this layer's merged
        gate/up weight, both projections are one product."""
        w = kv.merged(layer, "gate_up", x.shape[0]) if kv is not None else None
        if w is not None:
            f = w.shape[0] // 2
            gu = F.linear(x, w)
            return self.down_proj(F.silu(gu[:, :f]) * gu[:, f:])
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(Module):
    def __init__(self, cfg: LlamaConfig, dtype, device, linear=_linear):
        super().__init__()
        self.self_attn = LlamaAttention(cfg, dtype, device, linear)
        self.mlp = LlamaMLP(cfg, dtype, device, linear)
        self.input_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype,
                                                     device)

    def forward(self, x, shape, cos, sin, kv=None, layer=0):
        x = x + self.self_attn(self.input_layernorm(x), shape, cos, sin, kv, layer)
        return x + self.mlp(self.post_attention_layernorm(x), kv, layer)


class LlamaModel(Module):
    def __init__(self, cfg: LlamaConfig, dtype, device, linear=_linear):
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = ModuleList([LlamaDecoderLayer(cfg, dtype, device, linear)
                                  for _ in range(cfg.num_hidden_layers)])
        self.norm = LlamaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)

    def forward(self, ids, cos, sin, kv=None):
        """ids [B, S] -> final hidden states [B*S, hidden]. The residual stream is kept as rows
        (one GEMM per projection, no reshapes around it). kv: a `PagedStep` (decoding)."""
        x = self.embed_tokens(ids.reshape(-1))
        if kv is not None and kv.fuse_add_norm and self.layers:
            return self._fused_residual(x, tuple(ids.shape), cos, sin, kv)
        for i, layer in enumerate(self.layers):
            x = layer(x, tuple(ids.shape), cos, sin, kv, i)
        return self.norm(x)

    def _fused_residual(self, x, shape, cos, sin, kv):
        """The same layers with each residual add and the norm after it as one `add_rms_norm`
        (x: the residual stream, y: the normed input of the next block)."""
        y = self.layers[0].input_layernorm(x)
        norms = [m for layer in self.layers for m in (layer.post_attention_layernorm,
                                                      layer.input_layernorm)][1:] + [self.norm]
        for i, layer in enumerate(self.layers):
            a = layer.self_attn(y, shape, cos, sin, kv, i)
            x, y = FF.add_rms_norm(x, a, norms[2 * i].weight, norms[2 * i].eps)
            x, y = FF.add_rms_norm(x, layer.mlp(y, kv, i), norms[2 * i + 1].weight,
                                   norms[2 * i + 1].eps)
        return y


class LlamaForCausalLM(GenerationMixin, Module):
    """Llama decoder + output head. `model(input_ids)` -> logits [B, S, V];
    `model(input_ids, labels=labels)` -> the mean next-token cross-entropy (labels shifted by one
    inside, -100 ignored, as transformers does); `generate` decodes with a paged KV cache."""

    def __init__(self, cfg: LlamaConfig, dtype=dt.float32, device="cpu", linear=_linear):
        """`linear(in, out, bias, dtype, device)` builds each projection and the head (an
        nn.Linear by default; GGUF models pass quantized ones)."""
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, dtype, device, linear)
        if not cfg.tie_word_embeddings:
            self.lm_head = linear(cfg.hidden_size, cfg.vocab_size, False, dtype, device)
        self.rope = RopeTables(cfg)

    @property
    def dtype(self):
        return self.model.norm.weight.dtype

    @property
    def device(self):
        return self.model.norm.weight.device

    def head(self, h):
        """Logits of final hidden states h [..., hidden] -> [..., V] (one product, the weight
        broadcast over leading dims)."""
        if self.config.tie_word_embeddings:
            return h @ self.model.embed_tokens.weight.mT
        if type(self.lm_head) is Linear:
            return h @ self.lm_head.weight.mT
        return self.lm_head(h)

    def _ids(self, input_ids) -> Tensor:
        if isinstance(input_ids, Tensor):
            return input_ids.astype(dt.int64)
        return tensor(np.asarray(input_ids, np.int64), device=self.device)

    def forward(self, input_ids, labels=None):
        ids = self._ids(input_ids)
        if ids.ndim != 2:
            raise FuelGraphError(f"llama: input_ids must be [B, S], got {tuple(ids.shape)}")
        cos, sin = self.rope.at(0, ids.shape[1], self.dtype, self.device)
        h = self.model(ids, cos, sin)
        if labels is None:
            return self.head(h.reshape(*ids.shape, -1))
        return causal_lm_loss(self.head, h, ids.shape, self._ids(labels))

    def hf_config_extra(self) -> dict:
        """config.json fields beyond the dataclass's (transformers' names)."""
        sc = dict(self.config.rope_scaling)
        return {"model_type": "llama", "rope_scaling": sc or None,
                "num_key_value_heads": self.config.kv_heads, "head_dim": self.config.dim_head}

    def save_pretrained(self, directory) -> str:
        """config.json + model.safetensors, loadable by from_pretrained and transformers."""
        return save_pretrained(self, directory)

    def load_hf_state(self, state: dict):
        """Load a transformers LlamaForCausalLM state (names as in its safetensors files)."""
        drop = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if self.config.tie_word_embeddings
                                           else ())
        load_into(self, state, drop)
        return self

    # ---- decoding (GenerationMixin) -----------------------------------------------------------
    def new_cache(self, batch: int, max_tokens: int) -> PagedKVCache:
        """A paged KV cache with room for `batch` sequences of `max_tokens` tokens."""
        cfg = self.config
        per_seq = -(-max_tokens // KV_BLOCK_SIZE)
        return PagedKVCache(num_blocks=batch * per_seq, block_size=KV_BLOCK_SIZE,
                            num_kv_heads=cfg.kv_heads, head_dim=cfg.dim_head,
                            max_blocks_per_seq=per_seq, num_layers=cfg.num_hidden_layers,
                            max_seqs=batch, dtype=self.dtype, device=self.device)

    def decoder(self, batch: int, max_tokens: int) -> "PagedDecoder":
        """The traced decoder (cache + step) for `batch` sequences of up to `max_tokens` tokens.
        Capacities are rounded up to a power of two of KV blocks and the last
        `DECODERS_KEPT` decoders are kept, so later generate calls of similar sizes replay
        their traced steps; `release_decoders()` frees them (and their caches)."""
        blocks = 1 << max(-(-max_tokens // KV_BLOCK_SIZE) - 1, 0).bit_length()
        key = (batch, blocks, self.dtype, self.device)
        kept = self.__dict__.setdefault("_decoders", {})
        dec = kept.pop(key, None)
        if dec is None:
            dec = PagedDecoder(self, batch, blocks * KV_BLOCK_SIZE)
            while len(kept) >= DECODERS_KEPT:
                kept.pop(next(iter(kept)))
        kept[key] = dec                                   # most recently used last
        return dec

    def release_decoders(self):
        """Drop the kept decoders: their KV caches and traced steps."""
        self.__dict__.pop("_decoders", None)

    def _prefill(self, ids: np.ndarray, max_new: int, greedy: bool = False):
        b, s = ids.shape
        dec = self.decoder(b, s + max_new)
        seqs = dec.cache.add_sequences(b)
        state = DecodeRun(dec, seqs, greedy, max_new - 1)
        try:
            return state, dec.run(seqs, ids, greedy)
        except BaseException:
            self._release(state)
            raise

    def _decode_step(self, state: "DecodeRun", tok) -> Tensor:
        return state.step(tok)

    def _queue_greedy(self, state: "DecodeRun", step_out: Tensor, n: int, bar) -> list:
        steps = [step_out] + (state.greedy_steps(step_out, n - 1, bar) if n > 1 else [])
        if bar is not None:
            bar.update(1)
        return steps

    def _release(self, state: "DecodeRun"):
        state.dec.cache.free(state.seqs)


#: decoders (KV cache + traced steps) a model keeps between generate calls
DECODERS_KEPT = 2
#: prompt steps replay as CUDA graphs on the GPU; at most this many prompt shapes are kept
PROMPT_GRAPHS = True
PROMPT_TRACES_KEPT = 4
#: decoders made from now on merge q/k/v and gate/up weights (see MergedProjections)
MERGE_PROJECTIONS = True
#: ... on the CPU at every batch size: the merged product's parts are copied for the kernels
#: after it (a few KiB each), and one product instead of three (two) saves a hand-off to the
#: thread pool and a pass of Python per projection
MERGED_ROWS_ON_CPU = True
#: decoders made from now on compute each residual add and the norm after it as one
#: add_rms_norm (the decode and prompt steps; the model's own forward keeps the plain ops)
FUSE_ADD_NORM = True


class MergedProjections:
    """Each layer's q/k/v and gate/up weights as one weight [sum of outputs, hidden] each, so a
    step computes them with one product: the projections' own weights become row views of it
    (no second copy). Only plain bias-free `Linear`s of one dtype are merged (a GGUF model's
    quantized projections stay apart). `refresh()` merges again when a weight was replaced
    since (load_state_dict, an optimizer step rebinding it): weights updated in place stay
    merged, as they are the views. One per model (`of`), shared by its decoders."""

    @staticmethod
    def of(model) -> "MergedProjections":
        got = model.__dict__.get("_merged_projections")
        if got is None:
            got = model.__dict__["_merged_projections"] = MergedProjections(model)
        return got

    def __init__(self, model):
        self.groups = {}
        self.version = 0                # bumped by every refresh that merged something
        for i, layer in enumerate(model.model.layers):
            at, mlp = layer.self_attn, layer.mlp
            for kind, mods in (("qkv", (at.q_proj, at.k_proj, at.v_proj)),
                               ("gate_up", (mlp.gate_proj, mlp.up_proj))):
                if all(type(m) is Linear and m.bias is None for m in mods) and \
                        len({(m.weight.dtype, m.weight.device) for m in mods}) == 1:
                    self.groups[(i, kind)] = [m.weight for m in mods]
        self.handles: dict = {}         # (layer, kind) -> the merged weight's tensor handle
        self._nodes: dict = {}          # (layer, kind) -> the weights' nodes when merged

    def refresh(self) -> bool:
        """Merge the groups whose weights are not the views of their merged weight any more
        (all of them the first time) -> whether any was merged."""
        changed = False
        for key, ws in self.groups.items():
            nodes = self._nodes.get(key)
            if nodes is not None and all(w.value.node is n for w, n in zip(ws, nodes)):
                continue
            bufs = realize_raw(ws)
            if isinstance(bufs[0], np.ndarray):
                cat = np.concatenate(bufs, 0)
            else:
                import torch
                cat = torch.cat(bufs, 0)
            self.handles.pop(key, None)
            handle = _leaf(cat, ws[0].dtype, ws[0].device, False)
            OWNER[handle.value.node] = (handle, "value")     # persistent, like a parameter
            start = 0
            for w in ws:
                bind_buffer(w, cat[start:start + w.shape[0]])
                start += w.shape[0]
            self.handles[key] = handle
            self._nodes[key] = [w.value.node for w in ws]
            changed = True
        self.version += changed
        return changed


class PagedStep:
    """The paged KV cache as the layers of one traced step see it: the cache, the step's slot
    mapping [B*S], block table [B, max_blocks] and context lengths [B] (run-time tensors), and
    whether it is a prompt (every sequence started empty: the tokens attend each other with
    flash_attn; else paged_attn over the cache)."""

    def __init__(self, cache: PagedKVCache, slots, table, lens, prompt: bool, merged=None,
                 fuse_add_norm=False):
        self.cache, self.slots, self.table, self.lens = cache, slots, table, lens
        self.prompt, self.fuse_add_norm = prompt, fuse_add_norm
        self._merged = merged or {}

    def merged(self, layer, kind, rows: int):
        """The layer's merged projection weight (kind "qkv" or "gate_up"), or None. On a GPU
        used for one row (a decode step at batch 1) only: with more rows the parts of the
        merged product are strided, and the kernels after it (rope, paged attention and cache
        write, the SwiGLU glue) would each copy theirs first, costing more launches than it
        saves. On the CPU for any rows (MERGED_ROWS_ON_CPU)."""
        if rows == 1 or (MERGED_ROWS_ON_CPU and self.cache.device == "cpu"):
            return self._merged.get((layer, kind))
        return None

    def attend(self, layer, q, k, v, scale):
        """q [B, Hq, S, D], k/v [B, Hkv, S, D]: write k/v into the layer's pools (in the graph),
        then attention -> [B, Hq, S, D]."""
        b, hkv, s, d = k.shape
        rows = [t.permute(0, 2, 1, 3).reshape(b * s, hkv, d) for t in (k, v)]
        kp, vp = self.cache.append(layer, rows[0], rows[1], self.slots)
        if self.prompt:
            return FF.flash_attn(q, k, v, softmax_scale=scale, causal=True)
        return FF.paged_attn(q, kp, vp, self.table, self.lens, softmax_scale=scale)


class PagedDecoder:
    """A Llama's paged KV cache for `batch` sequences of up to `capacity` tokens, with the
    traced steps that run the model on it (`fuelgraph.jit`).

    A step takes the new token ids [B, S] and the cache's slot mapping, block table and context
    lengths as run-time tensors (the positions are derived from the lengths in the graph),
    writes the new k/v into the pools inside its plan and returns the last position's logits
    [B, V] (or, greedy, the next token ids [B] by an argmax in the graph). The pools and rope
    tables are fixed per decoder, so each (B, S, greedy) is traced once: `prompt_step` per
    prompt length, `step` once for all decode tokens (S = 1), which every later token replays
    on new input buffers; on the GPU a decode replay is one CUDA graph."""

    def __init__(self, model: LlamaForCausalLM, batch: int, capacity: int):
        self.model = model
        self.cache = model.new_cache(batch, capacity)
        self.cos, self.sin = model.rope.at(0, capacity, model.dtype, model.device)
        # prompts replay as CUDA graphs too (launching a prompt's kernels one by one from Python
        # cost ~25 ms per generate call at 1B); one trace per prompt length, the last
        # PROMPT_TRACES_KEPT kept (each holds its graph's memory)
        self.prompt_step = jit(self._prompt, cuda_graph=PROMPT_GRAPHS)
        self.step = jit(self._decode, cuda_graph=True)
        self._prompt_shapes: set = set()
        self.merges = MergedProjections.of(model) if MERGE_PROJECTIONS else None
        self.fuse_add_norm = FUSE_ADD_NORM
        self._merges_version = None

    def _check_merges(self):
        """Merge the projections (again, after their weights were replaced): the steps traced
        with other merged weights are dropped."""
        if self.merges is None:
            return
        self.merges.refresh()
        if self._merges_version != self.merges.version:
            self._merges_version = self.merges.version
            self.prompt_step.retrace()
            self._prompt_shapes.clear()
            self.step.retrace()

    def _prompt(self, ids, slots, table, lens, greedy):
        return self._forward(ids, slots, table, lens, greedy, True)

    def _decode(self, ids, slots, table, lens, greedy):
        return self._forward(ids, slots, table, lens, greedy, False)

    def _forward(self, ids, slots, table, lens, greedy, prompt):
        m = self.model
        if ids.ndim == 1:                              # the previous step's tokens [B]
            ids = ids.reshape(-1, 1)
        b, n = ids.shape
        pos = lens.astype(dt.int64).reshape(b, 1) - n + arange(n, dtype=dt.int64,
                                                                device=ids.device).reshape(1, n)

        def rot(t):                                               # [B, 1, S, D]
            return t.take(pos.reshape(-1), 0).reshape(b, 1, n, t.shape[-1])
        kv = PagedStep(self.cache, slots, table, lens, prompt,
                       self.merges.handles if self.merges is not None else None,
                       self.fuse_add_norm)
        h = m.model(ids, rot(self.cos), rot(self.sin), kv)
        last = h if n == 1 else h.reshape(b, n, -1)[:, -1]
        logits = m.head(last)
        return logits.argmax(-1) if greedy else logits

    def run(self, seqs, ids, greedy: bool) -> Tensor:
        """The next tokens ids [B, S] (NumPy) of the sequences `seqs` (a prompt when they are
        empty), or one token each as an int64 tensor [B] on the model's device (a previous
        step's result, never copied to the host) -> the last position's logits [B, V] or,
        greedy, the next tokens [B] (computed)."""
        self._check_merges()
        prompt = not self.cache.context_lens(seqs).any()
        self.cache.extend(seqs, 1 if isinstance(ids, Tensor) else ids.shape[1])
        step = self.prompt_step if prompt else self.step
        if prompt and tuple(ids.shape) not in self._prompt_shapes:
            if len(self._prompt_shapes) >= PROMPT_TRACES_KEPT:
                step.retrace()                # a new prompt shape: drop the kept ones
                self._prompt_shapes.clear()
            self._prompt_shapes.add(tuple(ids.shape))
        if not isinstance(ids, Tensor):
            ids = tensor(np.ascontiguousarray(ids, np.int64), device=self.model.device)
        return step(ids, *self.cache.step_tensors(seqs), greedy)


class DecodeRun:
    """The decode steps of one generate call (after its prefill): at most `steps` one-token
    steps of the sequences `seqs`. The first is a normal call of the decoder's traced step
    (which checks that its trace still holds, traces or captures it); the others replay it with
    `fuelgraph.jit.Replayer` (nothing else runs in between) on the inputs the cache prepared
    for all of them at once (`extend_steps`), so a token costs the host only the copy of three
    small buffers into the CUDA graph and its launch."""

    def __init__(self, dec: PagedDecoder, seqs, greedy: bool, steps: int):
        self.dec, self.seqs, self.greedy, self.left = dec, seqs, greedy, steps
        self.rep = None                # the Replayer; False: the step cannot be replayed
        self.inputs, self.i, self.meta = None, 0, None

    def _first(self, tok) -> Tensor:
        out = self.dec.run(self.seqs, tok if isinstance(tok, Tensor) else tok[:, None],
                           self.greedy)
        self.left -= 1
        if self.rep is None:
            self.rep = (self.dec.step.replayer() if self.left > 0 else None) or False
            if self.rep:
                self.inputs = self.dec.cache.extend_steps(self.seqs, self.left)
                self.meta = (out.dtype, out.device, tuple(tok.shape) if isinstance(tok, Tensor)
                             else (len(tok), 1))
        return out

    def _replay(self, buf):
        slots, table, lens = self.inputs
        out = self.rep.run([buf.reshape(self.meta[2]), slots[self.i], table, lens[self.i]])[0]
        self.i += 1
        self.left -= 1
        return out

    def _fast(self) -> bool:
        return bool(self.rep) and self.left > 0

    def step(self, tok) -> Tensor:
        """One step after the tokens tok: a tensor [B] (a previous greedy step's result, left
        on its device) or host ids [B] -> logits [B, V] or (greedy) next tokens [B]."""
        if not self._fast():
            return self._first(tok)
        if isinstance(tok, Tensor):
            buf = realize_raw([tok])[0]
        else:
            buf = get_backend(self.dec.model.device).from_any(
                np.ascontiguousarray(tok, np.int64), self.dec.model.device)
        return _leaf(self._replay(buf), *self.meta[:2], False)

    def greedy_steps(self, tok: Tensor, n: int, bar=None) -> list:
        """`n` greedy steps after the tokens tok [B] (a device tensor) -> their next tokens,
        queued on the device without waiting: tensors [B] or [B, k] (k steps), in order."""
        first = self.step(tok)
        if bar is not None:
            bar.update(1)
        fast = min(n - 1, self.left) if self._fast() else 0
        steps = [first]
        if fast:
            prev, rest = replay_greedy(self._replay, first, fast, bar)
            steps.append(rest)
            first = _leaf(prev, first.dtype, first.device, False)
        for _ in range(n - 1 - fast):            # more steps than generate announced
            first = self.step(first)
            steps.append(first)
            if bar is not None:
                bar.update(1)
        return steps


def causal_lm_loss(head, h: Tensor, shape, labels: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy of predicting token t+1 from position t, h [B*S, hidden] the final
    hidden states of `shape` = (B, S): the last position has no target and `ignore_index`
    labels are skipped, as in transformers' causal LM loss."""
    b, s = shape
    if tuple(labels.shape) != (b, s):
        raise FuelGraphError(f"loss: labels have shape {tuple(labels.shape)}, expected {(b, s)}")
    rows = h.reshape(b, s, -1)[:, :-1].reshape(b * (s - 1), -1)
    return F.cross_entropy(head(rows), labels[:, 1:].reshape(-1), ignore_index=ignore_index)
