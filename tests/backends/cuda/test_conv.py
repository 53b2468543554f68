"""Convolutions on the CUDA backend: the Triton causal conv1d kernels (forward, backward with
the weight/bias gradients reduced over batch and length) and the cuDNN wrappers (per-side
padding, every channels-last mode) against float64 torch references, then the ops through
fuelgraph on device="cuda" (values, gradients through the fused ops, float64 lowering to the
recipe, idiom fusion, channels-last inputs). Skips cleanly without a GPU unless
TRITON_INTERPRET=1 (then the kernel-level tests run on CPU tensors, tiny shapes)."""
from __future__ import annotations

import numpy as np
import pytest

from .cuda_oracle import (DEV, DTYPE_IDS, DTYPES, F64, HAS_CUDA, INTERPRET, KERNEL_TESTS,
                          assert_half_and_f32_only, assert_lowered_on_cuda, check, on_gpu,
                          poison, rand, torch)

pytestmark = KERNEL_TESTS

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import conv as K

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402

TF = torch.nn.functional


def ref_causal(x, w, b, silu):
    x, w = x.to(F64), w.to(F64)
    k = w.shape[-1]
    y = TF.conv1d(TF.pad(x, (k - 1, 0)), w.reshape(w.shape[0], 1, k),
                  None if b is None else b.to(F64), groups=x.shape[1])
    return TF.silu(y) if silu else y


# (B, C, L, W, weight as [C, 1, W], bias, silu)
CAUSAL = [(2, 3, 9, 4, False, True, True), (1, 2, 2, 4, False, True, False),
          (2, 5, 6, 1, False, False, True), (3, 4, 17, 3, True, False, False)]
if HAS_CUDA:
    CAUSAL += [(2, 64, 1000, 4, False, True, True), (4, 256, 4096, 4, False, True, True),
               (1, 3000, 300, 2, True, False, False), (8, 16, 2049, 4, False, True, False)]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CAUSAL, ids=str)
def test_causal_conv1d_kernels(case, dtype):
    b_, c, length, k, three_d, has_b, silu = case
    x, g = rand((b_, c, length), dtype), rand((b_, c, length), dtype)
    w = rand((c, 1, k) if three_d else (c, k), dtype, 0.5)
    bias = [rand((c,), dtype)] if has_b else []
    poison()
    y = K.causal_conv1d(x, w, *bias, use_silu=silu)
    check(y, ref_causal(x, w, bias[0] if bias else None, silu), dtype, name="y")
    poison()
    dx, dw, db = K.causal_conv1d_backward(x, w, g, *bias, use_silu=silu)
    ins = [t.to(F64).requires_grad_(True) for t in [x, w] + bias]
    out = ref_causal(ins[0], ins[1], ins[2] if has_b else None, silu)
    want = torch.autograd.grad(out, ins, g.to(F64))
    assert dx.dtype == dtype and dw.shape == w.shape and db.shape == (c,)
    check(dx, want[0], dtype, name="dx")
    # dw, db sum over B*L products: judged against the magnitude of what they sum
    scale_w = torch.ones_like(want[1]) * (x.to(F64).abs().mean() * g.to(F64).abs().sum() / c)
    check(dw, want[1], dtype, name="dw", scale_ref=scale_w)
    if has_b:
        check(db, want[2], dtype, name="db", scale_ref=torch.ones_like(want[2]) *
              g.to(F64).abs().sum() / c)


# (B, C, L, W, rows of 8 per program): several position blocks per row, halos of one and
# two chunks (W - 1 > 8), lengths that are not a multiple of 8
CAUSAL_BLOCKS = [(2, 3, 45, 4, 2), (1, 2, 37, 11, 1), (2, 2, 16, 9, 1), (1, 3, 13, 2, 4)]


@pytest.mark.parametrize("case", CAUSAL_BLOCKS, ids=str)
def test_causal_conv1d_kernels_across_position_blocks(case, monkeypatch):
    b_, c, length, k, rows = case
    for name in ("FWD_ROWS", "BWD_ROWS"):
        monkeypatch.setattr(K, name, rows)
    x, g = rand((b_, c, length), torch.float32), rand((b_, c, length), torch.float32)
    w, bias = rand((c, k), torch.float32, 0.5), rand((c,), torch.float32)
    check(K.causal_conv1d(x, w, bias, use_silu=True), ref_causal(x, w, bias, True),
          torch.float32, name="y")
    dx, dw, db = K.causal_conv1d_backward(x, w, g, bias, use_silu=True)
    ins = [t.to(F64).requires_grad_(True) for t in (x, w, bias)]
    want = torch.autograd.grad(ref_causal(*ins, True), ins, g.to(F64))
    for got, ref, name in zip((dx, dw, db), want, ("dx", "dw", "db")):
        check(got, ref, torch.float32, name=name)


def test_causal_kernels_declare_float64_unsupported():
    assert_half_and_f32_only(K.causal_conv1d, K.causal_conv1d_backward)


# cuDNN wrappers: (x, weight, stride, padding per side, dilation, groups)
CONV = [((2, 4, 7, 6), (6, 4, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
        ((1, 6, 9, 8), (4, 3, 3, 2), (2, 1), (1, 2, 0, 1), (2, 1), 2),
        ((2, 3, 6, 7), (3, 1, 4, 2), (1, 1), (1, 2, 0, 1), (1, 1), 3)]
if HAS_CUDA:
    CONV += [((8, 64, 28, 28), (64, 64, 3, 3), (1, 1), (1, 1, 1, 1), (1, 1), 1),
             ((4, 32, 30, 30), (32, 1, 3, 3), (2, 2), (1, 1, 1, 1), (1, 1), 32)]


@pytest.mark.parametrize("mode", ["always", "auto", "never"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", CONV, ids=str)
def test_cudnn_conv_wrappers(case, dtype, mode, monkeypatch):
    monkeypatch.setattr(K, "CHANNELS_LAST", mode)
    xs, ws, s, p, d, g = case
    x, w, b = rand(xs, dtype), rand(ws, dtype, 0.3), rand((ws[0],), dtype)
    xp = TF.pad(x.to(F64), (p[2], p[3], p[0], p[1]))
    y = K.conv2d(x, w, b, stride=s, padding=p, dilation=d, groups=g)
    check(y, TF.conv2d(xp, w.to(F64), b.to(F64), s, 0, d, g), dtype, name="conv2d")
    gy = rand(tuple(y.shape), dtype)
    dw = K.conv2d_backward_weight(x, gy, stride=s, padding=p, dilation=d, groups=g,
                                  kernel_size=ws[2:])
    want = torch.nn.grad.conv2d_weight(xp, ws, gy.to(F64), s, 0, d, g)
    # a weight gradient sums N * Ho * Wo products: rounding scales with their absolute sum
    mag = torch.nn.grad.conv2d_weight(xp.abs(), ws, gy.to(F64).abs(), s, 0, d, g)
    check(dw, want, dtype, name="dweight", scale_ref=mag)
    # the input gradient through conv_transpose2d with per-side padding
    hp, wp = xs[2] + p[0] + p[1], xs[3] + p[2] + p[3]
    op = ((hp - d[0] * (ws[2] - 1) - 1) % s[0], (wp - d[1] * (ws[3] - 1) - 1) % s[1])
    dx = K.conv_transpose2d(gy, w, stride=s, padding=p, output_padding=op, dilation=d, groups=g)
    xt = x.to(F64).requires_grad_(True)
    TF.conv2d(TF.pad(xt, (p[2], p[3], p[0], p[1])), w.to(F64), None, s, 0, d, g).backward(
        gy.to(F64))
    check(dx, xt.grad, dtype, name="dx")


@pytest.mark.parametrize("mode", ["always", "never"])
def test_cudnn_conv_transpose2d_with_bias(mode, monkeypatch):
    monkeypatch.setattr(K, "CHANNELS_LAST", mode)
    x, w, b = rand((2, 4, 5, 4), torch.float32), rand((4, 3, 4, 4), torch.float32), \
        rand((6,), torch.float32)
    y = K.conv_transpose2d(x, w, b, stride=(2, 2), padding=(1, 1, 1, 1), output_padding=(1, 0),
                           dilation=(1, 1), groups=2)
    want = TF.conv_transpose2d(x.to(F64), w.to(F64), b.to(F64), 2, 1, (1, 0), 2)
    check(y, want, torch.float32, name="conv_transpose2d")


# ---------------------------------------------------------------------------- API on the GPU
def _np(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@on_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_ops_and_gradients_on_cuda(dtype):
    tol = 2e-5 if dtype == "float32" else 3e-2
    td = getattr(torch, dtype)
    arrays = [_np((2, 8, 12, 10), 0), _np((6, 4, 3, 3), 1), _np((6,), 2)]
    xs = [fg.tensor(a, dtype=dtype, device="cuda") for a in arrays]
    ts = [torch.tensor(a, device="cuda").to(td).double().requires_grad_(True) for a in arrays]
    y = F.conv2d(*xs, 2, 1, 1, 2)
    yt = TF.conv2d(*ts, 2, 1, 1, 2)
    g = _np(tuple(yt.shape), 3)
    grads = fg.grad((y * fg.tensor(g, dtype=dtype, device="cuda")).astype(fg.float32).sum(), xs)
    yt.backward(torch.tensor(g, device="cuda").to(td).double())
    assert fg.explain(grads).fused_ops == {"conv_transpose2d": 1, "conv2d_backward_weight": 1}
    for got, want in [(y, yt)] + list(zip(grads, [t.grad for t in ts])):
        np.testing.assert_allclose(got.numpy().astype(np.float64), want.detach().cpu().numpy(),
                                   rtol=tol, atol=tol * 4)
    xc = [fg.tensor(a, dtype=dtype, device="cuda") for a in
          (_np((2, 16, 50), 4), _np((16, 4), 5), _np((16,), 6))]
    yc = F.causal_conv1d(*xc, True)
    assert fg.explain(yc).fused_ops == {"causal_conv1d": 1}
    want = ref_causal(*(torch.tensor(t.numpy().astype(np.float32)) for t in xc), True)
    np.testing.assert_allclose(yc.numpy().astype(np.float64), want.numpy(), rtol=tol, atol=tol)


@on_gpu
def test_float64_causal_conv1d_lowers_to_recipe():
    x, w, b = (torch.randn(s, dtype=F64, device="cuda") for s in ((2, 3, 9), (3, 4), (3,)))
    y = F.causal_conv1d(fg.from_torch(x), fg.from_torch(w), fg.from_torch(b), True)
    assert_lowered_on_cuda(y, "causal_conv1d")
    torch.testing.assert_close(y.to_torch(), ref_causal(x, w, b, True), rtol=1e-12, atol=1e-12)


@on_gpu
def test_channels_last_input_and_idiom_on_cuda():
    x = torch.randn(2, 8, 10, 10, device="cuda").to(memory_format=torch.channels_last)
    w = torch.randn(8, 8, 3, 3, device="cuda")
    y = F.conv2d(fg.from_torch(x), fg.from_torch(w), None, 1, 1)
    want = TF.conv2d(x.double(), w.double(), None, 1, 1)     # float32 means no TF32 here
    torch.testing.assert_close(y.to_torch().double(), want, rtol=1e-5, atol=1e-5)
    xc = fg.tensor(_np((2, 3, 9), 0), device="cuda")
    wc = fg.tensor(_np((3, 4), 1), device="cuda")
    xp = xc.pad(((0, 0), (0, 0), (3, 0)))
    z = xp[:, :, 0:9] * wc[:, 0:1]
    for j in range(1, 4):
        z = z + xp[:, :, j:j + 9] * wc[:, j:j + 1]
    assert fg.explain(z).fused_ops == {"causal_conv1d": 1}
    want = ref_causal(torch.tensor(_np((2, 3, 9), 0)), torch.tensor(_np((3, 4), 1)), None, False)
    np.testing.assert_allclose(z.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)
    assert DEV == "cuda"
