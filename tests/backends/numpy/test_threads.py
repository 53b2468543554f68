"""The NumPy backend's pool-split paths give the single-threaded results: large GEMMs split by
rows, columns or batches (`primitives.gemm`, used by the MatMul primitive, fused linear and
linear + cross-entropy) and large binary primitives split by blocks of an axis. Results are
compared with the unsplit path bit for bit, checked against float64 references, and repeated
runs give the same bits."""
import numpy as np
import pytest

from fuelgraph.backends.numpy import common, loss, primitives


class _Op:
    def __init__(self, kind):
        self.kind = kind


def _split_everything(monkeypatch):
    monkeypatch.setattr(common, "NUM_THREADS", 2)
    monkeypatch.setattr(common, "PARALLEL_MIN_ELEMS", 0)
    monkeypatch.setattr(primitives, "PARALLEL_GEMM_FLOPS", 0)


GEMM_CASES = [((300, 70), (70, 40), False),       # M > N: row blocks
              ((40, 70), (70, 300), False),       # N > M: column blocks (strided output)
              ((150, 90), (90, 150), True),       # a transposed view (a weight gradient)
              ((6, 50, 33), (6, 33, 20), False),  # stacked: batch blocks
              ((6, 50, 33), (1, 33, 20), False),  # broadcast batch of b
              ((3, 5), (5, 4), False)]            # too small to split


@pytest.mark.parametrize("sa,sb,transposed", GEMM_CASES)
def test_split_gemm_equals_one_call(sa, sb, transposed, monkeypatch):
    rng = np.random.default_rng(3)
    a = rng.standard_normal(sa[::-1] if transposed else sa).astype(np.float32)
    a = a.T if transposed else a
    b = rng.standard_normal(sb).astype(np.float32)
    monkeypatch.setattr(common, "NUM_THREADS", 1)
    one = primitives.gemm(a, b)
    _split_everything(monkeypatch)
    got = primitives.gemm(a, b)
    again = primitives.matmul(a, b, op=None)
    out = np.full(got.shape, np.nan, np.float32)
    into = primitives.gemm(a, b, out=out)
    assert into is out and got.shape == one.shape and got.dtype == np.float32
    for g in (got, again, out):
        np.testing.assert_array_equal(g, one)
    ref = np.matmul(a.astype(np.float64), b.astype(np.float64))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-4)


def test_even_spans_cover_the_range():
    for n, parts, least, align in [(1024, 4, 64, 16), (1000, 4, 64, 16), (100, 4, 64, 16),
                                   (8, 4, 1, 1), (5, 4, 1, 1), (130, 4, 64, 16), (1, 4, 1, 1)]:
        spans = primitives._even_spans(n, parts, least, align)
        assert spans[0][0] == 0 and spans[-1][1] == n and len(spans) <= parts
        assert all(a1 == b0 for (_, a1), (b0, _) in zip(spans, spans[1:]))
        assert all(e > s for s, e in spans)


def test_linear_cross_entropy_split_equals_one_thread(monkeypatch):
    rng = np.random.default_rng(4)
    x = rng.standard_normal((96, 40)).astype(np.float32)
    w = rng.standard_normal((130, 40)).astype(np.float32) * 0.3
    t = rng.integers(0, 130, 96)
    g = np.float32(1.0)

    def run():
        return loss.fused_linear_cross_entropy_fwd_bwd(x, w, t, g, reduction="mean",
                                                       ignore_index=-100)
    monkeypatch.setattr(common, "NUM_THREADS", 1)
    one = run()
    _split_everything(monkeypatch)
    for a, b in zip(run(), one):
        np.testing.assert_array_equal(a, b)
    z = x.astype(np.float64) @ w.T.astype(np.float64)
    lse = np.log(np.exp(z - z.max(1, keepdims=True)).sum(1)) + z.max(1)
    np.testing.assert_allclose(one[0], (lse - z[np.arange(96), t]).mean(), rtol=1e-5)


BINARY_CASES = [((64, 33, 8), (64, 33, 8)), ((1, 1, 8), (64, 33, 8)), ((64, 33, 8), ()),
                ((1, 300, 7), (1, 300, 7)), ((3, 1), (1, 500))]


@pytest.mark.parametrize("sa,sb", BINARY_CASES)
@pytest.mark.parametrize("kind", ["add", "sub", "mul", "div", "maximum", "pow"])
def test_split_binary_equals_numpy(sa, sb, kind, monkeypatch):
    rng = np.random.default_rng(5)
    a = rng.uniform(0.5, 2.0, sa).astype(np.float32)
    b = rng.uniform(0.5, 2.0, sb).astype(np.float32)
    monkeypatch.setattr(common, "NUM_THREADS", 1)
    one = primitives.binary(a, b, op=_Op(kind))
    _split_everything(monkeypatch)
    got = primitives.binary(a, b, op=_Op(kind))
    assert got.shape == np.broadcast_shapes(a.shape, b.shape) and got.dtype == np.float32
    np.testing.assert_array_equal(got, one)
    np.testing.assert_array_equal(primitives.binary(a, b, op=_Op(kind)), got)
    f64 = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.divide,
           "maximum": np.maximum, "pow": np.power}[kind]
    np.testing.assert_allclose(got, f64(a.astype(np.float64), b.astype(np.float64)), rtol=1e-6)


def test_split_binary_integers_and_mixed_dtypes(monkeypatch):
    _split_everything(monkeypatch)
    a = np.arange(4000, dtype=np.int64).reshape(40, 100)
    np.testing.assert_array_equal(primitives.binary(a, np.int64(3), op=_Op("mul")), a * 3)
    np.testing.assert_array_equal(primitives.binary(a, np.int64(7), op=_Op("div")), a // 7)
    f = np.ones((40, 100), np.float32)
    got = primitives.binary(f, np.asarray(0.5), op=_Op("mul"))     # mixed: the unsplit path
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, np.full((40, 100), 0.5, np.float32))
