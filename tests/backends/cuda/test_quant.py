"""Triton kernels of the quantized matmuls: the tile dequantizers bit-exact with gguf-py /
bitsandbytes / AutoAWQ's layout (through the dense `dequantize` kernel, random and edge bytes),
the GEMV (M = 1), small-M (split-K, atomics) and GEMM paths for the forward and the gradient vs
float64 torch products, and the ops end to end on a CUDA device (float64 lowers to the recipe).

Runs on a CUDA GPU; without one it is skipped, unless TRITON_INTERPRET=1, where the kernels run
in Triton's CPU interpreter on tiny shapes (bfloat16 tl.dot is not emulated faithfully there, so
the dot paths are checked in float32 and float16 only in that mode)."""
from __future__ import annotations

import functools

import numpy as np
import pytest

from .cuda_oracle import (DEV, HAS_CUDA, INTERPRET, KERNEL_TESTS, check_product,
                          gguf_dequant_ref, to_dev, torch)

gguf = pytest.importorskip("gguf")
pytestmark = [pytest.mark.cuda, KERNEL_TESTS]

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import quant as K
    from fuelgraph.backends.cuda.kernels.quant_tiles import AWQ, GGUF_IDS, NF4
    from fuelgraph.registry.quant import NF4_CODE

from quant_cases import (GGUF, awq_reference, gguf_bytes, gguf_edge_bytes, nf4_reference,
                         same_bits)

TYPES = list(GGUF)
# the products may come back in another dtype than the tolerance's (float64 via the recipe)
_check = functools.partial(check_product, same_dtype=False)
DOT_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])
# (M, config): GEMV, small M split over the reduction, a GEMM tile (bigger on the GPU)
PATHS = [(1, None), (5, "split"), (40, "gemm"), (70, None)]   # 70 rows: dequantize + cuBLAS


def _cfg(kind):
    if kind is None:
        return None
    if kind == "split":
        return K.QConfig(16, 16, 32, split=3)
    return K.QConfig(32, 32, 32, split=1) if INTERPRET else None


@pytest.mark.parametrize("qtype", TYPES)
def test_gguf_tile_dequantizer_bit_exact(qtype):
    qk, bb, _ = GGUF[qtype]
    raw = np.random.default_rng(bb).integers(0, 256, size=(6, 2 * bb), dtype=np.uint8)
    edge, n_e, k_e = gguf_edge_bytes(qtype)
    for blocks, n, k in ((raw, 6, 2 * qk), (edge, n_e, k_e)):
        w = to_dev(blocks.reshape(-1))
        b = K.dequantize(GGUF_IDS[qtype], w, w, w, blocks.shape[1], k, n)
        same_bits(b.cpu().numpy().T, gguf_dequant_ref(blocks.reshape(n, -1), qtype))


def test_nf4_and_awq_tile_dequantizers_bit_exact():
    rng = np.random.default_rng(1)
    packed = rng.integers(0, 256, size=(24, 64), dtype=np.uint8)
    absmax = rng.uniform(0, 2, size=(24, 4)).astype(np.float32)
    code = torch.tensor(NF4_CODE, device=DEV)
    b = K.dequantize(NF4, to_dev(packed), to_dev(absmax), code, 32, 128, 24)
    same_bits(b.cpu().numpy().T, nf4_reference(packed, absmax, 32))
    qw = rng.integers(-2 ** 31, 2 ** 31, size=(64, 4), dtype=np.int64).astype(np.int32)
    qz = rng.integers(-2 ** 31, 2 ** 31, size=(2, 4), dtype=np.int64).astype(np.int32)
    sc = rng.uniform(-1, 1, size=(2, 32)).astype(np.float16)
    b = K.dequantize(AWQ, to_dev(qw), to_dev(qz), to_dev(sc), 32, 64, 32)
    same_bits(b.cpu().numpy(), awq_reference(qw, qz, sc, 32))


@pytest.mark.parametrize("m,kind", PATHS)
@pytest.mark.parametrize("qtype", TYPES)
def test_qmatmul_paths(qtype, m, kind):
    qk = GGUF[qtype][0]
    rng = np.random.default_rng(qk + m)
    n, k = 24, 2 * qk if qk == 32 else qk
    raw = gguf_bytes(rng, qtype, n, k)
    w = gguf_dequant_ref(raw, qtype)
    dtypes = DOT_DTYPES if m > 1 else [torch.float32, torch.bfloat16]
    for dt in dtypes:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dt).to(DEV)
        out = K.qmatmul(x, to_dev(raw.reshape(-1)), quant_type=qtype, n=n, k=k, config=_cfg(kind))
        assert out.dtype == dt and out.shape == (m, n)
        _check(out, x, w.T, dt)
        g = torch.randn(m, n, generator=torch.Generator().manual_seed(7)).to(dt).to(DEV)
        ga = K.qmatmul_grad_a(g, to_dev(raw.reshape(-1)), quant_type=qtype, n=n, k=k,
                              config=_cfg(kind))
        assert ga.dtype == dt and ga.shape == (m, k)
        _check(ga, g, w, dt)


@pytest.mark.parametrize("m,kind", PATHS)
def test_nf4_and_awq_paths(m, kind):
    rng = np.random.default_rng(m)
    n, k = 48, 128
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    absmax = rng.uniform(0.1, 2, size=(n, k // 64)).astype(np.float32)
    wn = nf4_reference(packed, absmax, 64)
    qw = rng.integers(-2 ** 31, 2 ** 31, size=(k, n // 8), dtype=np.int64).astype(np.int32)
    qz = rng.integers(-2 ** 31, 2 ** 31, size=(k // 64, n // 8), dtype=np.int64).astype(np.int32)
    sc = rng.uniform(0.005, 0.05, size=(k // 64, n)).astype(np.float16)
    wa = awq_reference(qw, qz, sc, 64)
    dtypes = DOT_DTYPES if m > 1 else [torch.float32, torch.bfloat16]
    for dt in dtypes:
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(1)).to(dt).to(DEV)
        g = torch.randn(m, n, generator=torch.Generator().manual_seed(2)).to(dt).to(DEV)
        nf4 = (to_dev(packed), to_dev(absmax))
        _check(K.nf4_matmul(x, *nf4, block_size=64, config=_cfg(kind)), x, wn.T, dt)
        _check(K.nf4_matmul_grad_a(g, *nf4, block_size=64, config=_cfg(kind)), g, wn, dt)
        awq = (to_dev(qw), to_dev(qz), to_dev(sc))
        _check(K.awq_matmul(x, *awq, group_size=64, config=_cfg(kind)), x, wa, dt)
        _check(K.awq_matmul_grad_a(g, *awq, group_size=64, config=_cfg(kind)), g, wa.T, dt)


@pytest.mark.skipif(not HAS_CUDA, reason="end to end on the CUDA backend needs a GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64"])
def test_ops_on_the_cuda_backend(dtype):
    import fuelgraph as fg
    import fuelgraph.functional as F
    import fuelgraph.quant as Q
    rng = np.random.default_rng(3)
    n, k = 64, 256
    w = rng.standard_normal((n, k)).astype(np.float32)
    raw = gguf_bytes(rng, "Q4_K", n, k)
    wq = gguf_dequant_ref(raw, "Q4_K")
    packed, absmax = Q.quantize_nf4(w, device="cuda")
    wn = Q.dequantize_nf4(packed, absmax).numpy()
    qw, qz, sc = Q.quantize_awq(w.T.copy(), 128, device="cuda")
    wa = Q.dequantize_awq(qw, qz, sc, 128).numpy()
    a_np = rng.standard_normal((3, 7, k)).astype(np.float32)
    a = fg.tensor(a_np, dtype=dtype, device="cuda", requires_grad=True)
    tdt = getattr(torch, dtype)
    x = torch.tensor(a_np).to(tdt)
    for out, b in ((F.qmatmul(a, fg.tensor(raw, device="cuda"), "Q4_K", n, k), wq.T),
                   (F.nf4_matmul(a, packed, absmax), wn.T),
                   (F.awq_matmul(a, qw, qz, sc, 128), wa)):
        assert out.device == "cuda:0" and out.dtype.name == dtype
        _check(torch.as_tensor(out.numpy().astype(np.float64)), x, b,
               torch.float32 if dtype == "float64" else tdt)
        (ga,) = fg.grad([out.sum()], [a])
        ref = torch.ones(3, 7, b.shape[1], dtype=torch.float64) @ torch.as_tensor(
            np.asarray(b, np.float64)).T
        tol = 2e-5 if dtype in ("float32", "float64") else 3e-2
        err = np.abs(ga.numpy().astype(np.float64) - ref.numpy()).max()
        assert err <= tol * max(1.0, np.abs(ref.numpy()).max()), err
