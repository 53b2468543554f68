"""NumPy kernels of the quantized matmuls: the per-format dequantizers bit-exact with gguf-py
(random and edge bytes), tiled products equal to one GEMM on the whole dequantized weight
whatever the tile size (tiles cut rows for the forward, columns for the gradient, never across a
block or group), every activation dtype, empty batches."""
import gguf
import ml_dtypes
import numpy as np
import pytest

from fuelgraph.backends.numpy import quant as K
from fuelgraph.backends.numpy.quant_gguf import FORMATS
from quant_cases import (GGUF, awq_reference, gguf_bytes, gguf_edge_bytes, nf4_reference,
                         same_bits)

TYPES = list(GGUF)


def _ref(raw, qtype):
    with np.errstate(all="ignore"):
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])


def _close(got, ref):
    """float32 products: error within 1e-5 of the largest magnitude (sums cancel)."""
    ref = np.asarray(ref, np.float64)
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * max(1.0, np.abs(ref).max()))


@pytest.mark.parametrize("qtype", TYPES)
def test_block_dequantizers_bit_exact(qtype):
    fmt = FORMATS[qtype]
    qk, bb, _ = GGUF[qtype]
    raw = np.random.default_rng(len(qtype) + bb).integers(0, 256, size=(40, bb), dtype=np.uint8)
    edge, _, _ = gguf_edge_bytes(qtype)
    for blocks in (raw, edge):
        out = np.empty((blocks.shape[0], qk), np.float32)
        with np.errstate(all="ignore"):
            fmt.dequantize(blocks, out)
        same_bits(out, _ref(blocks, qtype))


@pytest.fixture(params=["tiles in turn", "tiles on the pool"])
def small_tiles(monkeypatch, request):
    """Tiles of ~1 Ki elements, so small weights are cut into many row / column tiles; run one
    after another, or whole tiles on the pool threads (as large products do)."""
    monkeypatch.setattr(K, "TILE_ELEMS", 1024)
    monkeypatch.setattr(K, "PARALLEL_TILES_MIN_FLOPS",
                        0 if request.param == "tiles on the pool" else float("inf"))


@pytest.mark.parametrize("qtype", TYPES)
def test_qmatmul_tiles_equal_one_gemm(qtype, small_tiles):
    qk = GGUF[qtype][0]
    rng = np.random.default_rng(3)
    n, k = 13, 4 * qk
    raw = gguf_bytes(rng, qtype, n, k)
    w = _ref(raw, qtype)
    same_bits(K.dequantize_gguf(raw.reshape(-1), qtype, n, k), w)
    # the kernel-order tiles (K-quants) are a column permutation of the weight
    tile = K._gguf_tile(FORMATS[qtype], raw.reshape(n, -1, FORMATS[qtype].type_size),
                        K._Scratch(), n, k)
    perm = K._kernel_columns(FORMATS[qtype], k)
    same_bits(tile, w if perm is None else w[:, perm])
    a = rng.standard_normal((2, 3, k)).astype(np.float32)
    g = rng.standard_normal((2, 3, n)).astype(np.float32)
    out = K.qmatmul(a, raw.reshape(-1), quant_type=qtype, n=n, k=k)
    _close(out, a @ w.T)
    _close(K.qmatmul_grad_a(g, raw.reshape(-1), quant_type=qtype, n=n, k=k), g @ w)


@pytest.mark.parametrize("dtype", [np.float64, np.float16, ml_dtypes.bfloat16])
def test_qmatmul_activation_dtypes(dtype):
    rng = np.random.default_rng(4)
    raw = gguf_bytes(rng, "Q4_1", 6, 64)
    w = _ref(raw, "Q4_1").astype(np.float64)
    a = rng.standard_normal((5, 64)).astype(dtype)
    out = K.qmatmul(a, raw.reshape(-1), quant_type="Q4_1", n=6, k=64)
    assert out.dtype == np.dtype(dtype)
    ref = a.astype(np.float64) @ w.T
    # float32 accumulation for halves, rounded once; float64 throughout for float64
    tol = 1e-12 if dtype == np.float64 else 2 ** -7 if dtype == ml_dtypes.bfloat16 else 2 ** -10
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol,
                               atol=tol * np.abs(ref).max())


def test_empty_batch():
    raw = gguf_bytes(np.random.default_rng(5), "Q8_0", 4, 32)
    out = K.qmatmul(np.zeros((0, 32), np.float32), raw.reshape(-1), quant_type="Q8_0", n=4, k=32)
    assert out.shape == (0, 4)


def test_nf4_tiles(small_tiles):
    rng = np.random.default_rng(6)
    n, k, bs = 9, 256, 64
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    absmax = rng.uniform(0, 2, size=(n, k // bs)).astype(np.float32)
    w = nf4_reference(packed, absmax, bs)
    same_bits(K.dequantize_nf4(packed, absmax, bs), w)
    a = rng.standard_normal((3, k)).astype(np.float32)
    g = rng.standard_normal((3, n)).astype(np.float32)
    _close(K.nf4_matmul(a, packed, absmax, block_size=bs), a @ w.T)
    _close(K.nf4_matmul_grad_a(g, packed, absmax, block_size=bs), g @ w)


@pytest.mark.parametrize("group_size", [16, 128])
def test_awq_tiles(group_size, small_tiles):
    rng = np.random.default_rng(7)
    k, n = 128, 40
    qweight = rng.integers(-2 ** 31, 2 ** 31, size=(k, n // 8), dtype=np.int64).astype(np.int32)
    qzeros = rng.integers(-2 ** 31, 2 ** 31, size=(k // group_size, n // 8), dtype=np.int64)
    qzeros = qzeros.astype(np.int32)
    scales = rng.uniform(-0.1, 0.1, size=(k // group_size, n)).astype(np.float16)
    w = awq_reference(qweight, qzeros, scales, group_size)
    same_bits(K.dequantize_awq(qweight, qzeros, scales, group_size), w)
    a = rng.standard_normal((3, k)).astype(np.float32)
    g = rng.standard_normal((3, n)).astype(np.float32)
    _close(K.awq_matmul(a, qweight, qzeros, scales, group_size=group_size), a @ w)
    _close(K.awq_matmul_grad_a(g, qweight, qzeros, scales, group_size=group_size), g @ w.T)
