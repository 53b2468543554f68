"""ROPE (forward and backward, rotate-half and interleaved) on the CUDA backend: the Triton
kernels (backends/cuda/kernels/rope.py) against float64 torch references (spec §5, H.13), and
the op through fuelgraph on device="cuda", including per-batch tables ([B, 1, S, D]) and the
table layouts the kernel declines (those run through the recipe). Shape errors (odd D, tables
not [..., S, D] broadcastable to x) are the registry's, at build time:
tests/registry/test_rope.py::test_validation_errors. Skips cleanly
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


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "pairs"])
@pytest.mark.parametrize("xs,ts", [((2, 3, 5, 8), (2, 1, 5, 8)), ((2, 3, 5, 8), (1, 3, 5, 8)),
                                   ((2, 3, 5, 8), (3, 5, 8)), ((3, 2, 2, 3, 4), (3, 2, 1, 3, 4))],
                         ids=str)
def test_rope_broadcast_tables(xs, ts, interleaved):
    """Per-batch tables (HF [B, 1, S, D]) and other contiguous runs of x's leading dims."""
    x, g = rand(xs, torch.float32), rand(xs, torch.float32)
    cos, sin = rand(ts, torch.float32), rand(ts, torch.float32)
    assert K._supports([xs, ts, ts], None, None)
    poison()
    check(K.rope(x, cos, sin, interleaved=interleaved), ref_rope(x, cos, sin, interleaved),
          torch.float32, name="rope")
    poison()
    check(K.rope_backward(g, cos, sin, interleaved=interleaved),
          vjp(lambda t: ref_rope(t, cos, sin, interleaved), x, g), torch.float32, name="rope-bwd")


def test_rope_table_layouts_the_kernel_declines():
    xs = (2, 3, 4, 5, 8)
    assert K.table_layout(xs, (2, 1, 4, 5, 8)) is None       # varying dims not adjacent
    assert K.table_layout(xs, (1, 3, 1, 5, 8)) == (3, 4)
    assert K.table_layout(xs, (5, 8)) == (1, 1)
    assert not K._supports([xs, (5, 8), (1, 5, 8)], None, None)   # cos and sin differ


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


@on_gpu
def test_per_batch_tables_through_the_api_and_declined_layouts_lower():
    x = torch.randn(2, 3, 4, 5, 8, device="cuda")
    tables = {"per batch": (2, 1, 1, 5, 8), "declined": (2, 1, 4, 5, 8)}
    for what, ts in tables.items():
        ct, st = torch.randn(ts, device="cuda"), torch.randn(ts, device="cuda")
        y = F.rope(fg.from_torch(x), fg.from_torch(ct), fg.from_torch(st))
        if what == "declined":               # varying table dims not adjacent: the recipe
            assert K.table_layout(tuple(x.shape), ts) is None
            assert_lowered_on_cuda(y, "rope")
        else:
            assert fg.explain(y).fused_ops == {"rope": 1}
        torch.testing.assert_close(y.to_torch().double(), ref_rope(x, ct, st, False),
                                   rtol=1e-5, atol=1e-5)
