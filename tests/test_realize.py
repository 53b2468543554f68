"""Results stay where they were computed: realize returns tensors holding their device
buffers; values are kept (a second read runs nothing, later graphs read them instead of
recomputing); gradients filled by one backward() are computed in one plan."""
import numpy as np

import fuelgraph as fg
import fuelgraph.nn as nn
from fuelgraph.runtime import executor


def plans():
    return executor.STATS["plan_hits"] + executor.STATS["plan_misses"]


def test_realize_returns_device_tensors_without_host_copies():
    x = fg.tensor(np.arange(6, dtype=np.float32))
    y, z = fg.realize([x * 2, x + 1])
    assert isinstance(y, fg.Tensor) and y.is_leaf and y.device == "cpu"
    np.testing.assert_array_equal(np.asarray(y), np.arange(6) * 2)
    w = y * 3                                        # a computed tensor feeds the next graph
    np.testing.assert_array_equal(w.numpy(), np.arange(6) * 6)


def test_values_are_kept():
    x = fg.tensor(np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32))
    y = (x @ x).exp().sum(-1)
    n = plans()
    a = y.numpy()
    assert plans() == n + 1
    b = y.numpy()
    assert plans() == n + 1 and a is b
    y.realize()
    assert plans() == n + 1
    # a later graph reads y's kept buffer: only the new op runs (one plan, one step)
    z = y * 2.0
    n = plans()
    np.testing.assert_allclose(z.numpy(), a * 2, rtol=1e-6)
    assert plans() == n + 1
    plan, _ = executor.compile_plan(executor._cut([(y * 3.0).value]))
    assert len(plan.steps) == 1


def test_reading_every_grad_costs_one_plan():
    fg.manual_seed(0)
    m = nn.Sequential(*[nn.Linear(16, 16) for _ in range(6)])
    loss = m(fg.ones((4, 16))).square().mean()
    loss.backward()
    n = plans()
    grads = [p.grad.numpy() for p in m.parameters()]
    assert plans() == n + 1 and len(grads) == 12
    assert all(p.grad.is_leaf for p in m.parameters())   # computed grads drop their graph
    loss.item()                                          # computed with them
    assert plans() == n + 1


def test_numpy_is_read_only_and_stable_under_updates():
    p = nn.Parameter(np.ones(4, np.float32))
    a = p.numpy()
    assert not a.flags.writeable
    p -= 1.0
    np.testing.assert_array_equal(a, np.ones(4))          # the array does not change
    np.testing.assert_array_equal(p.numpy(), np.zeros(4))


def test_lower_all_recomputes_and_keeps_nothing():
    x = fg.tensor(np.ones((3, 4), np.float32))
    y = (x - x.max(-1, keepdim=True)).exp()
    r = fg.realize([y], lower_all=True)[0]
    assert y.value.node not in fg.ir.tensor.REALIZED
    np.testing.assert_allclose(r.numpy(), np.ones((3, 4)))
