"""Convolution idioms fuse: a causal depthwise conv written as a left pad plus a sum of shifted
slices times weight columns (W = 2, 3, 4; with and without bias and silu) and a 3x3 conv2d
written as pad + nine strided slices + matmul fuse exactly once, keep torch's values and
gradients; every recipe (any kernel size, stride, padding, dilation, groups, with or without
bias, 32- and 16-bit) re-fuses into its op with the params read back off the graph; near misses
do not fuse."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph.ir import ops
from fuelgraph.ir.node import toposort
from fuelgraph.registry.core import FusedOps, call_fused


@pytest.fixture(scope="module", autouse=True)
def _torch_one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def rand(shape, seed, dtype=np.float64):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def fused_nodes(outs):
    res = fg.optimize(outs if isinstance(outs, list) else [outs])
    return [n for n in toposort(res.outputs) if isinstance(n.op, ops.Fused)]


def assert_grads(build, ref, arrays, seed=11):
    """Value and gradient of sum(out * G) w.r.t. every input: ours (fused) vs torch."""
    ts = [torch.tensor(a, requires_grad=True) for a in arrays]
    out_t = ref(*ts)
    g = rand(tuple(out_t.shape), seed)
    out_t.backward(torch.tensor(g))
    xs = [fg.tensor(a) for a in arrays]
    out = build(*xs)
    np.testing.assert_allclose(out.numpy(), out_t.detach().numpy(), rtol=1e-10, atol=1e-10)
    grads = fg.grad((out * fg.tensor(g)).sum(), xs)
    for got, t in zip(grads, ts):
        np.testing.assert_allclose(got.numpy(), t.grad.numpy(), rtol=1e-10, atol=1e-10)
    return grads


# ---- causal conv1d idioms ---------------------------------------------------------------------
def causal_by_hand(x, w, b, silu, spelling=0):
    k, length = w.shape[1], x.shape[2]
    xp = x.pad(((0, 0), (0, 0), (k - 1, 0)))
    y = xp[:, :, 0:length] * (w[:, 0:1] if spelling == 0 else w[:, 0, None])
    for j in range(1, k):
        col = w[:, j:j + 1] if spelling == 0 else w[:, j].reshape(-1, 1)
        y = y + xp[:, :, j:j + length] * col
    if b is not None:
        y = y + (b[:, None] if spelling == 0 else b.reshape(-1, 1))
    if silu:
        y = y.silu() if spelling == 0 else y * (1.0 / (1.0 + (-y).exp()))
    return y


def causal_torch(x, w, b, silu):
    k = w.shape[1]
    y = TF.conv1d(TF.pad(x, (k - 1, 0)), w[:, None, :], b, groups=x.shape[1])
    return TF.silu(y) if silu else y


@pytest.mark.parametrize("spelling", [0, 1])
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("k", [2, 3, 4])
def test_causal_conv1d_idiom_fuses_once(k, bias, silu, spelling):
    x, w, b = rand((2, 3, 9), 0), rand((3, k), 1), rand((3,), 2)
    arrays = [x, w, b] if bias else [x, w]
    build = lambda *t: causal_by_hand(t[0], t[1], t[2] if bias else None, silu, spelling)  # noqa
    y = build(*(fg.tensor(a) for a in arrays))
    nodes = fused_nodes(y)
    assert [n.op.id for n in nodes] == [FusedOps.CAUSAL_CONV1D]
    assert nodes[0].op.params.use_silu is silu and len(nodes[0].srcs) == len(arrays)
    grads = assert_grads(build, lambda *t: causal_torch(t[0], t[1], t[2] if bias else None, silu),
                         arrays)
    assert fg.explain(grads).fused_ops == {"causal_conv1d_backward": 1}


def test_causal_conv1d_idiom_in_float16_fuses():
    x, w, b = (rand(s, i, np.float16) for i, s in enumerate([(2, 4, 16), (4, 4), (4,)]))
    y = causal_by_hand(fg.tensor(x), fg.tensor(w), fg.tensor(b), True)
    assert fg.explain(y).fused_ops == {"causal_conv1d": 1}
    want = causal_torch(*(torch.tensor(a.astype(np.float64)) for a in (x, w, b)), True).numpy()
    np.testing.assert_allclose(y.numpy().astype(np.float64), want, rtol=4e-3, atol=4e-3)


def test_causal_near_misses_do_not_fuse():
    x, w = fg.tensor(rand((2, 3, 9), 0)), fg.tensor(rand((3, 4), 1))
    xp = x.pad(((0, 0), (0, 0), (2, 0)))           # one zero short: not causal conv of width 4
    y = xp[:, :, 0:7] * w[:, 0:1]
    for j in range(1, 3):
        y = y + xp[:, :, j:j + 7] * w[:, j:j + 1]
    assert fg.explain(y).fused_ops == {}
    # an intermediate term read elsewhere stays: fusing would compute it twice
    y = causal_by_hand(x, w, None, False)
    term = y.node.srcs[0]
    assert fg.explain([y, fg.Tensor(term) * 2.0]).fused_ops == {}


# ---- conv2d 3x3 idiom --------------------------------------------------------------------------
def conv3x3_by_hand(x, w, b, stride, padding, dilation):
    (sh, sw), (dh, dw) = stride, dilation
    n, co = x.shape[0], w.shape[0]
    xp = x.pad(((0, 0), (0, 0), (padding[0],) * 2, (padding[1],) * 2)) if padding else x
    ho = (xp.shape[2] - 2 * dh - 1) // sh + 1
    wo = (xp.shape[3] - 2 * dw - 1) // sw + 1
    cols = fg.stack([xp[:, :, i * dh: i * dh + ho * sh: sh, j * dw: j * dw + wo * sw: sw]
                     for i in range(3) for j in range(3)], 2)
    y = (w.reshape(co, -1) @ cols.reshape(n, -1, ho * wo)).reshape(n, co, ho, wo)
    return y + b.reshape(co, 1, 1) if b is not None else y


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("stride,padding,dilation", [((1, 1), (1, 1), (1, 1)),
                                                     ((2, 1), (0, 2), (1, 2)),
                                                     ((1, 1), None, (1, 1)),
                                                     ((2, 2), None, (2, 1))])
def test_conv2d_3x3_idiom_fuses_once(bias, stride, padding, dilation):
    x, w, b = rand((2, 4, 9, 8), 3), rand((5, 4, 3, 3), 4), rand((5,), 5)
    arrays = [x, w, b] if bias else [x, w]
    build = lambda *t: conv3x3_by_hand(t[0], t[1], t[2] if bias else None, stride, padding,  # noqa
                                       dilation)
    y = build(*(fg.tensor(a) for a in arrays))
    nodes = fused_nodes(y)
    assert [n.op.id for n in nodes] == [FusedOps.CONV2D]
    p = nodes[0].op.params
    pad = (padding or (0, 0))
    assert (p.stride, p.padding, p.dilation, p.groups) == \
        (stride, (pad[0], pad[0], pad[1], pad[1]), dilation, 1)
    grads = assert_grads(build, lambda *t: TF.conv2d(t[0], t[1], t[2] if bias else None, stride,
                                                     pad, dilation), arrays)
    assert fg.explain(grads).fused_ops == {"conv_transpose2d": 1, "conv2d_backward_weight": 1}


def test_conv2d_idiom_in_bfloat16_fuses():
    x, w = fg.tensor(rand((1, 3, 6, 6), 6), dtype=fg.bfloat16), \
        fg.tensor(rand((4, 3, 3, 3), 7), dtype=fg.bfloat16)
    y = conv3x3_by_hand(x, w, None, (1, 1), (1, 1), (1, 1))
    assert fg.explain(y).fused_ops == {"conv2d": 1}


def test_conv2d_near_miss_does_not_fuse():
    x, w = fg.tensor(rand((1, 3, 6, 6), 6)), fg.tensor(rand((4, 3, 3, 3), 7))
    xp = x.pad(((0, 0), (0, 0), (1, 1), (1, 1)))
    taps = [(i, j) for i in range(3) for j in range(3)]
    taps[4] = (2, 2)                                # a repeated tap: not a convolution
    cols = fg.stack([xp[:, :, i:i + 6, j:j + 6] for i, j in taps], 2)
    y = (w.reshape(4, -1) @ cols.reshape(1, -1, 36)).reshape(1, 4, 6, 6)
    assert fg.explain(y).fused_ops == {}
    assert "conv2d" in fg.explain(y).near_misses


# ---- recipes re-fuse ---------------------------------------------------------------------------
def refused(entry_id, srcs, params):
    e = fg.default_registry().entry(entry_id)
    lowered = e.lower(srcs, params)
    nodes = fused_nodes(list(lowered))
    assert [n.op.id for n in nodes] == [entry_id]
    assert len(nodes[0].srcs) == len(srcs)
    return lowered, nodes[0].op.params


CONV2D_SETTINGS = [  # (x, weight, stride, padding, dilation, groups)
    ((2, 4, 7, 6), (6, 4, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
    ((1, 6, 9, 8), (4, 3, 3, 2), (2, 1), (1, 1, 0, 0), (1, 2), 2),
    ((1, 2, 6, 7), (4, 2, 4, 2), (1, 1), (1, 2, 1, 1), (1, 1), 1),
    ((3, 4, 5, 5), (8, 2, 1, 1), (1, 1), (0, 0, 0, 0), (1, 1), 2),
    ((1, 3, 9, 9), (3, 1, 5, 5), (2, 3), (2, 0, 1, 3), (1, 1), 3),
]


@pytest.mark.parametrize("dtype", [fg.float32, fg.bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("setting", CONV2D_SETTINGS)
def test_conv2d_recipe_refuses(setting, bias, dtype):
    xs, ws, s, p, d, g = setting
    srcs = [fg.tensor(rand(xs, 0), dtype=dtype), fg.tensor(rand(ws, 1), dtype=dtype)]
    if bias:
        srcs.append(fg.tensor(rand((ws[0],), 2), dtype=dtype))
    y = call_fused(FusedOps.CONV2D, *srcs, stride=s, padding=p, dilation=d, groups=g)
    lowered, params = refused(FusedOps.CONV2D, srcs, y.node.op.params)
    assert params == y.node.op.params
    np.testing.assert_allclose(lowered[0].numpy().astype(np.float64),
                               y.numpy().astype(np.float64), rtol=2e-2, atol=2e-2)


CONVT_SETTINGS = [  # (x, weight, stride, padding, output_padding, dilation, groups)
    ((2, 4, 5, 4), (4, 3, 3, 3), (1, 1), (0, 0, 0, 0), (0, 0), (1, 1), 1),
    ((1, 6, 4, 5), (6, 2, 3, 2), (2, 3), (1, 1, 0, 0), (1, 2), (2, 1), 2),
    ((2, 4, 3, 3), (4, 1, 4, 4), (2, 2), (1, 1, 1, 1), (0, 0), (1, 1), 4),
    ((1, 2, 3, 4), (2, 3, 4, 3), (1, 1), (1, 2, 2, 0), (0, 0), (1, 1), 1),   # asymmetric
]


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("setting", CONVT_SETTINGS)
def test_conv_transpose2d_recipe_refuses(setting, bias):
    xs, ws, s, p, op, d, g = setting
    srcs = [fg.tensor(rand(xs, 0)), fg.tensor(rand(ws, 1))]
    if bias:
        srcs.append(fg.tensor(rand((ws[1] * g,), 2)))
    y = call_fused(FusedOps.CONV_TRANSPOSE2D, *srcs, stride=s, padding=p, output_padding=op,
                   dilation=d, groups=g)
    lowered, params = refused(FusedOps.CONV_TRANSPOSE2D, srcs, y.node.op.params)
    # only bottom padding - output padding shows in the graph; the values are what count
    assert (params.stride, params.dilation, params.groups, params.padding[0::2]) == \
        (s, d, g, p[0::2])
    refused_y = call_fused(FusedOps.CONV_TRANSPOSE2D, *srcs, **params.__dict__)
    np.testing.assert_allclose(refused_y.numpy(), y.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [fg.float32, fg.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("silu", [False, True])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("k", [2, 4, 5])
def test_causal_conv1d_recipe_refuses(k, bias, silu, dtype):
    srcs = [fg.tensor(rand((2, 3, 7), 0), dtype=dtype), fg.tensor(rand((3, k), 1), dtype=dtype)]
    if bias:
        srcs.append(fg.tensor(rand((3,), 2), dtype=dtype))
    y = F.causal_conv1d(*srcs[:2], srcs[2] if bias else None, silu)
    _, params = refused(FusedOps.CAUSAL_CONV1D, srcs, y.node.op.params)
    assert params == y.node.op.params


def test_causal_conv1d_with_one_tap_is_elementwise():
    """With W = 1 there is no window: canonicalization turns the recipe's sum over the one tap
    into an elementwise scale (a sum over a size-1 axis is a reshape), so the lowered graph is
    plain glue and is not re-fused; its value is still the op's."""
    srcs = [fg.tensor(rand((2, 3, 7), 0)), fg.tensor(rand((3, 1), 1)), fg.tensor(rand((3,), 2))]
    y = F.causal_conv1d(*srcs, True)
    lowered = fg.default_registry().entry(FusedOps.CAUSAL_CONV1D).lower(srcs, y.node.op.params)
    np.testing.assert_allclose(fg.realize(list(lowered))[0], y.numpy(), rtol=1e-6, atol=1e-6)
