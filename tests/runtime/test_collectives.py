"""Collectives in plans (runtime/collectives.py), planned in one process over a registered
2-process group that is never run: the issue order depends only on the graph's structure
(not on the order outputs are listed or nodes were built), collectives are issued as early as
their inputs allow and their readers run late, plans without collectives are untouched, and
the agreement check is attached only when asked for."""
import numpy as np
import pytest

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph.registry.collective import register_group, unregister_group
from fuelgraph.runtime import collectives
from fuelgraph.runtime.executor import compile_plan


@pytest.fixture(autouse=True)
def fake2():
    register_group("fake2", 2, 0)
    yield
    unregister_group("fake2")


def _t(*shape, seed=0):
    return fg.tensor(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _steps(outs):
    plan, _ = compile_plan([o.value for o in outs])
    return plan, [(st.op.name, plan.slot_types[st.srcs[0]][0] if st.srcs else None)
                  for st in plan.steps]


def _issue_order(outs):
    _, steps = _steps(outs)
    return [shape for name, shape in steps if name in ("all_reduce", "all_gather")]


def test_issue_order_depends_on_structure_not_output_order():
    x, w1, w2, y = _t(4, 8), _t(8, 8, seed=1), _t(8, 6, seed=2), _t(3, 5, seed=3)
    deep = F.all_reduce((x @ w1).tanh() @ w2, group="fake2")
    shallow = F.all_gather(y * 2.0, 0, "fake2")
    assert _issue_order([deep, shallow]) == _issue_order([shallow, deep]) == [(3, 5), (4, 6)]


def test_issue_order_does_not_depend_on_build_order():
    def build(first_a):
        a_in, b_in = _t(4, 4, seed=5), _t(2, 6, seed=6)
        mk = [lambda: F.all_reduce(a_in.exp(), group="fake2"),
              lambda: F.all_reduce(b_in.exp(), group="fake2")]
        a, b = (mk[0](), mk[1]()) if first_a else tuple(reversed((mk[1](), mk[0]())))
        return [a + 1.0, b + 1.0]
    assert _issue_order(build(True)) == _issue_order(build(False))


def test_collective_issued_early_and_its_reader_late():
    x, w, y, v = _t(6, 8), _t(8, 8, seed=1), _t(6, 8, seed=2), _t(8, 8, seed=3)
    reduced = F.all_reduce(x @ w, group="fake2")
    other = (y @ v).tanh() @ v              # independent work that can overlap
    _, steps = _steps([reduced * other])
    names = [n for n, _ in steps]
    coll = names.index("all_reduce")
    assert coll < len(names) - 1 - names[::-1].index("matmul")   # before the last product
    assert names[-1] in ("mul", "binary") or names[-1].startswith("glue")   # the reader: last


def test_plan_waits_before_reading_asynchronous_results():
    x = _t(4, 4)
    plan, _ = compile_plan([(F.all_reduce(x.exp(), group="fake2") * 2.0).value])
    async_slots = {o for st in plan.steps if st.asynchronous for o in st.outs}
    readers = [st for st in plan.steps if set(st.srcs) & async_slots]
    assert async_slots and readers and all(set(st.waits) == set(st.srcs) & async_slots
                                           for st in readers)


def test_plans_without_collectives_are_untouched():
    x = _t(3, 3)
    order = fg.optimize([(x @ x).exp()]).outputs
    from fuelgraph.ir.node import toposort
    nodes = toposort(order)
    assert collectives.schedule(nodes, {}) is nodes


def test_agreement_check_only_when_asked(monkeypatch):
    x = _t(5, 3)
    monkeypatch.delenv("FUELGRAPH_CHECK_COLLECTIVES", raising=False)
    plan, _ = compile_plan([F.all_reduce(x.exp(), group="fake2").value])
    assert plan.prologue is None
    monkeypatch.setenv("FUELGRAPH_CHECK_COLLECTIVES", "1")
    plan, _ = compile_plan([F.all_reduce(x.sin(), group="fake2").value])
    assert plan.prologue is not None
    seqs = collectives.sequence([st for st in []])
    assert seqs == {}
