"""RMS / layer norm over the last dim (forward and backward helpers) on the CUDA backend: the
Triton kernels (backends/cuda/kernels/norm.py) against float64 torch references (spec §3, §4,
§8, §9), and the ops through fuelgraph on device="cuda". Skips cleanly without a GPU unless
TRITON_INTERPRET=1 (then the kernel-level tests run in Triton's CPU interpreter)."""
from __future__ import annotations

import numpy as np
import pytest

from .cuda_oracle import (DTYPE_IDS, DTYPES, DT, F64, HAS_CUDA, INTERPRET, KERNEL_TESTS,
                          ROW_SHAPES, assert_half_and_f32_only, assert_lowered_on_cuda, check,
                          close, np_rand, on, on_gpu, poison, rand, torch, vjp)

pytestmark = KERNEL_TESTS

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import norm as K

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402


def ref_rms(x, eps):
    x = x.to(F64)
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def ref_ln(x, eps):
    x = x.to(F64)
    mu = x.mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps)


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
def test_rms_norm(shape, dtype):
    eps = 1e-6
    x = rand(shape, dtype, 2.0)
    g = rand(shape, dtype)
    poison()
    y = K.rms_norm_last_dim(x, eps=eps)
    check(y, ref_rms(x, eps), dtype, name="rms")
    poison()
    dx = K.rms_norm_last_dim_backward(x, g, eps=eps)
    check(dx, vjp(lambda t: ref_rms(t, eps), x, g), dtype, name="rms-bwd")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(1, 2048), (3, 7), (4, 33, 100), (32, 2048)], ids=str)
def test_add_rms_norm(shape, dtype):
    """s = x + r rounded to the dtype, y = rms_norm(s) rounded, times the weight."""
    eps = 1e-5
    x, r, w = rand(shape, dtype, 2.0), rand(shape, dtype), rand(shape[-1:], dtype)
    poison()
    s, y = K.add_rms_norm(x, r, w, eps=eps)
    check(s, x.to(F64) + r.to(F64), dtype, name="add")
    check(y, ref_rms(s, eps).to(dtype).to(F64) * w.to(F64), dtype, name="add-rms")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
def test_layer_norm(shape, dtype):
    eps = 1e-5
    x = (rand(shape, dtype, 2.0).to(F64) + 3.0).to(dtype)     # non-zero mean
    g = rand(shape, dtype)
    poison()
    y = K.layer_norm_last_dim(x, eps=eps)
    check(y, ref_ln(x, eps), dtype, name="ln")
    poison()
    dx = K.layer_norm_last_dim_backward(x, g, eps=eps)
    check(dx, vjp(lambda t: ref_ln(t, eps), x, g), dtype, name="ln-bwd")


def test_norms_large_eps_and_spec_formula():
    x = rand((9, 50), torch.float32, 0.1)
    g = rand((9, 50), torch.float32)
    eps = 0.5
    check(K.rms_norm_last_dim(x, eps=eps), ref_rms(x, eps), torch.float32)
    # spec §9 closed form
    x64, g64 = x.to(F64), g.to(F64)
    den = (x64 * x64).mean(-1, keepdim=True) + eps
    s = (g64 * x64).sum(-1, keepdim=True)
    ref = (g64 - x64 * s / (50 * den)) / torch.sqrt(den)
    check(K.rms_norm_last_dim_backward(x, g, eps=eps), ref, torch.float32)
    check(K.layer_norm_last_dim_backward(x, g, eps=eps),
          vjp(lambda t: ref_ln(t, eps), x, g), torch.float32)


def test_kernels_declare_float64_unsupported():
    assert_half_and_f32_only(K.rms_norm_last_dim, K.layer_norm_last_dim,
                             K.rms_norm_last_dim_backward, K.layer_norm_last_dim_backward)


# ----------------------------------------------------------------------------- API on cuda
@on_gpu
@pytest.mark.parametrize("dtype", list(DT))
def test_norms_vs_torch(dtype):
    tol = DT[dtype][2]
    x, xt = on(np_rand((64, 96)), dtype)
    close(F.rms_norm_last_dim(x, 1e-6).numpy(),
          torch.nn.functional.rms_norm(xt.float(), (96,), eps=1e-6), tol)
    close(F.layer_norm_last_dim(x, 1e-5).numpy(),
          torch.nn.functional.layer_norm(xt.float(), (96,), eps=1e-5), tol)


@on_gpu
@pytest.mark.parametrize("dtype", list(DT))
def test_add_rms_norm_vs_torch(dtype):
    """The op on the GPU as transformers' Llama computes a residual add and its RMSNorm."""
    tol = DT[dtype][2]
    (x, xt), (r, rt) = on(np_rand((5, 96)), dtype), on(np_rand((5, 96)) * 3, dtype)
    w, wt = on(np_rand((96,)), dtype)
    s, y = F.add_rms_norm(x, r, w, 1e-6)
    st = xt + rt
    yt = wt * torch.nn.functional.rms_norm(st.float(), (96,), eps=1e-6).to(st.dtype)
    close(s.numpy(), st, tol)
    close(y.numpy(), yt, tol)
    assert fg.explain([s, y]).fused_ops == {"add_rms_norm": 1}


@on_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gradients_through_fused_ops(dtype):
    tol = DT[dtype][2] * 4
    a = np_rand((16, 64))
    x = fg.tensor(a, dtype=dtype, device="cuda", requires_grad=True)
    xt = torch.tensor(a, device="cuda").to(DT[dtype][1]).float().requires_grad_()
    w = np.random.default_rng(7).standard_normal((16, 64)).astype(np.float32)
    wf = fg.tensor(w, dtype=dtype, device="cuda")
    loss = (F.rms_norm_last_dim(F.softmax_last_dim(x) * 3.0) * wf).astype(fg.float32).sum()
    (gx,) = fg.grad(loss, [x])
    wt = torch.tensor(w, device="cuda").to(DT[dtype][1]).float()
    ref = (torch.nn.functional.rms_norm(torch.softmax(xt, -1) * 3.0, (64,), eps=1e-6) * wt).sum()
    ref.backward()
    close(gx.numpy(), xt.grad, tol)


@on_gpu
def test_float64_lowers_to_recipe():
    xt = torch.randn(4, 64, dtype=F64, device="cuda")
    gt = torch.randn(4, 64, dtype=F64, device="cuda")
    x, g = fg.from_torch(xt), fg.from_torch(gt)
    cases = [(F.rms_norm_last_dim(x, 1e-6), "rms_norm_last_dim", ref_rms(xt, 1e-6)),
             (F.layer_norm_last_dim(x, 1e-5), "layer_norm_last_dim", ref_ln(xt, 1e-5)),
             (F.rms_norm_last_dim_backward(x, g, 1e-6), "rms_norm_last_dim_backward",
              vjp(lambda t: ref_rms(t, 1e-6), xt, gt)),
             (F.layer_norm_last_dim_backward(x, g, 1e-5), "layer_norm_last_dim_backward",
              vjp(lambda t: ref_ln(t, 1e-5), xt, gt))]
    for y, name, ref in cases:
        assert_lowered_on_cuda(y, name)
        torch.testing.assert_close(y.to_torch(), ref, rtol=1e-12, atol=1e-12)
