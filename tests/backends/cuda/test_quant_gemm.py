"""The fused dequantizing GEMMs of the quantized matmuls (`quant_gemm`: Q4_0, Q8_0, Q4_K, Q6_K,
NF4 rows, AWQ columns): the K-order dequantizer bit-exact with gguf-py and the NF4 reference on
random and edge bytes, and the products (both operand orders, a split reduction by atomics,
partial tiles) against float64 torch on the dequantized weight.

Runs on a CUDA GPU, or in Triton's CPU interpreter (TRITON_INTERPRET=1) on tiny shapes."""
from __future__ import annotations

import numpy as np
import pytest

from .cuda_oracle import (DEV, HAS_CUDA, INTERPRET, KERNEL_TESTS, check_product,
                          gguf_dequant_ref, to_dev, torch)

gguf = pytest.importorskip("gguf")
pytestmark = [pytest.mark.cuda, KERNEL_TESTS]

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import quant as K
    from fuelgraph.backends.cuda.kernels.quant_gemm import GemmConfig, dequantize_natural
    from fuelgraph.backends.cuda.kernels.quant_tiles import GGUF_IDS, NF4
    from fuelgraph.registry.quant import NF4_CODE

from quant_cases import (GGUF, awq_reference, gguf_bytes, gguf_edge_bytes, nf4_reference,
                         same_bits)

ROW_TYPES = ["Q4_0", "Q8_0", "Q4_K", "Q6_K"]
# (M, N, config): partial tiles (masked), whole tiles (unmasked), a split reduction, the weight
# as the left operand, the next step's words loaded ahead (Q4_0 / Q8_0; an uneven split)
CASES = [(20, 24, dict(split=1)), (32, 32, dict(split=1)), (16, 16, dict(split=2)),
         (17, 16, dict(split=1, w_left=1)), (20, 24, dict(split=3, block_k=32, prefetch=1))]
IDS = ["partial", "whole", "split", "w_left", "prefetch"]


def _gemm(opts):
    """A small GemmConfig: 16 x 16 tiles, 64 elements of K a step unless `opts` says."""
    return GemmConfig(**{"block_m": 16, "block_n": 16, "block_k": 64, "num_warps": 4,
                         "num_stages": 2, **opts})


def _dtypes():
    return [torch.float32, torch.bfloat16] if HAS_CUDA else [torch.float32]


@pytest.mark.parametrize("qtype", ROW_TYPES)
def test_natural_dequantizer_bit_exact(qtype):
    qk, bb, _ = GGUF[qtype]
    raw = np.random.default_rng(bb).integers(0, 256, size=(5, 2 * bb), dtype=np.uint8)
    edge, n_e, k_e = gguf_edge_bytes(qtype)
    for blocks, n, k, bn in ((raw, 5, 2 * qk, 4), (edge, n_e, k_e, 64)):
        w = to_dev(blocks.reshape(-1))
        got = dequantize_natural(GGUF_IDS[qtype], w, w, w, blocks.shape[1], k, n,
                                 dtype=torch.float32, block_n=bn, block_k=64)
        same_bits(got.cpu().numpy(), gguf_dequant_ref(blocks.reshape(n, -1), qtype))


@pytest.mark.parametrize("lut", [0, 2])
def test_nf4_natural_dequantizer_bit_exact(lut):
    rng = np.random.default_rng(4)
    packed = rng.integers(0, 256, size=(9, 96), dtype=np.uint8)
    absmax = rng.uniform(0, 3, size=(9, 3)).astype(np.float32)
    absmax[0, 0] = 0.0
    code = torch.tensor(NF4_CODE, device=DEV)
    got = dequantize_natural(NF4, to_dev(packed), to_dev(absmax), code, 64, 192, 9,
                             dtype=torch.float32, block_n=8, block_k=128, lut=lut)
    same_bits(got.cpu().numpy(), nf4_reference(packed, absmax, 64))


@pytest.mark.parametrize("m,n,cfg", CASES, ids=IDS)
@pytest.mark.parametrize("qtype", ROW_TYPES)
def test_qmatmul_gemm(qtype, m, n, cfg):
    qk = GGUF[qtype][0]
    rng = np.random.default_rng(qk + m)
    k = 4 * qk if qk == 32 else qk
    raw = gguf_bytes(rng, qtype, n, k)
    w = gguf_dequant_ref(raw, qtype)
    for dt in _dtypes():
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dt).to(DEV)
        out = K.qmatmul(x, to_dev(raw.reshape(-1)), quant_type=qtype, n=n, k=k, config=_gemm(cfg))
        check_product(out, x, w.T, dt)


@pytest.mark.parametrize("m,n,cfg", CASES, ids=IDS)
def test_nf4_gemm(m, n, cfg):
    rng = np.random.default_rng(m)
    k = 256
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    absmax = rng.uniform(0.1, 2, size=(n, k // 64)).astype(np.float32)
    wn = nf4_reference(packed, absmax, 64)
    for dt in _dtypes():
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dt).to(DEV)
        check_product(K.nf4_matmul(x, to_dev(packed), to_dev(absmax), block_size=64, config=_gemm(cfg)), x,
               wn.T, dt)


@pytest.mark.parametrize("m,n,cfg", CASES[:3], ids=IDS[:3])
def test_awq_gemm(m, n, cfg):
    rng = np.random.default_rng(m + 5)
    n, k, gs = 2 * n, 128, 32
    qw = rng.integers(-2 ** 31, 2 ** 31, size=(k, n // 8), dtype=np.int64).astype(np.int32)
    qz = rng.integers(-2 ** 31, 2 ** 31, size=(k // gs, n // 8), dtype=np.int64).astype(np.int32)
    sc = rng.uniform(-0.05, 0.05, size=(k // gs, n)).astype(np.float16)
    wa = awq_reference(qw, qz, sc, gs)
    for dt in _dtypes():
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(dt).to(DEV)
        cfg2 = _gemm({**cfg, "block_k": 32})
        check_product(K.awq_matmul(x, to_dev(qw), to_dev(qz), to_dev(sc), group_size=gs, config=cfg2), x, wa, dt)


@pytest.mark.parametrize("split,mode", [(1, 1), (3, 1), (3, 2)])
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "NF4"])
def test_one_row_prefetch(qtype, split, mode):
    """The one-row GEMV that loads the next step's bytes ahead (`quant_gemv`), partial row tile,
    a reduction split unevenly (the last program's prefetch runs past its range); mode 2 reads x
    at the weight's positions."""
    from fuelgraph.backends.cuda.kernels.quant_rows import RowConfig
    rng = np.random.default_rng(split)
    n, k = 20, 7 * 64
    cfg = RowConfig(1, 16, 2, split=split, prefetch=mode)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5)).to(DEV)
    if qtype == "NF4":
        packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
        absmax = rng.uniform(0.1, 2, size=(n, k // 64)).astype(np.float32)
        out = K.nf4_matmul(x, to_dev(packed), to_dev(absmax), block_size=64, config=cfg)
        check_product(out, x, nf4_reference(packed, absmax, 64).T, torch.float32)
    else:
        raw = gguf_bytes(rng, qtype, n, k)
        out = K.qmatmul(x, to_dev(raw.reshape(-1)), quant_type=qtype, n=n, k=k, config=cfg)
        check_product(out, x, gguf_dequant_ref(raw, qtype).T, torch.float32)


@pytest.mark.parametrize("fmt", ROW_TYPES + ["NF4", "AWQ"])
def test_gemm_dequantizes_bit_exact(fmt):
    """x = I (float32, IEEE dot: every product is 0 or one weight, every sum exact) reads the
    fused GEMM's in-register weights back: bit-identical to the references (up to the sign of
    zero: -0 + 0 sums to +0)."""
    rng = np.random.default_rng(7)
    cfg = GemmConfig(16, 16, 64, split=1, num_warps=4, num_stages=2)
    if fmt == "AWQ":
        n, k, gs = 32, 64, 32
        qw = rng.integers(-2 ** 31, 2 ** 31, size=(k, n // 8), dtype=np.int64).astype(np.int32)
        qz = rng.integers(-2 ** 31, 2 ** 31, size=(k // gs, n // 8),
                          dtype=np.int64).astype(np.int32)
        sc = rng.uniform(-0.05, 0.05, size=(k // gs, n)).astype(np.float16)
        x = torch.eye(k).to(DEV)
        got = K.awq_matmul(x, to_dev(qw), to_dev(qz), to_dev(sc), group_size=gs, config=cfg)
        same_bits(got.cpu().numpy(), awq_reference(qw, qz, sc, gs) + np.float32(0))
        return
    if fmt == "NF4":
        n, k = 16, 128
        packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
        absmax = rng.uniform(0, 3, size=(n, k // 64)).astype(np.float32)
        x = torch.eye(k).to(DEV)
        got = K.nf4_matmul(x, to_dev(packed), to_dev(absmax), block_size=64, config=cfg)
        same_bits(got.cpu().numpy(), nf4_reference(packed, absmax, 64).T + np.float32(0))
        return
    qk = GGUF[fmt][0]
    n, k = 16, 2 * qk if qk == 32 else qk
    raw = gguf_bytes(rng, fmt, n, k)
    x = torch.eye(k).to(DEV)
    for pf in (0, 1):
        got = K.qmatmul(x, to_dev(raw.reshape(-1)), quant_type=fmt, n=n, k=k,
                        config=GemmConfig(16, 16, 64, 1, 4, 2, prefetch=pf))
        same_bits(got.cpu().numpy(), gguf_dequant_ref(raw, fmt).T + np.float32(0))


def test_many_rows_default_paths():
    """Above DEQUANT_GEMM_MIN_M rows: AWQ takes the fused GEMM for 16-bit x (the dense copy for
    float32), NF4 the K-order dense copy."""
    rng = np.random.default_rng(12)
    m = K.DEQUANT_GEMM_MIN_M + 3
    n, k, gs = 24, 64, 32
    qw = rng.integers(-2 ** 31, 2 ** 31, size=(k, n // 8), dtype=np.int64).astype(np.int32)
    qz = rng.integers(-2 ** 31, 2 ** 31, size=(k // gs, n // 8), dtype=np.int64).astype(np.int32)
    sc = rng.uniform(-0.05, 0.05, size=(k // gs, n)).astype(np.float16)
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    absmax = rng.uniform(0.1, 2, size=(n, k // 64)).astype(np.float32)
    for dt in (torch.float32, torch.float16):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(6)).to(dt).to(DEV)
        check_product(K.awq_matmul(x, to_dev(qw), to_dev(qz), to_dev(sc), group_size=gs), x,
               awq_reference(qw, qz, sc, gs), dt)
        check_product(K.nf4_matmul(x, to_dev(packed), to_dev(absmax), block_size=64), x,
               nf4_reference(packed, absmax, 64).T, dt)
