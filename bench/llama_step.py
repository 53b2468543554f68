"""The Llama-style model of the training benchmarks, written twice with the same weights:
with fuelgraph.nn (`FgLlama`) and with torch.nn (`TorchLlama`). Pre-norm decoder blocks: RMS
norm, grouped-query attention with RoPE (heads-first, causal), a SiLU-gated MLP, a tied-free
output head and a cross-entropy loss; no biases (as Llama).

fuelgraph's attention goes through `fuelgraph.nn.functional.scaled_dot_product_attention`,
which uses the registry's flash attention when the build has it and otherwise materializes
the scores (a softmax the optimizer fuses), so this file needs no change when it lands."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Config:
    vocab: int = 2048
    hidden: int = 512
    layers: int = 4
    heads: int = 8
    kv_heads: int = 4
    ffn: int = 1024
    batch: int = 4
    seq: int = 256

    @property
    def head_dim(self):
        return self.hidden // self.heads


def rope_tables(seq, dim, base=10000.0):
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    ang = np.arange(seq, dtype=np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang), np.sin(ang)
    return np.concatenate([c, c], -1).astype(np.float32), np.concatenate([s, s], -1).astype(np.float32)


def init_weights(cfg: Config, seed=0) -> dict:
    """name -> float32 array, shared by both implementations (torch.nn.Linear's layout)."""
    rng = np.random.default_rng(seed)

    def lin(o, i):
        return (rng.standard_normal((o, i)) / math.sqrt(i)).astype(np.float32)
    w = {"emb.weight": rng.standard_normal((cfg.vocab, cfg.hidden)).astype(np.float32) * 0.02}
    kv = cfg.kv_heads * cfg.head_dim
    for i in range(cfg.layers):
        p = f"blocks.{i}."
        w[p + "norm1.weight"] = np.ones(cfg.hidden, np.float32)
        w[p + "norm2.weight"] = np.ones(cfg.hidden, np.float32)
        w[p + "wq.weight"] = lin(cfg.hidden, cfg.hidden)
        w[p + "wk.weight"] = lin(kv, cfg.hidden)
        w[p + "wv.weight"] = lin(kv, cfg.hidden)
        w[p + "wo.weight"] = lin(cfg.hidden, cfg.hidden)
        w[p + "gate.weight"] = lin(cfg.ffn, cfg.hidden)
        w[p + "up.weight"] = lin(cfg.ffn, cfg.hidden)
        w[p + "down.weight"] = lin(cfg.hidden, cfg.ffn)
    w["norm.weight"] = np.ones(cfg.hidden, np.float32)
    w["head.weight"] = lin(cfg.vocab, cfg.hidden)
    return w


def batch(cfg: Config, seed=1):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)),
            rng.integers(0, cfg.vocab, (cfg.batch, cfg.seq)))


# ---- fuelgraph ----------------------------------------------------------------------------------
def fg_model(cfg: Config, device="cpu", dtype=None):
    import fuelgraph as fg
    import fuelgraph.nn as nn
    import fuelgraph.nn.functional as F

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            kv = cfg.kv_heads * cfg.head_dim
            self.norm1, self.norm2 = nn.RMSNorm(cfg.hidden, 1e-6), nn.RMSNorm(cfg.hidden, 1e-6)
            self.wq = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
            self.wk = nn.Linear(cfg.hidden, kv, bias=False)
            self.wv = nn.Linear(cfg.hidden, kv, bias=False)
            self.wo = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
            self.gate = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
            self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
            self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

        def forward(self, x, cos, sin):
            b, s, _ = x.shape
            h = self.norm1(x)
            q = self.wq(h).view(b, s, cfg.heads, cfg.head_dim).transpose(1, 2)
            k = self.wk(h).view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
            v = self.wv(h).view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
            q, k = F.rope(q, cos, sin), F.rope(k, cos, sin)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self.wo(o.transpose(1, 2).reshape(b, s, cfg.hidden))
            h = self.norm2(x)
            return x + self.down(F.silu(self.gate(h)) * self.up(h))

    class Llama(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(cfg.vocab, cfg.hidden)
            self.blocks = nn.ModuleList([Block() for _ in range(cfg.layers)])
            self.norm = nn.RMSNorm(cfg.hidden, 1e-6)
            self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)
            c, s = rope_tables(cfg.seq, cfg.head_dim)
            self.register_buffer("cos", c)
            self.register_buffer("sin", s)

        def forward(self, idx, targets):
            x = self.emb(idx)
            for blk in self.blocks:
                x = blk(x, self.cos.astype(x.dtype), self.sin.astype(x.dtype))
            logits = self.head(self.norm(x))
            return F.cross_entropy(logits.reshape(-1, cfg.vocab), targets.reshape(-1))

    m = Llama()
    m.load_state_dict({**init_weights(cfg), "cos": m.cos.numpy(), "sin": m.sin.numpy()})
    if dtype is not None:
        m.to(dtype)
    if device != "cpu":
        m.to(device)
    return m, fg


# ---- torch --------------------------------------------------------------------------------------
def torch_model(cfg: Config, device="cpu", dtype=None, sdpa=False):
    import torch
    import torch.nn as tnn
    import torch.nn.functional as TF

    def rope(x, cos, sin):
        h = x.shape[-1] // 2
        return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin

    class Block(tnn.Module):
        def __init__(self):
            super().__init__()
            kv = cfg.kv_heads * cfg.head_dim
            self.norm1, self.norm2 = tnn.RMSNorm(cfg.hidden, 1e-6), tnn.RMSNorm(cfg.hidden, 1e-6)
            self.wq = tnn.Linear(cfg.hidden, cfg.hidden, bias=False)
            self.wk = tnn.Linear(cfg.hidden, kv, bias=False)
            self.wv = tnn.Linear(cfg.hidden, kv, bias=False)
            self.wo = tnn.Linear(cfg.hidden, cfg.hidden, bias=False)
            self.gate = tnn.Linear(cfg.hidden, cfg.ffn, bias=False)
            self.up = tnn.Linear(cfg.hidden, cfg.ffn, bias=False)
            self.down = tnn.Linear(cfg.ffn, cfg.hidden, bias=False)

        def forward(self, x, cos, sin, mask):
            b, s, _ = x.shape
            h = self.norm1(x)
            q = self.wq(h).view(b, s, cfg.heads, cfg.head_dim).transpose(1, 2)
            k = self.wk(h).view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
            v = self.wv(h).view(b, s, cfg.kv_heads, cfg.head_dim).transpose(1, 2)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            rep = cfg.heads // cfg.kv_heads
            if sdpa:
                o = TF.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
                att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(cfg.head_dim))
                att = torch.softmax(att.masked_fill(mask, float("-inf")), -1)
                o = att @ v
            x = x + self.wo(o.transpose(1, 2).reshape(b, s, cfg.hidden))
            h = self.norm2(x)
            return x + self.down(TF.silu(self.gate(h)) * self.up(h))

    class Llama(tnn.Module):
        def __init__(self):
            super().__init__()
            self.emb = tnn.Embedding(cfg.vocab, cfg.hidden)
            self.blocks = tnn.ModuleList([Block() for _ in range(cfg.layers)])
            self.norm = tnn.RMSNorm(cfg.hidden, 1e-6)
            self.head = tnn.Linear(cfg.hidden, cfg.vocab, bias=False)
            c, s = rope_tables(cfg.seq, cfg.head_dim)
            self.register_buffer("cos", torch.tensor(c))
            self.register_buffer("sin", torch.tensor(s))
            self.register_buffer("mask", torch.triu(torch.ones(cfg.seq, cfg.seq, dtype=torch.bool), 1))

        def forward(self, idx, targets):
            x = self.emb(idx)
            for blk in self.blocks:
                x = blk(x, self.cos.to(x.dtype), self.sin.to(x.dtype), self.mask)
            logits = self.head(self.norm(x))
            return TF.cross_entropy(logits.reshape(-1, cfg.vocab).float(), targets.reshape(-1))

    m = Llama()
    sd = {k: torch.tensor(v) for k, v in init_weights(cfg).items()}
    m.load_state_dict(sd, strict=False)
    m.to(device)
    if dtype is not None:
        m.to(dtype)
    return m
