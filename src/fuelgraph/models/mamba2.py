"""Mamba-2 written with fuelgraph tensors: each block is an input projection, a causal depthwise
conv (`causal_conv1d`), the state-space scan (`ssd_chunk_scan`) with its skip and SiLU gate, a
grouped RMS norm and an output projection; decoding carries each layer's conv window and SSM
state and updates them one token at a time (a traced step, replayed per token). Parameter names
are those of Hugging Face's Mamba2ForCausalLM.

    model = fuelgraph.models.from_pretrained("path/to/mamba2")
    logits = model(ids)                       # [B, S, V]
    out = model.generate(ids, max_new_tokens=32)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import dtype as dt
from .. import functional as FF
from ..errors import FuelGraphError
from ..api import bind_buffer, rebind
from ..backends import get_backend
from ..ir.tensor import Tensor, _leaf, cat, full, tensor
from ..jit import jit
from ..nn import functional as F
from ..nn.layers import Embedding, Linear
from ..nn.module import Module, ModuleList, Parameter
from ..runtime.executor import realize_raw
from .config import inf_or, load_into, save_pretrained
from .generation import GenerationMixin, replay_greedy
from .llama import causal_lm_loss


@dataclass(frozen=True)
class Mamba2Config:
    """The fields of a Hugging Face Mamba2 config.json that the model uses."""
    vocab_size: int = 32768
    hidden_size: int = 768
    num_hidden_layers: int = 24
    state_size: int = 128
    expand: float = 2
    head_dim: int = 64
    num_heads: int = 24
    n_groups: int = 1
    chunk_size: int = 256
    conv_kernel: int = 4
    layer_norm_epsilon: float = 1e-5
    use_bias: bool = False
    use_conv_bias: bool = True
    tie_word_embeddings: bool = True
    time_step_limit: tuple = (0.0, math.inf)
    hidden_act: str = "silu"

    @property
    def intermediate(self) -> int:
        return int(self.expand * self.hidden_size)

    @property
    def conv_dim(self) -> int:
        return self.intermediate + 2 * self.n_groups * self.state_size

    @classmethod
    def from_hf(cls, cfg: dict) -> "Mamba2Config":
        kw = {k: cfg[k] for k in cls.__dataclass_fields__ if k in cfg and cfg[k] is not None}
        if "time_step_limit" in kw:
            lo, hi = kw["time_step_limit"]
            kw["time_step_limit"] = (inf_or(lo, 0.0), inf_or(hi))
        c = cls(**kw)
        if c.hidden_act != "silu":
            raise FuelGraphError(f"mamba2: hidden_act {c.hidden_act!r} is not supported (silu)")
        if c.num_heads * c.head_dim != c.intermediate or c.num_heads % c.n_groups:
            raise FuelGraphError(f"mamba2: num_heads * head_dim = {c.num_heads * c.head_dim} "
                                 f"must equal expand * hidden_size = {c.intermediate}, and "
                                 f"n_groups = {c.n_groups} divide num_heads")
        return c


def _chunk(length: int, preferred: int) -> int:
    """The largest divisor of `length` that is at most `preferred` (a tiling hint)."""
    for c in range(min(length, preferred), 0, -1):
        if length % c == 0:
            return c
    return 1


class DepthwiseConv1d(Module):
    """The weights of Mamba's causal depthwise conv: weight [C, 1, W], bias [C]."""

    def __init__(self, channels, width, bias, dtype, device):
        super().__init__()
        self.weight = Parameter(np.zeros((channels, 1, width), dtype.np))
        self.bias = Parameter(np.zeros(channels, dtype.np)) if bias else None
        if device != "cpu":
            self.to(device)


class GroupedRMSNorm(Module):
    """RMS norm over groups of size `hidden / groups`, then times weight [hidden]."""

    def __init__(self, hidden, groups, eps, dtype, device):
        super().__init__()
        self.groups, self.eps = groups, float(eps)
        self.weight = Parameter(np.ones(hidden, dtype.np))
        if device != "cpu":
            self.to(device)

    def forward(self, y):
        shape = y.shape
        g = y.reshape(*shape[:-1], self.groups, shape[-1] // self.groups)
        return F.rms_norm(g, None, None, self.eps).reshape(shape) * self.weight


class Mamba2Mixer(Module):
    def __init__(self, cfg: Mamba2Config, dtype, device):
        super().__init__()
        self.cfg = cfg
        i, h = cfg.intermediate, cfg.num_heads
        self.in_proj = Linear(cfg.hidden_size, i + cfg.conv_dim + h, bias=cfg.use_bias,
                              dtype=dtype, device=device)
        self.conv1d = DepthwiseConv1d(cfg.conv_dim, cfg.conv_kernel, cfg.use_conv_bias, dtype,
                                      device)
        self.dt_bias = Parameter(tensor(np.zeros(h, dtype.np), device=device))
        self.A_log = Parameter(tensor(np.zeros(h, dtype.np), device=device))
        self.D = Parameter(tensor(np.ones(h, dtype.np), device=device))
        self.norm = GroupedRMSNorm(i, cfg.n_groups, cfg.layer_norm_epsilon, dtype, device)
        self.out_proj = Linear(i, cfg.hidden_size, bias=cfg.use_bias, dtype=dtype, device=device)

    def _split(self, zxbcdt):
        c = self.cfg
        i, gn = c.intermediate, c.n_groups * c.state_size
        return (zxbcdt[..., :i], zxbcdt[..., i:i + c.conv_dim], zxbcdt[..., i + c.conv_dim:],
                (i, gn))

    def _heads(self, bc, lead):
        """[..., G*N] -> [..., H, N]: head h reads group h // (H / G)."""
        c = self.cfg
        g = bc.reshape(*lead, c.n_groups, 1, c.state_size)
        g = g.broadcast_to((*lead, c.n_groups, c.num_heads // c.n_groups, c.state_size))
        return g.reshape(*lead, c.num_heads, c.state_size)

    def _dt(self, dt_raw):
        """(dt, dt_bias, softplus flag) for the scan: the bias and softplus go into the fused op
        unless the config clamps dt (time_step_limit), which is applied here."""
        lo, hi = self.cfg.time_step_limit
        if lo <= 0.0 and hi == math.inf:
            return dt_raw, self.dt_bias, True
        return (dt_raw + self.dt_bias).softplus().clamp(lo, hi), None, False

    def forward(self, x, shape, with_state=False):
        """x [B*S, hidden] (the tokens of `shape` = (B, S) as rows) -> [B*S, hidden] (and the
        decode state after the last token)."""
        c = self.cfg
        b, s = shape
        z, xbc, dt_raw, (i, gn) = self._split(self.in_proj(x))
        xbc_t = xbc.reshape(b, s, c.conv_dim).permute(0, 2, 1)        # [B, C, S]
        conv = FF.causal_conv1d(xbc_t, self.conv1d.weight, self.conv1d.bias, use_silu=True)
        xbc = conv.permute(0, 2, 1)
        xs = xbc[..., :i].reshape(b, s, c.num_heads, c.head_dim)
        bh = self._heads(xbc[..., i:i + gn], (b, s))
        ch = self._heads(xbc[..., i + gn:], (b, s))
        dt_in, dt_bias, softplus = self._dt(dt_raw.reshape(b, s, c.num_heads))
        y, last = FF.ssd_chunk_scan(xs, dt_in, -self.A_log.exp(), bh, ch,
                                    chunk_size=_chunk(s, c.chunk_size), d=self.D,
                                    z=z.reshape(b, s, c.num_heads, c.head_dim), dt_bias=dt_bias,
                                    dt_softplus=softplus)
        out = self.out_proj(self.norm(y.reshape(b * s, i)))
        if not with_state:
            return out
        w = c.conv_kernel - 1
        padded = xbc_t.pad([(0, 0), (0, 0), (max(w - s, 0), 0)])
        window = padded[..., -w:] if w else xbc_t[..., :0]
        return out, (window, last.astype(x.dtype.acc))

    def step(self, x, conv_state, ssm_state):
        """One token: x [B, hidden], conv_state [B, C, W-1] (the last inputs of the conv),
        ssm_state [B, H, P, N] (float32) -> (out [B, hidden], conv_state, ssm_state)."""
        c = self.cfg
        b = x.shape[0]
        z, xbc, dt_raw, (i, gn) = self._split(self.in_proj(x))
        window = cat([conv_state, xbc.unsqueeze(-1)], -1)              # [B, C, W]
        w = self.conv1d.weight.reshape(c.conv_dim, c.conv_kernel)
        on_cpu = STEP_SCAN_ON_CPU and self.A_log.device == "cpu"
        if on_cpu:      # tap by tap: one elementwise region over [B, C] (NumPy reduces a
            #             length-4 last axis row by row, ~5x slower)
            conv = window[..., 0] * w[:, 0]
            for j in range(1, c.conv_kernel):
                conv = conv + window[..., j] * w[:, j]
        else:
            conv = (window * w).sum(-1)
        if self.conv1d.bias is not None:
            conv = conv + self.conv1d.bias
        xbc = conv.silu()
        acc = x.dtype.acc
        xs = xbc[..., :i].reshape(b, c.num_heads, c.head_dim).astype(acc)
        bh = self._heads(xbc[..., i:i + gn], (b,)).astype(acc)
        ch = self._heads(xbc[..., i + gn:], (b,)).astype(acc)
        dt_in, dt_bias, softplus = self._dt(dt_raw)
        zs = z.reshape(b, c.num_heads, c.head_dim).astype(acc)
        if on_cpu:
            # the NumPy scan kernel runs a one-token scan as the recurrence itself, each part
            # of the heads' states in cache: ~2x faster than the same math as glue at B = 4
            y, state = FF.ssd_chunk_scan(
                xs[:, None], dt_in.astype(acc)[:, None], -self.A_log.astype(acc).exp(),
                bh[:, None], ch[:, None], chunk_size=1, d=self.D.astype(acc), z=zs[:, None],
                dt_bias=None if dt_bias is None else dt_bias.astype(acc), dt_softplus=softplus,
                initial_states=ssm_state)
            y = y.astype(x.dtype)
            return self.out_proj(self.norm(y.reshape(b, i))), window[..., 1:], state
        dtv = (dt_in + dt_bias).softplus() if softplus else dt_in
        dtv = dtv.astype(acc)                                          # [B, H]
        decay = (dtv * (-self.A_log.astype(acc).exp())).exp()
        state = ssm_state * decay[:, :, None, None] + \
            (dtv[:, :, None] * xs)[..., None] * bh[:, :, None, :]
        y = (state * ch[:, :, None, :]).sum(-1) + self.D.astype(acc)[:, None] * xs
        y = (y * zs.silu()).astype(x.dtype)
        return self.out_proj(self.norm(y.reshape(b, i))), window[..., 1:], state


class Mamba2Block(Module):
    def __init__(self, cfg: Mamba2Config, dtype, device):
        super().__init__()
        self.norm = GroupedRMSNorm(cfg.hidden_size, 1, cfg.layer_norm_epsilon, dtype, device)
        self.mixer = Mamba2Mixer(cfg, dtype, device)

    def forward(self, x, shape, with_state=False):
        if not with_state:
            return x + self.mixer(self.norm(x), shape)
        y, st = self.mixer(self.norm(x), shape, True)
        return x + y, st

    def step(self, x, conv_state, ssm_state):
        y, cs, ss = self.mixer.step(self.norm(x), conv_state, ssm_state)
        return x + y, cs, ss


class Mamba2Model(Module):
    def __init__(self, cfg: Mamba2Config, dtype, device):
        super().__init__()
        self.embeddings = Embedding(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device)
        self.layers = ModuleList([Mamba2Block(cfg, dtype, device)
                                  for _ in range(cfg.num_hidden_layers)])
        self.norm_f = GroupedRMSNorm(cfg.hidden_size, 1, cfg.layer_norm_epsilon, dtype, device)


class Mamba2ForCausalLM(GenerationMixin, Module):
    """Mamba-2 backbone + output head. `model(input_ids)` -> logits [B, S, V];
    `model(input_ids, labels=labels)` -> the mean next-token cross-entropy; `generate` runs the
    prompt through the chunked scan, then steps the recurrent state one token at a time."""

    def __init__(self, cfg: Mamba2Config, dtype=dt.float32, device="cpu"):
        super().__init__()
        self.config = cfg
        self.backbone = Mamba2Model(cfg, dtype, device)
        if not cfg.tie_word_embeddings:
            self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype,
                                  device=device)

    @property
    def dtype(self):
        return self.backbone.norm_f.weight.dtype

    @property
    def device(self):
        return self.backbone.norm_f.weight.device

    def head(self, h):
        """Logits of final hidden states h [..., hidden] -> [..., V] (one product, the weight
        broadcast over leading dims)."""
        tied = self.config.tie_word_embeddings
        w = self.backbone.embeddings.weight if tied else self.lm_head.weight
        return h @ w.mT

    def _ids(self, input_ids) -> Tensor:
        if isinstance(input_ids, Tensor):
            return input_ids.astype(dt.int64)
        return tensor(np.asarray(input_ids, np.int64), device=self.device)

    def forward(self, input_ids, labels=None):
        ids = self._ids(input_ids)
        if ids.ndim != 2:
            raise FuelGraphError(f"mamba2: input_ids must be [B, S], got {tuple(ids.shape)}")
        shape = tuple(ids.shape)
        x = self.backbone.embeddings(ids.reshape(-1))
        for layer in self.backbone.layers:
            x = layer(x, shape)
        h = self.backbone.norm_f(x)
        if labels is None:
            return self.head(h.reshape(*shape, -1))
        return causal_lm_loss(self.head, h, shape, self._ids(labels))

    def hf_config_extra(self) -> dict:
        return {"model_type": "mamba2"}

    def save_pretrained(self, directory) -> str:
        """config.json + model.safetensors, loadable by from_pretrained and transformers."""
        return save_pretrained(self, directory)

    def load_hf_state(self, state: dict):
        """Load a transformers Mamba2ForCausalLM state (names as in its safetensors files)."""
        state = {k.replace("backbone.embedding.", "backbone.embeddings."): v
                 for k, v in state.items()}
        load_into(self, state, ("lm_head.weight",) if self.config.tie_word_embeddings else ())
        return self

    # ---- decoding (GenerationMixin) -----------------------------------------------------------
    def decoder(self, batch: int) -> "Mamba2Decoder":
        """The traced decoder (recurrent states + steps) for `batch` sequences; the last
        `DECODERS_KEPT` are kept, so later generate calls replay their traced steps."""
        key = (batch, self.dtype, self.device)
        kept = self.__dict__.setdefault("_decoders", {})
        dec = kept.pop(key, None)
        if dec is None:
            dec = Mamba2Decoder(self, batch)
            while len(kept) >= DECODERS_KEPT:
                kept.pop(next(iter(kept)))
        kept[key] = dec
        return dec

    def release_decoders(self):
        """Drop the kept decoders: their states and traced steps."""
        self.__dict__.pop("_decoders", None)

    def _prefill(self, ids: np.ndarray, max_new: int, greedy: bool = False):
        dec = self.decoder(ids.shape[0])
        return [dec, greedy, None], dec.prompt_step(self._ids(ids), greedy)

    def _decode_step(self, state, tok) -> Tensor:
        """The first step of a generate call is a normal call of the traced step; the later
        ones replay it (`fuelgraph.jit.Replayer`: nothing else runs in between)."""
        dec, greedy, rep = state
        if rep is None:
            out = dec.step(self._ids(tok), greedy)
            r = dec.step.replayer()
            state[2] = (r, out.dtype, out.device) if r is not None else False
            return out
        if rep is False:
            return dec.step(self._ids(tok), greedy)
        buf = realize_raw([tok])[0] if isinstance(tok, Tensor) else get_backend(
            self.device).from_any(np.ascontiguousarray(tok, np.int64), self.device)
        return _leaf(rep[0].run([buf])[0], rep[1], rep[2], False)

    def _queue_greedy(self, state, step_out: Tensor, n: int, bar) -> list:
        """Greedy steps queued on the device: the first a normal call of the traced step, the
        others replays of it (`fuelgraph.jit.Replayer`: nothing else runs in between), each fed
        the previous step's tokens where they are -> tensors [B] and [B, n - 2]."""
        if n < 3:
            return super()._queue_greedy(state, step_out, n, bar)
        first = self._decode_step(state, step_out)
        rep = state[2][0] if state[2] else None
        if rep is None:
            if bar is not None:
                bar.update(1)
            return [step_out] + super()._queue_greedy(state, first, n - 1, bar)
        _, rest = replay_greedy(lambda t: rep.run([t])[0], first, n - 2, bar)
        if bar is not None:
            bar.update(2)
        return [step_out, first, rest]

    def _release(self, state):
        state.clear()


#: decode steps traced from now on run the CPU state update as a one-token ssd_chunk_scan and
#: the CPU conv step tap by tap (the GPU keeps the glue forms)
STEP_SCAN_ON_CPU = True
#: decoders (recurrent states + traced steps) a model keeps between generate calls
DECODERS_KEPT = 2
#: decode steps traced from now on fuse each residual add with the next block's norm
FUSE_ADD_NORM = True


class Mamba2Decoder:
    """The recurrent states of `batch` sequences, one conv window [B, C, W-1] and one SSM state
    [B, H, P, N] (float32) per layer, held as persistent tensor handles, with the traced steps
    that run the model on them (`fuelgraph.jit`): `prompt_step(ids [B, S], greedy)` runs the
    prompt through the chunked scan and sets the states, `step(tokens [B], greedy)` advances
    them by one token (traced once, replayed for every later token; one CUDA graph on the GPU).
    Both return the last position's logits [B, V], or with greedy the next tokens [B] (an
    argmax in the graph)."""

    def __init__(self, model: Mamba2ForCausalLM, batch: int):
        self.model = model
        cfg = model.config
        dev, dtype = model.device, model.dtype

        def state(shape, d):
            t = full(shape, 0, d, dev)
            bind_buffer(t, get_backend(dev).copy(realize_raw([t])[0]))
            return t
        self.convs = [state((batch, cfg.conv_dim, cfg.conv_kernel - 1), dtype)
                      for _ in model.backbone.layers]
        self.ssms = [state((batch, cfg.num_heads, cfg.head_dim, cfg.state_size), dtype.acc)
                     for _ in model.backbone.layers]
        self.prompt_step = jit(self._prompt)
        self.step = jit(self._decode, cuda_graph=True)

    def _out(self, h, greedy):
        logits = self.model.head(self.model.backbone.norm_f(h))
        return logits.argmax(-1) if greedy else logits

    def _prompt(self, ids, greedy):
        bb = self.model.backbone
        b, s = ids.shape
        x = bb.embeddings(ids.reshape(-1))
        for layer, conv, ssm in zip(bb.layers, self.convs, self.ssms):
            x, (cs, ss) = layer(x, (b, s), True)
            rebind(conv, cs.value)
            rebind(ssm, ss.value)
        return self._out(x if s == 1 else x.reshape(b, s, -1)[:, -1], greedy)

    def _decode(self, tok, greedy):
        bb = self.model.backbone
        x = bb.embeddings(tok)
        norms = [layer.norm for layer in bb.layers] + [bb.norm_f]
        if FUSE_ADD_NORM and all(n.groups == 1 for n in norms):
            # each residual add and the norm after it as one add_rms_norm (x: the residual
            # stream, h: the next block's normed input)
            h = norms[0](x)
            for i, (layer, conv, ssm) in enumerate(zip(bb.layers, self.convs, self.ssms)):
                y, cs, ss = layer.mixer.step(h, conv, ssm)
                rebind(conv, cs.value)
                rebind(ssm, ss.value)
                x, h = FF.add_rms_norm(x, y, norms[i + 1].weight, norms[i + 1].eps)
            logits = self.model.head(h)
            return logits.argmax(-1) if greedy else logits
        for layer, conv, ssm in zip(bb.layers, self.convs, self.ssms):
            x, cs, ss = layer.step(x, conv, ssm)
            rebind(conv, cs.value)
            rebind(ssm, ss.value)
        return self._out(x, greedy)
