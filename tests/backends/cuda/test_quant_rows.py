"""The storage-order kernels of the quantized matmuls (`quant_rows`: Q4_0, Q8_0, Q4_K, Q6_K, NF4
row layouts and AWQ's column layout): the row dequantizer bit-exact with gguf-py and the NF4
reference on random and edge bytes, and the products for M = 1 (one-row elementwise path),
3 (CUDA cores), 16 and 33 (tl.dot) with odd N, a split reduction (atomics) and every NF4
code lookup, against float64 torch on the dequantized weight.

Runs on a CUDA GPU, or in Triton's CPU interpreter (TRITON_INTERPRET=1) on tiny shapes, where
bfloat16 dots are not emulated faithfully (checked in float32 and float16 there)."""
from __future__ import annotations

import numpy as np
import pytest

from .cuda_oracle import (DEV, HAS_CUDA, INTERPRET, KERNEL_TESTS, check_product,
                          gguf_dequant_ref, to_dev, torch)

gguf = pytest.importorskip("gguf")
pytestmark = [pytest.mark.cuda, KERNEL_TESTS]

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import quant as K
    from fuelgraph.backends.cuda.kernels.quant_rows import RowConfig, dequantize_rows
    from fuelgraph.backends.cuda.kernels.quant_tiles import GGUF_IDS, NF4
    from fuelgraph.registry.quant import NF4_CODE

from quant_cases import (GGUF, awq_reference, gguf_bytes, gguf_edge_bytes, nf4_reference,
                         same_bits)

ROW_TYPES = ["Q4_0", "Q8_0", "Q4_K", "Q6_K"]
# (M, config): defaults (M = 1, 3, 16, 33 take the one-row, CUDA-core, dot and dot paths) and
# small explicit tiles with a split reduction (partial sums by atomics)
CASES = [(1, None), (3, None), (16, None), (33, None), (1, "split"), (3, "split"),
         (16, "split")]


def _cfg(kind, m, awq=False):
    if kind is None:
        return None
    bm = 1 if m == 1 else (4 if m <= 4 else 16)
    return RowConfig(bm, 128 if awq else 16, 16 if awq else 1, split=2)


def _dtypes(m):
    if HAS_CUDA:
        return [torch.float32, torch.float16, torch.bfloat16]
    return [torch.float32, torch.float16] if m > 1 else [torch.float32, torch.bfloat16]


@pytest.mark.parametrize("qtype", ROW_TYPES)
def test_row_dequantizer_bit_exact(qtype):
    qk, bb, _ = GGUF[qtype]
    raw = np.random.default_rng(bb).integers(0, 256, size=(5, 3 * bb), dtype=np.uint8)
    edge, n_e, k_e = gguf_edge_bytes(qtype)
    for blocks, n, k in ((raw, 5, 3 * qk), (edge, n_e, k_e)):
        w = to_dev(blocks.reshape(-1))
        for words in (False, True):
            got = dequantize_rows(GGUF_IDS[qtype], w, w, w, blocks.shape[1], k, n,
                                  dtype=torch.float32, block_n=16, steps=2, words=words)
            same_bits(got.cpu().numpy(), gguf_dequant_ref(blocks.reshape(n, -1), qtype))


def test_nf4_row_dequantizer_bit_exact():
    rng = np.random.default_rng(4)
    packed = rng.integers(0, 256, size=(9, 96), dtype=np.uint8)
    absmax = rng.uniform(0, 3, size=(9, 3)).astype(np.float32)
    absmax[0, 0] = 0.0
    code = torch.tensor(NF4_CODE, device=DEV)
    got = dequantize_rows(NF4, to_dev(packed), to_dev(absmax), code, 64, 192, 9, dtype=torch.float32,
                          block_n=8, steps=2)
    same_bits(got.cpu().numpy(), nf4_reference(packed, absmax, 64))


@pytest.mark.parametrize("m,kind", CASES)
@pytest.mark.parametrize("qtype", ROW_TYPES)
def test_qmatmul_rows(qtype, m, kind):
    qk = GGUF[qtype][0]
    rng = np.random.default_rng(qk + m)
    n, k = 5, 3 * qk if qk == 32 else 2 * qk
    raw = gguf_bytes(rng, qtype, n, k)
    w = gguf_dequant_ref(raw, qtype)
    for dt in _dtypes(m):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dt).to(DEV)
        out = K.qmatmul(x, to_dev(raw.reshape(-1)), quant_type=qtype, n=n, k=k, config=_cfg(kind, m))
        check_product(out, x, w.T, dt)


@pytest.mark.parametrize("m,kind", CASES)
def test_nf4_rows(m, kind):
    rng = np.random.default_rng(m)
    n, k = 7, 192
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    absmax = rng.uniform(0.1, 2, size=(n, k // 64)).astype(np.float32)
    wn = nf4_reference(packed, absmax, 64)
    for dt in _dtypes(m):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dt).to(DEV)
        check_product(K.nf4_matmul(x, to_dev(packed), to_dev(absmax), block_size=64, config=_cfg(kind, m)),
               x, wn.T, dt)


@pytest.mark.parametrize("lut", [0, 1, 2])
@pytest.mark.parametrize("m", [1, 16])
def test_nf4_code_lookups(lut, m):
    rng = np.random.default_rng(9)
    n, k = 16, 128
    packed = np.arange(n * k // 2, dtype=np.int64).astype(np.uint8).reshape(n, k // 2)
    absmax = rng.uniform(0.1, 2, size=(n, k // 32)).astype(np.float32)
    wn = nf4_reference(packed, absmax, 32)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(2)).to(DEV)
    cfg = RowConfig(m, 16, 2, lut=lut)
    check_product(K.nf4_matmul(x, to_dev(packed), to_dev(absmax), block_size=32, config=cfg), x, wn.T,
           torch.float32)


@pytest.mark.parametrize("m,kind", CASES)
def test_awq_columns(m, kind):
    rng = np.random.default_rng(m + 5)
    n, k, gs = 24, 128, 32       # 3 packed words per row: a partial word tile
    qw = rng.integers(-2 ** 31, 2 ** 31, size=(k, n // 8), dtype=np.int64).astype(np.int32)
    qz = rng.integers(-2 ** 31, 2 ** 31, size=(k // gs, n // 8), dtype=np.int64).astype(np.int32)
    sc = rng.uniform(-0.05, 0.05, size=(k // gs, n)).astype(np.float16)
    wa = awq_reference(qw, qz, sc, gs)
    for dt in _dtypes(m):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(dt).to(DEV)
        out = K.awq_matmul(x, to_dev(qw), to_dev(qz), to_dev(sc), group_size=gs,
                           config=_cfg(kind, m, awq=True))
        check_product(out, x, wa, dt)


def test_many_rows_take_the_dense_copy():
    """Above DEQUANT_GEMM_MIN_M rows the row formats dequantize W [N, K] in storage order."""
    rng = np.random.default_rng(11)
    n, k = 5, 64
    raw = gguf_bytes(rng, "Q8_0", n, k)
    x = torch.randn(K.DEQUANT_GEMM_MIN_M + 3, k, generator=torch.Generator().manual_seed(4))
    out = K.qmatmul(x.to(DEV), to_dev(raw.reshape(-1)), quant_type="Q8_0", n=n, k=k)
    check_product(out, x, gguf_dequant_ref(raw, "Q8_0").T, torch.float32)


@pytest.mark.parametrize("qtype", ROW_TYPES)
def test_word_and_byte_reads_unmasked_tiles(qtype):
    """2-byte-word and byte reads, x in float32 or as given, on tiles that divide the weight
    (the unmasked loads), one row and sixteen."""
    qk = GGUF[qtype][0]
    rng = np.random.default_rng(qk)
    n, k = 16, 4 * qk if qk == 32 else qk
    raw = gguf_bytes(rng, qtype, n, k)
    w = gguf_dequant_ref(raw, qtype)
    for m in (1, 16):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(DEV)
        for words in (0, 1):
            for x32 in (0, 1):
                cfg = RowConfig(m, 16, 2 if qk == 32 else 1, split=1, words=words, x32=x32)
                out = K.qmatmul(x, to_dev(raw.reshape(-1)), quant_type=qtype, n=n, k=k, config=cfg)
                check_product(out, x, w.T, torch.float32)
