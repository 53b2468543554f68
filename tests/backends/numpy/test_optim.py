"""NumPy kernels of the optimizer updates (backends/numpy/optim.py): they write into the
buffers they are given (and return those very arrays), agree with the recipe bit for bit in
float32/float64, and chunking over threads does not change results."""
import ml_dtypes
import numpy as np
import pytest

import fuelgraph as fg
from fuelgraph.backends.numpy import optim as K
from fuelgraph.registry.optim import adamw_step_recipe, sgd_step_recipe

NP = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16,
      "float16": np.float16}


def _arrays(n, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(n).astype(NP[dtype]) for _ in range(3)] + \
        [(np.abs(rng.standard_normal(n)) * 0.01).astype(NP[dtype])]


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("n", [1, 1000, 600_001])
def test_adamw_in_place_and_equal_to_recipe(dtype, n):
    p, g, m, v = _arrays(n, dtype)
    acc = np.float64 if dtype == "float64" else np.float32
    sc = [np.asarray(acc(x)) for x in (0.999, 0.01, 0.3)]
    want = [o.numpy() for o in fg.realize(list(adamw_step_recipe(
        *(fg.tensor(a) for a in (p, g, m, v, *sc)), 0.9, 0.999, 1e-8)))]
    bufs = [a.copy() for a in (p, g, m, v)]
    out = K.adamw_step(*bufs, *sc, beta1=0.9, beta2=0.999, eps=1e-8)
    assert out[0] is bufs[0] and out[1] is bufs[2] and out[2] is bufs[3]
    np.testing.assert_array_equal(bufs[1], g)           # the gradient is only read
    for a, b in zip(out, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("momentum,nesterov,first", [(0.0, False, False), (0.9, False, True),
                                                     (0.9, True, False)])
def test_sgd_in_place_and_equal_to_recipe(dtype, momentum, nesterov, first):
    p, g, buf, _ = _arrays(777, dtype, 1)
    acc = np.float64 if dtype == "float64" else np.float32
    lr, fl = np.asarray(acc(0.05)), np.asarray(acc(1.0 if first else 0.0))
    kw = dict(momentum=momentum, dampening=0.0, weight_decay=0.01, nesterov=nesterov)
    state = (buf, fl) if momentum else ()
    want = sgd_step_recipe(*(fg.tensor(a) for a in (p, g, lr, *state)), **kw)
    want = [o.numpy() for o in fg.realize(list(want) if isinstance(want, tuple) else [want])]
    bufs = [p.copy(), g.copy()] + ([buf.copy(), fl] if momentum else [])
    out = K.sgd_step(bufs[0], bufs[1], lr, *bufs[2:], **kw)
    out = out if isinstance(out, tuple) else (out,)
    assert out[0] is bufs[0] and (not momentum or out[1] is bufs[2])
    for a, b in zip(out, want):
        np.testing.assert_array_equal(a, b)
