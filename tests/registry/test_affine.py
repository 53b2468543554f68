"""INPLACE_AFFINE (id 16): out = mul * x + add, computed in input 0's buffer.

Value semantics stay functional (property tests over random graphs that mix the in-place op
with other readers of the same value, before and after it: results equal pure NumPy and the
lower_all evaluation), and the memory contract holds: the buffer is reused when no later reader
needs it and copied when it cannot be (value read later, graph input, graph output or a view of
it, a second destructive op on the same buffer)."""
import ml_dtypes
import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph import FuelGraphError, FusedOps
from fuelgraph.ir import ops
from fuelgraph.ir.tensor import bound_data
from fuelgraph.opt import regions
from fuelgraph.runtime import executor
from fuelgraph.runtime.executor import compile_plan

NP = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16,
      "float16": np.float16}
TORCH = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
         "float16": torch.float16}


@pytest.fixture(autouse=True)
def _no_glue(monkeypatch):
    """This module tests the affine op's own kernel and buffer contract. With glue regions on,
    an affine next to other elementwise primitives runs inside their generated kernel instead
    (there is then no buffer of its own to reuse), so the glue pass is off here."""
    monkeypatch.setattr(regions, "ENABLED", False)
    executor._PLANS.clear()
    yield
    executor._PLANS.clear()


# ---- forward / backward vs torch ------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("shape", [(), (7,), (3, 4, 5)])
def test_forward_matches_torch(dtype, shape):
    rng = np.random.default_rng(len(shape))
    x = rng.standard_normal(shape).astype(NP[dtype])
    mul, add = 1.7, -0.3
    out = F.inplace_affine(fg.tensor(x), mul, add)
    assert out.dtype.name == dtype and out.shape == shape
    got = np.asarray(out.numpy(), np.float64)
    ref = (torch.tensor(np.asarray(x, np.float64)) * mul + add).numpy()
    same = (torch.tensor(np.asarray(x, np.float64)).to(TORCH[dtype]) * mul + add).double().numpy()
    err = np.abs(got - ref).max(initial=0)
    if dtype == "float64":
        assert err <= 1e-15 * max(np.abs(ref).max(initial=1), 1)
    elif dtype == "float32":
        assert err <= 1e-6 * max(np.abs(ref).max(initial=1), 1)
    else:
        assert err <= 2 * np.abs(same - ref).max(initial=0) + 1e-7
    low = np.asarray(fg.realize([out], lower_all=True)[0], np.float64)   # the recipe
    np.testing.assert_allclose(low, got, rtol={"float64": 1e-15, "float32": 1e-6}.get(dtype, 1e-2),
                               atol=1e-6 if dtype in ("float64", "float32") else 2e-2)


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
def test_gradient_matches_torch(dtype):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3)).astype(NP[dtype])
    xt = fg.tensor(x, requires_grad=True)
    y = F.inplace_affine(xt, -2.5, 0.25)
    w = rng.standard_normal((4, 3)).astype(NP[dtype])
    (y * y * fg.tensor(w)).sum().backward()
    tx = torch.tensor(np.asarray(x, np.float64), requires_grad=True)
    ty = tx * -2.5 + 0.25
    (ty * ty * torch.tensor(np.asarray(w, np.float64))).sum().backward()
    tol = {"float64": 1e-13, "float32": 1e-5, "bfloat16": 5e-2}[dtype]
    np.testing.assert_allclose(np.asarray(xt.grad.numpy(), np.float64), tx.grad.numpy(),
                               rtol=tol, atol=tol * 10)
    assert xt.grad.dtype.name == dtype


def test_entry_facets_and_errors():
    e = fg.default_registry().entry(FusedOps.INPLACE_AFFINE)
    assert e.destructive_inputs == (0,) and e.backward.kind == "decompose"
    with pytest.raises(FuelGraphError, match="inplace_affine: x has dtype int64"):
        F.inplace_affine(fg.tensor(np.arange(3)), 2.0, 1.0)
    with pytest.raises(FuelGraphError, match="param mul must be a real number"):
        F.inplace_affine(fg.tensor(np.ones(3, np.float32)), "2", 1.0)
    with pytest.raises(FuelGraphError, match="1 inputs"):
        from fuelgraph.registry.core import call_fused
        x = fg.tensor(np.ones(3, np.float32))
        call_fused(FusedOps.INPLACE_AFFINE, x, x, mul=1.0, add=0.0)


# ---- the memory contract --------------------------------------------------------------------
def _run_capturing(outs, producer_kind):
    """Run the plan of `outs`, capturing the buffer produced by the (single) Unary node of
    kind `producer_kind`. Returns (results, captured buffer, stats delta)."""
    vals = [o.value for o in outs]
    plan, inputs = compile_plan(vals)
    captured = []
    step = next(s for s in plan.steps
                if isinstance(s.op, ops.Unary) and s.op.kind == producer_kind)
    orig = step.fn

    def spy(*a):
        r = orig(*a)
        captured.append(r)
        return r

    before = dict(plan.stats)
    step.fn = spy
    try:
        res = plan.run([bound_data(n) for n in inputs])
    finally:
        step.fn = orig
    delta = {k: plan.stats.get(k, 0) - before.get(k, 0)
             for k in ("inplace_reused", "inplace_copies")}
    return res, captured[0], delta


A = np.random.default_rng(42).standard_normal((6, 5))


def test_buffer_reused_when_no_later_reader():
    a = fg.tensor(A)
    x = a.exp()
    r = x.sum(-1, keepdim=True)              # another reader of x, ordered before the overwrite
    y = F.inplace_affine(x, 2.0, 1.0) + r
    (got,), buf, delta = _run_capturing([y * 1.0], "exp")   # y * 1 keeps y an intermediate
    assert delta == {"inplace_reused": 1, "inplace_copies": 0}
    np.testing.assert_allclose(got, (2 * np.exp(A) + 1) + np.exp(A).sum(-1, keepdims=True))
    # the exp buffer was overwritten with the affine result
    np.testing.assert_allclose(buf, 2 * np.exp(A) + 1)


def test_output_shares_the_intermediate_buffer():
    a = fg.tensor(A)
    x = a.tanh()
    y = F.inplace_affine(x, -1.0, 0.5)
    (got,), buf, delta = _run_capturing([y], "tanh")
    assert delta["inplace_reused"] == 1
    assert np.shares_memory(got, buf)
    np.testing.assert_allclose(got, -np.tanh(A) + 0.5)


def test_spelled_affine_fuses_and_reuses():
    a = fg.tensor(A)
    x = a.exp()
    y = x * 3.0 + 0.5
    assert fg.explain(y).fused_ops == {"inplace_affine": 1}
    (got,), buf, delta = _run_capturing([y], "exp")
    assert delta["inplace_reused"] == 1 and np.shares_memory(got, buf)
    np.testing.assert_allclose(got, np.exp(A) * 3 + 0.5)


def test_buffer_reused_through_a_view():
    a = fg.tensor(A)
    x = a.exp()
    y = F.inplace_affine(x.reshape(-1), 2.0, 0.0).reshape(6, 5)
    (got,), buf, delta = _run_capturing([y], "exp")
    assert delta["inplace_reused"] == 1 and np.shares_memory(got, buf)
    np.testing.assert_allclose(got, 2 * np.exp(A))


@pytest.mark.parametrize("case", ["read_later", "graph_input", "graph_output", "view_output",
                                  "two_destructive"])
def test_copied_when_it_cannot_be_reused(case):
    a = fg.tensor(A)
    x = a.exp()
    ex = np.exp(A)
    if case == "read_later":          # x is read by something that needs the affine result
        y = F.inplace_affine(x, 2.0, 1.0)
        outs, refs = [y + x], [2 * ex + 1 + ex]
    elif case == "graph_input":       # never overwrite user data
        y = F.inplace_affine(a, 2.0, 1.0)
        outs, refs = [y], [2 * A + 1]
    elif case == "graph_output":
        y = F.inplace_affine(x, 2.0, 1.0)
        outs, refs = [x, y], [ex, 2 * ex + 1]
    elif case == "view_output":       # an output aliasing x's storage
        y = F.inplace_affine(x, 2.0, 1.0)
        outs, refs = [x.reshape(-1), y], [ex.reshape(-1), 2 * ex + 1]
    else:                             # two destructive ops on one buffer: only one in place
        outs = [F.inplace_affine(x, 2.0, 1.0), F.inplace_affine(x, 3.0, 1.0)]
        refs = [2 * ex + 1, 3 * ex + 1]
    vals = [o.value for o in outs]
    plan, inputs = compile_plan(vals)
    before = dict(plan.stats)
    got = fg.realize(outs)
    for g, r in zip(got, refs):
        np.testing.assert_allclose(g, r)
    copies = plan.stats.get("inplace_copies", 0) - before.get("inplace_copies", 0)
    reused = plan.stats.get("inplace_reused", 0) - before.get("inplace_reused", 0)
    assert copies == 1
    assert reused == (1 if case == "two_destructive" else 0)
    np.testing.assert_array_equal(bound_data(a.node), A)     # user data untouched


@pytest.mark.parametrize("view", [False, True])
def test_read_only_input_is_never_written(view):
    """A leaf sharing read-only user memory (fg.from_dlpack of a NumPy array) is never
    overwritten, directly or through a view: the runtime hands the kernel a fresh buffer
    (`out=`) instead. (Replaces the NumPy kernel's old run-time rejection of a read-only x;
    the kernel itself no longer validates its inputs.)"""
    user = A.astype(np.float32)
    user.flags.writeable = False
    keep = user.copy()
    a = fg.from_dlpack(user)
    assert np.shares_memory(bound_data(a.node), user)
    src = a.reshape(-1) if view else a
    y = F.inplace_affine(src, 2.0, 1.0)
    assert fg.explain(y).fused_ops == {"inplace_affine": 1}
    plan, _ = compile_plan([y.value])
    before = dict(plan.stats)
    want = (keep * np.float32(2) + np.float32(1)).reshape(src.shape)
    np.testing.assert_array_equal(y.numpy(), want)
    np.testing.assert_array_equal(user, keep)
    assert plan.stats.get("inplace_copies", 0) - before.get("inplace_copies", 0) == 1
    assert plan.stats.get("inplace_reused", 0) == before.get("inplace_reused", 0)


def test_cross_buffer_ordering_does_not_deadlock():
    """n1 overwrites x, n2 overwrites z; x is read after n2 and z after n1: granting both
    would need a cycle, so one of them copies."""
    B = A[::-1].copy()
    a, b = fg.tensor(A), fg.tensor(B)
    x, z = a.exp(), b.exp()
    n1, n2 = F.inplace_affine(x, 2.0, 1.0), F.inplace_affine(z, 3.0, 1.0)
    got = fg.realize([z + n1, x + n2])
    np.testing.assert_allclose(got[0], np.exp(B) + 2 * np.exp(A) + 1)
    np.testing.assert_allclose(got[1], np.exp(A) + 3 * np.exp(B) + 1)


def test_repeated_runs_of_a_cached_plan_are_stable():
    # realizing a tensor again reads its kept value: rebuild the graph on new inputs (same
    # structure, so the same cached plan runs each time)
    def run():
        y = F.inplace_affine(fg.tensor(A).exp(), 2.0, 1.0) * 2.0
        return fg.realize([y])[0].numpy()
    first = run().copy()
    for _ in range(3):
        np.testing.assert_array_equal(run(), first)


# ---- property test: random graphs -----------------------------------------------------------
SHAPE = (3, 4)
reals = st.floats(-2.0, 2.0, allow_nan=False).map(lambda v: round(v, 3))

op_st = st.one_of(
    st.tuples(st.just("affine"), st.integers(0, 99), reals, reals),
    st.tuples(st.just("spelled"), st.integers(0, 99), reals, reals),
    st.tuples(st.just("affine_view"), st.integers(0, 99), reals, reals),
    st.tuples(st.just("affine_T"), st.integers(0, 99), reals, reals),
    st.tuples(st.just("tanh"), st.integers(0, 99)),
    st.tuples(st.just("neg"), st.integers(0, 99)),
    st.tuples(st.just("add"), st.integers(0, 99), st.integers(0, 99)),
    st.tuples(st.just("mul"), st.integers(0, 99), st.integers(0, 99)),
    st.tuples(st.just("rowsum"), st.integers(0, 99)),
)


def _build(seed, program):
    rng = np.random.default_rng(seed)
    arrs = [rng.standard_normal(SHAPE) for _ in range(2)]
    pool = [(fg.tensor(v), v) for v in arrs]
    for step in program:
        kind, i = step[0], step[1] % len(pool)
        t, v = pool[i]
        if kind == "affine":
            new = (F.inplace_affine(t, step[2], step[3]), step[2] * v + step[3])
        elif kind == "spelled":
            new = (t * step[2] + step[3], v * step[2] + step[3])
        elif kind == "affine_view":
            new = (F.inplace_affine(t.reshape(-1), step[2], step[3]).reshape(SHAPE),
                   step[2] * v + step[3])
        elif kind == "affine_T":
            new = (F.inplace_affine(t.T, step[2], step[3]).T, step[2] * v + step[3])
        elif kind == "tanh":
            new = (t.tanh(), np.tanh(v))
        elif kind == "neg":
            new = (-t, -v)
        elif kind in ("add", "mul"):
            t2, v2 = pool[step[2] % len(pool)]
            new = (t + t2, v + v2) if kind == "add" else ((t * t2).tanh(), np.tanh(v * v2))
        else:
            new = (t + t.sum(-1, keepdim=True), v + v.sum(-1, keepdims=True))
        pool.append(new)
    return pool


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**16), program=st.lists(op_st, min_size=1, max_size=8),
       picks=st.lists(st.integers(0, 99), min_size=1, max_size=4))
def test_inplace_never_changes_results(seed, program, picks):
    pool = _build(seed, program)
    chosen = [pool[p % len(pool)] for p in picks]
    outs = [t for t, _ in chosen]
    refs = [v for _, v in chosen]
    for lower_all in (False, True, False):    # the third run reuses the cached plan
        got = fg.realize(outs, lower_all=lower_all)
        for g, r in zip(got, refs):
            np.testing.assert_allclose(g, r, rtol=1e-12, atol=1e-12)
    # each value alone (a different graph, different in-place decisions) reads the same
    for t, v in chosen:
        np.testing.assert_allclose(fg.realize([t])[0], v, rtol=1e-12, atol=1e-12)
    # user data never changes
    for t, v in pool[:2]:
        np.testing.assert_array_equal(bound_data(t.node), v)
