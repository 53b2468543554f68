"""The Gluon wgmma GEMM on the fragment-order weight copy (`quant_gluon_gemm`: Q4_0, AWQ, Q4_K,
Q8_0). Without a GPU: the packed copy decoded by a torch re-implementation of the documented
fragment order and pair formula equals gguf-py's / the AWQ reference's dequantized weight bit
for bit. On an sm_90 GPU: x = the bf16 identity gives every weight rounded once to bf16 (edge
bytes, every nibble / byte value), and products against float64 torch on the dequantized
weight (a partial x tile, bf16 and f16 x, the launches of the sweep)."""
from __future__ import annotations

import numpy as np
import pytest

from .cuda_oracle import DEV, HAS_CUDA, check_product, gguf_dequant_ref, torch

gguf = pytest.importorskip("gguf")

from fuelgraph.backends.cuda.kernels import quant_gluon_gemm as G  # noqa: E402
from fuelgraph.backends.cuda.kernels.common import _EAGER_COUNTERS, stream_key  # noqa: E402
from fuelgraph.backends.cuda.kernels.quant_tiles import AWQ, GGUF_IDS, NF4  # noqa: E402
from fuelgraph.registry.quant import NF4_CODE  # noqa: E402

from quant_cases import (GGUF, awq_case, gguf_bytes, gguf_edge_bytes,  # noqa: E402
                         nf4_reference, same_bits)

FORMATS = ["Q4_0", "Q8_0", "Q4_K", "AWQ", "NF4", "Q6_K"]
SM90 = HAS_CUDA and torch.cuda.get_device_capability() >= (9, 0)
NEEDS_SM90 = pytest.mark.skipif(not SM90, reason="needs an sm_90 GPU")
#: launches (num_warps, block_m, stages, sub, ws[, h2, rot, late, split, wtma, rega]) the GPU
#: tests run: the defaults' first (K split in two, the producer warp, the decoded tiles as the
#: wgmmas' register operands: 128 x 256 tiles with the words by TMA, 128 x 128 tiles), then
#: session 10's (the shared A buffer) and others
LAUNCHES = [(8, 256, 5, 2, 1, 0, 0, 0, 2, 1, 1), (8, 128, 4, 2, 1, 0, 0, 0, 2, 0, 1),
            (8, 256, 4, 1, 1, 0, 0, 0, 2, 1), (8, 128, 4, 2, 1, 0, 0, 0, 2), (4, 256, 4, 2, 0),
            (4, 256, 4, 2, 1), (4, 128, 4, 2, 0), (8, 128, 6, 2, 1)]
#: (num_warps, block_m, stages, sub, ws, h2, rot, late, split): 128 x 256 tiles, K split in two
SPLIT2 = (8, 256, 4, 2, 0, 0, 0, 0, 2)
#: (..., split, wtma): the same with the words and scales by TMA
WTMA = (8, 256, 4, 1, 0, 0, 0, 0, 2, 1)
#: (..., wtma, rega): register A with 6 stages, the words by TMA (Q4_0's default) or loaded by
#: the threads (Q8_0's, Q6_K's)
REGA = [(8, 256, 6, 2, 1, 0, 0, 0, 2, 1, 1), (8, 256, 6, 2, 1, 0, 0, 0, 2, 0, 1)]


def _weight(fmt, rng, n, edge=False, dev=DEV, k=512):
    """((fmt id, w0, w1, w2, i0) as quant.run takes them, n, k, float64 reference W [N, K]):
    random bytes (K = 512), or (edge) the 256 GGUF edge blocks as the first rows / random f16
    bit patterns as AWQ scales with group 64 (NF4: every byte value, absmax blocks of 64)."""
    if fmt == "NF4":
        packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
        if edge:
            packed[:, :256] = np.arange(256, dtype=np.uint8)
        absmax = rng.uniform(0.1, 2, size=(n, k // 64)).astype(np.float32)
        t = [torch.as_tensor(packed).to(dev), torch.as_tensor(absmax).to(dev),
             torch.tensor(NF4_CODE, dtype=torch.float32, device=dev)]
        return (NF4, *t, 64), n, k, nf4_reference(packed, absmax, 64)
    if fmt in GGUF:
        qk = GGUF[fmt][0]
        raw = gguf_bytes(rng, fmt, n, k)
        if edge:
            blocks, _, _ = gguf_edge_bytes(fmt)
            per = k // qk
            idx = (np.arange(256)[:, None] + 37 * np.arange(per)[None, :]) % 256
            raw = np.concatenate([blocks[idx].reshape(256, -1), raw])
        w = torch.as_tensor(raw.reshape(-1)).to(dev)
        return (GGUF_IDS[fmt], w, w, w, raw.shape[1]), raw.shape[0], k, gguf_dequant_ref(raw, fmt)
    qw, qz, sc, gs, ref = awq_case(rng, k, n, edge)
    t = [torch.as_tensor(v).to(dev) for v in (qw, qz, sc)]
    return (AWQ, *t, gs), n, k, ref


def _emulate(pw: "G.WgmmaWeight") -> np.ndarray:
    """W [N, K] float32 from the packed copy, written from the module docstring: row
    16 t + 8 h + r, k = 64 kk + 32 u + 16 s + 8 c + 2 p + e; 4-bit: word (h, u) of lane 4 r + p,
    nibble 4 e + 2 c + s; 8-bit: word (h, u, s), byte 2 e + c; W = v a + b with
    v = 2^23 + 2^SH q (SH = 12 / 8; Q4_K: v - 2^23; Q4_0 / Q8_0 store no b: -(2^23 + 2^15) a),
    rounded once to float32; NF4
    code[q] absmax; Q6_K 2^16 q a - 2^21 a with a per 16 elements (SH = 16)."""
    n, k = pw.n, pw.k
    bits = G._BITS[pw.fmt]
    words = 4 if bits == 4 else 8
    c = pw.codes.cpu()[: n // 16 * k // 64 * 32 * words].to(torch.int64) & 0xFFFFFFFF
    per = 32 // bits
    vals = torch.stack([(c >> (bits * j)) & (2 ** bits - 1) for j in range(per)], -1)
    if bits == 4:   # (t, kk, r, p, h, u, e, c, s) -> (t, h, r, kk, u, s, c, p, e)
        q = vals.reshape(n // 16, k // 64, 8, 4, 2, 2, 2, 2, 2).permute(0, 4, 2, 1, 5, 8, 7, 3, 6)
        sh = 12
    else:           # (t, kk, r, p, h, u, s, e, c) -> (t, h, r, kk, u, s, c, p, e)
        q = vals.reshape(n // 16, k // 64, 8, 4, 2, 2, 2, 2, 2).permute(0, 4, 2, 1, 5, 6, 8, 3, 7)
        sh = 8
    q = q.reshape(n, k).double()

    def pairs(t):
        t = t.cpu()[: n // 16 * k // 64 * 32].reshape(n // 16, k // 64, 8, 2, 2)
        return t.permute(0, 3, 2, 1, 4).reshape(n, k // 32).double().repeat_interleave(32, 1)

    if pw.fmt == NF4:       # code[q] * absmax
        return (torch.tensor(NF4_CODE, dtype=torch.float64)[q.long()] * pairs(pw.a)).float().numpy()
    if pw.fmt == GGUF_IDS["Q6_K"]:      # a per 16 elements (u, s): W = 2^16 (q - 32) a
        a = pw.a.cpu()[: n // 16 * k // 64 * 64].reshape(n // 16, k // 64, 8, 2, 2, 2)
        a = a.permute(0, 3, 2, 1, 4, 5).reshape(n, k // 16).double().repeat_interleave(16, 1)
        return (q * 2.0 ** 16 * a - 2.0 ** 21 * a).float().numpy()
    v = q * 2.0 ** sh + (0 if pw.fmt == GGUF_IDS["Q4_K"] else 2.0 ** 23)
    a = pairs(pw.a)
    b = a * -(2.0 ** 23 + 2.0 ** 15) if pw.b.numel() == 0 else pairs(pw.b)   # Q4_0, Q8_0
    return (v * a + b).float().numpy()


@pytest.mark.parametrize("fmt", FORMATS)
def test_wgmma_copy_decodes_bit_exact(fmt):
    """The packed copy (built on the CPU) decoded by the documented formula equals the
    format's dequantizer bit for bit on edge bytes (every nibble / byte value, zero and extreme
    scales; rows of finite weights)."""
    args, n, k, want = _weight(fmt, np.random.default_rng(41), 64, edge=True, dev="cpu")
    pw = G.pack_wgmma(*args[:1], *args[1:4], args[4], k, n)
    got = _emulate(pw)
    fin = np.isfinite(want).all(axis=1)
    assert fin.sum() >= 64
    same_bits(got[fin] + 0.0, want[fin].astype(np.float32) + 0.0)


def _codes_nk(pw: "G.WgmmaWeight") -> torch.Tensor:
    """The 4-bit codes q [N, K] (int64) of a packed copy, by the documented fragment order."""
    n, k = pw.n, pw.k
    c = pw.codes.cpu()[: n // 16 * k // 64 * 32 * 4].to(torch.int64) & 0xFFFFFFFF
    vals = torch.stack([(c >> (4 * j)) & 15 for j in range(8)], -1)
    q = vals.reshape(n // 16, k // 64, 8, 4, 2, 2, 2, 2, 2).permute(0, 4, 2, 1, 5, 8, 7, 3, 6)
    return q.reshape(n, k)


@pytest.mark.parametrize("fmt", ["Q4_0", "AWQ"])
def test_h2_scales_round_once_like_float32(fmt):
    """The h2 decode for bf16 x (`h2_scales`: words (dh, dl) and, AWQ, (o, o)): t = (128 + q)
    + o = q - z exactly in bf16, then fma(t, dh, dl t) rounded once to bf16, emulated exactly
    (float64 sum, one rounding), equals the dequantized weight rounded to bf16, on edge bytes /
    scales; dh + dl = s with both halves bf16 numbers, o = -(128 + z) a bf16 number."""
    args, n, k, want = _weight(fmt, np.random.default_rng(41), 64, edge=True, dev="cpu")
    pw = G.pack_wgmma(args[0], *args[1:4], args[4], k, n)
    hi, lo = G.h2_scales(pw)

    def half(t, top):   # bf16 half of each word, as float64 [N, K] (a's layout)
        bits = t.view(torch.int32)
        bits = bits & -65536 if top else (bits & 0xFFFF) << 16
        t = bits.view(torch.float32)[: n // 16 * k // 64 * 32].reshape(n // 16, k // 64, 8, 2, 2)
        return t.permute(0, 3, 2, 1, 4).reshape(n, k // 32).double().repeat_interleave(32, 1)

    dh, dl = half(hi, False), half(hi, True)
    if fmt == "Q4_0":   # o = -136, a constant of the kernel
        assert lo.numel() == 0
        o = -136.0
    else:               # (o, o)
        assert torch.equal(lo.view(torch.int32) >> 16 & 0xFFFF, lo.view(torch.int32) & 0xFFFF)
        o = half(lo, False)
    t = (128 + _codes_nk(pw)).double() + o
    assert torch.equal(t, t.float().bfloat16().double())            # q - z exact in bf16
    got = (t * dh + dl * t).float().bfloat16().float().numpy()
    fin = np.isfinite(want).all(axis=1)
    same_bits(got[fin] + 0.0, _bf16(want[fin]) + 0.0)


def test_wgmma_copy_is_padded_and_sized():
    """Two (tile, step) blocks of zeros after each array (the kernel's unbounded look-ahead);
    Q8_0 stores no b (a fixed multiple of a)."""
    args, n, k, _ = _weight("Q8_0", np.random.default_rng(3), 64, dev="cpu")
    pw = G.pack_wgmma(args[0], *args[1:4], args[4], k, n)
    assert pw.codes.numel() == (n // 16 * k // 64 + 2) * 32 * 8
    assert pw.a.numel() == (n // 16 * k // 64 + 2) * 32 and pw.b.numel() == 0
    assert not pw.codes[-2 * 256:].any()


def _bf16(w: np.ndarray) -> np.ndarray:
    return torch.as_tensor(np.asarray(w, np.float32)).to(torch.bfloat16).float().numpy()


def _case_id(v) -> str:
    """A format's name, or a launch's tag (-k "split2 and Q8_0" picks cases)."""
    return v if isinstance(v, str) else G.GluonGemmConfig(*v).tag()


#: (format, launch): every format with the first two launches (the defaults), a 4-bit and
#: the 8-bit layout with the others (the decode does not depend on the launch; the
#: register layout on the warps; some run a TMA producer warp)
CASES = [(f, c) for c in LAUNCHES[:2] for f in FORMATS] + [(f, c) for c in LAUNCHES[2:]
                                                            for f in ("Q4_0", "Q8_0")] \
    + [("Q4_0", (4, 256, 4, 2, 1, 1)),          # Q4_0's bf16x2 decode (h2)
       ("Q4_0", (4, 256, 4, 2, 1, 0, 1)), ("Q8_0", (4, 256, 4, 2, 0, 0, 1)),   # rotated K
       ("Q4_0", (4, 256, 4, 2, 1, 0, 0, 1)), ("Q6_K", (4, 256, 4, 2, 0, 0, 0, 1)),   # late
       ("Q4_0", SPLIT2), ("NF4", SPLIT2),       # split K in two without the producer warp
       ("Q8_0", (8, 256, 5, 2, 1, 0, 0, 0, 2)), ("Q6_K", (8, 256, 5, 2, 1, 0, 0, 0, 2)),
       *[(f, (8, 256, 5, 1, 1, 0, 0, 0, 2, 1)) for f in ("AWQ", "Q4_0", "Q4_K", "NF4")],
       ("Q6_K", (8, 256, 6, 2, 1, 0, 0, 0, 2)), ("Q6_K", (8, 128, 4, 2, 0, 0, 0, 0, 2)),
       ("Q4_0", WTMA), ("Q6_K", WTMA), ("Q8_0", (4, 128, 4, 1, 0, 0, 0, 0, 1, 1)),   # wtma
       ("Q4_0", REGA[0]), ("NF4", REGA[0]),                                     # register A
       *[(f, REGA[1]) for f in ("Q4_0", "Q8_0", "Q6_K")]]
#: Q4_0's / AWQ's h2 decode (bf16x2) with the words by TMA, on the shared A buffer and on
#: register A (their defaults), and AWQ's with the words loaded by the threads
CASES += [*[(f, (8, 256, 5, 1, 1, 1, 0, 0, 2, 1)) for f in ("Q4_0", "AWQ")],
          ("AWQ", (4, 256, 4, 2, 1, 1)),
          ("Q4_0", (8, 256, 6, 2, 1, 1, 0, 0, 2, 1, 1)),
          ("AWQ", (8, 256, 5, 2, 1, 1, 0, 0, 2, 1, 1))]


@pytest.mark.cuda
@NEEDS_SM90
@pytest.mark.parametrize("fmt, launch", CASES, ids=_case_id)
def test_gluon_gemm_decodes_bit_exact(fmt, launch):
    """x = the bf16 identity [K, K]: out[m, n] = W[n, m] rounded once to bf16, for every
    weight of the edge rows (finite ones)."""
    args, n, k, want = _weight(fmt, np.random.default_rng(41), 128, edge=True)
    assert n % (16 * launch[0]) == 0
    x = torch.eye(k, dtype=torch.bfloat16, device=DEV)
    got = G.run_gluon_gemm(args[0], x, *args[1:4], args[4], k, n,
                           config=G.GluonGemmConfig(*launch))
    got = got.float().cpu().numpy().T
    fin = np.isfinite(want).all(axis=1)
    g, w = got[fin] + 0.0, _bf16(want[fin]) + 0.0
    bad = ~((g == w) | (np.isnan(g) & np.isnan(w)))
    rows, cols = np.nonzero(bad)
    assert not bad.any(), (f"{bad.sum()} of {bad.size} differ; (row % 16, k % 64) of the first: "
                           f"{sorted(set(zip(rows[:64] % 16, cols[:64] % 64)))[:24]}; "
                           f"got {g[bad][:4]}, want {w[bad][:4]}")
    same_bits(g, w)


@pytest.mark.cuda
@NEEDS_SM90
@pytest.mark.parametrize("fmt, launch", CASES, ids=_case_id)
def test_gluon_gemm_product(fmt, launch):
    """M = 200 rows (a partial x tile), N = 256, bf16 x (and f16 x for the first launch)
    through quant.run, against float64 torch on the dequantized weight."""
    from fuelgraph.backends.cuda.kernels import quant as K
    args, n, k, want = _weight(fmt, np.random.default_rng(7), 256)
    cfg = G.GluonGemmConfig(*launch)
    for dt in (torch.bfloat16, torch.float16)[:2 if launch == LAUNCHES[0] else 1]:
        x = torch.randn(200, k, generator=torch.Generator().manual_seed(3)).to(dt).to(DEV)
        assert G.gluon_ok(args[0], x, *args[1:4], args[4], k, n, cfg)
        check_product(K.run(*args[:1], x, *args[1:4], args[4], k, n, config=cfg), x, want.T, dt)


@pytest.mark.cuda
@NEEDS_SM90
def test_default_route_takes_gluon(monkeypatch):
    """The launches of quant.GLUON_GEMM that are Gluon ones (65..256 rows of bf16 x; the packed
    formats keep their packed GEMM up to 128 rows) take it by default (calls counted), with
    the right product; float32 x falls back; N = 192 runs 64-row tiles."""
    from fuelgraph.backends.cuda.kernels import quant as K
    calls = []
    real = K.run_gluon_gemm
    monkeypatch.setattr(K, "run_gluon_gemm", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    names = {GGUF_IDS[f]: f for f in ("Q4_0", "Q8_0", "Q4_K", "Q6_K")} | {AWQ: "AWQ", NF4: "NF4"}
    for fid, launches in K.GLUON_GEMM.items():
        args, n, k, want = _weight(names[fid], np.random.default_rng(5), 256)
        for m, cfg in launches.items():
            gluon = int(isinstance(cfg, G.GluonGemmConfig))
            x = torch.randn(m - 3, k, generator=torch.Generator().manual_seed(m)).to(DEV)
            before = len(calls)
            got = K.run(args[0], x.bfloat16(), *args[1:4], args[4], k, n)
            assert len(calls) == before + gluon
            check_product(got, x.bfloat16(), want.T, torch.bfloat16)
            check_product(K.run(args[0], x, *args[1:4], args[4], k, n), x, want.T, torch.float32)
            assert len(calls) == before + gluon
    # N = 192, a multiple of 64 only: the 128-row launches run 64-row tiles
    args, n, k, want = _weight("Q4_0", np.random.default_rng(6), 192)
    x = torch.randn(200, k, generator=torch.Generator().manual_seed(9)).bfloat16().to(DEV)
    before = len(calls)
    check_product(K.run(args[0], x, *args[1:4], args[4], k, n), x, want.T, torch.bfloat16)
    assert len(calls) == before + 1


@pytest.mark.cuda
@NEEDS_SM90
def test_split_k_is_deterministic_and_resets_its_counters():
    """Split K (two programs a tile meet in the kernel): the same bits on every call whichever
    program arrives first, the tile counters back at zero after each launch (the next one
    relies on it), including after a launch with a partial x tile and one with other tiles."""
    args, n, k, want = _weight("Q4_0", np.random.default_rng(8), 256)
    cfg = G.GluonGemmConfig(*SPLIT2)
    outs = []
    xs = torch.randn(256, k, generator=torch.Generator().manual_seed(1)).bfloat16().to(DEV)
    for m in (256, 200, 256, 256):
        x = xs[:m].contiguous()
        outs.append(G.run_gluon_gemm(args[0], x, *args[1:4], args[4], k, n, config=cfg))
        torch.cuda.synchronize()
        assert not _EAGER_COUNTERS[stream_key(x.device)].any()
    check_product(outs[0], xs, want.T, torch.bfloat16)
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[0], outs[3])
    assert torch.equal(outs[1], outs[0][:200])


@pytest.mark.cuda
@NEEDS_SM90
def test_split_k_launches_on_two_streams_at_once_keep_apart():
    """Split-K launches queued on two streams at once (each stream its own tile counters): the
    same bits as the launches one at a time, and each stream's counters back at zero."""
    args, n, k, want = _weight("Q4_0", np.random.default_rng(9), 256)
    cfg = G.GluonGemmConfig(*SPLIT2)
    gen = torch.Generator().manual_seed(2)
    xs = [torch.randn(256, k, generator=gen).bfloat16().to(DEV) for _ in range(2)]
    alone = [G.run_gluon_gemm(args[0], x, *args[1:4], args[4], k, n, config=cfg) for x in xs]
    streams = [torch.cuda.Stream() for _ in xs]
    torch.cuda.synchronize()
    outs = [[], []]
    for _ in range(8):
        for s, x, o in zip(streams, xs, outs):
            with torch.cuda.stream(s):
                o.append(G.run_gluon_gemm(args[0], x, *args[1:4], args[4], k, n, config=cfg))
    torch.cuda.synchronize()
    for s in streams:
        with torch.cuda.stream(s):
            assert not _EAGER_COUNTERS[stream_key(xs[0].device)].any()
    for a, o in zip(alone, outs):
        assert all(torch.equal(a, got) for got in o)
    check_product(alone[0], xs[0], want.T, torch.bfloat16)


@pytest.mark.cuda
@NEEDS_SM90
def test_register_a_launch_with_odd_steps_takes_the_shared_a_buffer():
    """K = 384 split in two: 3 steps a program, so the register-A launches take one step an
    iteration and the shared A buffer (`quant_gluon_rega.operand_path`), with fewer stages
    where the ring and the A buffers would not fit (`fit_stages`): the product is right."""
    from fuelgraph.backends.cuda.kernels import quant as K
    for fmt in ("Q4_0", "Q8_0"):
        args, n, k, want = _weight(fmt, np.random.default_rng(4), 256, k=384)
        x = torch.randn(256, k, generator=torch.Generator().manual_seed(2)).bfloat16().to(DEV)
        check_product(K.run(args[0], x, *args[1:4], args[4], k, n), x, want.T, torch.bfloat16)

