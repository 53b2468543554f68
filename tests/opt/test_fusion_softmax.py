"""Fusion of hand-written softmax spellings into SOFTMAX_LAST_DIM, negative cases and near
misses, fused vs lower_all execution, the plan cache, and run-time registration of a new fused
op that then fuses from its own idiom. Values are checked against NumPy / torch."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph.backends import base as backend_base
from fuelgraph.runtime import executor


def _np_softmax(a, axis=-1):
    a = a.astype(np.float64)
    e = np.exp(a - a.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def _x(shape=(3, 7), dtype=np.float32, seed=0):
    return (np.random.default_rng(seed).standard_normal(shape) * 2).astype(dtype)


# ---- spellings that must fuse --------------------------------------------------------------
def sp_keepdim_div(x):
    m = x.max(-1, keepdim=True)
    e = (x - m).exp()
    return e / e.sum(-1, keepdim=True)


def sp_reciprocal_mul(x):
    e = (x - x.max(-1, keepdim=True)).exp()
    return e * (1.0 / e.sum(-1, keepdim=True))


def sp_reciprocal_method_left(x):
    e = (x - x.max(-1, keepdim=True)).exp()
    return e.sum(-1, keepdim=True).reciprocal() * e


def sp_pow_minus_one(x):
    e = (x - x.max(-1, keepdim=True)).exp()
    return e * e.sum(-1, keepdim=True) ** -1


def sp_no_keepdim_unsqueeze(x):
    m = x.max(-1).unsqueeze(-1)
    e = (x - m).exp()
    return e / e.sum(-1).unsqueeze(-1)


def sp_no_keepdim_none_index(x):
    e = (x - x.max(-1)[..., None]).exp()
    return e / e.sum(-1)[..., None]


def sp_positive_axis(x):
    ax = x.ndim - 1
    e = (x - x.max(ax, keepdim=True)).exp()
    return e / e.sum(axis=ax, keepdim=True)


def sp_explicit_broadcast(x):
    e = (x - x.max(-1, keepdim=True).broadcast_to(x.shape)).exp()
    return e / e.sum(-1, keepdim=True).broadcast_to(x.shape)


def sp_sugar(x):
    return x.softmax(-1)


def sp_functional(x):
    return F.softmax_last_dim(x)


SPELLINGS = [sp_keepdim_div, sp_reciprocal_mul, sp_reciprocal_method_left, sp_pow_minus_one,
             sp_no_keepdim_unsqueeze, sp_no_keepdim_none_index, sp_positive_axis,
             sp_explicit_broadcast, sp_sugar, sp_functional]


@pytest.mark.parametrize("shape", [(3, 7), (2, 3, 5), (6,)], ids=str)
@pytest.mark.parametrize("spell", SPELLINGS, ids=lambda f: f.__name__)
def test_spellings_fuse(spell, shape):
    a = _x(shape)
    y = spell(fg.tensor(a))
    rep = fg.explain(y)
    assert rep.fused_ops == {"softmax_last_dim": 1}, str(rep)
    assert rep.primitive_count == 0, str(rep)
    fused = fg.realize([y])[0]
    lowered = fg.realize([y], lower_all=True)[0]
    ref = torch.softmax(torch.tensor(a.astype(np.float64)), -1).numpy()
    np.testing.assert_allclose(fused, ref, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(lowered, ref, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(y.numpy(), fused, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [np.float64, np.float16])
def test_spelling_fuses_in_other_dtypes(dtype):
    a = _x((4, 9), dtype)
    y = sp_reciprocal_mul(fg.tensor(a))
    assert fg.explain(y).fused_ops == {"softmax_last_dim": 1}
    tol = 1e-12 if dtype == np.float64 else 2e-3
    np.testing.assert_allclose(y.numpy().astype(np.float64), _np_softmax(a), rtol=tol, atol=tol)


@pytest.mark.parametrize("view", ["transpose", "reversed_slice", "broadcast", "permute3d"])
def test_spelling_over_strided_views_fuses(view):
    a = _x((4, 6), seed=5)
    x = fg.tensor(a)
    v, ref_in = {"transpose": (x.T, a.T), "reversed_slice": (x[:, ::-2], a[:, ::-2]),
                 "broadcast": (x[:1].broadcast_to(3, 6), np.broadcast_to(a[:1], (3, 6))),
                 "permute3d": (x.reshape(2, 2, 6).permute(2, 0, 1),
                               a.reshape(2, 2, 6).transpose(2, 0, 1))}[view]
    y = sp_keepdim_div(v)
    assert fg.explain(y).fused_ops == {"softmax_last_dim": 1}
    np.testing.assert_allclose(y.numpy(), _np_softmax(ref_in), rtol=2e-6, atol=1e-7)


def test_two_softmaxes_and_surrounding_graph():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((2, 4, 8)).astype(np.float32) for _ in range(3))
    tq, tk, tv = fg.tensor(q), fg.tensor(k), fg.tensor(v)
    scores = (tq @ tk.mT) * (1.0 / math.sqrt(8))
    out = sp_keepdim_div(scores) @ tv + sp_no_keepdim_none_index(tq).sum(-1, keepdim=True)
    rep = fg.explain(out)
    assert rep.fused_ops == {"softmax_last_dim": 2}, str(rep)
    s = np.matmul(q.astype(np.float64), np.swapaxes(k, -1, -2)) / math.sqrt(8)
    ref = _np_softmax(s) @ v + _np_softmax(q).sum(-1, keepdims=True)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(fg.realize([out], lower_all=True)[0], ref, rtol=1e-5, atol=1e-6)


def test_softmax_output_with_several_consumers_still_fuses():
    a = _x()
    x = fg.tensor(a)
    y = sp_keepdim_div(x)
    outs = [y * 2.0, y.sum(-1), y]
    assert fg.explain(outs).fused_ops == {"softmax_last_dim": 1}
    ref = _np_softmax(a)
    got = fg.realize(outs)
    np.testing.assert_allclose(got[0], 2 * ref, rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(got[1], ref.sum(-1), rtol=2e-6)
    np.testing.assert_allclose(got[2], ref, rtol=2e-6, atol=1e-7)


# ---- negative cases ------------------------------------------------------------------------
def test_softmax_over_axis0_does_not_fuse_and_reports_near_miss():
    a = _x((5, 5))  # square: only the axis tells the two apart
    y = fg.tensor(a).softmax(0)
    rep = fg.explain(y)
    assert rep.fused_ops == {}, str(rep)
    assert "softmax_last_dim" in rep.near_misses, str(rep)
    why = rep.near_misses["softmax_last_dim"]
    assert "axis" in why or "axes" in why, why
    assert "softmax_last_dim" in str(rep)
    np.testing.assert_allclose(y.numpy(), _np_softmax(a, 0), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(fg.realize([y], lower_all=True)[0], _np_softmax(a, 0), rtol=2e-6,
                               atol=1e-7)


def test_softmax_over_axis0_of_3d_does_not_fuse():
    a = _x((4, 3, 4))
    y = fg.tensor(a).softmax(0)
    assert fg.explain(y).fused_ops == {}
    np.testing.assert_allclose(y.numpy(), _np_softmax(a, 0), rtol=2e-6, atol=1e-7)


def test_exp_without_max_subtraction_does_not_fuse():
    a = _x()
    x = fg.tensor(a)
    e = x.exp()
    y = e / e.sum(-1, keepdim=True)
    assert fg.explain(y).fused_ops == {}
    ea = np.exp(a.astype(np.float64))
    np.testing.assert_allclose(y.numpy(), ea / ea.sum(-1, keepdims=True), rtol=2e-6, atol=1e-7)


def test_min_instead_of_max_is_a_near_miss():
    a = _x()
    x = fg.tensor(a)
    e = (x - x.min(-1, keepdim=True)).exp()
    y = e / e.sum(-1, keepdim=True)
    rep = fg.explain(y)
    assert rep.fused_ops == {}
    assert "min" in rep.near_misses.get("softmax_last_dim", ""), str(rep)
    ref = np.exp(a - a.min(-1, keepdims=True))
    np.testing.assert_allclose(y.numpy(), ref / ref.sum(-1, keepdims=True), rtol=2e-6)


def test_wrong_constant_or_extra_term_does_not_fuse():
    a = _x()
    x = fg.tensor(a)
    e = (x - x.max(-1, keepdim=True)).exp()
    y1 = e / (e.sum(-1, keepdim=True) + 1.0)
    y2 = (x * 2.0 - x.max(-1, keepdim=True)).exp()
    y2 = y2 / y2.sum(-1, keepdim=True)
    for y in (y1, y2):
        assert fg.explain(y).fused_ops == {}
    ea = np.exp(a - a.max(-1, keepdims=True))
    np.testing.assert_allclose(y1.numpy(), ea / (ea.sum(-1, keepdims=True) + 1), rtol=2e-6)
    eb = np.exp(2 * a - a.max(-1, keepdims=True))
    np.testing.assert_allclose(y2.numpy(), eb / eb.sum(-1, keepdims=True), rtol=2e-6)


def test_max_of_another_tensor_does_not_fuse():
    a, b = _x(seed=40), _x(seed=41)
    x, z = fg.tensor(a), fg.tensor(b)
    e = (x - z.max(-1, keepdim=True)).exp()
    y = e / e.sum(-1, keepdim=True)
    assert fg.explain(y).fused_ops == {}
    ea = np.exp(a.astype(np.float64) - b.max(-1, keepdims=True))
    np.testing.assert_allclose(y.numpy(), ea / ea.sum(-1, keepdims=True), rtol=2e-6, atol=1e-7)
    # the normaliser of another row set: e / sum(other) must not fuse either
    e2 = (z - z.max(-1, keepdim=True)).exp()
    y2 = e / e2.sum(-1, keepdim=True)
    assert fg.explain(y2).fused_ops == {}


@pytest.mark.parametrize("shared", ["exp", "sub", "max", "sum"])
def test_shared_intermediate_blocks_fusion_and_keeps_values(shared):
    a = _x()
    x = fg.tensor(a)
    m = x.max(-1, keepdim=True)
    d = x - m
    e = d.exp()
    s = e.sum(-1, keepdim=True)
    y = e / s
    other = {"exp": e * 3.0, "sub": d * 3.0, "max": m * 3.0, "sum": s * 3.0}[shared]
    rep = fg.explain([y, other])
    assert rep.fused_ops == {}, str(rep)
    why = rep.near_misses.get("softmax_last_dim", "")
    assert "another consumer" in why, str(rep)
    ma = a.astype(np.float64).max(-1, keepdims=True)
    ea = np.exp(a - ma)
    ref_other = {"exp": ea * 3, "sub": (a - ma) * 3, "max": ma * 3,
                 "sum": ea.sum(-1, keepdims=True) * 3}[shared]
    for got in (fg.realize([y, other]), fg.realize([y, other], lower_all=True)):
        np.testing.assert_allclose(got[0], _np_softmax(a), rtol=2e-6, atol=1e-7)
        np.testing.assert_allclose(got[1], ref_other, rtol=2e-6, atol=1e-6)


def test_shared_intermediate_as_direct_output():
    a = _x()
    x = fg.tensor(a)
    e = (x - x.max(-1, keepdim=True)).exp()
    y = e / e.sum(-1, keepdim=True)
    assert fg.explain([y, e]).fused_ops == {}
    got = fg.realize([y, e])
    np.testing.assert_allclose(got[0], _np_softmax(a), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(got[1], np.exp(a - a.max(-1, keepdims=True)), rtol=2e-6)
    # realized separately, each still fuses as much as it can
    assert fg.explain([y]).fused_ops == {"softmax_last_dim": 1}


def test_explain_report_is_readable():
    y = sp_keepdim_div(fg.tensor(_x()))
    rep = fg.explain(y)
    text = str(rep)
    assert "softmax_last_dim" in text and "fused" in text
    assert rep.nodes_before > rep.nodes_after
    low = fg.explain(y, lower_all=True)
    assert low.fused_ops == {} and low.primitive_count >= 5


# ---- runtime: plan cache -------------------------------------------------------------------
def test_plan_cache_reuses_plan_with_fresh_data():
    def build(a):
        x = fg.tensor(a)
        return sp_keepdim_div(x) * 2.0 + x

    a1, a2 = _x(seed=10), _x(seed=11)
    y1 = build(a1)
    r1 = y1.numpy()
    hits = executor.STATS["plan_hits"]
    misses = executor.STATS["plan_misses"]
    y2 = build(a2)
    r2 = y2.numpy()
    assert executor.STATS["plan_hits"] == hits + 1
    assert executor.STATS["plan_misses"] == misses
    np.testing.assert_allclose(r1, 2 * _np_softmax(a1) + a1, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(r2, 2 * _np_softmax(a2) + a2, rtol=2e-6, atol=1e-6)
    # a third run, new data again, through fg.realize
    a3 = _x(seed=12)
    r3 = fg.realize([build(a3)])[0]
    assert executor.STATS["plan_hits"] == hits + 2
    np.testing.assert_allclose(r3, 2 * _np_softmax(a3) + a3, rtol=2e-6, atol=1e-6)
    # the first results were not overwritten by later runs of the shared plan
    np.testing.assert_allclose(r1, 2 * _np_softmax(a1) + a1, rtol=2e-6, atol=1e-6)


def test_plan_cache_distinguishes_shapes_dtypes_and_lower_all():
    a = _x((2, 5))
    sp_keepdim_div(fg.tensor(a)).numpy()
    misses = executor.STATS["plan_misses"]
    r_shape = sp_keepdim_div(fg.tensor(_x((3, 5)))).numpy()
    r_dtype = sp_keepdim_div(fg.tensor(a.astype(np.float64))).numpy()
    assert executor.STATS["plan_misses"] == misses + 2
    assert r_shape.shape == (3, 5) and r_dtype.dtype == np.float64
    np.testing.assert_allclose(r_dtype, _np_softmax(a), rtol=1e-12)
    y = sp_keepdim_div(fg.tensor(a))
    fg.realize([y], lower_all=True)
    hits = executor.STATS["plan_hits"]
    fg.realize([sp_keepdim_div(fg.tensor(a))], lower_all=True)
    assert executor.STATS["plan_hits"] == hits + 1


def test_plan_cache_distinguishes_constants():
    a = _x(seed=22)
    r1 = (sp_keepdim_div(fg.tensor(a)) * 2.0).numpy()
    r2 = (sp_keepdim_div(fg.tensor(a)) * 3.0).numpy()
    c1 = (fg.tensor(a) + fg.const(np.ones(7, np.float32))).numpy()
    c2 = (fg.tensor(a) + fg.const(np.full(7, 5.0, np.float32))).numpy()
    np.testing.assert_allclose(r1, 2 * _np_softmax(a), rtol=2e-6, atol=1e-7)
    np.testing.assert_allclose(r2, 3 * _np_softmax(a), rtol=2e-6, atol=1e-7)
    np.testing.assert_array_equal(c1, a + 1)
    np.testing.assert_array_equal(c2, a + 5)


def test_plan_cache_with_input_used_twice_and_swapped_inputs():
    """Input leaves are abstracted by position: swapping two same-shaped inputs must not reuse
    a binding for the wrong one."""
    a, b = _x(seed=20), _x(seed=21)

    def build(p, q):
        return sp_keepdim_div(p) - q * 0.5

    r1 = build(fg.tensor(a), fg.tensor(b)).numpy()
    r2 = build(fg.tensor(b), fg.tensor(a)).numpy()
    np.testing.assert_allclose(r1, _np_softmax(a) - b * 0.5, rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(r2, _np_softmax(b) - a * 0.5, rtol=2e-6, atol=1e-6)
    x = fg.tensor(a)
    r3 = build(x, x).numpy()
    np.testing.assert_allclose(r3, _np_softmax(a) - a * 0.5, rtol=2e-6, atol=1e-6)


# ---- run-time registration -----------------------------------------------------------------
C = math.sqrt(2.0 / math.pi)


def my_gelu_tanh(x):
    return 0.5 * x * (1.0 + ((x + 0.044715 * x ** 3) * C).tanh())


def my_gelu_tanh_again(x):  # another function object, same body
    return 0.5 * x * (1.0 + ((x + 0.044715 * x ** 3) * C).tanh())


def my_gelu_tanh_other_constant(x):  # a different recipe
    return 0.5 * x * (1.0 + ((x + 0.05 * x ** 3) * C).tanh())


def _gelu_np(a, k=0.044715):
    a = a.astype(np.float64)
    return 0.5 * a * (1.0 + np.tanh(C * (a + k * a ** 3)))


def _sample(rng):
    return [rng.standard_normal((4, 8)).astype(np.float32)]


@pytest.fixture
def gelu_ops():
    """Registers the run-time ops (ids are never reused, so this happens once per process) and
    detaches their NumPy kernels afterwards so later tests in the session never fuse them."""
    reg = fg.default_registry()
    fid = reg.register("my_gelu_tanh", my_gelu_tanh, _sample)
    fid_again = reg.register("my_gelu_tanh_again", my_gelu_tanh_again, _sample)
    fid_other = reg.register("my_gelu_tanh_k05", my_gelu_tanh_other_constant, _sample)
    key = (int(fid), "numpy")
    if not backend_base.KERNELS.get(key):  # first use, or kernels detached by an earlier use
        @fg.kernel(fid, "numpy")
        def gelu_numpy(a):
            return _gelu_np(a).astype(a.dtype)
    yield fid, fid_again, fid_other
    backend_base.KERNELS.pop(key, None)


def test_runtime_registration_ids(gelu_ops):
    fid, fid_again, fid_other = gelu_ops
    reg = fg.default_registry()
    assert isinstance(fid, fg.FusedOpId) and fid >= 0x8000 and fid.is_runtime()
    assert fid_again == fid, "a structurally identical recipe must return the existing id"
    assert fid_other != fid and fid_other >= 0x8000
    assert reg.entry(fid).name == "my_gelu_tanh" and reg.entry("my_gelu_tanh").id == fid
    assert reg.entry(fid_other).name == "my_gelu_tanh_k05"
    assert "my_gelu_tanh_again" not in reg  # deduplicated: no second entry
    ids = [int(e.id) for e in reg]
    assert ids == sorted(ids) and int(fid) in ids and int(fid_other) in ids
    # a name already taken by a different recipe is refused
    with pytest.raises(fg.FuelGraphError):
        reg.register("my_gelu_tanh", lambda x: x * 3.0 + 1.0, _sample)


@pytest.mark.parametrize("shape", [(4, 8), (3, 5)], ids=str)
def test_runtime_op_fuses_from_its_idiom(gelu_ops, shape):
    fid = gelu_ops[0]
    a = _x(shape, seed=30)
    y = my_gelu_tanh(fg.tensor(a))
    rep = fg.explain(y)
    assert rep.fused_ops == {"my_gelu_tanh": 1}, str(rep)
    np.testing.assert_allclose(y.numpy(), _gelu_np(a), rtol=2e-6, atol=1e-6)
    np.testing.assert_allclose(fg.realize([y], lower_all=True)[0], _gelu_np(a), rtol=2e-6,
                               atol=1e-6)
    # a commuted spelling meets the same canonical form
    x = fg.tensor(a)
    y2 = (1.0 + (C * (0.044715 * x ** 3 + x)).tanh()) * (x * 0.5)
    assert fg.explain(y2).fused_ops == {"my_gelu_tanh": 1}, str(fg.explain(y2))
    np.testing.assert_allclose(y2.numpy(), _gelu_np(a), rtol=2e-6, atol=1e-6)
    # the other constant is another op: its idiom does not fuse into my_gelu_tanh
    y3 = my_gelu_tanh_other_constant(fg.tensor(a))
    assert "my_gelu_tanh" not in fg.explain(y3).fused_ops
    np.testing.assert_allclose(y3.numpy(), _gelu_np(a, 0.05), rtol=2e-6, atol=1e-6)
    # called directly as a fused op
    from fuelgraph.registry import call_fused
    z = call_fused(fid, fg.tensor(a))
    np.testing.assert_allclose(z.numpy(), _gelu_np(a), rtol=2e-6, atol=1e-6)


def test_runtime_op_without_kernel_runs_its_recipe(gelu_ops):
    from fuelgraph.registry import call_fused
    fid_other = gelu_ops[2]
    a = _x((4, 8), seed=31)
    z = call_fused(fid_other, fg.tensor(a))
    rep = fg.explain(z)
    assert rep.fused_ops == {} and rep.lowered == {"my_gelu_tanh_k05": 1}, str(rep)
    np.testing.assert_allclose(z.numpy(), _gelu_np(a, 0.05), rtol=2e-6, atol=1e-6)


def test_runtime_op_gradient_decomposes(gelu_ops):
    from fuelgraph.registry import call_fused
    fid = gelu_ops[0]
    a = _x((4, 8), seed=32)
    x = fg.tensor(a, requires_grad=True)
    call_fused(fid, x).sum().backward()
    tx = torch.tensor(a, requires_grad=True)
    torch.nn.functional.gelu(tx, approximate="tanh").sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), tx.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_plan_cache_keeps_no_input_data_alive():
    import gc
    import weakref

    from fuelgraph.ir.tensor import bound_data
    x = fg.tensor(np.ones((64, 64), np.float32))
    ref = weakref.ref(bound_data(x.node))
    y = F.softmax_last_dim(x * 2.0)
    y.numpy()
    del x, y
    gc.collect()
    assert ref() is None
