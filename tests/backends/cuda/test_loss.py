"""FUSED_SOFTMAX_CROSS_ENTROPY (forward and backward) on the CUDA backend: the Triton kernels
(backends/cuda/kernels/loss.py) against float64 torch references (spec §17, H.3), and the op
through fuelgraph on device="cuda". Build-time errors (targets shape, reduction) are the
registry's: tests/registry/test_loss.py::test_build_time_errors; the opt-in run-time target
check (CHECK_TARGETS) stays here. Skips cleanly without a GPU unless TRITON_INTERPRET=1 (then
the kernel-level tests run in Triton's CPU interpreter)."""
from __future__ import annotations

import pytest

from .cuda_oracle import (DTYPE_IDS, DTYPES, DT, F64, DEV, HAS_CUDA, INTERPRET, KERNEL_TESTS,
                          assert_half_and_f32_only, assert_lowered_on_cuda, check, close,
                          np_rand, on, on_gpu, poison, rand, torch, vjp)

pytestmark = KERNEL_TESTS

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import loss as K
    from fuelgraph.errors import FuelGraphError

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402


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


# ----------------------------------------------------------------------------- kernels
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
    out = K._fsce_forward(x, t, reduction, -100, splits=splits)
    torch.testing.assert_close(out.to(F64), ref_ce(x, t, reduction, -100), rtol=2e-5, atol=2e-5)
    g = rand((3,), torch.float32) if reduction == "none" else torch.tensor(0.5, device=DEV)
    dx = K._fsce_backward(x, t, g, reduction, -100, splits=splits)
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
    e = K.fused_softmax_cross_entropy(rand((0, 5), torch.float32),
                                      torch.zeros(0, dtype=torch.int64, device=DEV),
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
    old = K.CHECK_TARGETS
    K.CHECK_TARGETS = True              # the opt-in run-time check (one device sync)
    try:
        with pytest.raises(FuelGraphError):
            K.fused_softmax_cross_entropy(x, t, reduction="mean", ignore_index=-100)
    finally:
        K.CHECK_TARGETS = old


def test_kernels_declare_float64_unsupported():
    assert_half_and_f32_only(K.fused_softmax_cross_entropy, K.fused_softmax_cross_entropy_backward)


# ----------------------------------------------------------------------------- API on cuda
@on_gpu
@pytest.mark.parametrize("dtype", list(DT))
def test_cross_entropy_vs_torch(dtype):
    x, xt = on(np_rand((64, 96)), dtype)
    t = torch.randint(0, 96, (64,), device="cuda")
    close(F.fused_softmax_cross_entropy(x, fg.from_torch(t)).numpy(),
          torch.nn.functional.cross_entropy(xt.float(), t), DT[dtype][2])


@on_gpu
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_float64_lowers_to_recipe(reduction):
    xt = torch.randn(4, 64, dtype=F64, device="cuda")
    t = torch.randint(0, 64, (4,), device="cuda")
    t[1] = -100
    y = F.fused_softmax_cross_entropy(fg.from_torch(xt), fg.from_torch(t), reduction)
    assert_lowered_on_cuda(y, "fused_softmax_cross_entropy")
    out = y.to_torch()
    assert out.dtype == F64
    torch.testing.assert_close(out, ref_ce(xt, t, reduction, -100), rtol=1e-12, atol=1e-12)


# ---- one pass, and the fused linear + cross-entropy ------------------------------------------
# the one-pass cross-entropy (persistent row kernel) and the chunked fused linear +
# cross-entropy (cuBLAS + that kernel), forward, backward and both at once, vs float64 torch;
# chunking never changes a result beyond float32 rounding (16-bit dW: one rounding per chunk);
# no logits-sized buffer on the GPU
if HAS_CUDA or INTERPRET:
    import torch.nn.functional as TF
    import triton

    from fuelgraph.backends.cuda.kernels import loss as L
    from fuelgraph.backends.cuda.kernels import loss_flow as LF
    from fuelgraph.backends.cuda.kernels import loss_linear as LL
    from fuelgraph.backends.cuda.kernels import loss_split as LS

IDS = DTYPE_IDS
REDUCTIONS = ["mean", "sum", "none"]
# launch overrides that exercise the persistent loop (several rows per program, ragged tail)
# and the V loop (several blocks) on interpreter-sized shapes
SMALL = dict(programs=3, block=16) if not HAS_CUDA else {}


def _ce_ref(x, t, g, reduction, ignore_index, dtype=F64):
    xr = x.to(dtype).detach().requires_grad_()
    ii = -1_000_000 if ignore_index is None else ignore_index
    out = TF.cross_entropy(xr.float() if dtype != F64 else xr, t, reduction=reduction,
                           ignore_index=ii)
    out.backward(g.to(out.dtype))
    return out.detach().double(), xr.grad.double()


def _err(a, b):
    return (a.double() - b).abs().max().item() / max(b.abs().max().item(), 1.0)


def _tol(dtype):
    return {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}[dtype]


def _confident(x, t):
    """x with every other row's target logit raised by 8 (softmax there near 1: a gradient
    written wrong at the target shows)."""
    rows = torch.arange(0, x.shape[0], 2, device=x.device)
    x = x.clone()
    x[rows, t[rows].clamp(min=0)] += 8
    return x


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("ignore_index", [-100, None])
def test_ce_fwd_bwd_matches_torch(dtype, reduction, ignore_index):
    r, v = (11, 37) if not HAS_CUDA else (1000, 50257)
    x = (torch.randn(r, v, dtype=F64, device=DEV) * 3).to(dtype)
    t = torch.randint(0, v, (r,), device=DEV)
    if ignore_index is not None:
        t[::4] = ignore_index
    g = torch.randn(() if reduction != "none" else (r,), dtype=F64, device=DEV)
    loss, dx = L._fsce_fwd_bwd(x, t, g.float(), reduction, ignore_index, **SMALL)
    ref_loss, ref_dx = _ce_ref(x, t, g, reduction, ignore_index)
    assert loss.dtype == torch.float32 and dx.dtype == dtype
    assert _err(loss, ref_loss) < 2e-6
    assert _err(dx, ref_dx) < _tol(dtype)
    # the same as the separate forward and backward kernels
    assert _err(loss, L._fsce_forward(x, t, reduction, ignore_index).double()) < 2e-6
    sep = L._fsce_backward(x, t, g.float(), reduction, ignore_index).double()
    assert _err(dx, sep) < _tol(dtype) / 4


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU: the programs of a row wait for each other, "
                    "which the one-by-one interpreter cannot run")
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("chunk", [256, 1024, 4096])
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_ce_split_rows_meet_across_programs(dtype, chunk, reduction):
    r, v = 777, 5003                      # S = 20, 5, 2 programs per row; ragged last chunk
    x = (torch.randn(r, v, dtype=F64, device=DEV) * 3).to(dtype)
    t = torch.randint(0, v, (r,), device=DEV)
    t[::5] = -100
    t[3] = v - 1                          # the target in the ragged last chunk
    g = torch.randn(() if reduction != "none" else (r,), dtype=F64, device=DEV)
    plan = (triton.cdiv(v, chunk), chunk)
    g32, n_valid = L.grad_weights_inputs(g.float(), t, reduction, -100, DEV)
    loss_rows = torch.empty(r, dtype=torch.float32, device=DEV)
    dx = x.clone()                        # written in place over its own input, as FLCE does
    LS.ce_split(dx, t, plan, loss_rows=loss_rows, dx=dx, grad=g32, n_valid=n_valid,
                reduction=reduction, ignore_index=-100, block=256, hold=False)
    loss = L.reduce_rows(loss_rows, t, reduction, -100, t.shape)
    ref_loss, ref_dx = _ce_ref(x, t, g, reduction, -100)
    assert _err(loss, ref_loss) < 2e-6
    assert _err(dx, ref_dx) < _tol(dtype)


# split-row launch options: running statistics per 8 logits or per BLOCK step, with and
# without the first read's cache hint, the meeting through a counter or through words, the
# leaner exps (fast). On the GPU rows split into 20 / 5 chunks; the interpreter runs whole
# rows (S = 1) over several BLOCK steps
@pytest.mark.parametrize("chunk", [256, 1024])
@pytest.mark.parametrize("group,evict,meet,fast", [(0, "evict_last", "counter", False),
                                                   (8, "", "word", False),
                                                   (8, "evict_last", "counter", True)])
def test_ce_split_launch_options(chunk, group, evict, meet, fast):
    dtype, reduction = torch.bfloat16, "mean"
    r, v = (777, 5003) if HAS_CUDA else (11, 37)
    x = (torch.randn(r, v, dtype=F64, device=DEV) * 3).to(dtype)
    t = torch.randint(0, v, (r,), device=DEV)
    t[::5] = -100
    t[3] = v - 1                          # the target in the ragged last chunk
    x = _confident(x, t)
    g = torch.randn((), dtype=F64, device=DEV)
    plan = LS.split_plan(v, chunk, hold=False) if HAS_CUDA else (1, v)
    g32, n_valid = L.grad_weights_inputs(g.float(), t, reduction, -100, DEV)
    loss_rows = torch.empty(r, dtype=torch.float32, device=DEV)
    dx = x.clone()                        # written in place over its own input, as FLCE does
    LS.ce_split(dx, t, plan, loss_rows=loss_rows, dx=dx, grad=g32, n_valid=n_valid,
                reduction=reduction, ignore_index=-100, block=256 if HAS_CUDA else 16,
                evict=evict, group=group, meet=meet, hold=False, fast=fast)
    loss = L.reduce_rows(loss_rows, t, reduction, -100, t.shape)
    ref_loss, ref_dx = _ce_ref(x, t, g, reduction, -100)
    assert _err(loss, ref_loss) < 2e-6
    assert _err(dx, ref_dx) < _tol(dtype)


# chunks held in registers across the meeting (one read of the logits): on the GPU rows split
# into 20 / 5 chunks of a power of two (the last one masked) and the 16-bit logits are held two
# to a register, and a chunk wider than the row is one masked program per row; the interpreter
# runs whole rows (S = 1). The gradient is written over its own input, as FLCE does; with
# `eager` the chunks of ignored rows are read (and not used); the row's programs meet through an
# arrival counter or through self-flagging partial words.
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("chunk,reduction,ignore_index,eager,meet",
                         [(256, "mean", -100, False, "counter"), (1024, "none", -100, True, "word"),
                          (256, "sum", None, True, "word"), (8192, "mean", -100, False, "counter")])
def test_ce_held_chunks(dtype, chunk, reduction, ignore_index, eager, meet):
    r, v = (777, 5003) if HAS_CUDA else (11, 37)
    x = (torch.randn(r, v, dtype=F64, device=DEV) * 3).to(dtype)
    t = torch.randint(0, v, (r,), device=DEV)
    if ignore_index is not None:
        t[::5] = ignore_index
    t[3] = v - 1                          # the target in the masked last chunk
    x = _confident(x, t)
    g = torch.randn(() if reduction != "none" else (r,), dtype=F64, device=DEV)
    plan = LS.split_plan(v, chunk, hold=True)
    assert plan == ((triton.cdiv(v, chunk), chunk) if HAS_CUDA and chunk < v
                    else (1, triton.next_power_of_2(v)))
    g32, n_valid = L.grad_weights_inputs(g.float(), t, reduction, ignore_index, DEV)
    loss_rows = torch.empty(r, dtype=torch.float32, device=DEV)
    dx = x.clone()
    LS.ce_split(dx, t, plan, loss_rows=loss_rows, dx=dx, grad=g32, n_valid=n_valid,
                reduction=reduction, ignore_index=ignore_index, hold=True, eager=eager, meet=meet)
    loss = L.reduce_rows(loss_rows, t, reduction, ignore_index, t.shape)
    ref_loss, ref_dx = _ce_ref(x, t, g, reduction, ignore_index)
    assert _err(loss, ref_loss) < 2e-6
    assert _err(dx, ref_dx) < _tol(dtype)


# the word meeting with S > 1 where programs run one by one (the interpreter): every row's
# partial words are preset to what its programs will publish, so no program waits
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("hold", [False, True])
def test_ce_meet_word_with_partials_preset(dtype, hold):
    r, v, chunk = 11, 37, 16                  # S = 3, the last chunk ragged
    x = (torch.randn(r, v, dtype=F64, device=DEV) * 3).to(dtype)
    t = torch.randint(0, v, (r,), device=DEV)
    t[::4] = -100
    t[3] = v - 1
    x = _confident(x, t)
    g = torch.randn((), dtype=F64, device=DEV)
    S = triton.cdiv(v, chunk)
    words = _preset_words(x, chunk)
    g32, n_valid = L.grad_weights_inputs(g.float(), t, "mean", -100, DEV)
    loss_rows = torch.empty(r, dtype=torch.float32, device=DEV)
    dx = torch.empty_like(x)
    LS.ce_split(x, t, (S, chunk), loss_rows=loss_rows, dx=dx, grad=g32, n_valid=n_valid,
                reduction="mean", ignore_index=-100, block=8, hold=hold, meet="word",
                partials=words)
    loss = L.reduce_rows(loss_rows, t, "mean", -100, t.shape)
    ref_loss, ref_dx = _ce_ref(x, t, g, "mean", -100)
    assert _err(loss, ref_loss) < 2e-6
    assert _err(dx, ref_dx) < _tol(dtype)


def _preset_words(x, chunk):
    """The partial words (max, sum exp) every chunk of every row of x will publish."""
    r, v = x.shape
    S = triton.cdiv(v, chunk)
    xf = torch.full((r, S * chunk), float("-inf"), dtype=F64, device=x.device)
    xf[:, :v] = x.to(F64)
    part = xf.reshape(r, S, chunk)
    m = part.amax(-1)
    s = (part - m[..., None]).exp().sum(-1)
    bits = lambda a: a.to(torch.float32).view(torch.int32).to(torch.int64)
    return ((bits(s) << 32) | (bits(m) & 0xFFFFFFFF)).reshape(-1).contiguous()


# persistent programs holding two work items (loss_flow): on the GPU rows of 20 / 5 chunks
# meeting for real; the interpreter (2 programs, one by one) at S = 1 and, with the partial
# words preset, at S = 3
@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("chunk,reduction,preset", [(256, "mean", False), (1024, "none", False),
                                                    (16, "sum", True)])
def test_ce_flow(dtype, chunk, reduction, preset):
    if not HAS_CUDA and not preset:
        chunk = 64
    r, v = (777, 5004) if HAS_CUDA and not preset else (11, 38)   # V even: 16-bit pairs
    x = (torch.randn(r, v, dtype=F64, device=DEV) * 3).to(dtype)
    t = torch.randint(0, v, (r,), device=DEV)
    t[::5] = -100
    t[3] = v - 1                          # the target in the ragged last chunk
    x = _confident(x, t)
    g = torch.randn(() if reduction != "none" else (r,), dtype=F64, device=DEV)
    plan = LF.flow_plan(v, chunk, x.element_size())
    g32, n_valid = L.grad_weights_inputs(g.float(), t, reduction, -100, DEV)
    loss_rows = torch.empty(r, dtype=torch.float32, device=DEV)
    dx = x.clone()                        # written in place over its own input, as FLCE does
    LF.ce_flow(dx, t, plan, loss_rows=loss_rows, dx=dx, grad=g32, n_valid=n_valid,
               reduction=reduction, ignore_index=-100,
               partials=_preset_words(x, plan[1]) if preset else None)
    loss = L.reduce_rows(loss_rows, t, reduction, -100, t.shape)
    ref_loss, ref_dx = _ce_ref(x, t, g, reduction, -100)
    assert _err(loss, ref_loss) < 2e-6
    assert _err(dx, ref_dx) < _tol(dtype)
    assert LF.flow_plan(v + 1, chunk, 2) is None and LF.flow_plan(v + 1, chunk, 4) is not None
    if not preset:                        # the same through ce_split(flow=True)
        dx2 = torch.empty_like(x)
        LS.ce_split(x, t, plan, dx=dx2, grad=g32, n_valid=n_valid, reduction=reduction,
                    ignore_index=-100, hold=True, flow=True)
        assert torch.equal(dx2, dx)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a GPU: the interpreter plans whole rows")
def test_ce_default_plan():
    held = LS.CE_SPLIT_HOLD
    c = LS.CE_HOLD_CHUNK
    assert LS.default_plan(128256, 2) == (((triton.cdiv(128256, c), c), True) if held
                                          else (LS.split_plan(128256, hold=False), False))
    assert LS.default_plan(128256, 4) == (LS.split_plan(128256, hold=False), False)
    wide = c * LS.CE_SPLIT_MAX + 2                 # too many held chunks: streamed ones
    assert LS.default_plan(wide, 2) == (LS.split_plan(wide, hold=False), False)


def test_ce_held_needs_a_power_of_two_chunk():
    x = torch.randn(2, 40, device=DEV)
    t = torch.zeros(2, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError):
        LS.ce_split(x, t, (2, 20), dx=torch.empty_like(x), grad=torch.ones(1, device=DEV),
                    hold=True)


def test_ce_fwd_bwd_public_entry_and_edges():
    v = 9
    x = torch.randn(5, v, device=DEV)
    t = torch.full((5,), -100, device=DEV)
    loss, dx = L.fused_softmax_cross_entropy_fwd_bwd(x, t, torch.tensor(1.0, device=DEV),
                                                     reduction="mean", ignore_index=-100)
    assert loss.item() == 0 and not dx.any()          # every row ignored: 0, not NaN
    e, de = L.fused_softmax_cross_entropy_fwd_bwd(
        torch.zeros(0, v, device=DEV), torch.zeros(0, dtype=torch.int64, device=DEV),
        torch.tensor(1.0, device=DEV), reduction="sum", ignore_index=-100)
    assert e.item() == 0 and de.shape == (0, v)


def _flce_data(n, h, v, dtype, ignored=True):
    x = torch.randn(n, h, dtype=F64, device=DEV).to(dtype)
    w = (torch.randn(v, h, dtype=F64, device=DEV) * 0.5).to(dtype)
    b = torch.randn(v, dtype=F64, device=DEV).to(dtype)
    t = torch.randint(0, v, (n,), device=DEV)
    if ignored:
        t[1::5] = -100
    return x, w, b, t


def _flce_ref(x, w, b, t, g, reduction, dtype=F64):
    xs = [a.to(dtype).detach().requires_grad_() for a in (x, w, b) if a is not None]
    logits = TF.linear(xs[0], xs[1], xs[2] if b is not None else None)
    out = TF.cross_entropy(logits.float() if dtype != F64 else logits, t, reduction=reduction)
    out.backward(g.to(out.dtype))
    return [out.detach().double()] + [a.grad.double() for a in xs[:3 if b is not None else 2]]


def _flce_shape():
    return (23, 8, 41) if not HAS_CUDA else (2048, 512, 32000)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("has_bias", [True, False], ids=["bias", "nobias"])
def test_flce_matches_torch(dtype, reduction, has_bias):
    n, h, v = _flce_shape()
    x, w, b, t = _flce_data(n, h, v, dtype)
    bias = b if has_bias else None
    g = torch.randn(() if reduction != "none" else (n,), dtype=F64, device=DEV)
    chunk = 5 if not HAS_CUDA else None
    got = LL._flce("op", x, w, t, bias, g.float(), reduction, -100, True, True, chunk=chunk,
                   **SMALL)
    ref = _flce_ref(x, w, bias, t, g, reduction)
    same = _flce_ref(x, w, bias, t, g, reduction, dtype)     # torch in the inputs' dtype
    assert [a.dtype for a in got[1:]] == [dtype] * len(got[1:])
    for k, (a, r, s) in enumerate(zip(got, ref, same)):
        if dtype == torch.float32:
            assert _err(a, r) < 2e-5, k
        else:   # FlashAttention rule against torch in the same dtype, plus one ulp of the
            # largest value -- sqrt(chunks) ulps for dW / db, rounded to their dtype per chunk
            chunks = -(-n // (chunk or LL.chunk_rows(n, v, x.element_size())))
            ulp = torch.finfo(dtype).eps * r.abs().max() * (chunks ** 0.5 if k >= 2 else 1.0)
            assert (a.double() - r).abs().max() <= 2 * (s - r).abs().max() + ulp, k
    # forward alone and backward alone
    loss = LL._flce("op", x, w, t, bias, None, reduction, -100, True, False, chunk=chunk,
                    **SMALL)
    assert _err(loss, got[0].double()) < 1e-6
    grads = LL._flce("op", x, w, t, bias, g.float(), reduction, -100, False, True, chunk=chunk,
                     **SMALL)
    for a, r in zip(grads, got[1:]):
        assert torch.equal(a, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_flce_chunking_changes_nothing_beyond_rounding(dtype):
    n, h, v = _flce_shape()
    x, w, b, t = _flce_data(n, h, v, dtype)
    g = torch.tensor(1.0, device=DEV)
    chunks = (n, 7, 1) if not HAS_CUDA else (n, 300, 64)
    outs = [LL._flce("op", x, w, t, b, g, "mean", -100, True, True, chunk=c, **SMALL)
            for c in chunks]
    # float32: only the order of float32 additions differs; 16-bit: dW / db are rounded to
    # their dtype once per chunk (loss, dx and every per-row value are unchanged)
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}[dtype]
    for o in outs[1:]:
        assert _err(o[0], outs[0][0].double()) < 1e-6
        assert _err(o[1], outs[0][1].double()) < (1e-5 if dtype == torch.float32 else 1e-2)
        for a, r in zip(o[2:], outs[0][2:]):
            assert _err(a, r.double()) < tol * 4


def test_flce_public_kernels_and_chunk_rule():
    x, w, b, t = _flce_data(9, 4, 13, torch.float32)
    g = torch.tensor(1.0, device=DEV)
    kw = dict(reduction="sum", ignore_index=-100)
    loss = LL.fused_linear_cross_entropy(x, w, t, b, **kw)
    both = LL.fused_linear_cross_entropy_fwd_bwd(x, w, t, b, g, **kw)
    grads = LL.fused_linear_cross_entropy_backward(x, w, t, g, **kw)       # no bias
    assert len(both) == 4 and len(grads) == 2
    assert torch.allclose(loss, both[0], rtol=1e-6)
    # chunks: ~8% of the logits, at least 256 rows (or all of them), multiples of 64
    assert LL.chunk_rows(8192, 128256, 2) == 640
    assert LL.chunk_rows(100, 1000, 2) == 100 and LL.chunk_rows(1000, 10, 4) == 256


@pytest.mark.skipif(not HAS_CUDA, reason="memory is measured on the GPU")
def test_flce_never_allocates_the_logits():
    n, h, v = 4096, 256, 50000
    x, w, b, t = _flce_data(n, h, v, torch.bfloat16)
    g = torch.tensor(1.0, device=DEV)
    LL.fused_linear_cross_entropy_fwd_bwd(x, w, t, b, g, reduction="mean", ignore_index=-100)
    torch.cuda.synchronize()            # (the first call also sets up cuBLAS's workspace)
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = LL.fused_linear_cross_entropy_fwd_bwd(x, w, t, b, g, reduction="mean",
                                                ignore_index=-100)
    torch.cuda.synchronize()
    grads = sum(o.numel() * o.element_size() for o in out)
    extra = torch.cuda.max_memory_allocated() - base - grads
    assert extra < 0.15 * n * v * 2, extra
