"""A Llama-style transformer block written with plain tensor ops only (no fused calls): RMS
norm, RoPE, causal softmax attention, a SiLU MLP and a cross-entropy loss. The optimizer is
expected to find the fused ops in it."""
from __future__ import annotations

import math

import numpy as np

from .. import dtype as dt
from ..ir.tensor import Tensor, cat, tensor


def rms_norm(x: Tensor, eps=1e-6) -> Tensor:
    return x / ((x * x).mean(-1, keepdim=True) + eps).sqrt()


def rotate_half(x: Tensor) -> Tensor:
    h = x.shape[-1] // 2
    return cat([-x[..., h:], x[..., :h]], -1)


def softmax(x: Tensor) -> Tensor:
    e = (x - x.max(-1, keepdim=True)).exp()
    return e / e.sum(-1, keepdim=True)


def rope_tables(seq: int, dim: int, base=10000.0):
    inv = base ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    ang = np.arange(seq, dtype=np.float64)[:, None] * inv[None, :]
    c, s = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    return np.concatenate([c, c], -1), np.concatenate([s, s], -1)


class TinyBlock:
    """One pre-norm decoder block plus an output head: x [B, S, D] -> logits [B, S, V]."""

    def __init__(self, d=64, heads=4, hidden=128, vocab=96, seq=16, seed=0):
        rng = np.random.default_rng(seed)
        w = lambda *s: tensor((rng.standard_normal(s) / math.sqrt(s[0])).astype(np.float32),
                              requires_grad=True)
        self.d, self.h, self.seq, self.vocab = d, heads, seq, vocab
        self.wq, self.wk, self.wv, self.wo = w(d, d), w(d, d), w(d, d), w(d, d)
        self.w1, self.w2, self.wout = w(d, hidden), w(hidden, d), w(d, vocab)
        self.b1 = tensor(np.zeros(hidden, np.float32), requires_grad=True)
        cos, sin = rope_tables(seq, d // heads)
        self.cos, self.sin = tensor(cos), tensor(sin)
        mask = np.triu(np.full((seq, seq), -np.inf, np.float32), 1)
        self.mask = tensor(mask)

    def params(self):
        return [self.wq, self.wk, self.wv, self.wo, self.w1, self.b1, self.w2, self.wout]

    def __call__(self, x: Tensor) -> Tensor:
        b, s, d = x.shape
        hd = d // self.h
        h = rms_norm(x)
        split = lambda t: t.reshape(b, s, self.h, hd).permute(0, 2, 1, 3)
        q, k, v = split(h @ self.wq), split(h @ self.wk), split(h @ self.wv)
        q = q * self.cos + rotate_half(q) * self.sin
        k = k * self.cos + rotate_half(k) * self.sin
        att = softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd)) + self.mask)
        o = (att @ v).permute(0, 2, 1, 3).reshape(b, s, d)
        x = x + o @ self.wo
        m = rms_norm(x)
        x = x + ((m @ self.w1 + self.b1).silu() @ self.w2)
        return rms_norm(x) @ self.wout

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        ls = logits - logits.max(-1, keepdim=True)
        ls = ls - ls.exp().sum(-1, keepdim=True).log()
        return -(ls.gather(-1, targets.unsqueeze(-1)).squeeze(-1)).mean()

    def example(self, batch=2, seed=1):
        rng = np.random.default_rng(seed)
        x = tensor(rng.standard_normal((batch, self.seq, self.d)).astype(np.float32))
        t = tensor(rng.integers(0, self.vocab, (batch, self.seq)), dtype=dt.int64)
        return x, t
