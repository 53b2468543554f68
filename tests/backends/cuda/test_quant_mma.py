"""The few-row tensor-core GEMV (`quant_mma`: Q4_0, bf16 x, M <= 8): its register order read as
mma.sync's documented fragments (PTX ISA, m16n8k16 bf16) gives W @ x for gguf-py's W (CPU, no
Triton), and the kernel's products against float64 torch on the dequantized weight (random and
edge bytes, 1..8 rows, several launches, partial programs, inside a CUDA graph) on a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from .cuda_oracle import DEV, HAS_CUDA, check_product, gguf_dequant_ref, to_dev, torch

gguf = pytest.importorskip("gguf")

from quant_cases import gguf_bytes, gguf_edge_bytes  # noqa: E402

GPU = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (inline PTX mma)")


def _emulate(mw, x):
    """x [M <= 8, K] float64 -> [M, N]: each lane's registers as mma.sync m16n8k16's fragments
    (A row-major: a0 a1 row l / 4, k 2 (l % 4) + (0, 1); a2 a3 row + 8; a4..a7 k + 8; B column
    l / 4 with k as A's; C c0 c1 row l / 4, columns 2 (l % 4) + (0, 1); c2 c3 row + 8)."""
    words = mw.words.numpy().astype(np.int64) & 0xFFFFFFFF
    sc = mw.scales.float().numpy()
    tiles, kch = words.shape[:2]
    m = x.shape[0]
    lane = np.arange(32)
    r, p = lane // 4, lane % 4
    out = np.zeros((m, mw.n))
    for t in range(tiles):
        acc = np.zeros((32, 4))
        for ch in range(kch):
            for g in range(2):
                c = np.zeros((16, 8))
                for s in range(2):
                    a = np.zeros((16, 16))
                    b = np.zeros((16, 8))
                    for e, rows in ((2 * g, r), (2 * g + 1, r + 8)):
                        for half, m_ in ((0, 2 * s), (8, 2 * s + 1)):
                            w = words[t, ch, :, e] >> (4 * m_)
                            a[rows, 2 * p + half] = (w & 15) - 8
                            a[rows, 2 * p + half + 1] = ((w >> 16) & 15) - 8
                    xr = np.minimum(r, m - 1)
                    base = ch * 64 + g * 32 + 8 * p + 4 * s
                    for off, slot in ((0, 0), (1, 1), (2, 8), (3, 9)):
                        b[2 * p + slot, r] = x[xr, base + off]
                    c += a @ b
                frag = np.stack([c[r, 2 * p], c[r, 2 * p + 1], c[r + 8, 2 * p],
                                 c[r + 8, 2 * p + 1]], axis=1)
                acc += frag * np.stack([sc[t, ch, r, 2 * g + j // 2] for j in range(4)], axis=1)
        for e in range(4):
            n_ = t * 16 + r + 8 * (e // 2)
            m_ = 2 * p + e % 2
            ok = m_ < m
            out[m_[ok], n_[ok]] = acc[ok, e]
    return out


@pytest.mark.parametrize("m", [1, 3, 8])
def test_register_order_as_mma_fragments(m):
    from fuelgraph.backends.cuda.kernels import quant_mma as Q
    rng = np.random.default_rng(m)
    n, k = 32, 192
    raw = gguf_bytes(rng, "Q4_0", n, k)
    mw = Q.pack_mma(Q.Q4_0, torch.from_numpy(raw.reshape(-1)), None, None, 18 * k // 32, k, n)
    x = rng.standard_normal((m, k))
    want = x @ gguf_dequant_ref(raw, "Q4_0").astype(np.float64).T
    np.testing.assert_allclose(_emulate(mw, x), want, rtol=1e-12, atol=1e-12)


CFGS = {"default": None, "u1": (1, 4, 1, 1, 1), "u4": (1, 2, 4, 1, 1), "t2": (2, 2, 2, 1, 1),
        "stages": (1, 4, 2, 0, 3), "k1": (1, 1, 2, 1, 1)}


def _cfg(name):
    from fuelgraph.backends.cuda.kernels.quant_mma import MmaConfig
    v = CFGS[name]
    return MmaConfig() if v is None else MmaConfig(*v)


@GPU
@pytest.mark.parametrize("name", list(CFGS))
@pytest.mark.parametrize("m", [1, 5, 8])
def test_mma_q4_0(name, m):
    from fuelgraph.backends.cuda.kernels import quant as K
    rng = np.random.default_rng(m + len(name))
    n, k = 48, 512          # 3 tiles (t2: a partial last program), 8 chunks
    raw = gguf_bytes(rng, "Q4_0", n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).to(DEV)
    out = K.qmatmul(x, to_dev(raw.reshape(-1)), quant_type="Q4_0", n=n, k=k, config=_cfg(name))
    check_product(out, x, gguf_dequant_ref(raw, "Q4_0").T, torch.bfloat16)


@GPU
def test_mma_q4_0_edge_bytes():
    """Every byte value and the edge scales (zero, extremes) of gguf_edge_bytes."""
    from fuelgraph.backends.cuda.kernels import quant as K
    edge, _, qk = gguf_edge_bytes("Q4_0")
    fin = np.isfinite(gguf_dequant_ref(edge, "Q4_0")).all(axis=1)
    edge = edge[fin]
    rows = (len(edge) // 16) * 16
    per_row = 8                     # 8 blocks: 256 elements a row
    idx = (np.arange(rows)[:, None] + 37 * np.arange(per_row)[None, :]) % len(edge)
    raw = edge[idx].reshape(rows, -1)
    n, k = rows, per_row * qk
    w = gguf_dequant_ref(raw, "Q4_0")
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16).to(DEV)
    out = K.qmatmul(x, to_dev(raw.reshape(-1)), quant_type="Q4_0", n=n, k=k,
                    config=_cfg("u1"))
    ref = x.double().cpu() @ torch.as_tensor(w.astype(np.float64).T)
    err = (out.double().cpu() - ref).abs().max().item()
    assert err <= 3e-2 * max(1.0, ref.abs().max().item()), err


@GPU
def test_mma_in_a_cuda_graph():
    from fuelgraph.backends.cuda.kernels import quant as K
    rng = np.random.default_rng(13)
    n, k = 64, 512
    raw = gguf_bytes(rng, "Q4_0", n, k)
    w = to_dev(raw.reshape(-1))
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    cfg = _cfg("default")
    K.qmatmul(x, w, quant_type="Q4_0", n=n, k=k, config=cfg)
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        K.qmatmul(x, w, quant_type="Q4_0", n=n, k=k, config=cfg)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        out = K.qmatmul(x, w, quant_type="Q4_0", n=n, k=k, config=cfg)
    x.copy_(torch.randn(1, k, device=DEV, dtype=torch.bfloat16))
    graph.replay()
    check_product(out, x, gguf_dequant_ref(raw, "Q4_0").T, torch.bfloat16)
