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


def _entry_scales(mw, t, ch):
    """(a, b) [8, 4] float64 of tile t, chunk ch as the kernel's `_scales` forms them (Q6_K:
    the two half blocks' d sc)."""
    from fuelgraph.backends.cuda.kernels import quant_mma as Q
    h = np.arange(4) % 2
    if mw.fmt in (Q.Q4_0, Q.Q8_0):
        d = mw.scales[t, ch].double().numpy()
        return d, -8 * d
    if mw.fmt == Q.Q4_K:
        sc = mw.scales[t, ch, :, 0].double().numpy()
        mn = mw.scales[t, ch, :, 1].double().numpy()
        dd = mw.table[t, ch // 4].double().numpy()                      # [8, 4]
        return dd[:, h] * sc, -(dd[:, 2 + h] * mn)
    if mw.fmt == Q.Q6_K:
        d = mw.table[t, ch // 4].double().numpy()[:, h]
        sc = mw.scales[t, ch].view(torch.int8).double().numpy()          # int8 bits
        return d * sc[:, 0], d * sc[:, 1]
    grp = ch // (mw.group // 64)
    s_ = mw.scales[t, grp].double().numpy()[:, h]
    z = mw.zeros[t, grp].double().numpy()[:, h]
    return s_, -z * s_


def _emulate(mw, x):
    """x [M <= 8, K] float64 -> [M, N]: each lane's registers as mma.sync m16n8k16's fragments
    (A row-major: a0 a1 row l / 4, k 2 (l % 4) + (0, 1); a2 a3 row + 8; a4..a7 k + 8; B column
    l / 4 with k as A's; C c0 c1 row l / 4, columns 2 (l % 4) + (0, 1); c2 c3 row + 8), A the
    codes (two planes: lo + 16 hi - offset), the sums scaled as the kernel does: Q4_0 / Q8_0
    d C a block (Q4_0: A = q, minus 8 d C1), Q4_K / AWQ a C + b C1 (C1: all-ones A), Q6_K
    (d sc) C a half block (one mma step)."""
    from fuelgraph.backends.cuda.kernels import quant_mma as Q
    words = mw.words.numpy().astype(np.int64) & 0xFFFFFFFF
    if words.ndim == 4:
        words = words[:, :, None]                                        # one plane
    off = {Q.Q8_0: 128, Q.Q6_K: 32}.get(mw.fmt, 0)
    halves = mw.fmt == Q.Q6_K
    tiles, kch = words.shape[0], mw.k // 64
    m = x.shape[0]
    lane = np.arange(32)
    r, p = lane // 4, lane % 4

    def kk(j):                          # the block element of the lane's j-th code
        return 4 * p + j % 4 + 16 * (j // 4) if halves else 8 * p + j

    def code(t, ch, e, j):
        if halves:      # Q6_K: [pairs, (lo 0, lo 1, crumbs of both), 32, 4]
            lo = (words[t, ch // 2, ch % 2, :, e] >> (4 * (j // 2) + 16 * (j % 2))) & 15
            hi = (words[t, ch // 2, 2, :, e] >> (2 * (4 * (ch % 2) + j // 2) + 16 * (j % 2))) & 3
            return lo + 16 * hi - off
        v = 0
        for pl in range(words.shape[2]):
            w = words[t, ch, pl, :, e] >> (4 * (j // 2) + 16 * (j % 2))
            v = v + (w & 15) * (16 ** pl)
        return v - off
    out = np.zeros((m, mw.n))
    xr = np.minimum(r, m - 1)
    for t in range(tiles):
        acc = np.zeros((32, 4))
        for ch in range(kch):
            sa, sb = _entry_scales(mw, t, ch)
            for g in range(2):
                cs = []
                for s in range(2):
                    a = np.zeros((16, 16))
                    b = np.zeros((16, 8))
                    for e, rows in ((2 * g, r), (2 * g + 1, r + 8)):
                        for jj, slot in ((0, 0), (1, 1), (2, 8), (3, 9)):
                            a[rows, 2 * p + slot] = code(t, ch, e, 4 * s + jj)
                    for jj, slot in ((0, 0), (1, 1), (2, 8), (3, 9)):
                        b[2 * p + slot, r] = x[xr, ch * 64 + g * 32 + kk(4 * s + jj)]
                    cs.append((a @ b, np.ones((16, 16)) @ b))
                for j in range(4):
                    e = 2 * g + j // 2
                    row, col = r + 8 * (j // 2), 2 * p + j % 2
                    c = cs[0][0] + cs[1][0]
                    c1 = cs[0][1] + cs[1][1]
                    if mw.fmt == Q.Q6_K:
                        acc[:, j] += sa[r, e] * cs[0][0][row, col] + sb[r, e] * cs[1][0][row, col]
                    elif mw.fmt == Q.Q8_0:
                        acc[:, j] += sa[r, e] * c[row, col]
                    else:
                        acc[:, j] += sa[r, e] * c[row, col] + sb[r, e] * c1[row, col]
        for e in range(4):
            n_ = t * 16 + r + 8 * (e // 2)
            m_ = 2 * p + e % 2
            ok = m_ < m
            out[m_[ok], n_[ok]] = acc[ok, e]
    return out


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "awq", "Q8_0", "Q6_K"])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_register_order_as_mma_fragments(fmt, m):
    from fuelgraph.backends.cuda.kernels import quant_mma as Q
    rng = np.random.default_rng(m)
    n, k = 32, 512
    if fmt == "awq":
        from quant_cases import awq_reference
        gs = 128
        qw = rng.integers(-2 ** 31, 2 ** 31, size=(k, n // 8), dtype=np.int64).astype(np.int32)
        qz = rng.integers(-2 ** 31, 2 ** 31, size=(k // gs, n // 8), dtype=np.int64)
        qz = qz.astype(np.int32)
        sc = rng.uniform(-0.05, 0.05, size=(k // gs, n)).astype(np.float16)
        mw = Q.pack_mma(Q.AWQ, torch.from_numpy(qw), torch.from_numpy(qz),
                        torch.from_numpy(sc), gs, k, n)
        w = awq_reference(qw, qz, sc, gs).T
    else:
        raw = gguf_bytes(rng, fmt, n, k)
        qk, tsize = GGUF_SIZES[fmt]
        mw = Q.pack_mma(getattr(Q, fmt), torch.from_numpy(raw.reshape(-1)), None, None,
                        tsize * k // qk, k, n)
        w = gguf_dequant_ref(raw, fmt)
    x = rng.standard_normal((m, k))
    want = x @ w.astype(np.float64).T
    # (Q4_K: gguf-py rounds each weight's (d sc) q - dmin m once in float32)
    np.testing.assert_allclose(_emulate(mw, x), want, rtol=0, atol=1e-6 * np.abs(want).max())


@pytest.mark.parametrize("fmt", ["Q4_K", "Q4_0"])
def test_diag_order_as_mma_fragments(fmt):
    """quant_mma_diag (one row; Q4_0 as a q + b with b = -8 d): lane l's B column l // 4 holds x
    of block l // 8 of a chunk pair, block q's mma its own chain; lane p takes chain p's column
    2 p (block p), the scales of block p's rows r, r + 8; the rows summed over the 4 lanes p."""
    from fuelgraph.backends.cuda.kernels import quant_mma as Q
    rng = np.random.default_rng(5)
    n, k = 32, 512
    raw = gguf_bytes(rng, fmt, n, k)
    qk, tsize = GGUF_SIZES[fmt]
    mw = Q.pack_mma(getattr(Q, fmt), torch.from_numpy(raw.reshape(-1)), None, None,
                    tsize * k // qk, k, n)
    words = mw.words.numpy().astype(np.int64) & 0xFFFFFFFF              # [T, C, 32, 4]
    x = rng.standard_normal(k)
    lane = np.arange(32)
    r, p = lane // 4, lane % 4
    out = np.zeros(n)
    for t in range(n // 16):
        acc = np.zeros((32, 2))
        for c0 in range(0, k // 64, 2):
            blk = (c0 + r // 4) * 64 + ((r // 2) % 2) * 32 + 8 * p           # lane's x block
            xl = x[blk[:, None] + np.arange(8)]                                 # [32, 8]
            chains = np.zeros((4, 16, 8))
            d = np.zeros((16, 8))
            for q in range(4):
                u, g = c0 + q // 2, q % 2
                for s in range(2):
                    a = np.zeros((16, 16))
                    b = np.zeros((16, 8))
                    for e, rows in ((2 * g, r), (2 * g + 1, r + 8)):
                        for jj, slot in ((0, 0), (1, 1), (2, 8), (3, 9)):
                            j = 4 * s + jj
                            a[rows, 2 * p + slot] = 128 + ((words[t, u, :, e] >> (
                                4 * (j // 2) + 16 * (j % 2))) & 15)
                    for jj, slot in ((0, 0), (1, 1), (2, 8), (3, 9)):
                        b[2 * p + slot, r] = xl[:, 4 * s + jj]
                    chains[q] += a @ b
                    if q == 0:
                        d += np.ones((16, 16)) @ b
            scales = [_entry_scales(mw, t, c0 + j) for j in range(2)]  # (a, b) [8, 4]
            for h in range(2):
                e = 2 * (p % 2) + h
                a_ = np.choose(p // 2, [sc[0][r, e] for sc in scales])
                b_ = np.choose(p // 2, [sc[1][r, e] for sc in scales])
                acc[:, h] += (a_ * chains[p, r + 8 * h, 2 * p]
                              + (b_ - 128 * a_) * d[r + 8 * h, 2 * p])
        for h in range(2):
            out[t * 16 + np.arange(8) + 8 * h] = acc[:, h].reshape(8, 4).sum(axis=1)
    want = gguf_dequant_ref(raw, fmt).astype(np.float64) @ x
    np.testing.assert_allclose(out, want, rtol=0, atol=1e-6 * np.abs(want).max())


GGUF_SIZES = {"Q4_0": (32, 18), "Q4_K": (256, 144), "Q8_0": (32, 34), "Q6_K": (256, 210)}


CFGS = {"default": None, "u1": (4, 1, 1), "u4": (2, 4, 1), "k8": (8, 2, 1), "sn": (4, 2, 0),
        "k1": (1, 2, 1), "xa": (4, 2, 1, 1), "sw": (4, 2, 2), "sw4": (4, 4, 2)}


def _cfg(name):
    from fuelgraph.backends.cuda.kernels.quant_mma import MmaConfig
    if name == "mma":       # the format's default launch (DEFAULT_MMA)
        return "mma"
    v = CFGS[name]
    return MmaConfig() if v is None else MmaConfig(*v)


def _weight(fmt, rng, n, k):
    """(matmul(x, cfg), W [N, K] float32 reference) of a random weight of the format."""
    from fuelgraph.backends.cuda.kernels import quant as K
    if fmt == "awq":
        gs = 64
        qw = rng.integers(-2 ** 31, 2 ** 31, size=(k, n // 8), dtype=np.int64).astype(np.int32)
        qz = rng.integers(-2 ** 31, 2 ** 31, size=(k // gs, n // 8), dtype=np.int64)
        sc = rng.uniform(-0.05, 0.05, size=(k // gs, n)).astype(np.float16)
        from quant_cases import awq_reference
        ref = awq_reference(qw, qz.astype(np.int32), sc, gs).T
        args = [to_dev(qw), to_dev(qz.astype(np.int32)), to_dev(sc)]
        return (lambda x, c: K.awq_matmul(x, *args, group_size=gs, config=c)), ref, args[0]
    raw = gguf_bytes(rng, fmt, n, k)
    w = to_dev(raw.reshape(-1))
    return (lambda x, c: K.qmatmul(x, w, quant_type=fmt, n=n, k=k, config=c)), \
        gguf_dequant_ref(raw, fmt), w


def _ran_mma(w):
    """Whether the mma copy of weight tensor w was made (the product took `quant_mma`)."""
    from fuelgraph.backends.cuda.kernels import quant_packed as P
    return any(key[0] == id(w) and "pack_mma" in key for key in P._CACHE)


@GPU
@pytest.mark.parametrize("name", list(CFGS))
@pytest.mark.parametrize("m", [1, 5, 8, 16])
def test_mma_q4_0(name, m):
    rng = np.random.default_rng(m + len(name))
    n, k = 48, 512          # 3 tiles, 8 chunks (k8: one a warp)
    fn, ref, w = _weight("Q4_0", rng, n, k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16).to(DEV)
    check_product(fn(x, _cfg(name)), x, ref.T, torch.bfloat16)
    assert _ran_mma(w)


@GPU
@pytest.mark.parametrize("m", [1, 16])
@pytest.mark.parametrize("fmt,name", [(f, c) for f in ("Q4_0", "Q4_K", "awq", "Q8_0", "Q6_K")
                                      for c in ("mma", "u1")]
                         + [(f, c) for f in ("Q4_K", "awq", "Q6_K") for c in ("sw", "sw4")])
def test_mma_formats_and_rows(fmt, m, name):
    """Q4_K / AWQ (a q + b a block: the x sums by an all-ones mma), Q8_0 / Q6_K (two planes,
    Q6_K scaled per half block), their byte scale fields carried a step ahead as words (sw),
    and 9..16 rows (two x tiles), the rows in a 3-d x."""
    rng = np.random.default_rng(m + 7 * len(fmt))
    n, k = 48, 1024
    fn, ref, w = _weight(fmt, rng, n, k)
    x = torch.randn(1, m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    x = x.to(DEV)
    out = fn(x, _cfg(name))
    assert out.shape == (1, m, n)
    check_product(out[0], x[0], ref.T, torch.bfloat16)
    assert _ran_mma(w)


@GPU
@pytest.mark.parametrize("fmt,cfg,k", [
    ("Q4_K", (8, 2, 0, 0, 1), 1024), ("Q4_K", (4, 4, 0, 0, 1), 1024),
    ("Q4_K", (4, 2, 2, 0, 1), 1024), ("Q4_K", (8, 2, 0, 0, 1), 768),
    ("awq", (4, 4, 0, 0, 1), 1024), ("awq", (4, 2, 2, 0, 1), 512),
    ("Q4_0", (4, 2, 1, 0, 1), 512), ("Q4_0", (4, 4, 1, 0, 1), 1024)])
def test_mma_diag_one_row(fmt, cfg, k):
    """One row with a lane scaling one block (quant_mma_diag): B's columns carry 4 blocks of a
    chunk pair, the scales of block lane % 4, the row summed over its lanes; K of 3 super-blocks
    (odd chunks a warp at 4 warps: the launch halves the warps); 2 rows ignore diag."""
    from fuelgraph.backends.cuda.kernels.quant_mma import MmaConfig
    rng = np.random.default_rng(k + cfg[0])
    n = 48
    fn, ref, w = _weight(fmt, rng, n, k)
    for m in (1, 2):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
        check_product(fn(x.to(DEV), MmaConfig(*cfg)), x.to(DEV), ref.T, torch.bfloat16)
    assert _ran_mma(w)


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
    wd = to_dev(raw.reshape(-1))
    out = K.qmatmul(x, wd, quant_type="Q4_0", n=n, k=k, config=_cfg("u1"))
    assert _ran_mma(wd)
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


@GPU
@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "awq", "Q8_0", "Q6_K"])
def test_default_route(fmt):
    """bf16 x of 1..16 rows takes the mma GEMV by default (the one-row and the few-row launch),
    on the copy made once; float32 x and rows beyond MMA_DEFAULT_ROWS keep the other routes."""
    from fuelgraph.backends.cuda.kernels import quant_mma as Q
    from fuelgraph.backends.cuda.kernels.quant_tiles import AWQ, GGUF_IDS
    rng = np.random.default_rng(31)
    n, k = 32, 512
    fn, ref, w = _weight(fmt, rng, n, k)
    rows = Q.MMA_DEFAULT_ROWS[GGUF_IDS.get(fmt, AWQ)]
    for m, dt, mma in ((1, torch.float32, False), (rows + 1, torch.bfloat16, False),
                       (1, torch.bfloat16, True), (5, torch.bfloat16, True),
                       (rows, torch.bfloat16, True)):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dt).to(DEV)
        check_product(fn(x, None), x, ref.T, dt)
        assert _ran_mma(w) == mma, (m, dt)
