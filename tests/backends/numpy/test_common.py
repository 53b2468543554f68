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


def test_kept_blocks_are_never_shared_while_used(monkeypatch):
    """new_output: large outputs come from kept blocks, a block is handed out again only once
    nothing refers to it (an array, a view of it, a torch tensor over it)."""
    import torch
    monkeypatch.setattr(common, "RECYCLE", True)
    monkeypatch.setattr(common, "_blocks", {})
    monkeypatch.setattr(common, "_blocks_bytes", 0)
    shape = (common.RECYCLE_MIN_BYTES // 4,)
    a = common.new_output(shape, np.float32)
    assert a.shape == shape and a.dtype == np.float32 and a.flags.c_contiguous
    assert a.flags.writeable
    a[:] = 1
    b = common.new_output(shape, np.float32)            # a is alive: another block
    assert not np.shares_memory(a, b)
    view = a[::2]
    tensor = torch.from_numpy(b.reshape(2, -1))
    del a, b
    c = common.new_output(shape, np.float32)            # both blocks still referred to
    assert not np.shares_memory(c, view) and not np.shares_memory(c, tensor.numpy())
    assert common._blocks_bytes == 3 * shape[0] * 4
    del view
    d = common.new_output((2, shape[0] // 2), np.float32)  # a's block is free: reused
    assert common._blocks_bytes == 3 * shape[0] * 4
    assert not np.shares_memory(d, c) and not np.shares_memory(d, tensor.numpy())
    small = common.new_output((4,), np.float32)          # small outputs: plain arrays
    assert small.base is None
    common.release_kept_memory()                         # only blocks in use stay
    assert common._blocks_bytes == 3 * shape[0] * 4
    del c, d, tensor
    common.release_kept_memory()
    assert common._blocks_bytes == 0
    monkeypatch.setattr(common, "RECYCLE", False)
    assert common.new_output(shape, np.float32).base is None


def test_kept_blocks_cap_and_threads(monkeypatch):
    """Past the cap, free blocks of other sizes are dropped, then outputs come from malloc;
    threads allocating at once never get the same block."""
    import threading
    monkeypatch.setattr(common, "RECYCLE", True)
    monkeypatch.setattr(common, "_blocks", {})
    monkeypatch.setattr(common, "_blocks_bytes", 0)
    n = common.RECYCLE_MIN_BYTES
    monkeypatch.setattr(common, "RECYCLE_CAP_BYTES", 2 * n)
    x = common.new_output((2 * n,), np.uint8)           # a free block of another size...
    del x
    y = common.new_output((n,), np.uint8)               # ...dropped to make room
    assert common._blocks_bytes == n
    z = common.new_output((n,), np.uint8)
    w = common.new_output((n,), np.uint8)                # over the cap: from malloc
    assert w.base is None and common._blocks_bytes == 2 * n
    del y, z, w
    monkeypatch.setattr(common, "RECYCLE_CAP_BYTES", 1 << 30)
    errors = []

    def worker(k):
        for _ in range(50):
            a = common.new_output((n // 4,), np.float32)
            a.fill(k)
            b = common.new_output((n // 4,), np.float32)
            b.fill(-k)
            if not ((a == k).all() and (b == -k).all()):
                errors.append(k)
    threads = [threading.Thread(target=worker, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
