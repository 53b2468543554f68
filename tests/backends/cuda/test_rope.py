"""ROPE (forward and backward, rotate-half and interleaved) on the CUDA backend: the Triton
kernels (backends/cuda/kernels/rope.py) against float64 torch references (spec §5, H.13), and
the op through fuelgraph on device="cuda". Shape errors (odd D, tables not [S, D]) are the
registry's, at build time: tests/registry/test_rope.py::test_validation_errors. Skips cleanly
without a GPU unless TRITON_INTERPRET=1 (then the kernel-level tests run in Triton's CPU
interpreter)."""
from __future__ import annotations

import pytest

from .cuda_oracle import (DTYPE_IDS, DTYPES, F64, DEV, HAS_CUDA, INTERPRET, KERNEL_TESTS,
                          assert_half_and_f32_only, assert_lowered_on_cuda, check, on_gpu,
                          poison, rand, torch, vjp)

pytestmark = KERNEL_TESTS

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import rope as K

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402


def ref_rope(x, cos, sin, interleaved):
    x, cos, sin = x.to(F64), cos.to(F64), sin.to(F64)
    if interleaved:
        xp = x.unflatten(-1, (-1, 2))
        rot = torch.stack((-xp[..., 1], xp[..., 0]), dim=-1).flatten(-2)
    else:
        h = x.shape[-1] // 2
        rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


ROPE_SHAPES = [(8, 16), (2, 3, 8, 16), (1, 5, 7, 6), (3, 40, 80), (2, 4, 33, 128)]


# ----------------------------------------------------------------------------- kernels
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "pairs"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ROPE_SHAPES, ids=str)
def test_rope(shape, dtype, interleaved):
    S, D = shape[-2:]
    x = rand(shape, dtype)
    g = rand(shape, dtype)
    # general tables: halves / pair entries deliberately differ
    cos = rand((S, D), dtype)
    sin = rand((S, D), dtype)
    poison()
    y = K.rope(x, cos, sin, interleaved=interleaved)
    assert y.dtype == dtype
    check(y, ref_rope(x, cos, sin, interleaved), dtype, name="rope")
    poison()
    dx = K.rope_backward(g, cos, sin, interleaved=interleaved)
    ref = vjp(lambda t: ref_rope(t, cos, sin, interleaved), x, g)
    check(dx, ref, dtype, name="rope-bwd")


def test_rope_standard_tables_match_spec_backward():
    S, D = 12, 32
    pos = torch.arange(S, dtype=F64, device=DEV)[:, None]
    theta = 10000.0 ** (-torch.arange(D // 2, dtype=F64, device=DEV) * 2 / D)
    ang = torch.cat((pos * theta, pos * theta), dim=-1)
    cos, sin = ang.cos().float(), ang.sin().float()
    g = rand((3, S, D), torch.float32)
    # fuel's Rope(g, cos, -sin) equals the general formula for standard tables
    check(K.rope_backward(g, cos, sin, interleaved=False),
          ref_rope(g, cos, -sin, False), torch.float32)


def test_kernels_declare_float64_unsupported():
    assert_half_and_f32_only(K.rope)


# ----------------------------------------------------------------------------- API on cuda
@on_gpu
@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "pairs"])
def test_float64_lowers_to_recipe(interleaved):
    xt = torch.randn(2, 3, 8, 16, dtype=F64, device="cuda")
    ct = torch.randn(8, 16, dtype=F64, device="cuda")
    st = torch.randn(8, 16, dtype=F64, device="cuda")
    y = F.rope(fg.from_torch(xt), fg.from_torch(ct), fg.from_torch(st), interleaved=interleaved)
    assert_lowered_on_cuda(y, "rope")
    torch.testing.assert_close(y.to_torch(), ref_rope(xt, ct, st, interleaved),
                               rtol=1e-12, atol=1e-12)
