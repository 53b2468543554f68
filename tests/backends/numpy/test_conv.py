"""NumPy conv kernels called directly (arrays in, arrays out) against torch CPU: each code path
of conv2d (im2col blocks over whole rows of the stride phases, or one GEMM per tap straight from
the padded input, 1x1 without im2col, depthwise tap loop with and without a channel multiplier,
row blocks), conv_transpose2d's overlap-add, the weight-gradient kernel (GEMM and
depthwise paths, a gradient shorter than the conv output), causal conv1d forward/backward, in
the four float dtypes."""
import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from fuelgraph.backends.numpy import conv as K
from oracle import assert_close_dtype

from .kernel_oracle import DTYPES, NP, TORCH


def arr(shape, dt, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(NP[dt])


def t(a, dt=None):
    x = torch.tensor(a.astype(np.float64))
    return x if dt is None else x.to(TORCH[dt])


def close(got, ref64, same, dt):
    assert got.dtype == NP[dt]
    assert_close_dtype(got.astype(np.float64), ref64.numpy(),
                       None if same is None else same.double().numpy(), dt, f32_rtol=3e-5,
                       f64_rtol=1e-11, slack={"bfloat16": 4e-3, "float16": 5e-4}.get(dt, 0))


def ref_and_same(fn, arrays, dt):
    ref = fn(*(t(a) if a is not None else None for a in arrays))
    same = fn(*(t(a, dt) if a is not None else None for a in arrays)) if dt in ("bfloat16",
                                                                                "float16") else None
    return ref, same


# (x, weight, bias, stride, padding per side, dilation, groups)
CONV2D = [
    ((2, 4, 7, 6), (6, 4, 3, 3), True, (1, 1), (1, 1, 1, 1), (1, 1), 1),     # whole-row im2col
    ((1, 6, 9, 8), (4, 3, 3, 2), True, (2, 1), (1, 1, 0, 0), (1, 2), 2),     # sh > 1, sw = 1
    ((2, 4, 9, 9), (4, 2, 3, 3), False, (1, 2), (0, 1, 2, 0), (2, 1), 2),    # strided windows
    ((3, 4, 5, 5), (8, 2, 1, 1), True, (1, 1), (0, 0, 0, 0), (1, 1), 2),     # 1x1
    ((2, 3, 7, 6), (3, 1, 3, 3), True, (1, 1), (1, 2, 1, 1), (1, 1), 3),     # depthwise
    ((1, 3, 7, 8), (6, 1, 3, 3), False, (2, 2), (1, 1, 1, 1), (1, 1), 3),    # multiplier 2
    ((1, 1, 5, 4), (2, 1, 2, 2), True, (1, 1), (0, 0, 0, 0), (1, 1), 1),     # one channel
]


def _torch_conv2d(x, w, b, stride, pad, dil, g):
    return TF.conv2d(TF.pad(x, (pad[2], pad[3], pad[0], pad[1])), w, b, stride, 0, dil, g)


@pytest.mark.parametrize("path", ["im2col", "shifted"])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("case", CONV2D, ids=[f"c{i}" for i in range(len(CONV2D))])
def test_conv2d(case, dt, path, monkeypatch):
    """Both GEMM paths: im2col blocks, and one GEMM per tap from the padded input (channel-rich
    convs; forced here by a threshold of one channel)."""
    xs, ws, has_b, s, p, d, g = case
    monkeypatch.setattr(K, "BLOCK_ELEMS", 300)         # several row blocks per sample
    monkeypatch.setattr(K, "SHIFTED_MIN_CHANNELS", 1 if path == "shifted" else 10 ** 9)
    x, w = arr(xs, dt, 0), arr(ws, dt, 1)
    b = arr((ws[0],), dt, 2) if has_b else None
    got = K.conv2d(x, w, *([b] if has_b else []), stride=s, padding=p, dilation=d, groups=g)
    ref, same = ref_and_same(lambda *a: _torch_conv2d(*a, s, p, d, g), [x, w, b], dt)
    close(got, ref, same, dt)
    # its weight gradient, against torch's
    gy = arr(got.shape, dt, 3)
    dw = K.conv2d_backward_weight(x, gy, stride=s, padding=p, dilation=d, groups=g,
                                  kernel_size=ws[2:])
    ref, same = ref_and_same(lambda xx, gg: torch.nn.grad.conv2d_weight(
        TF.pad(xx, (p[2], p[3], p[0], p[1])), ws, gg, s, 0, d, g), [x, gy], dt)
    close(dw, ref, same, dt)


@pytest.mark.parametrize("shifted", [False, True])
@pytest.mark.parametrize("case", [CONV2D[0], CONV2D[1], CONV2D[2], CONV2D[3], CONV2D[4]],
                         ids=["rows", "sh2", "strided", "1x1", "depthwise"])
def test_blocks_on_the_pool_threads_give_the_same_result(case, shifted, monkeypatch):
    """Forced onto the pool (two threads, one block per row): forward and weight gradient are
    bit-identical to the single-threaded run."""
    from fuelgraph.backends.numpy import common
    xs, ws, has_b, s, p, d, g = case
    x, w = arr(xs, "float32", 0), arr(ws, "float32", 1)
    extra = [arr((ws[0],), "float32", 2)] if has_b else []
    kw = dict(stride=s, padding=p, dilation=d, groups=g)
    monkeypatch.setattr(K, "BLOCK_ELEMS", 1)
    monkeypatch.setattr(K, "DEPTHWISE_CHUNK_ELEMS", 1)
    monkeypatch.setattr(K, "SHIFTED_MIN_CHANNELS", 1 if shifted else 10 ** 9)
    monkeypatch.setattr(common, "NUM_THREADS", 1)
    y1 = K.conv2d(x, w, *extra, **kw)
    gy = arr(y1.shape, "float32", 3)
    dw1 = K.conv2d_backward_weight(x, gy, kernel_size=ws[2:], **kw)
    monkeypatch.setattr(common, "NUM_THREADS", 2)
    monkeypatch.setattr(K, "PARALLEL_CONV_FLOPS", 0)
    np.testing.assert_array_equal(K.conv2d(x, w, *extra, **kw), y1)
    np.testing.assert_array_equal(K.conv2d_backward_weight(x, gy, kernel_size=ws[2:], **kw), dw1)


def test_weight_gradient_shorter_than_the_conv_output():
    """conv_transpose2d's weight gradient correlates with a gradient that stops before the
    conv output does (output_padding >= stride)."""
    x, gy = arr((1, 3, 9, 7), "float64", 0), arr((1, 3, 3, 2), "float64", 1)
    dw = K.conv2d_backward_weight(x, gy, stride=(2, 2), padding=(0, 0, 0, 0), dilation=(3, 1),
                                  groups=1, kernel_size=(2, 3))
    want = torch.nn.grad.conv2d_weight(t(x)[:, :, :8, :5], (3, 3, 2, 3), t(gy), 2, 0, (3, 1))
    np.testing.assert_allclose(dw, want.numpy(), rtol=1e-12, atol=1e-12)


# (x, weight, bias, stride, padding per side, output padding, dilation, groups)
CONVT = [
    ((2, 4, 5, 4), (4, 3, 3, 3), True, (1, 1), (0, 0, 0, 0), (0, 0), (1, 1), 1),
    ((1, 6, 4, 5), (6, 2, 3, 2), True, (2, 3), (1, 1, 0, 0), (1, 2), (2, 1), 2),
    ((2, 4, 3, 3), (4, 1, 4, 4), False, (2, 2), (1, 1, 1, 1), (0, 0), (1, 1), 4),
    ((1, 2, 2, 2), (2, 1, 1, 1), True, (4, 4), (1, 1, 1, 1), (0, 0), (1, 1), 1),
]


@pytest.mark.parametrize("path", ["im2col", "shifted"])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("case", CONVT, ids=[f"t{i}" for i in range(len(CONVT))])
def test_conv_transpose2d(case, dt, path, monkeypatch):
    xs, ws, has_b, s, p, op, d, g = case
    monkeypatch.setattr(K, "BLOCK_ELEMS", 200)
    monkeypatch.setattr(K, "SHIFTED_MIN_CHANNELS", 1 if path == "shifted" else 10 ** 9)
    x, w = arr(xs, dt, 0), arr(ws, dt, 1)
    b = arr((ws[1] * g,), dt, 2) if has_b else None
    got = K.conv_transpose2d(x, w, *([b] if has_b else []), stride=s, padding=p,
                             output_padding=op, dilation=d, groups=g)
    ref, same = ref_and_same(lambda xx, ww, bb: TF.conv_transpose2d(
        xx, ww, bb, s, (p[0], p[2]), op, g, d), [x, w, b], dt)
    close(got, ref, same, dt)


def test_conv_transpose2d_asymmetric_padding_is_the_adjoint():
    """Per-side padding (what the gradient of a 'same' conv with an even kernel needs):
    <conv_transpose2d(g), x> == <g, conv2d(x)>."""
    x, w = arr((2, 3, 6, 7), "float64", 0), arr((4, 3, 4, 2), "float64", 1)
    p = (1, 2, 0, 1)
    y = K.conv2d(x, w, stride=(1, 1), padding=p, dilation=(1, 1), groups=1)
    g = arr(y.shape, "float64", 2)
    dx = K.conv_transpose2d(g, w, stride=(1, 1), padding=p, output_padding=(0, 0),
                            dilation=(1, 1), groups=1)
    assert dx.shape == x.shape
    np.testing.assert_allclose((dx * x).sum(), (g * y).sum(), rtol=1e-12)


CAUSAL = [((2, 3, 9), 4, True, False), ((2, 3, 9), 4, True, True), ((1, 2, 2), 4, True, True),
          ((2, 5, 6), 1, False, True), ((3, 4, 17), 3, False, False)]


def _torch_causal(x, w, b, silu):
    k = w.shape[-1]
    y = TF.conv1d(TF.pad(x, (k - 1, 0)), w.reshape(w.shape[0], 1, k), b, groups=x.shape[1])
    return TF.silu(y) if silu else y


@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("case", CAUSAL, ids=[f"k{i}" for i in range(len(CAUSAL))])
def test_causal_conv1d_forward_and_backward(case, dt):
    xs, k, has_b, silu = case
    x, w, g = arr(xs, dt, 0), arr((xs[1], k), dt, 1), arr(xs, dt, 3)
    b = arr((xs[1],), dt, 2) if has_b else None
    extra = [b] if has_b else []
    got = K.causal_conv1d(x, w, *extra, use_silu=silu)
    ref, same = ref_and_same(lambda *a: _torch_causal(*a, silu), [x, w, b], dt)
    close(got, ref, same, dt)
    dx, dw, db = K.causal_conv1d_backward(x, w, g, *extra, use_silu=silu)

    def grads(xx, ww, bb, gg):
        ins = [v.requires_grad_(True) for v in (xx, ww) + ((bb,) if bb is not None else ())]
        out = _torch_causal(*ins[:2], ins[2] if bb is not None else None, silu)
        return torch.autograd.grad(out, ins, gg)

    ref = grads(*(t(a) if a is not None else None for a in (x, w, b, g)))
    same = grads(*(t(a, dt) if a is not None else None for a in (x, w, b, g))) \
        if dt in ("bfloat16", "float16") else [None] * 3
    for mine, r, s_ in zip((dx, dw, db), ref, same):
        close(mine, r, s_, dt)
    if not has_b:      # dbias is returned anyway: the sum of the gradient through silu
        assert db.shape == (xs[1],)


@pytest.mark.parametrize("dt", ["float32", "float64"])
@pytest.mark.parametrize("shape", [(2, 3, 9), (1, 300, 7)], ids=["samples", "channel-parts"])
def test_causal_conv1d_time_major_views(shape, dt, monkeypatch):
    """x and grad as transposed views of time-major arrays (Mamba's layout, x sliced out of a
    wider projection): computed time-major, results returned as time-major views."""
    monkeypatch.setattr(K.common, "NUM_THREADS", 3)       # one sample: three channel parts
    monkeypatch.setattr(K, "TM_PART_ELEMS", 500)          # ... or four of about 500 elements
    b, c, l = shape
    assert len(K._tm_spans(b, c, l)) == (4 if c >= 256 else b)
    wide = arr((b, l, c + 5), dt, 0)
    x = wide[..., :c].transpose(0, 2, 1)
    g = arr((b, l, c), dt, 3).transpose(0, 2, 1)
    w, bias = arr((c, 1, 4), dt, 1), arr((c,), dt, 2)
    assert K._time_major(x) and K._time_major(g)
    got = K.causal_conv1d(x, w, bias, use_silu=True)
    assert got.strides[1] == got.itemsize               # time-major
    close(got, _torch_causal(t(x), t(w), t(bias), True), None, dt)
    ins = [t(a).requires_grad_(True) for a in (x, w, bias)]
    ref = torch.autograd.grad(_torch_causal(*ins, True), ins, t(g))
    for mine, r in zip(K.causal_conv1d_backward(x, w, g, bias, use_silu=True), ref):
        close(mine, r, None, dt)
