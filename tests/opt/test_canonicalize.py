"""Canonicalization rules one by one: every named rule fires on a spelling made for it, reports
itself in the rewrite log, and keeps the value (exactly, except where NOTES allows a change);
equivalent spellings meet one node; a random property test over chains of the ops the rules
move; the rewrite engine (patterns as data, indexed by root op); and canonicalization stays
linear in the graph's size."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import fuelgraph as fg
from fuelgraph.ir import ops
from fuelgraph.ir.node import apply
from fuelgraph.ir.tensor import Tensor
from fuelgraph.opt import pattern as pattern_mod
from fuelgraph.opt.canonicalize import CANONICALIZE
from fuelgraph.opt.engine import Pass, Pat, RewriteLog, Rule, run_pass
from fuelgraph.opt.passes import optimize

A = np.array([[0.5, -1.25, 0.0, 2.0], [-0.0, 3.5, -2.25, 0.75], [1.5, -0.5, 4.0, -3.0]])
IDX = np.array([[3, 0], [1, 1], [2, 0]])


def _op(op, t):
    return Tensor(apply(op, t.value))


def _canon(t):
    log = RewriteLog()
    out = run_pass([t.value], CANONICALIZE, log)[0]
    return out, log


def _same(got, ref, exact):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    if exact:
        np.testing.assert_array_equal(got, ref)
        np.testing.assert_array_equal(np.signbit(got), np.signbit(ref))   # -0.0 kept
    else:
        np.testing.assert_allclose(got, ref, rtol=4e-16, atol=0)
        zero = ref == 0
        np.testing.assert_array_equal(np.signbit(got[zero]), np.signbit(ref[zero]))


def _idx():
    return fg.tensor(IDX)


IDX_T = _idx()


# rule name -> (spelling of x, NumPy reference of a, exact)
RULE_CASES = {
    "movement_noop": (lambda x: _op(ops.Reshape((3, 4)), x) * 2.0, lambda a: a * 2, True),
    "movement_of_constant": (lambda x: x + fg.full((12,), 0.5, fg.float64).reshape(3, 4),
                             lambda a: a + 0.5, True),
    "reshape_of_reshape": (lambda x: x.reshape(12).reshape(4, 3), lambda a: a.reshape(4, 3), True),
    "broadcast_of_broadcast": (lambda x: x[:1, :1].broadcast_to(1, 4).broadcast_to(3, 4),
                               lambda a: np.broadcast_to(a[:1, :1], (3, 4)), True),
    "unit_reshape_after_elementwise": (lambda x: (-x[:, None]).exp(),
                                       lambda a: np.exp(-a[:, None]), True),
    "permute_identity": (lambda x: _op(ops.Permute((0, 1)), x) + 1.0, lambda a: a + 1, True),
    "permute_of_permute": (lambda x: x.T.T * 3.0, lambda a: a * 3, True),
    "cast_noop": (lambda x: _op(ops.Cast(fg.float64), x) * 2.0, lambda a: a * 2, True),
    "detach_after_movement": (lambda x: x.detach().reshape(4, 3), lambda a: a.reshape(4, 3), True),
    "reduce_keepdim": (lambda x: x.max(-1), lambda a: a.max(-1), True),
    "reduce_size1_is_reshape": (lambda x: x[:, :1].sum(-1), lambda a: a[:, :1].sum(-1), True),
    "reduce_of_unit_reshape": (lambda x: x[:, None].max(0), lambda a: a[:, None].max(0), True),
    "neg_through_movement": (lambda x: (-x).T[1:], lambda a: (-a).T[1:], True),
    "neg_through_gather": (lambda x: (-x).gather(-1, _idx()),
                           lambda a: np.take_along_axis(-a, IDX, -1), True),
    "neg_before_broadcast": (lambda x: -(x[:1].broadcast_to(3, 4)),
                             lambda a: -np.broadcast_to(a[:1], (3, 4)), True),
    "scale_through_movement": (lambda x: (x * 3.0).T, lambda a: (a * 3).T, True),
    "scale_through_gather": (lambda x: (x * 0.3).gather(-1, _idx()),
                             lambda a: np.take_along_axis(a * 0.3, IDX, -1), True),
    "scale_before_broadcast": (lambda x: x[:1].broadcast_to(3, 4) * 0.3,
                               lambda a: np.broadcast_to(a[:1], (3, 4)) * 0.3, True),
    "neg_into_scale": (lambda x: (-x) * 0.3, lambda a: (-a) * 0.3, True),
    "neg_of_scale": (lambda x: -(x * 0.3), lambda a: -(a * 0.3), True),
    "div_one_to_recip": (lambda x: 1.0 / (x + 5.0), lambda a: 1 / (a + 5), True),
    "div_by_const_to_mul": (lambda x: x / 3.0, lambda a: a / 3, False),          # <= 1 ulp
    "mul_reciprocal_to_div": (lambda x: x * (x + 5.0).reciprocal(), lambda a: a / (a + 5), True),
    "mul_broadcast_reciprocal_to_div": (
        lambda x: x * (1.0 / (x * x).sum(-1, keepdim=True)),
        lambda a: a / (a * a).sum(-1, keepdims=True), True),
    "mul_by_minus_one_to_neg": (lambda x: x * -1.0, lambda a: -a, True),
    "neg_zero_minus_to_neg": (lambda x: -0.0 - x, lambda a: -0.0 - a, True),
    "pow_by_constant": (lambda x: x ** 2, lambda a: a * a, True),
    "neg_neg": (lambda x: -(-x), lambda a: a, True),
    "recip_sqrt_to_rsqrt": (lambda x: 1.0 / (x * x + 1.0).sqrt(),
                            lambda a: 1 / np.sqrt(a * a + 1), True),
    "order_commutative_operands": (lambda x: (x * 2.0) + x, lambda a: a * 2 + a, True),
}


def test_every_rule_is_named_once_and_has_a_case():
    names = [r.name for r in CANONICALIZE.rules]
    assert len(names) == len(set(names))
    assert set(names) == set(RULE_CASES), set(names) ^ set(RULE_CASES)


@pytest.mark.parametrize("rule", list(RULE_CASES))
def test_rule_fires_and_keeps_the_value(rule):
    spell, ref, exact = RULE_CASES[rule]
    y = spell(fg.tensor(A))
    _, log = _canon(y)
    assert log.count(rule) >= 1, log.counts("canonicalize")
    assert fg.explain(y).rules_fired.get(rule, 0) >= 1
    _same(y.numpy(), ref(A), exact)


MEET = {   # spellings that must canonicalize to the very same node
    "neg/permute": (lambda x: (-x).T, lambda x: -(x.T)),
    "scale/slice": (lambda x: (x * 3.0)[1:], lambda x: x[1:] * 3.0),
    "neg/scale": (lambda x: (-x) * 3.0, lambda x: x * -3.0),
    "neg of scale": (lambda x: -(x * 3.0), lambda x: x * -3.0),
    "neg times -1": (lambda x: (-x) * -1.0, lambda x: x),
    "neg/gather": (lambda x: (-x).gather(-1, IDX_T), lambda x: -x.gather(-1, IDX_T)),
    "scale/broadcast": (lambda x: x[:1].broadcast_to(3, 4) * 2.0,
                        lambda x: (x[:1] * 2.0).broadcast_to(3, 4)),
    "squeezed mean": (lambda x: x.mean(-1)[:, None], lambda x: x.mean(-1, keepdim=True)),
    "size-1 max": (lambda x: x[:, :1].max(-1), lambda x: x[:, 0]),
    "size-1 sum": (lambda x: x[:, :1].sum(-1), lambda x: x[:, 0] + 0.0),
    "unsqueezed sum": (lambda x: x[:, None].sum(0), lambda x: x.sum(0, keepdim=True)),
    "[N,1] sum": (lambda x: x[:, :1].sum(), lambda x: x[:, 0].sum()),
    "neg [N,1] sum": (lambda x: (-x[:, :1]).sum(), lambda x: (-x[:, 0]).sum()),
    "detached squeezed max": (lambda x: x.max(-1).detach()[:, None],
                              lambda x: x.max(-1, keepdim=True).detach()),
    "squeezed logsumexp": (
        lambda x: x.max(-1) + (x - x.max(-1)[:, None]).exp().sum(-1).log(),
        lambda x: (x.max(-1, keepdim=True) + (x - x.max(-1, keepdim=True)).exp()
                   .sum(-1, keepdim=True).log())[:, 0]),
}


@pytest.mark.parametrize("pair", list(MEET))
def test_equivalent_spellings_meet(pair):
    f, g = MEET[pair]
    x = fg.tensor(A)
    assert _canon(f(x))[0] == _canon(g(x))[0]


def test_negation_does_not_cross_a_sum():
    """-(a + b) and (-a) + (-b) differ in the sign of an exact zero: the rule set keeps them
    apart, and the value of each spelling is NumPy's."""
    z = np.array([[0.0, -0.0], [1.5, -1.5]])
    x = fg.tensor(z)
    a, b = (-x).sum(-1), -(x.sum(-1))
    assert _canon(a)[0] != _canon(b)[0]
    _same(a.numpy(), (-z).sum(-1), True)
    _same(b.numpy(), -(z.sum(-1)), True)
    assert not np.signbit(a.numpy()[0]) and np.signbit(b.numpy()[0])


def test_constant_scaling_does_not_cross_a_sum():
    x = fg.tensor(A)
    assert _canon((x * 0.3).sum(-1))[0] != _canon(x.sum(-1) * 0.3)[0]


def test_detached_gradient_survives_canonicalization():
    """Stop-gradients move past movement ops but keep stopping the gradient."""
    x = fg.tensor(A, requires_grad=True)
    y = (x.detach().reshape(4, 3) * x.reshape(4, 3)).sum()
    (g,) = fg.grad(y, [x])
    np.testing.assert_array_equal(g.numpy(), A)


# ---- property: random chains of the ops the rules move ---------------------------------------
def _apply_step(step, t, a):
    kind, k = step
    nd = a.ndim
    if kind == "neg":
        return -t, -a
    if kind == "scale":
        c = (2.0, -1.0, 1.0, 0.3, -0.5)[k % 5]
        return t * c, a * c
    if kind == "exp":
        return (t * 0.25).exp(), np.exp(a * 0.25)
    if kind == "unsqueeze":
        ax = k % (nd + 1)
        return t.unsqueeze(ax), np.expand_dims(a, ax)
    if kind == "squeeze":
        ones = [i for i, d in enumerate(a.shape) if d == 1]
        if not ones:
            return t, a
        ax = ones[k % len(ones)]
        return t.squeeze(ax), a.squeeze(ax)
    if kind == "permute" and nd >= 2:
        return t.T, a.T
    if kind == "slice" and nd >= 1 and a.shape[0] >= 2:
        return t[1:], a[1:]
    if kind == "broadcast":
        ones = [i for i, d in enumerate(a.shape) if d == 1]
        if not ones:
            return t, a
        shape = tuple(3 if i == ones[k % len(ones)] else d for i, d in enumerate(a.shape))
        return t.broadcast_to(shape), np.broadcast_to(a, shape)
    if kind == "gather" and nd >= 1 and a.shape[-1] >= 1:
        idx = (np.arange(int(np.prod(a.shape[:-1], dtype=int)) * 2) % a.shape[-1]).reshape(
            a.shape[:-1] + (2,))
        return t.gather(-1, fg.tensor(idx)), np.take_along_axis(a, idx, -1)
    if kind in ("sum", "max") and nd >= 1:
        ax, keep = k % nd, bool(k // nd % 2)
        red = getattr(np, kind)
        return getattr(t, kind)(ax, keepdim=keep), red(a, axis=ax, keepdims=keep)
    if kind == "detach":
        return t.detach(), a
    return t, a


KINDS = ["neg", "scale", "exp", "unsqueeze", "squeeze", "permute", "slice", "broadcast", "gather",
         "sum", "max", "detach"]
# rows and columns that cancel to exact zeros, signed zeros among the entries
CANCEL = np.array([[0.5, -0.5, 0.0, -0.0], [1.5, -1.5, -0.0, -0.0], [-2.0, 2.0, 0.0, 2.0]])


def test_all_two_step_chains_keep_their_value():
    for k1 in KINDS:
        for k2 in KINDS:
            for k in (0, 1, 3):
                steps = [(k1, k), (k2, k)]
                t, a = fg.tensor(CANCEL), CANCEL
                for s in steps:
                    t, a = _apply_step(s, t, a)
                _same(t.numpy(), a, exact="sum" not in (k1, k2))


STEPS = st.tuples(st.sampled_from(["neg", "neg", "scale", "exp", "unsqueeze", "squeeze",
                                   "permute", "slice", "broadcast", "gather", "sum", "sum", "max",
                                   "detach"]),
                  st.integers(0, 11))


@settings(max_examples=150, deadline=None, derandomize=True)
@given(st.lists(STEPS, min_size=1, max_size=6), st.sampled_from([(3, 4), (2, 1, 3), (4,), (2, 2)]),
       st.integers(0, 2 ** 16))
def test_random_chains_keep_their_value(steps, shape, seed):
    # few distinct values, signed zeros among them: sums cancel to exact zeros often
    a = np.random.default_rng(seed).choice([0.0, -0.0, 0.5, -0.5, 1.5, -1.5, 2.0], size=shape)
    t = fg.tensor(a)
    for s in steps:
        t, a = _apply_step(s, t, a)
    exact = not any(k == "sum" for k, _ in steps)   # a reduction's order is the backend's
    _same(t.numpy(), a, exact)


# ---- the engine ---------------------------------------------------------------------------
def test_pat_matches_op_kind_sources_names_and_commutes():
    x = fg.tensor(A)
    y = _canon(x * 2.0)[0]                # mul(x, Full)
    env = {}
    assert Pat(ops.Binary, "mul", (Pat.var("a"), Pat.const("c"))).match(y, env)
    assert env["a"] == x.value and env["c"].node.op.value == 2.0
    assert not Pat(ops.Binary, "add").match(y, {})
    assert not Pat(ops.Unary).match(y, {})
    swapped = Pat(ops.Binary, "mul", (Pat.const("c"), Pat.var("a")))
    assert not swapped.match(y, {})
    assert Pat(ops.Binary, "mul", (Pat.const("c"), Pat.var("a")), commutative=True).match(y, {})
    sq = (x * x).value                    # one name used twice binds one value
    assert Pat(ops.Binary, "mul", (Pat.var("a"), Pat.var("a"))).match(sq, {})
    assert not Pat(ops.Binary, "mul", (Pat.var("a"), Pat.var("a"))).match(y, {})


def test_pass_indexes_rules_by_root_op_and_kind():
    tried = []
    neg_rule = Rule("only_neg", Pat(ops.Unary, "neg", name="r"), lambda r: tried.append(r))
    p = Pass("test", [neg_rule])
    assert p.rules_for(ops.Unary("neg")) == [neg_rule]
    assert p.rules_for(ops.Unary("exp")) == [] and p.rules_for(ops.Binary("add")) == []
    x = fg.tensor(A)
    run_pass([(-(x.exp())).value], p)
    assert len(tried) == 1
    with pytest.raises(ValueError, match="unique"):
        Pass("dup", [neg_rule, neg_rule])


def test_rewrite_log_counts_per_pass():
    x = fg.tensor(A)
    log = RewriteLog()
    run_pass([(-(-(x.exp())) * x).value], CANONICALIZE, log)
    counts = log.counts("canonicalize")
    assert counts == {"neg_neg": 1, "order_commutative_operands": 1}, counts
    assert log.count("neg_neg") == 1 and log.counts("lower") == {}


# ---- linear in the graph's size ------------------------------------------------------------
def _stack(k, rng=np.random.default_rng(3)):
    w = fg.tensor(rng.standard_normal((8, 8)) * 0.3)
    x = fg.tensor(rng.standard_normal((2, 4, 8)))
    for _ in range(k):
        h = x * ((x * x).mean(-1)[..., None] + 1e-6).rsqrt()
        s = (-(h @ w)).T.T / 2.0
        e = (s - s.max(-1, keepdim=True)).exp()
        x = x + e / e.sum(-1, keepdim=True)
    return x


def test_rule_attempts_grow_linearly_with_depth(monkeypatch):
    calls = [0]
    apply_rule = Rule.apply

    def counted(self, n):
        calls[0] += 1
        return apply_rule(self, n)
    monkeypatch.setattr(Rule, "apply", counted)
    per_depth = []
    for k in (8, 32):
        y = _stack(k)
        calls[0] = 0
        rep = optimize([y])
        assert sum(1 for e in rep.log.events if e[0] == "fuse") == 2 * k
        per_depth.append(calls[0] / k)
    assert per_depth[1] <= 1.1 * per_depth[0], per_depth


def test_verifying_a_match_does_not_walk_the_graph_above_it(monkeypatch):
    """A re-traced recipe is canonicalized down to the captured inputs, not beyond them."""
    walked, real = [0], pattern_mod.run_pass

    def counting(outs, p, log=None, memo=None):
        memo = {} if memo is None else memo
        before = len(memo)
        r = real(outs, p, log, memo)
        walked[0] += len(memo) - before
        return r
    monkeypatch.setattr(pattern_mod, "run_pass", counting)
    per_match = []
    for k in (4, 32):
        y = _stack(k)
        walked[0] = 0
        optimize([y])
        per_match.append(walked[0] / (2 * k))
    assert per_match[1] <= 1.1 * per_match[0], per_match
