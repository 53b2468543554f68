"""The NumPy glue kernel (backends/numpy/glue.py, a blocked evaluation of a region) against the
reference mode (`lower_all`: one NumPy call per primitive): bitwise for float32, float64, int
and bool programs (the same ufuncs in the same order), within rounding for 16-bit floats (the
region computes in float32 and rounds once where the primitives round after each op). Random
programs (hypothesis) cover broadcasting, 0-d and size-1 axes, NaN/inf/-0.0, integer and bool
ops, row reductions; fixed cases cover many chunks, the thread split and the joint layout."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings

import fuelgraph as fg
from fuelgraph.backends.glue import build_program
from fuelgraph.backends.numpy import glue as G
from fuelgraph.ir import ops
from fuelgraph.ir.node import toposort

from glue_programs import glue_program

SETTINGS = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view(np.uint8) if a.dtype.itemsize else a


def check_exact(outs):
    got, ref = fg.realize(outs), fg.realize(outs, lower_all=True)
    for a, b in zip(got, ref):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(bits(a), bits(b))


@pytest.mark.parametrize("kind", ["float32", "float64", "int32", "int64", "bool"])
def test_random_programs_bitwise(kind):
    @SETTINGS
    @given(glue_program(kind))
    def run(prog):
        outs, desc = prog
        check_exact(outs)
    run()


@pytest.mark.parametrize("kind", ["bfloat16", "float16"])
def test_random_half_programs_within_rounding(kind):
    @SETTINGS
    @given(glue_program(kind, max_ops=4, reductions=False))
    def run(prog):
        outs, desc = prog
        got, ref = fg.realize(outs), fg.realize(outs, lower_all=True)
        for a, b in zip(got, ref):
            a, b = a.numpy().astype(np.float64), b.numpy().astype(np.float64)
            fin = np.isfinite(a) & np.isfinite(b)
            tol = 2.0 ** -5 if kind == "bfloat16" else 2.0 ** -8
            np.testing.assert_allclose(a[fin], b[fin], rtol=4 * tol, atol=4 * tol, err_msg=desc)
    run()


def _evaluator(y, chunk):
    res = fg.optimize([y])
    (n,) = [n for n in toposort(res.outputs) if isinstance(n.op, ops.Fused)]
    prog = build_program(fg.default_registry().entry(n.op.id).body)
    return G.GlueEvaluator(prog, chunk=chunk)


@pytest.mark.parametrize("chunk", [1, 7, 64, 1 << 20])
def test_chunking_never_changes_a_bit(chunk):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((6, 5, 12)).astype(np.float32)
    b = rng.standard_normal((5, 1)).astype(np.float32)
    tx, tb = fg.tensor(x), fg.tensor(b)
    y = (tx * tb).tanh() * (tx * tx).sum(-1, keepdim=True) + tx.max(-1, keepdim=True)
    ref = fg.realize([y], lower_all=True)[0]
    ev = _evaluator(y, chunk)
    np.testing.assert_array_equal(bits(ev(x, b)), bits(ref))


def test_large_region_runs_split_over_threads():
    rng = np.random.default_rng(4)
    g, u = (rng.standard_normal((600, 520)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal(520).astype(np.float32)
    tg, tu, tw = fg.tensor(g), fg.tensor(u), fg.tensor(w)
    y = tg.silu() * tu * tw + tg
    check_exact([y])


def test_broadcast_layouts_reshape_to_one_joint_shape():
    rng = np.random.default_rng(5)
    a = fg.tensor(rng.standard_normal((4, 1, 6)).astype(np.float32))
    b = fg.tensor(rng.standard_normal((3, 1)).astype(np.float32))
    c = fg.tensor(rng.standard_normal((24,)).astype(np.float32))
    y = (a * b).exp() + c.reshape(4, 1, 6).tanh()
    z = (y.reshape(4, 18) * 2.0).sin()
    check_exact([y, z])


def test_empty_and_zero_d_regions():
    e = fg.tensor(np.zeros((0, 3), np.float32))
    s = fg.tensor(np.float32(0.5))
    check_exact([(e * 2.0).exp() + e, (s.exp() * s).tanh()])


def test_region_outputs_row_values_and_intermediates():
    rng = np.random.default_rng(6)
    x = fg.tensor(rng.standard_normal((7, 33)).astype(np.float32))
    ss = (x * x).sum(-1, keepdim=True)
    r = (ss * (1.0 / 33) + 1e-6).rsqrt()
    y = x * r
    t = y.tanh()
    check_exact([t * 2.0 + y, r, ss, t @ fg.tensor(np.ones((33, 2), np.float32))])


def test_zero_d_inputs_broadcast_into_chunked_regions():
    # a 0-d input (or a 0-d slice of one) in a region large enough to be chunked is read whole
    # by every chunk (it was sliced like the chunked arrays, giving empty operands)
    n = 200_000
    x = fg.tensor(np.arange(n, dtype=np.float32) * 1e-5)
    s = fg.tensor(np.float32(2.0))
    v = fg.tensor(np.array([1.0, 3.0], np.float32))
    m = fg.tensor(np.random.default_rng(7).standard_normal((300, 1000)).astype(np.float32))
    check_exact([(x + s).exp() * 2.0, (x * v[1] + 1.0).tanh(), (m + s) * 2.0 - v[0]])
