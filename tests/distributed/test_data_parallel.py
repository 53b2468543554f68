"""Data parallelism over two gloo processes (fuelgraph.distributed.DataParallel): the losses and
parameters of traced and eager steps equal those of one process training on the whole batch,
the processes stay identical (rank 1 starts from other weights: the broadcast fixes that), a
traced step replays, and the bucketed all-reduces start while the backward still runs."""
import numpy as np
import pytest

import fuelgraph.distributed as dist
from fuelgraph import FuelGraphError
from tests.distributed import scenarios as S
from tests.distributed.harness import results


@pytest.fixture(scope="module")
def reference():
    return S.reference_data_parallel()


def test_losses_equal_one_process_on_the_whole_batch(reference):
    for r in results("data_parallel"):
        np.testing.assert_allclose(r["losses"], reference["losses"], rtol=1e-6)


def test_parameters_equal_one_process_and_each_other(reference):
    a, b = results("data_parallel")
    for k, want in reference["params"].items():
        np.testing.assert_array_equal(a["params"][k], b["params"][k])
        np.testing.assert_allclose(a["params"][k], want, rtol=1e-5, atol=1e-6)


def test_traced_step_replays():
    for r in results("data_parallel"):
        assert (r["traces"], r["replays"]) == (1, S.DP_STEPS_TRACED - 1)


def test_buckets_all_reduce_while_backward_runs():
    a, b = results("schedule")
    assert a["names"] == b["names"]                 # the same plan, collectives in one order
    assert a["n_buckets"] == 3 and a["names"].count("all_reduce") == 3
    assert a["first_coll"] < a["last_matmul"]       # overlap: issued before the backward ends
    assert sum(np.prod(s) for s in a["coll_shapes"]) == 16 * 32 + 32 + 32 * 32 + 32 + 32 * 8 + 8


def test_one_process_wrapper_is_transparent():
    m = S.mlp()
    dp = dist.DataParallel(m)
    x, y = S.dp_batch()
    assert dp.world_size == 1 and dp.rank == 0
    xs, ys = dp.shard_batch(x, y)
    np.testing.assert_array_equal(xs.numpy(), x)
    np.testing.assert_array_equal(dp(xs).numpy(), m(xs).numpy())
    with pytest.raises(FuelGraphError, match="not divisible"):
        dist.DataParallel(m).shard_batch(np.zeros((3, 2)), axis=2)
    with pytest.raises(FuelGraphError, match="bucket_mb"):
        dist.DataParallel(m, bucket_mb=0)


def test_buckets_follow_reverse_parameter_order_and_size():
    import fuelgraph.nn.functional as F
    m = S.mlp()
    dp = dist.DataParallel(m, bucket_mb=4096 / 2**20)
    x, y = S.dp_batch()
    F.cross_entropy(m(dist.DataParallel(m).shard_batch(x)), dp.shard_batch(y)).backward()
    names = {id(p): k for k, p in m.named_parameters()}
    assert [[names[id(p)] for p in b] for b in dp.buckets()] == \
        [["4.bias", "4.weight", "2.bias"], ["2.weight"], ["0.bias", "0.weight"]]
