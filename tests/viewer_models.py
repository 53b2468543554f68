"""Models the viewer and memory-plan tests run: the CLI's demo (TinyBlock with its backward
pass), a GPT-style transformer block (layer norm, causal attention, tanh-GELU MLP) with its
backward pass, and a stack of Llama-style layers (for repeated-layer folding)."""
from __future__ import annotations

import math

import numpy as np

import fuelgraph as fg
from fuelgraph.nn import TinyBlock
from fuelgraph.nn.transformer import rms_norm, rope_tables, rotate_half, softmax


def demo_graph(device="cpu", batch=4):
    """The outputs `fuelgraph demo` / `fuelgraph explain` use, on `device`."""
    m = TinyBlock(d=256, heads=4, hidden=512, vocab=2048, seq=128)
    for name in ("wq", "wk", "wv", "wo", "w1", "w2", "wout", "b1", "cos", "sin", "mask"):
        setattr(m, name, getattr(m, name).to(device))
    x, t = m.example(batch)
    x, t = x.to(device), t.to(device)
    loss = m.loss(m(x), t)
    return [loss] + fg.grad(loss, m.params())


def gpt_block(b=4, s=128, d=256, h=4, device="cpu", seed=0):
    """Loss and parameter gradients of one pre-norm GPT block; loss = mean(y^2)."""
    rng = np.random.default_rng(seed)

    def t(a, grad=True):
        return fg.tensor(a.astype(np.float32), requires_grad=grad).to(device)
    w = lambda *sh: t(rng.standard_normal(sh) / math.sqrt(sh[0]))   # noqa: E731
    p = dict(g1=t(np.ones(d)), b1=t(np.zeros(d)), wqkv=w(d, 3 * d), wo=w(d, d),
             g2=t(np.ones(d)), b2=t(np.zeros(d)), w1=w(d, 4 * d), c1=t(np.zeros(4 * d)),
             w2=w(4 * d, d))
    x = t(rng.standard_normal((b, s, d)), grad=False)
    mask = t(np.triu(np.full((s, s), -np.inf), 1), grad=False)

    def ln(x, g, bb):
        xc = x - x.mean(-1, keepdim=True)
        return xc / ((xc * xc).mean(-1, keepdim=True) + 1e-5).sqrt() * g + bb
    hd = d // h
    qkv = ln(x, p["g1"], p["b1"]) @ p["wqkv"]
    q, k, v = [qkv[..., i * d:(i + 1) * d].reshape(b, s, h, hd).permute(0, 2, 1, 3)
               for i in range(3)]
    a = (q @ k.transpose(-2, -1)) * (1 / math.sqrt(hd)) + mask
    e = (a - a.max(-1, keepdim=True)).exp()
    o = ((e / e.sum(-1, keepdim=True)) @ v).permute(0, 2, 1, 3).reshape(b, s, d)
    x = x + o @ p["wo"]
    m = ln(x, p["g2"], p["b2"]) @ p["w1"] + p["c1"]
    m = 0.5 * m * (1 + (math.sqrt(2 / math.pi) * (m + 0.044715 * m * m * m)).tanh())
    x = x + m @ p["w2"]
    loss = (x * x).mean()
    return [loss] + fg.grad(loss, list(p.values()))


def stacked_layers(layers=4, b=2, s=16, d=32, h=2, seed=0):
    """Loss and gradients of `layers` identical Llama-style layers."""
    rng = np.random.default_rng(seed)
    w = lambda *sh: fg.tensor((rng.standard_normal(sh) / math.sqrt(sh[0])).astype(np.float32),  # noqa: E731
                              requires_grad=True)
    x = fg.tensor(rng.standard_normal((b, s, d)).astype(np.float32))
    cos, sin = [fg.tensor(a) for a in rope_tables(s, d // h)]
    mask = fg.tensor(np.triu(np.full((s, s), -np.inf, np.float32), 1))
    hd, params = d // h, []
    split = lambda t: t.reshape(b, s, h, hd).permute(0, 2, 1, 3)   # noqa: E731
    for _ in range(layers):
        wq, wk, wv, wo, w1, w2 = w(d, d), w(d, d), w(d, d), w(d, d), w(d, 2 * d), w(2 * d, d)
        params += [wq, wk, wv, wo, w1, w2]
        y = rms_norm(x)
        q, k, v = split(y @ wq), split(y @ wk), split(y @ wv)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        a = softmax((q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd)) + mask)
        x = x + (a @ v).permute(0, 2, 1, 3).reshape(b, s, d) @ wo
        x = x + (rms_norm(x) @ w1).silu() @ w2
    loss = (x * x).mean()
    return [loss] + fg.grad(loss, params)
