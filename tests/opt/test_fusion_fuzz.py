"""Property test: on random chains of hand-written idioms (softmax, RMS norm, layer norm, RoPE,
linear) with random extra readers of their intermediates, the optimized graph (fused wherever a
pattern verifies) computes the same values as the reference mode (every fused op lowered) and
as NumPy in float64, and its gradients agree with the reference mode too."""
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

import fuelgraph as fg

D = 8


def softmax(x, taps):
    e = (x - x.max(-1, keepdim=True)).exp()
    taps.append(e)
    return e / e.sum(-1, keepdim=True)


def rms(x, taps):
    ms = (x * x).mean(-1, keepdim=True)
    taps.append(ms)
    return x * (ms + 1e-6).rsqrt()


def layer_norm(x, taps):
    xc = x - x.mean(-1, keepdim=True)
    taps.append(xc)
    return xc / ((xc * xc).mean(-1, keepdim=True) + 1e-5).sqrt()


def rope(x, taps, c=np.cos(np.arange(4 * D).reshape(4, D) / 7.0), s=np.sin(np.arange(4 * D).reshape(4, D) / 5.0)):
    rot = fg.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    taps.append(rot)
    return x * fg.tensor(c) + rot * fg.tensor(s)


def linear(x, taps, w=np.random.default_rng(7).standard_normal((D, D)) / 3, b=np.arange(D) / 10.0):
    h = x @ fg.tensor(w)
    taps.append(h)
    return h + fg.tensor(b)


IDIOMS = [softmax, rms, layer_norm, rope, linear]

# float64 NumPy references of the same idioms
def np_softmax(x):
    e = np.exp(x - x.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


NP = {
    softmax: np_softmax,
    rms: lambda x: x / np.sqrt((x * x).mean(-1, keepdims=True) + 1e-6),
    layer_norm: lambda x: (x - x.mean(-1, keepdims=True)) / np.sqrt(
        ((x - x.mean(-1, keepdims=True)) ** 2).mean(-1, keepdims=True) + 1e-5),
    rope: lambda x: x * rope.__defaults__[0] + np.concatenate([-x[..., D // 2:], x[..., :D // 2]], -1)
    * rope.__defaults__[1],
    linear: lambda x: x @ linear.__defaults__[0] + linear.__defaults__[1],
}


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.sampled_from(range(len(IDIOMS))), st.booleans()), min_size=1,
                max_size=4), st.integers(0, 2 ** 16))
def test_fused_graph_equals_reference(chain, seed):
    a = np.random.default_rng(seed).standard_normal((2, 4, D))
    x = fg.tensor(a, requires_grad=True)
    y, ref, outs = x, a, []
    for k, export in chain:
        taps = []
        y = IDIOMS[k](y, taps)
        ref = NP[IDIOMS[k]](ref)
        if export:                 # an extra reader of the idiom's intermediate
            outs.append(taps[0] * 1.5)
    if len(outs) == 0:             # nothing shared: every idiom of the chain fuses
        assert sum(fg.explain([y]).fused_ops.values()) == len(chain), chain
    outs = [y] + outs
    (gx,) = fg.grad((y * y).sum(), [x])
    got = fg.realize(outs + [gx])
    want = fg.realize(outs + [gx], lower_all=True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-9, atol=1e-11)
    np.testing.assert_allclose(got[0], ref, rtol=1e-9, atol=1e-11)
