"""NumPy kernels of the collectives (backends/numpy/collective.py), called directly. Over two
gloo processes (tests/distributed/harness.py): each returns a handle and an output that is
valid once the handle was waited for, reduces in place or into `out=`, rounds 16-bit sums once
from float32, gathers and scatters along any axis, and leaves its inputs alone. Over one
process: identities without torch.distributed, no handle."""
import numpy as np
import pytest

from fuelgraph.backends.numpy import collective as K
from tests.distributed import scenarios as S
from tests.distributed.harness import results

WORLD = 2


def _round(v, dtype):
    return np.asarray(np.asarray(v).astype(S.np_dtype(dtype)), np.float64)


@pytest.mark.parametrize("dtype", S.DTYPES)
def test_kernels_over_two_processes(dtype):
    res = results("numpy_kernels")
    xs = [np.asarray(S.rank_input(r, (5, 4), dtype, 4), np.float64) for r in range(WORLD)]
    total = xs[0] + xs[1]
    for r in range(WORLD):
        y, y_avg, gathered, scattered, shard, wrote_out, input_kept = res[r][dtype]
        np.testing.assert_array_equal(y, _round(total, dtype))           # one rounding
        np.testing.assert_array_equal(y_avg, _round(total / 2, dtype))
        np.testing.assert_array_equal(gathered, np.concatenate(xs, 1))
        np.testing.assert_array_equal(scattered, _round(total.reshape(10, 2)[5 * r:5 * r + 5],
                                                        dtype))
        np.testing.assert_array_equal(shard, xs[r][:, 2 * r:2 * r + 2])
        assert wrote_out and input_kept


@pytest.mark.parametrize("dtype", S.DTYPES)
def test_one_process_kernels_are_identities(dtype):
    x = S.rank_input(0, (4, 6), dtype, 9)
    h, y = K.all_reduce(x.copy(), op="sum", group="world", world=1)
    assert h is None and np.array_equal(y, x)
    out = np.empty_like(x)
    h, y = K.all_reduce(x, op="avg", group="world", world=1, out=out)
    assert h is None and y is out and np.array_equal(out, x)
    for fn, kw in ((K.all_gather, {"axis": 1, "grad": "shard"}),
                   (K.reduce_scatter, {"axis": 0, "op": "sum"})):
        h, y = fn(x, group="world", world=1, **kw)
        assert h is None and np.array_equal(y, x)
    assert np.array_equal(K.shard(x, axis=1, group="world", world=1), x)
    assert K.replicate(x, group="world", world=1) is x
