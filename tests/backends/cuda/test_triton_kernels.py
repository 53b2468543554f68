"""Correctness of the Triton kernels in fuelgraph.backends.cuda.kernels against float64 torch
references (spec §1, 3-5, 7-10, 15-17, Appendix H).

Runs on a CUDA GPU. Without one the module is skipped, unless ``TRITON_INTERPRET=1`` is set, in
which case the same tests run the kernels through Triton's CPU interpreter on CPU tensors
(slow; used while developing). Inputs are fresh random draws per test; output buffers are
poisoned with NaN through the caching allocator on CUDA so unwritten elements show up.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()

pytestmark = pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs a CUDA GPU")

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda import kernels as K
    from fuelgraph.backends.cuda.kernels import loss as loss_mod
    from fuelgraph.errors import FuelGraphError

DEV = "cuda" if HAS_CUDA else "cpu"
F64 = torch.float64
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
DTYPE_IDS = ["f32", "bf16", "f16"]

# (norm-relative bound, elementwise rtol, elementwise atol as a fraction of max|ref|)
TOL = {
    torch.float32: (1e-5, 1e-4, 1e-5),
    torch.bfloat16: (1e-2, 1.6e-2, 1e-2),
    torch.float16: (2e-3, 2e-3, 2e-3),
}

ROW_SHAPES = [(3, 7), (4, 33, 100), (128, 128), (16, 4096), (2, 20000)]
if HAS_CUDA:
    ROW_SHAPES += [(2048, 4096), (3, 5, 1000)]


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(abs(hash(request.node.name)) % (2**31))


def poison():
    """Leave a NaN-filled block in the caching allocator so the next torch.empty sees NaN."""
    if HAS_CUDA:
        t = torch.full((1 << 22,), float("nan"), device=DEV)
        del t


def rand(shape, dtype, scale=1.0):
    return (torch.randn(shape, dtype=F64, device=DEV) * scale).to(dtype)


def check(out, ref, dtype, *, name="", scale_ref=None):
    """``out`` (kernel, dtype) against ``ref`` (float64). ``scale_ref`` (optional, float64, same
    shape) is the magnitude rounding errors scale with where ``ref`` itself is small through
    cancellation (e.g. y * (g - dot) when y is nearly one-hot)."""
    assert out.shape == ref.shape, (name, out.shape, ref.shape)
    o = out.to(F64)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(o), fin), f"{name}: non-finite output where ref is finite"
    o, ref = o[fin], ref[fin]
    nrel, rtol, afrac = TOL[dtype]
    denom = ref.norm().item()
    if scale_ref is not None:
        denom = max(denom, scale_ref[fin].norm().item())
    err = (o - ref).norm().item()
    assert err <= nrel * max(denom, 1e-30) + 1e-30, f"{name}: norm-relative error {err / max(denom, 1e-30):.3g}"
    scale = ref.abs().max().item() if ref.numel() else 0.0
    torch.testing.assert_close(o, ref, rtol=rtol, atol=afrac * max(scale, 1e-30) + 1e-30,
                               msg=lambda m: f"{name}: {m}")


# ----------------------------------------------------------------------------- references


def ref_softmax(x):
    return torch.softmax(x.to(F64), -1)


def ref_rms(x, eps):
    x = x.to(F64)
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def ref_ln(x, eps):
    x = x.to(F64)
    mu = x.mean(-1, keepdim=True)
    return (x - mu) / torch.sqrt(((x - mu) ** 2).mean(-1, keepdim=True) + eps)


def vjp(fn, x, g):
    x = x.to(F64).detach().requires_grad_(True)
    (dx,) = torch.autograd.grad(fn(x), x, g.to(F64))
    return dx


def ref_rope(x, cos, sin, interleaved):
    x, cos, sin = x.to(F64), cos.to(F64), sin.to(F64)
    if interleaved:
        xp = x.unflatten(-1, (-1, 2))
        rot = torch.stack((-xp[..., 1], xp[..., 0]), dim=-1).flatten(-2)
    else:
        h = x.shape[-1] // 2
        rot = torch.cat((-x[..., h:], x[..., :h]), dim=-1)
    return x * cos + rot * sin


# ----------------------------------------------------------------------------- softmax


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
def test_softmax_forward(shape, dtype):
    x = rand(shape, dtype, scale=4.0)
    poison()
    y = K.softmax_last_dim(x)
    assert y.dtype == dtype and y.shape == x.shape
    check(y, ref_softmax(x), dtype, name="softmax")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_softmax_forward_large_and_inf(dtype):
    x = rand((6, 300), dtype, scale=1.0)
    x[0] += 60.0                        # no overflow thanks to the max subtraction
    x[1, :150] = float("-inf")          # masked logits
    y = K.softmax_last_dim(x)
    check(y, ref_softmax(x), dtype, name="softmax-large")
    xl = rand((2, 20000), dtype)
    xl[0, :9000] = float("-inf")        # whole first chunks -inf in the looped kernel
    check(K.softmax_last_dim(xl), ref_softmax(xl), dtype, name="softmax-looped-inf")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", ROW_SHAPES, ids=str)
def test_softmax_backward(shape, dtype):
    y = torch.softmax(rand(shape, F64, 3.0), -1).to(dtype)
    g = rand(shape, dtype)
    poison()
    dx = K.softmax_last_dim_backward(y, g)
    y64, g64 = y.to(F64), g.to(F64)
    dot = (g64 * y64).sum(-1, keepdim=True)
    ref = y64 * (g64 - dot)
    check(dx, ref, dtype, name="softmax-bwd", scale_ref=y64 * (g64.abs() + dot.abs()))


def test_softmax_backward_matches_autograd():
    x = rand((5, 77), torch.float32)
    g = rand((5, 77), torch.float32)
    dx = K.softmax_last_dim_backward(K.softmax_last_dim(x), g)
    check(dx, vjp(lambda t: torch.softmax(t, -1), x, g), torch.float32, name="softmax-autograd")


# ----------------------------------------------------------------------------- norms


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


# ----------------------------------------------------------------------------- rope

ROPE_SHAPES = [(8, 16), (2, 3, 8, 16), (1, 5, 7, 6), (3, 40, 80), (2, 4, 33, 128)]


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


@pytest.mark.parametrize("interleaved", [False, True], ids=["half", "pairs"])
@pytest.mark.parametrize("xs,ts", [((2, 3, 5, 8), (2, 1, 5, 8)), ((2, 3, 5, 8), (1, 3, 5, 8)),
                                   ((2, 3, 5, 8), (3, 5, 8)), ((3, 2, 2, 3, 4), (3, 2, 1, 3, 4))],
                         ids=str)
def test_rope_broadcast_tables(xs, ts, interleaved):
    """Per-batch tables (HF [B, 1, S, D]) and other contiguous runs of x's leading dims."""
    from fuelgraph.backends.cuda.kernels import rope as rope_mod
    x, g = rand(xs, torch.float32), rand(xs, torch.float32)
    cos, sin = rand(ts, torch.float32), rand(ts, torch.float32)
    assert rope_mod._supports([xs, ts, ts], None, None)
    check(rope_mod.rope(x, cos, sin, interleaved=interleaved),
          ref_rope(x, cos, sin, interleaved), torch.float32, name="rope")
    check(rope_mod.rope_backward(g, cos, sin, interleaved=interleaved),
          vjp(lambda t: ref_rope(t, cos, sin, interleaved), x, g), torch.float32, name="rope-bwd")


def test_rope_table_layouts_the_kernel_declines():
    from fuelgraph.backends.cuda.kernels import rope as rope_mod
    xs = (2, 3, 4, 5, 8)
    assert rope_mod.table_layout(xs, (2, 1, 4, 5, 8)) is None       # varying dims not adjacent
    assert rope_mod.table_layout(xs, (1, 3, 1, 5, 8)) == (3, 4)
    assert not rope_mod._supports([xs, (5, 8), (1, 5, 8)], None, None)   # cos, sin differ


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


def test_rope_rejects_bad_inputs():
    x = rand((2, 4, 6), torch.float32)
    with pytest.raises(FuelGraphError):
        K.rope(rand((4, 5), torch.float32), rand((4, 5), torch.float32),
               rand((4, 5), torch.float32), interleaved=False)
    with pytest.raises(FuelGraphError):
        K.rope(x, rand((4, 4), torch.float32), rand((4, 6), torch.float32), interleaved=False)


# ----------------------------------------------------------------------------- cross entropy


def ref_ce(logits, targets, reduction, ignore_index):
    x = logits.reshape(-1, logits.shape[-1]).to(F64)
    t = targets.reshape(-1)
    ii = -(2**62) if ignore_index is None else ignore_index
    valid = t != ii
    if reduction == "mean" and not bool(valid.any()):
        return x.sum() * 0.0            # keeps the autograd graph: zero loss, zero gradient
    out = torch.nn.functional.cross_entropy(x, t, reduction=reduction, ignore_index=ii)
    return out.reshape(targets.shape) if reduction == "none" else out


def make_targets(shape, V, ignore_index, frac_ignored=0.3):
    t = torch.randint(0, V, shape, device=DEV)
    if ignore_index is not None:
        drop = torch.rand(shape, device=DEV) < frac_ignored
        t = torch.where(drop, torch.full_like(t, ignore_index), t)
    return t


CE_SHAPES = [(7, 1000), (2, 3, 130), (5, 9000), (600, 64)]
if HAS_CUDA:
    CE_SHAPES += [(4, 128256), (1000, 32000)]


@pytest.mark.parametrize("ignore_index", [-100, None, 3], ids=["ii-100", "iiNone", "ii3"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", CE_SHAPES, ids=str)
def test_cross_entropy(shape, dtype, reduction, ignore_index):
    V = shape[-1]
    x = rand(shape, dtype, 3.0)
    t = make_targets(shape[:-1], V, ignore_index)
    poison()
    out = K.fused_softmax_cross_entropy(x, t, reduction=reduction, ignore_index=ignore_index)
    assert out.dtype == torch.float32
    assert out.shape == (t.shape if reduction == "none" else ())
    ref = ref_ce(x, t, reduction, ignore_index)
    torch.testing.assert_close(out.to(F64), ref, rtol=2e-5, atol=2e-5)

    gshape = t.shape if reduction == "none" else ()
    g = rand(gshape, torch.float32) if reduction == "none" else torch.tensor(1.7, device=DEV)
    poison()
    dx = K.fused_softmax_cross_entropy_backward(x, t, g, reduction=reduction,
                                                ignore_index=ignore_index)
    assert dx.dtype == dtype and dx.shape == x.shape
    dref = vjp(lambda z: ref_ce(z, t, reduction, ignore_index), x, g)
    check(dx, dref, dtype, name="ce-bwd")


@pytest.mark.parametrize("splits", [2, 3, 7])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_cross_entropy_split_rows(splits, reduction):
    x = rand((3, 50000), torch.bfloat16, 3.0)
    t = torch.tensor([5, -100, 49999], device=DEV)
    out = loss_mod._fsce_forward(x, t, reduction, -100, splits=splits)
    torch.testing.assert_close(out.to(F64), ref_ce(x, t, reduction, -100), rtol=2e-5, atol=2e-5)
    g = rand((3,), torch.float32) if reduction == "none" else torch.tensor(0.5, device=DEV)
    dx = loss_mod._fsce_backward(x, t, g, reduction, -100, splits=splits)
    check(dx, vjp(lambda z: ref_ce(z, t, reduction, -100), x, g), torch.bfloat16, name="ce-split")


def test_cross_entropy_all_ignored_and_empty():
    x = rand((4, 33), torch.float32)
    t = torch.full((4,), -100, device=DEV)
    for red in ("mean", "sum"):
        out = K.fused_softmax_cross_entropy(x, t, reduction=red, ignore_index=-100)
        assert out.item() == 0.0
        dx = K.fused_softmax_cross_entropy_backward(x, t, torch.tensor(1.0, device=DEV),
                                                    reduction=red, ignore_index=-100)
        assert torch.count_nonzero(dx).item() == 0
    out = K.fused_softmax_cross_entropy(x, t, reduction="none", ignore_index=-100)
    assert out.shape == (4,) and torch.count_nonzero(out).item() == 0
    e = K.fused_softmax_cross_entropy(rand((0, 5), torch.float32), torch.zeros(0, dtype=torch.int64, device=DEV),
                                      reduction="mean", ignore_index=-100)
    assert e.shape == () and e.item() == 0.0


def test_cross_entropy_rank1_and_python_grad():
    x = rand((50,), torch.float32)
    t = torch.tensor(7, device=DEV)
    out = K.fused_softmax_cross_entropy(x, t, reduction="sum", ignore_index=None)
    assert out.shape == ()
    torch.testing.assert_close(out.to(F64), ref_ce(x[None], t[None], "sum", None))
    dx = K.fused_softmax_cross_entropy_backward(x, t, 2.0, reduction="sum", ignore_index=None)
    ref = 2.0 * (torch.softmax(x.to(F64), -1) - torch.nn.functional.one_hot(t, 50).to(F64))
    check(dx, ref, torch.float32)


def test_cross_entropy_out_of_range_target():
    x = rand((3, 40), torch.float32)
    t = torch.tensor([1, 40, -7], device=DEV)
    out = K.fused_softmax_cross_entropy(x, t, reduction="none", ignore_index=-100)
    assert torch.isfinite(out[0]) and torch.isnan(out[1]) and torch.isnan(out[2])
    dx = K.fused_softmax_cross_entropy_backward(x, t, torch.ones(3, device=DEV), reduction="none",
                                                ignore_index=-100)
    assert torch.isfinite(dx[0]).all() and torch.isnan(dx[1:]).all()
    old = loss_mod.CHECK_TARGETS
    loss_mod.CHECK_TARGETS = True
    try:
        with pytest.raises(FuelGraphError):
            K.fused_softmax_cross_entropy(x, t, reduction="mean", ignore_index=-100)
    finally:
        loss_mod.CHECK_TARGETS = old


def test_cross_entropy_rejects_bad_targets_shape():
    with pytest.raises(FuelGraphError):
        K.fused_softmax_cross_entropy(rand((3, 5), torch.float32),
                                      torch.zeros(4, dtype=torch.int64, device=DEV),
                                      reduction="mean", ignore_index=-100)
    with pytest.raises(FuelGraphError):
        K.fused_softmax_cross_entropy(rand((3, 5), torch.float32),
                                      torch.zeros(3, dtype=torch.int64, device=DEV),
                                      reduction="avg", ignore_index=-100)


# ----------------------------------------------------------------------------- helpers


def ref_amax_bwd(x, g, dims):
    x64 = x.to(F64).detach().requires_grad_(True)
    y = torch.amax(x64, dim=dims, keepdim=True)
    (dx,) = torch.autograd.grad(y, x64, g.to(F64).reshape(y.shape))
    return dx


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("shape", [(5, 9), (3, 4, 100), (64, 1000), (2, 20000)], ids=str)
def test_reduce_max_to_backward_last_axis(shape, dtype):
    x = torch.randint(-4, 4, shape, device=DEV).to(dtype)        # many ties
    x[0] = rand(shape[1:], dtype)                                # one tie-free slice
    g = rand(shape[:-1] + (1,), dtype)
    poison()
    dx = K.reduce_max_to_backward(x, g)
    check(dx, ref_amax_bwd(x, g, -1), dtype, name="rmax")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_reduce_max_to_backward_nan_window(dtype):
    x = rand((4, 300), dtype)
    x[2, 17] = float("nan")
    g = rand((4, 1), dtype)
    dx = K.reduce_max_to_backward(x, g)
    ref = ref_amax_bwd(x, g, -1)           # torch amax: NaN over the whole NaN window
    assert torch.isnan(dx[2]).all() and torch.isnan(ref[2]).all()
    keep = torch.tensor([0, 1, 3], device=DEV)
    check(dx[keep], ref[keep], dtype, name="rmax-nan")
    xl = rand((2, 20000), dtype)
    xl[1, 19999] = float("nan")
    dxl = K.reduce_max_to_backward(xl, rand((2, 1), dtype))
    assert torch.isnan(dxl[1]).all() and torch.isfinite(dxl[0]).all()


@pytest.mark.parametrize("gshape,dims", [((1, 6), (0, 1)), ((4, 1, 1), (1, 2)), ((), (0, 1, 2)),
                                         ((1, 5, 6), (0,))], ids=str)
def test_reduce_max_to_backward_other_axes(gshape, dims):
    x = torch.randint(-3, 3, (4, 5, 6), device=DEV).float()
    g = rand(gshape, torch.float32)
    dx = K.reduce_max_to_backward(x, g)
    check(dx, ref_amax_bwd(x, g, dims), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("exp", [-3, -1, 0, 1, 2, 3, 7])
def test_powi_backward(exp, dtype):
    shape = (3, 1001)
    x = rand(shape, F64)
    x = (x.sign() * (torch.rand(shape, dtype=F64, device=DEV) + 0.5)).to(dtype)  # |x| in [0.5, 1.5)
    g = rand(shape, dtype)
    poison()
    dx = K.powi_backward(x, g, exp=exp)
    x64, g64 = x.to(F64), g.to(F64)
    ref = torch.zeros_like(x64) if exp == 0 else exp * x64.pow(exp - 1) * g64
    check(dx, ref, dtype, name=f"powi{exp}")


def test_powi_backward_exp0_is_zero_at_zero():
    x = torch.zeros(10, device=DEV)
    dx = K.powi_backward(x, torch.ones(10, device=DEV), exp=0)
    assert torch.equal(dx, torch.zeros(10, device=DEV))
    dx1 = K.powi_backward(x, torch.full((10,), 3.0, device=DEV), exp=1)
    assert torch.equal(dx1, torch.full((10,), 3.0, device=DEV))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("numel", [1, 1000, 70001])
def test_inplace_affine(numel, dtype):
    x = rand((numel,), dtype)
    expect = (x.float() * torch.tensor(1.37, dtype=torch.float32) + torch.tensor(-0.25, dtype=torch.float32)).to(dtype)
    ptr = x.data_ptr()
    out = K.inplace_affine(x, mul=1.37, add=-0.25)
    assert out is x and x.data_ptr() == ptr
    if INTERPRET and dtype != torch.float32:
        # the CPU interpreter narrows float32 -> bf16/f16 by truncation, the GPU rounds to nearest
        torch.testing.assert_close(x, expect, rtol=1e-2, atol=1e-2)
    else:
        assert torch.equal(x, expect)     # float32 multiply, then add: bit-exact


def test_inplace_affine_non_contiguous():
    base = rand((6, 8), torch.float32)
    view = base[:, ::2]
    expect = view * 2.0 + 1.0
    out = K.inplace_affine(view, mul=2.0, add=1.0)
    assert out is view
    torch.testing.assert_close(base[:, ::2], expect)


# ----------------------------------------------------------------------------- float64 + errors


def test_float64_goes_through_torch_formulas():
    x = rand((4, 64), F64)
    g = rand((4, 64), F64)
    check_f64 = lambda a, b: torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    check_f64(K.softmax_last_dim(x), ref_softmax(x))
    check_f64(K.rms_norm_last_dim(x, eps=1e-6), ref_rms(x, 1e-6))
    check_f64(K.layer_norm_last_dim_backward(x, g, eps=1e-5), vjp(lambda t: ref_ln(t, 1e-5), x, g))
    t = torch.randint(0, 64, (4,), device=DEV)
    check_f64(K.fused_softmax_cross_entropy(x, t, reduction="mean", ignore_index=-100).to(F64),
              ref_ce(x, t, "mean", -100).float().to(F64))


def test_shape_and_dtype_errors():
    with pytest.raises(FuelGraphError):
        K.softmax_last_dim_backward(rand((3, 4), torch.float32), rand((3, 5), torch.float32))
    with pytest.raises(FuelGraphError):
        K.rms_norm_last_dim(torch.zeros(3, 4, dtype=torch.int32, device=DEV), eps=1e-6)
    with pytest.raises(FuelGraphError):
        K.layer_norm_last_dim(rand((3, 0), torch.float32), eps=1e-6)
    with pytest.raises(FuelGraphError):
        K.reduce_max_to_backward(rand((3, 4), torch.float32), rand((3, 2), torch.float32))
