"""The planner runs independent large products together in one step on the NumPy backend
(`plan._group_products`, the backend's `run_products`): the q/k/v and gate/up projections of a
layer and the weight gradients of a backward pass. Results match torch float64; views a moved
product needs move up with it; products that depend on each other, or on a non-view op that
runs later, stay apart; the plan's FLOPs count every product of a group."""
from __future__ import annotations

import numpy as np
import pytest
import torch

import fuelgraph as fg
from fuelgraph.backends.numpy import common, primitives
from fuelgraph.runtime.executor import compile_plan


@pytest.fixture
def split(monkeypatch):
    """Every product counts as large and the pool has two threads (plans built after this)."""
    monkeypatch.setattr(common, "NUM_THREADS", 2)
    monkeypatch.setattr(primitives, "PARALLEL_GEMM_FLOPS", 0)


def _plan(outs):
    plan, _ = compile_plan([o.value for o in outs])
    return plan


def test_independent_projections_run_as_one_group_and_match_torch(split):
    rng = np.random.default_rng(0)
    x_np = rng.standard_normal((37, 24)).astype(np.float32)
    ws = [rng.standard_normal((n, 24)).astype(np.float32) * 0.2 for n in (24, 12, 12)]
    x = fg.tensor(x_np)
    w = [fg.tensor(a) for a in ws]
    q, k, v = (x @ wi.T for wi in w)             # three products of one input (weights as views)
    h = q[:, :12] * k + v                         # a consumer of all three
    plan = _plan([h])
    groups = [st for st in plan.steps if st.group]
    assert len(groups) == 1 and len(groups[0].group) == 3
    assert groups[0].name.endswith("_group")
    xt = torch.from_numpy(x_np).double()
    qt, kt, vt = (xt @ torch.from_numpy(a).double().T for a in ws)
    np.testing.assert_allclose(h.numpy(), (qt[:, :12] * kt + vt).numpy(), rtol=1e-5, atol=1e-5)
    rep = fg.plan_report([h], measure=False)
    assert rep.flops >= 2 * 37 * 24 * (24 + 12 + 12)


def test_dependent_products_stay_apart(split):
    rng = np.random.default_rng(1)
    a_np, b_np, c_np = ((rng.standard_normal((19, 19)) * 0.3).astype(np.float32) for _ in range(3))
    a, b, c = fg.tensor(a_np), fg.tensor(b_np), fg.tensor(c_np)
    y = ((a @ b).exp() @ c)                       # the second product needs the first
    plan = _plan([y])
    assert not any(st.group for st in plan.steps)
    at, bt, ct = (torch.from_numpy(t).double() for t in (a_np, b_np, c_np))
    np.testing.assert_allclose(y.numpy(), ((at @ bt).exp() @ ct).numpy(), rtol=1e-5, atol=1e-5)


def test_backward_weight_gradients_grouped_and_match_torch(split):
    rng = np.random.default_rng(2)
    x_np = rng.standard_normal((33, 16)).astype(np.float32)
    w_np = [rng.standard_normal((16, 16)).astype(np.float32) * 0.3 for _ in range(3)]
    x = fg.tensor(x_np)
    ws = [fg.tensor(a, requires_grad=True) for a in w_np]
    h = x
    for w in ws:
        h = (h @ w.T).tanh()
    h.sum().backward()
    grads = [w.grad for w in ws]
    plan = _plan([h] + grads)
    assert any(st.group for st in plan.steps)
    xt = torch.from_numpy(x_np).double()
    wt = [torch.from_numpy(a).double().requires_grad_() for a in w_np]
    ht = xt
    for w in wt:
        ht = (ht @ w.T).tanh()
    ht.sum().backward()
    for g, w in zip(grads, wt):
        np.testing.assert_allclose(g.numpy(), w.grad.numpy(), rtol=1e-4, atol=1e-5)


def test_no_groups_on_one_thread(monkeypatch):
    monkeypatch.setattr(common, "NUM_THREADS", 1)
    monkeypatch.setattr(primitives, "PARALLEL_GEMM_FLOPS", 0)
    rng = np.random.default_rng(3)
    x = fg.tensor(rng.standard_normal((23, 8)).astype(np.float32))
    w1, w2 = (fg.tensor(rng.standard_normal((8, 8)).astype(np.float32)) for _ in range(2))
    plan = _plan([x @ w1 + x @ w2])
    assert not any(st.group for st in plan.steps)
