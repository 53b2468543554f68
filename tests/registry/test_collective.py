"""Collectives (registry/collective.py): all_reduce, all_gather, reduce_scatter, shard and
replicate. Over two processes (gloo on the CPU, started by tests/distributed/harness.py): every
op's value and gradient convention in four float dtypes against torch references computed
here from both processes' inputs. In one process: the ops are identities, shapes and dtypes,
every validation error at build time, and the recipe refusing to stand in for communication."""
import numpy as np
import pytest

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph import FuelGraphError
from fuelgraph.registry.collective import (ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, REPLICATE,
                                           SHARD, group_info, register_group, unregister_group)
from fuelgraph.registry.core import call_fused
from tests.distributed import scenarios as S
from tests.distributed.harness import results
from tests.distributed.references import WORLD, check_chain, check_collective_case


@pytest.fixture
def fake2():
    """A registered 2-process group that is never run (building and planning need no peers)."""
    register_group("fake2", 2, 0)
    yield "fake2"
    unregister_group("fake2")


# ---- two processes: values and gradients against torch -----------------------------------------
@pytest.mark.parametrize("dtype", S.DTYPES)
@pytest.mark.parametrize("case,kw,shape", S.COLLECTIVE_CASES,
                         ids=[c[0] for c in S.COLLECTIVE_CASES])
def test_two_processes_value_and_gradient(case, kw, shape, dtype):
    check_collective_case(results("collectives"), case, kw, shape, dtype)


def test_two_processes_agree_on_replicated_results():
    res = results("collectives")
    for case, kw, shape in S.COLLECTIVE_CASES:
        if case.startswith(("all_reduce", "all_gather")):
            for dtype in S.DTYPES:
                np.testing.assert_array_equal(res[0][(case, dtype)][0], res[1][(case, dtype)][0])


def test_integer_sum_and_input_leaf_left_intact():
    res = results("collectives")
    for r in range(WORLD):
        np.testing.assert_array_equal(res[r]["int_sum"], np.arange(6) * 3)
        np.testing.assert_array_equal(res[r]["leaf_kept"], np.arange(6) * (r + 1))


def test_collectives_mixed_with_compute_in_one_plan():
    check_chain(results("collectives"))


def test_broadcast_gives_rank_0_values_in_every_dtype():
    want = [np.asarray(S.rank_input(0, (3, 2), d, 6), np.float64) for d in S.DTYPES] + \
        [np.arange(4.0)]
    for r in results("collectives"):
        for got, w in zip(r["broadcast"], want):
            np.testing.assert_array_equal(got, w)


def test_recipe_refuses_to_replace_communication():
    for r in results("collectives"):
        assert "all_reduce: over a group of 2 processes" in r["lower_all"]
        assert "lower_all" in r["lower_all"]


def test_processes_building_different_graphs_get_an_error_not_a_hang():
    for r in results("collectives"):
        assert "every process must build the same graph" in r["mismatch"]


# ---- one process ------------------------------------------------------------------------------
BUILDERS = [(F.all_reduce, {}), (F.all_reduce, {"op": "avg"}), (F.all_gather, {"axis": 1}),
            (F.reduce_scatter, {"axis": -1}), (F.shard, {"axis": 0}), (F.replicate, {})]


@pytest.mark.parametrize("dtype", S.DTYPES)
@pytest.mark.parametrize("fn,kw", BUILDERS, ids=[f"{f.__name__}{k}" for f, k in BUILDERS])
def test_one_process_is_the_identity_with_identity_gradient(fn, kw, dtype):
    a = S.rank_input(0, (2, 4), dtype, 5)
    x = fg.tensor(a, requires_grad=True)
    y = fn(x, **kw)
    assert y.shape == x.shape and y.dtype == x.dtype
    np.testing.assert_array_equal(y.numpy(), a)
    np.testing.assert_array_equal(fg.realize([y], lower_all=True)[0].numpy(), a)
    w = S.rank_input(1, (2, 4), dtype, 5)
    (y * fg.tensor(w)).sum().backward()
    np.testing.assert_array_equal(x.grad.numpy(), w)


def test_world_group_without_torch_distributed_is_one_process():
    assert group_info("world").size == 1 and group_info().rank == 0


def test_shapes_follow_the_group_size(fake2):
    x = fg.tensor(np.zeros((4, 6), np.float32))
    assert F.all_gather(x, 0, fake2).shape == (8, 6)
    assert F.all_gather(x, -1, fake2).shape == (4, 12)
    assert F.reduce_scatter(x, 1, group=fake2).shape == (4, 3)
    assert F.shard(x, 0, fake2).shape == (2, 6)
    assert F.all_reduce(x, group=fake2).shape == (4, 6)
    assert F.replicate(x, fake2).shape == (4, 6)
    assert F.all_reduce(x, group=fake2).node.op.params.world == 2


def test_gradients_are_the_conventional_collectives(fake2):
    """The backward of each op is the collective of its convention (built, not run)."""
    x = fg.tensor(np.zeros((4, 6), np.float32), requires_grad=True)
    want = {F.all_reduce: REPLICATE, F.replicate: ALL_REDUCE, F.reduce_scatter: ALL_GATHER,
            F.shard: ALL_GATHER}
    for fn, helper in want.items():
        (g,) = fg.grad([fn(x, group=fake2).sum()], [x])
        assert _fused_ids(g) & {int(helper)}, fn.__name__
    (g,) = fg.grad([F.all_gather(x, 0, fake2).sum()], [x])
    assert int(REDUCE_SCATTER) in _fused_ids(g)
    (g,) = fg.grad([F.all_gather(x, 0, fake2, grad="shard").sum()], [x])
    assert int(SHARD) in _fused_ids(g)


def _fused_ids(t):
    from fuelgraph.ir import ops
    from fuelgraph.ir.node import toposort
    return {int(n.op.id) for n in toposort([t.value]) if isinstance(n.op, ops.Fused)}


def test_lowering_over_two_processes_raises_instead_of_computing_one(fake2):
    x = fg.tensor(np.ones((4, 6), np.float32))
    for y in (F.all_reduce(x, group=fake2), F.all_gather(x, 0, fake2),
              F.reduce_scatter(x, 0, group=fake2), F.shard(x, 0, fake2),
              F.replicate(x, fake2)):
        with pytest.raises(FuelGraphError, match="no composition of primitives"):
            fg.realize([y * 2.0], lower_all=True)


@pytest.mark.parametrize("build,match", [
    (lambda x, g: F.all_reduce(x, op="max", group=g), "op is 'max'"),
    (lambda x, g: F.all_reduce(x.astype(fg.int64), op="avg", group=g), "needs a float"),
    (lambda x, g: F.all_reduce(x > 0, group=g), "needs a numeric"),
    (lambda x, g: F.reduce_scatter(x, 0, op="prod", group=g), "op is 'prod'"),
    (lambda x, g: F.all_gather(x, 2, g), "axis 2 is out of range"),
    (lambda x, g: F.all_gather(x, 0, g, grad="sum"), "grad is 'sum'"),
    (lambda x, g: F.reduce_scatter(x[:3], 0, group=g), "not divisible by the group size 2"),
    (lambda x, g: F.shard(x[:, :5], 1, g), "not divisible by the group size 2"),
    (lambda x, g: F.all_gather(x.sum(), 0, g), "out of range"),
    (lambda x, g: F.all_reduce(x, group="nope"), "no process group named 'nope'"),
    (lambda x, g: F.all_reduce(np.ones(3), group=g), "must be a Tensor"),
])
def test_validation_errors_at_build_time(fake2, build, match):
    with pytest.raises(FuelGraphError, match=match):
        build(fg.tensor(np.ones((4, 6), np.float32)), fake2)


def test_params_are_checked_when_built_directly():
    x = fg.tensor(np.ones((4, 6), np.float32))
    with pytest.raises(FuelGraphError, match="world must be an int >= 1"):
        call_fused(ALL_REDUCE, x, op="sum", group="world", world=0)
    with pytest.raises(FuelGraphError, match="param axis is -1"):
        call_fused(ALL_GATHER, x, axis=-1, grad="shard", group="world", world=1)
    with pytest.raises(FuelGraphError, match="group must be a group name"):
        call_fused(REPLICATE, x, group="", world=1)


def test_register_group_checks_its_arguments():
    with pytest.raises(FuelGraphError, match="0 <= rank < size"):
        register_group("bad", 2, 2)
    with pytest.raises(FuelGraphError, match="non-empty string"):
        register_group("", 1, 0)
