"""Plumbing shared by the NumPy kernels (backends/numpy/common.py): chunking and the thread pool
never change a bit of any kernel's result nor write its inputs; the integer-op float16 casts
are bit-identical to NumPy's."""
import numpy as np
import pytest

from fuelgraph.backends.numpy import affine, common, helpers, linear, loss, norm, rope

from .kernel_oracle import rand


@pytest.mark.parametrize("dt", ["float32", "bfloat16", "float16"])
def test_chunking_is_bit_stable_and_inputs_untouched(dt, monkeypatch):
    rng = np.random.default_rng(11)
    x, g = rand(rng, (37, 300), dt), rand(rng, (37, 300), dt)
    t = rng.integers(0, 300, 37)
    runs = [lambda: linear.fused_linear(x, g.T.copy(), g[0, :37].copy()),
            lambda: helpers.reduce_max_to_backward(x, g[:, :1].copy()),
            lambda: helpers.powi_backward(x, g, exp=-3),
            lambda: affine.inplace_affine(x.copy(), mul=0.3, add=2.0),
            lambda: norm.rms_norm_last_dim(x, eps=1e-6),
            lambda: norm.layer_norm_last_dim(x, eps=1e-6),
            lambda: norm.layer_norm_last_dim_backward(x, g, eps=1e-6),
            lambda: norm.rms_norm_last_dim_backward(x, g, eps=1e-6),
            lambda: rope.rope(x.reshape(1, 37, 300), x[:, ::-1].copy(), g, interleaved=True),
            lambda: loss.fused_softmax_cross_entropy(x, t, reduction="none", ignore_index=-100),
            lambda: loss.fused_softmax_cross_entropy_backward(x, t, np.float32(2), reduction="sum",
                                                              ignore_index=-100)]
    x0, g0 = x.copy(), g.copy()
    base = [f() for f in runs]
    monkeypatch.setattr(common, "CHUNK_ELEMS", 700)
    monkeypatch.setattr(common, "PARALLEL_MIN_ELEMS", 0)
    for f, b in zip(runs, base):
        np.testing.assert_array_equal(f(), b)
    np.testing.assert_array_equal(x, x0)                       # inputs are never written
    np.testing.assert_array_equal(g, g0)


def test_float16_casts_match_numpy():
    """common's integer-op float16 <-> float32 casts are bit-identical to NumPy's."""
    h = np.arange(1 << 16, dtype=np.uint16).view(np.float16).reshape(256, 256)
    ref, got = h.astype(np.float32), common.to_acc(h, np.dtype(np.float32))
    nan = np.isnan(ref)
    assert np.isnan(got[nan]).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint32), ref[~nan].view(np.uint32))
    bits = np.random.default_rng(12).integers(0, 1 << 32, 1 << 18, dtype=np.uint64)
    edge = np.array([0.0, -0.0, 65504, 65519.99, 65520, 1e9, np.inf, -np.inf, 2.0 ** -24,
                     2.0 ** -25, 3 * 2.0 ** -25, 2.0 ** -14 * (1 - 2.0 ** -11), -1e-8], np.float32)
    f = np.concatenate([bits.astype(np.uint32).view(np.float32), edge])
    with np.errstate(all="ignore"):
        ref = f.astype(np.float16)
    got = np.empty(f.shape, np.float16)
    common.store(got, f)
    nan = np.isnan(ref)
    assert np.isnan(got[nan]).all()
    np.testing.assert_array_equal(got[~nan].view(np.uint16), ref[~nan].view(np.uint16))


def test_keep_heap_switch():
    """The malloc thresholds are set at import only with FUELGRAPH_KEEP_HEAP=1, and not even
    then when the user's own malloc settings say otherwise."""
    import os
    import subprocess
    import sys
    code = "import fuelgraph.backends.numpy.common as c; print(c.HEAP_KEPT)"
    env = {**os.environ, "FUELGRAPH_KEEP_HEAP": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
    env = {k: v for k, v in os.environ.items() if k != "FUELGRAPH_KEEP_HEAP"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr            # off unless asked for
    env["FUELGRAPH_KEEP_HEAP"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "True", out.stderr             # glibc here
    env["MALLOC_TRIM_THRESHOLD_"] = "131072"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "False", out.stderr
    assert isinstance(common.HEAP_KEPT, bool)
