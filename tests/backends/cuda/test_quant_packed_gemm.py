"""The many-row GEMM on the packed (chunk-layout) weight copy (`quant_packed_gemm`: Q4_0, Q8_0,
Q4_K, Q6_K, NF4, AWQ): every weight decoded bit for bit as gguf-py / the NF4 and AWQ layout
references (x = the float32 identity, random and edge bytes), and the products against float64
torch on the dequantized weight (partial tiles in N and M, a split reduction by atomics, x or
every load by TMA), and the route through `quant.run`.

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
    from fuelgraph.backends.cuda.kernels import quant_packed as P
    from fuelgraph.backends.cuda.kernels.quant_packed_gemm import (PackedGemmConfig,
                                                                   run_packed_gemm)
    from fuelgraph.backends.cuda.kernels.quant_tiles import AWQ, GGUF_IDS, NF4

from quant_cases import (GGUF, awq_case, gguf_bytes, gguf_edge_bytes, nf4_reference,
                         same_bits)

FORMATS = ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "NF4", "AWQ"]
#: small launches: partial tiles, a split reduction (atomics), x by TMA, a step's scales in one
#: load (PackedGemmConfig's arguments: the kernels import only with a GPU or the interpreter)
VARIANTS = {"plain": ((16, 16, 1, 4, 2), {}),
            "split": ((16, 32, 2, 4, 2), {}),
            "tma": ((16, 32, 1, 4, 2), dict(tma=1)),
            "vec": ((16, 16, 1, 4, 2), dict(vec=1))}


def _weight(fmt, rng, n, edge=False):
    """((fmt id, w0, w1, w2, i0) as quant.run takes them, n, k, float64 reference W [N, K]):
    random bytes, or (edge) the 256 GGUF edge blocks (every byte value, edge scales) as rows
    followed by 16 random rows / every finite f16 magnitude and sign as AWQ scales."""
    if fmt in GGUF:
        e = P.CHUNK[GGUF_IDS[fmt]]
        qk = GGUF[fmt][0]
        per = max(1, e // qk) * 2
        raw = gguf_bytes(rng, fmt, n, per * qk)
        if edge:
            blocks, _, _ = gguf_edge_bytes(fmt)
            idx = (np.arange(256)[:, None] + 37 * np.arange(per)[None, :]) % 256
            raw = np.concatenate([blocks[idx].reshape(256, -1), raw])
        w = to_dev(raw.reshape(-1))
        return (GGUF_IDS[fmt], w, w, w, raw.shape[1]), raw.shape[0], per * qk, \
            gguf_dequant_ref(raw, fmt)
    k = 512
    if fmt == "NF4":
        from fuelgraph.registry.quant import NF4_CODE
        packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
        absmax = rng.uniform(0.1, 2, size=(n, k // 64)).astype(np.float32)
        return ((NF4, to_dev(packed), to_dev(absmax), torch.tensor(NF4_CODE, device=DEV), 64),
                n, k, nf4_reference(packed, absmax, 64))
    qw, qz, sc, gs, ref = awq_case(rng, k, n, edge)
    return (AWQ, to_dev(qw), to_dev(qz), to_dev(sc), gs), n, k, ref


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_gemm_decodes_bit_exact(fmt):
    """x = the float32 identity: out[m, n] = W[n, m] exactly, the format's dequantizer's value
    (rows whose weights are all finite; zero signs aside)."""
    args, n, k, want = _weight(fmt, np.random.default_rng(41), 16, edge=fmt != "NF4")
    fid, w0, w1, w2, i0 = args
    x = torch.eye(k, dtype=torch.float32).to(DEV)
    fin = np.isfinite(want).all(axis=1)
    got = run_packed_gemm(fid, x, w0, w1, w2, i0, k, n, config=PackedGemmConfig(64, 64, 1, 4, 2))
    got = got.cpu().numpy().T
    same_bits(got[fin] + 0.0, want[fin] + 0.0)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_gemm_product(fmt, variant):
    """M = 40 rows (partial x tiles), N = 24 (a partial weight tile) against float64 torch on
    the dequantized weight; bf16 x on the GPU, float32 in the interpreter."""
    args, n, k, want = _weight(fmt, np.random.default_rng(7), 24)
    dt = torch.float32 if INTERPRET else torch.bfloat16
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(3)).to(dt).to(DEV)
    fid, w0, w1, w2, i0 = args
    shape_args, kw = VARIANTS[variant]
    got = run_packed_gemm(fid, x, w0, w1, w2, i0, k, n, config=PackedGemmConfig(*shape_args, **kw))
    check_product(got, x, want.T, dt)


@pytest.mark.parametrize("fmt", ["Q4_0", "AWQ", "Q4_K"])
def test_packed_gemm_all_tma(fmt):
    """The affine formats' all-TMA kernel on whole tiles (N = 64, M = 64; split 2 by atomics
    for AWQ and Q4_K)."""
    args, n, k, want = _weight(fmt, np.random.default_rng(9), 64)
    dt = torch.float32 if INTERPRET else torch.bfloat16
    x = torch.randn(64, k, generator=torch.Generator().manual_seed(4)).to(dt).to(DEV)
    fid, w0, w1, w2, i0 = args
    cfg = PackedGemmConfig(16, 32, 2 if fmt != "Q4_0" else 1, 4, 2, tma=2)
    check_product(run_packed_gemm(fid, x, w0, w1, w2, i0, k, n, config=cfg), x, want.T, dt)


@pytest.mark.parametrize("fmt", ["Q4_0", "AWQ"])
def test_packed_gemm_route(fmt):
    """quant.run takes the GEMM for a PackedGemmConfig and 16-bit x; float32 x falls back to
    the dense copy + cuBLAS (or AWQ's fused GEMM) with the same result."""
    args, n, k, want = _weight(fmt, np.random.default_rng(5), 16)
    fid, w0, w1, w2, i0 = args
    cfg = PackedGemmConfig(16, 32, 1, 4, 2)
    for dt in (torch.float16 if INTERPRET else torch.bfloat16, torch.float32):
        x = torch.randn(33, k, generator=torch.Generator().manual_seed(1)).to(dt).to(DEV)
        check_product(K.run(fid, x, w0, w1, w2, i0, k, n, config=cfg), x, want.T, dt)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (CUDA graphs)")
def test_packed_gemm_in_a_cuda_graph():
    """Captured before the weight's (a, b) pairs exist, the route falls back to the dense copy
    (no pairs made inside a capture); made eagerly afterwards, a new capture uses the GEMM."""
    args, n, k, want = _weight("Q4_0", np.random.default_rng(15), 64)
    fid, w0, w1, w2, i0 = args
    cfg = PackedGemmConfig(64, 64, 1, 4, 2, tma=2)                 # (TMA descriptors too)
    x = torch.randn(64, k, device=DEV, dtype=torch.bfloat16)
    K.run(fid, x, w0, w1, w2, i0, k, n, config="dequant_rows")     # warm up outside
    P.packed_weight(fid, w0, w1, w2, i0, k, n)                      # the copy, no pairs yet
    for _ in range(2):      # first capture: no pairs yet; second: made in between
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = K.run(fid, x, w0, w1, w2, i0, k, n, config=cfg)
        x.copy_(torch.randn(64, k, device=DEV, dtype=torch.bfloat16))
        graph.replay()
        check_product(out, x, want.T, torch.bfloat16)
        check_product(K.run(fid, x, w0, w1, w2, i0, k, n, config=cfg), x, want.T,
                      torch.bfloat16)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q4_K", "AWQ"])
def test_many_rows_default_route(fmt):
    """65..PACKED_GEMM_MAX_M rows of 16-bit x take the packed GEMM by default (or the Gluon
    GEMM, whose shapes N = 24 is not one of: then the packed GEMM; M = 70: a partial x tile,
    split K on the small grid); float32 x the dense copy (AWQ: its GEMM)."""
    assert isinstance(_fmt_route(fmt, 70), (PackedGemmConfig, K.GluonGemmConfig))
    args, n, k, want = _weight(fmt, np.random.default_rng(17), 24)
    fid, w0, w1, w2, i0 = args
    for dt in (torch.float16 if INTERPRET else torch.bfloat16, torch.float32):
        x = torch.randn(70, k, generator=torch.Generator().manual_seed(2)).to(dt).to(DEV)
        check_product(K.run(fid, x, w0, w1, w2, i0, k, n), x, want.T, dt)


def _fmt_route(fmt, m):
    return K.default_route(AWQ if fmt == "AWQ" else GGUF_IDS[fmt], m)
