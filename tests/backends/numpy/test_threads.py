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


@pytest.mark.parametrize("on_pool", [False, True], ids=["caller", "pool"])
@pytest.mark.parametrize("block", [1 << 18, 96 * 4 * 64], ids=["parts", "blocks"])
@pytest.mark.parametrize("m", [2, 4, 16])
def test_few_rows_against_a_weight_split_by_weight_rows(m, block, on_pool, monkeypatch):
    """x [M, K] @ W.T with few rows (a decode step) runs as W @ x.T over blocks of W's rows (on
    the calling thread or the pool): C-contiguous, float64-close, the same bits on every run,
    and within float32 rounding of the unsplit product (OpenBLAS picks its kernel by block
    size, so not bit for bit)."""
    rng = np.random.default_rng(4)
    x = rng.standard_normal((m, 96)).astype(np.float32)
    w = rng.standard_normal((700, 96)).astype(np.float32)      # nn.Linear's [out, in]
    monkeypatch.setattr(common, "NUM_THREADS", 1)
    one = primitives.gemm(x, w.T)
    monkeypatch.setattr(common, "NUM_THREADS", 2)
    monkeypatch.setattr(primitives, "SMALL_M_POOL_FLOPS", 0)
    monkeypatch.setattr(primitives, "WEIGHT_BLOCK_BYTES", block)     # 2 or 11 blocks (pool: 4, 11)
    monkeypatch.setattr(primitives, "WEIGHT_ROWS_ON_POOL", on_pool)
    got = primitives.gemm(x, w.T)
    assert got.shape == (m, 700) and got.flags.c_contiguous
    np.testing.assert_array_equal(primitives.gemm(x, w.T), got)
    np.testing.assert_allclose(got, one, rtol=1e-5, atol=1e-5)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
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


GROUP_CASES = [[((300, 70), (70, 40)), ((300, 70), (70, 40))],            # two equal products
               [((200, 64), (64, 96)), ((200, 64), (64, 32)), ((200, 64), (64, 32))],  # q, k, v
               [((512, 40), (40, 520)), ((30, 40), (40, 20))],             # one split in blocks
               [((64, 700), (700, 90)), ((90, 700), (700, 64))]]           # split by columns


@pytest.mark.parametrize("shapes", GROUP_CASES)
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_products_equal_single_calls(shapes, transposed, monkeypatch):
    """Products run together over the pool (`gemm_group`: whole or in blocks, single-threaded
    BLAS each) give the bits of one call each, and the float64 products."""
    import torch
    rng = np.random.default_rng(6)
    pairs = []
    for sa, sb in shapes:
        a = rng.standard_normal(sa).astype(np.float32)
        b = rng.standard_normal(sb[::-1] if transposed else sb).astype(np.float32)
        pairs.append((a, b.T if transposed else b))
    # one single-threaded BLAS call per product (BLAS's own threads may round differently)
    one = [common.blas_single(lambda: np.matmul(a, b)) for a, b in pairs]
    _split_everything(monkeypatch)
    got = primitives.gemm_group(pairs)
    for g, o, (a, b) in zip(got, one, pairs):
        assert g.shape == o.shape and g.dtype == np.float32 and g.flags.c_contiguous
        np.testing.assert_array_equal(g, o)
        ref = torch.from_numpy(a).double() @ torch.from_numpy(np.ascontiguousarray(b)).double()
        np.testing.assert_allclose(g, ref.numpy(), rtol=1e-5, atol=1e-4)


def test_scatter_add_of_whole_slices_matches_torch():
    """An index constant along every axis but the scattered one (an embedding gradient: a
    broadcast [N, 1] index) adds whole slices, repeated indices in order (as np.add.at, bit for
    bit); checked against torch's float64 index_add on every axis and dtype."""
    import torch
    rng = np.random.default_rng(7)
    for axis, base_shape, idx_shape in [(0, (20, 6), (30, 6)), (1, (3, 9, 5), (3, 12, 5)),
                                        (0, (20, 6), (30, 4)), (2, (2, 3, 7), (2, 2, 11)),
                                        (0, (5, 3), (0, 3))]:
        for dt in (np.float32, np.float16, np.float64):
            base = rng.standard_normal(base_shape).astype(dt)
            shape = [1] * len(idx_shape)
            shape[axis] = idx_shape[axis]
            rows = rng.integers(0, base_shape[axis], idx_shape[axis])
            idx = np.broadcast_to(rows.reshape(shape), idx_shape)
            src = rng.standard_normal(idx_shape).astype(dt)
            got = primitives.scatter_add(base, idx, src, op=_Axis(axis))
            assert got.dtype == dt and got.shape == base.shape
            want = torch.from_numpy(base.astype(np.float64)).clone()
            part = want[tuple(slice(None) if a == axis else slice(0, d)
                              for a, d in enumerate(idx_shape))]
            part.index_add_(axis, torch.from_numpy(rows), torch.from_numpy(src.astype(np.float64)))
            tol = 2e-3 if dt == np.float16 else 1e-5
            np.testing.assert_allclose(got.astype(np.float64), want.numpy(), rtol=tol, atol=tol)
            full = list(np.indices(idx.shape, sparse=True))      # the element-wise path
            full[axis] = idx
            slow = base.astype(np.float32 if dt == np.float16 else dt)
            np.add.at(slow, tuple(full), src.astype(slow.dtype))
            np.testing.assert_array_equal(got, slow.astype(dt))


class _Axis:
    def __init__(self, axis):
        self.axis = axis


def test_linear_cross_entropy_grouped_gradients_match_torch(monkeypatch):
    """One token chunk tall enough for dx = dl @ W as is: dx and dW run as one group of two
    products; both match torch's float64 autograd."""
    import torch
    rng = np.random.default_rng(8)
    x = rng.standard_normal((120, 48)).astype(np.float32)
    w = (rng.standard_normal((150, 48)) * 0.3).astype(np.float32)
    t = rng.integers(0, 150, 120)
    _split_everything(monkeypatch)
    monkeypatch.setattr(loss, "_DX_DIRECT_ROWS", 1)
    calls = []
    real = loss.gemm_group
    monkeypatch.setattr(loss, "gemm_group", lambda *a, **k: calls.append(1) or real(*a, **k))
    got = loss.fused_linear_cross_entropy_fwd_bwd(x, w, t, np.float32(1.0), reduction="mean",
                                                  ignore_index=-100)
    assert calls == [1]
    xt = torch.from_numpy(x).double().requires_grad_()
    wt = torch.from_numpy(w).double().requires_grad_()
    ref = torch.nn.functional.cross_entropy(xt @ wt.T, torch.from_numpy(t))
    ref.backward()
    np.testing.assert_allclose(got[0], ref.item(), rtol=1e-5)
    np.testing.assert_allclose(got[1], xt.grad.numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(got[2], wt.grad.numpy(), rtol=1e-4, atol=1e-6)
