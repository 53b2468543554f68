"""The one-row GEMV on the repacked (chunk-layout) weight (`quant_packed`: Q4_0, Q8_0, Q4_K, Q6_K,
NF4, AWQ) and the few-row dots on it (`quant_packed_dot`): the packed copy decoded by the
kernel's own planes bit-exact with gguf-py / the NF4 and AWQ layout references on random and
edge bytes, the products against float64 torch on the dequantized weight (odd N, a split
reduction by atomics, with and without prefetch, several chunks a step), the cache (reused,
refreshed after an in-place change) and the routing of shapes the layout rejects (K not a
multiple of the chunk) to the storage-order kernels.

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
    from fuelgraph.backends.cuda.kernels.quant_tiles import AWQ, GGUF_IDS, NF4
    from fuelgraph.registry.quant import NF4_CODE

from quant_cases import (GGUF, awq_case, awq_reference, gguf_bytes, gguf_edge_bytes,
                         nf4_reference, same_bits)

CONFIGS = [None, "split", "noprefetch", "chunk1", "h1_nofma", "h4_x16", "stages", "aff"]
DTYPES = [torch.float32, torch.bfloat16, torch.float16] if HAS_CUDA else \
    [torch.float32, torch.bfloat16]


def _dtypes(kind):
    """Every dtype for the default launch, bfloat16 (and float32 in the interpreter) for the
    variants: each (dtype, variant) is a compile on the GPU."""
    return DTYPES if kind is None else DTYPES[1:2] if HAS_CUDA else DTYPES


def _cfg(kind):
    return {None: None, "split": P.PackedConfig(8, 1, split=2),
            "noprefetch": P.PackedConfig(16, 2, split=1, prefetch=0),
            "chunk1": P.PackedConfig(4, 1, split=1, num_warps=2),
            "h1_nofma": P.PackedConfig(8, 2, split=1, halves=1, fma=0),
            "h4_x16": P.PackedConfig(8, 2, split=2, halves=4, x32=0),
            "stages": P.PackedConfig(32, 2, split=1, num_warps=8, prefetch=0, stages=3),
            "shfl": P.PackedConfig(16, 4, split=0, num_warps=2, prefetch=0, x32=0, stages=3,
                                   shfl=1),
            "aff": P.PackedConfig(16, 4, split=0, num_warps=2, prefetch=0, x32=0, stages=3,
                                  aff=1)}[kind]


def _edge_rows(qtype, per_row):
    """The 256 edge blocks (every byte value, edge scales) as 256 rows of `per_row` blocks."""
    edge, _, qk = gguf_edge_bytes(qtype)
    idx = (np.arange(256)[:, None] + 37 * np.arange(per_row)[None, :]) % 256
    return edge[idx].reshape(256, -1), 256, per_row * qk


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_packed_gguf_bit_exact(qtype):
    qk, bb, _ = GGUF[qtype]
    e = P.CHUNK[GGUF_IDS[qtype]]
    rng = np.random.default_rng(bb)
    cases = [(gguf_bytes(rng, qtype, 3, 2 * max(e, qk)), 3, 2 * max(e, qk)),
             _edge_rows(qtype, max(1, e // qk))]
    for raw, n, k in cases:
        w = to_dev(raw.reshape(-1))
        pw = P.pack(GGUF_IDS[qtype], w, w, w, raw.shape[1], k, n)
        want = gguf_dequant_ref(raw, qtype)
        same_bits(P.dequantize_packed(pw, fma=0).cpu().numpy(), want)
        # the one-FMA form: the same values where the row's scales are finite (d * 0 is +0
        # there for either sign of d), non-finite elsewhere
        got = P.dequantize_packed(pw).cpu().numpy()
        if qtype in ("Q4_0", "Q4_K"):   # each plane's precomputed pair (`affine_pairs`)
            fin = np.isfinite(want).all(axis=1)
            aff = P.dequantize_packed(pw, aff=1).cpu().numpy()
            same_bits(aff[fin] + 0.0, want[fin] + 0.0)
        if qtype == "Q4_K":     # the same operations as gguf-py
            same_bits(got, want)
            continue
        at = 208 if qtype == "Q6_K" else 0      # f16 d of the block
        d = raw.reshape(n, -1, bb)[:, :, at:at + 2].copy().view(np.float16)[..., 0]
        finite = np.repeat(np.isfinite(d), qk, axis=1)                    # [N, K] by block
        same_bits(got[finite] + 0.0, want[finite] + 0.0)
        assert not np.isfinite(got[~finite]).any()


@pytest.mark.parametrize("block", [32, 64, 256])
def test_packed_nf4_bit_exact(block):
    rng = np.random.default_rng(block)
    n, k = 5, 512
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    absmax = rng.uniform(0, 3, size=(n, k // block)).astype(np.float32)
    absmax[0, 0] = 0.0
    code = torch.tensor(NF4_CODE, device=DEV)
    pw = P.pack(NF4, to_dev(packed), to_dev(absmax), code, block, k, n)
    same_bits(P.dequantize_packed(pw, code).cpu().numpy(), nf4_reference(packed, absmax, block))


@pytest.mark.parametrize("group", [32, 128])
def test_packed_awq_bit_exact(group):
    rng = np.random.default_rng(group)
    n, k = 24, 256
    qw = rng.integers(-2 ** 31, 2 ** 31, size=(k, n // 8), dtype=np.int64).astype(np.int32)
    qz = rng.integers(-2 ** 31, 2 ** 31, size=(k // group, n // 8), dtype=np.int64)
    qz = qz.astype(np.int32)
    sc = rng.uniform(-0.05, 0.05, size=(k // group, n)).astype(np.float16)
    pw = P.pack(AWQ, to_dev(qw), to_dev(qz), to_dev(sc), group, k, n)
    want = awq_reference(qw, qz, sc, group).T
    same_bits(P.dequantize_packed(pw, fma=0).cpu().numpy(), want)
    same_bits(P.dequantize_packed(pw, fma=1).cpu().numpy() + 0.0, want + 0.0)   # +0 for -0
    same_bits(P.dequantize_packed(pw, aff=1).cpu().numpy() + 0.0, want + 0.0)


@pytest.mark.parametrize("kind", CONFIGS)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_packed_gguf_gemv(qtype, kind):
    rng = np.random.default_rng(len(qtype) + len(str(kind)))
    n, k = 19, 2 * max(P.CHUNK[GGUF_IDS[qtype]], GGUF[qtype][0])
    raw = gguf_bytes(rng, qtype, n, k)
    w = gguf_dequant_ref(raw, qtype)
    for dt in _dtypes(kind):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(3)).to(dt).to(DEV)
        out = K.qmatmul(x, to_dev(raw.reshape(-1)), quant_type=qtype, n=n, k=k,
                        config=_cfg(kind) or "packed")
        check_product(out, x, w.T, dt)


@pytest.mark.parametrize("kind", CONFIGS + ["shfl"])
def test_packed_nf4_gemv(kind):
    rng = np.random.default_rng(7)
    n, k = 11, 768
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    absmax = rng.uniform(0.1, 2, size=(n, k // 64)).astype(np.float32)
    wn = nf4_reference(packed, absmax, 64)
    for dt in _dtypes(kind):
        x = torch.randn(1, k, generator=torch.Generator().manual_seed(1)).to(dt).to(DEV)
        out = K.nf4_matmul(x, to_dev(packed), to_dev(absmax), block_size=64,
                           config=_cfg(kind) or "packed")
        check_product(out, x, wn.T, dt)


@pytest.mark.parametrize("block,pair", [(32, 1), (128, 1), (64, 0)])
def test_packed_nf4_gemv_blocks(block, pair):
    """Blocks of 32 (absmax per plane) and 128 (one absmax for four planes, applied per pair),
    and the per-plane decoding forced on blocks of 64 (pair=0)."""
    rng = np.random.default_rng(block)
    n, k = 9, 512
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    absmax = rng.uniform(0.1, 2, size=(n, k // block)).astype(np.float32)
    wn = nf4_reference(packed, absmax, block)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)).to(DEV)
    out = K.nf4_matmul(x, to_dev(packed), to_dev(absmax), block_size=block,
                       config=P.PackedConfig(8, 2, split=1, pair=pair))
    check_product(out, x, wn.T, torch.float32)


@pytest.mark.parametrize("kind", CONFIGS)
def test_packed_awq_gemv(kind):
    rng = np.random.default_rng(8)
    n, k, gs = 40, 512, 64
    qw = rng.integers(-2 ** 31, 2 ** 31, size=(k, n // 8), dtype=np.int64).astype(np.int32)
    qz = rng.integers(-2 ** 31, 2 ** 31, size=(k // gs, n // 8), dtype=np.int64)
    qz = qz.astype(np.int32)
    sc = rng.uniform(-0.05, 0.05, size=(k // gs, n)).astype(np.float16)
    wa = awq_reference(qw, qz, sc, gs)
    for dt in _dtypes(kind):
        x = torch.randn(1, 1, k, generator=torch.Generator().manual_seed(2)).to(dt).to(DEV)
        out = K.awq_matmul(x, to_dev(qw), to_dev(qz), to_dev(sc), group_size=gs,
                           config=_cfg(kind) or "packed")
        assert out.shape == (1, 1, n)
        check_product(out[0], x[0], wa, dt)


def _entry(w):
    return [v[2] for key, v in P._CACHE.items() if key[0] == id(w)]


def test_default_route_and_cache():
    """One row takes the packed path by default; the copy is made once per weight (also when
    the weight arrives as a fresh view of the same memory every call) and made again after
    an in-place change; freeing the weight drops it."""
    rng = np.random.default_rng(12)
    n, k = 8, 256
    raw = gguf_bytes(rng, "Q4_0", n, k)
    w = to_dev(raw.reshape(-1))
    assert K.default_route(GGUF_IDS["Q4_0"], 1) == "packed"
    for fmt in (GGUF_IDS["Q4_0"], GGUF_IDS["Q4_K"], NF4, AWQ):
        assert K.default_route(fmt, 16) == K.DOT_16.get(fmt, "rows")
        assert K.default_route(fmt, 17) == ("rows" if fmt in (NF4, AWQ) else "tiles")
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(5)).to(DEV)
    check_product(K.qmatmul(x, w, quant_type="Q4_0", n=n, k=k), x,
                  gguf_dequant_ref(raw, "Q4_0").T, torch.float32)
    (first,) = _entry(w)
    K.qmatmul(x, w, quant_type="Q4_0", n=n, k=k)
    K.qmatmul(x, w.view(n, -1).reshape(-1), quant_type="Q4_0", n=n, k=k)    # a new view
    assert _entry(w) == [first] and _entry(w)[0] is first
    raw2 = gguf_bytes(rng, "Q4_0", n, k)
    w.copy_(to_dev(raw2.reshape(-1)))
    check_product(K.qmatmul(x, w, quant_type="Q4_0", n=n, k=k), x,
                  gguf_dequant_ref(raw2, "Q4_0").T, torch.float32)
    assert _entry(w)[0] is not first
    key = id(w)
    del w
    assert not any(kk[0] == key for kk in P._CACHE)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0"])
def test_unpackable_shapes_keep_the_row_kernels(qtype):
    """K not a multiple of the chunk (Q4_0 96, Q8_0 160): the packed route falls back."""
    qk = GGUF[qtype][0]
    n, k = 6, 3 * qk if qtype == "Q4_0" else 5 * qk
    assert not P.packable(GGUF_IDS[qtype], 0, k, n)
    raw = gguf_bytes(np.random.default_rng(k), qtype, n, k)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(6)).to(DEV)
    for cfg in (None, "packed"):
        out = K.qmatmul(x, to_dev(raw.reshape(-1)), quant_type=qtype, n=n, k=k, config=cfg)
        check_product(out, x, gguf_dequant_ref(raw, qtype).T, torch.float32)


def test_unpackable_groups():
    """NF4 blocks / AWQ groups of 16 elements are not multiples of a plane (32)."""
    assert not P.packable(NF4, 16, 512, 4)
    assert not P.packable(AWQ, 16, 512, 8)
    assert P.packable(NF4, 64, 512, 4) and P.packable(AWQ, 128, 512, 8)


# ---- few rows: tensor-core dots on the packed copy (quant_packed_dot) ------------------------
def _dot_cfg(m, variant="plain", split=None):
    """The dot kernel on 16 x 16 tiles; "pf_join": words loaded a step ahead and four planes
    side by side in one dot; "join8": all planes of a chunk in one dot; "nat" / "pf_nat8":
    the joined planes in K order (x read contiguously)."""
    from fuelgraph.backends.cuda.kernels.quant_packed_dot import PackedDotConfig
    extra = {"plain": {}, "pf_join": {"prefetch": 1, "join": 4}, "join8": {"join": 8},
             "nat": {"join": 4, "nat": 1}, "pf_nat8": {"prefetch": 1, "join": 8, "nat": 1},
             "aff": {"join": 4, "nat": 1, "aff": 1}, "aff_plain": {"aff": 1},
             "nat_shfl": {"join": 4, "nat": 1, "shfl": 1},
             "pf_nat_shfl": {"join": 4, "nat": 1, "shfl": 1, "prefetch": 1},
             "aff_r128": {"join": 4, "nat": 1, "aff": 1, "maxnreg": 128}}
    split = (2 if m > 16 else 0) if split is None else split
    return PackedDotConfig(block_n=16, block_m=16, chunks=1, split=split, **extra[variant])


def _dot_case(fmt, m, n=None):
    """(n, k, float64 reference W.T [K, N], fn(x, cfg)) of a random weight of the format."""
    rng = np.random.default_rng(m)
    if fmt in ("Q4_0", "Q8_0", "Q4_K", "Q6_K"):
        n, k = n or 19, 2 * P.CHUNK[GGUF_IDS[fmt]]
        raw = gguf_bytes(rng, fmt, n, k)
        ref = gguf_dequant_ref(raw, fmt).T
        return n, k, ref, lambda x, c: K.qmatmul(x, to_dev(raw.reshape(-1)), quant_type=fmt,
                                                 n=n, k=k, config=c)
    if fmt == "NF4":
        n, k = n or 11, 512
        packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
        absmax = rng.uniform(0.1, 2, size=(n, k // 64)).astype(np.float32)
        ref = nf4_reference(packed, absmax, 64).T
        return n, k, ref, lambda x, c: K.nf4_matmul(x, to_dev(packed), to_dev(absmax),
                                                    block_size=64, config=c)
    n, k, gs = n or 24, 256, 128
    qw = rng.integers(-2 ** 31, 2 ** 31, size=(k, n // 8), dtype=np.int64).astype(np.int32)
    qz = rng.integers(-2 ** 31, 2 ** 31, size=(k // gs, n // 8), dtype=np.int64).astype(np.int32)
    sc = rng.uniform(-0.05, 0.05, size=(k // gs, n)).astype(np.float16)
    ref = awq_reference(qw, qz, sc, gs)
    return n, k, ref, lambda x, c: K.awq_matmul(x, to_dev(qw), to_dev(qz), to_dev(sc),
                                                group_size=gs, config=c)


@pytest.mark.parametrize("variant", ["nat", "pf_nat8", "pf_join", "aff", "aff_r128",
                                     "nat_shfl", "pf_nat_shfl"])
@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "NF4", "AWQ"])
def test_packed_dot_even(fmt, variant):
    """Whole tiles (N = 32 on 16-row tiles, M = 16, the chunks split evenly): the kernel
    without bounds masks (planes in K order, or gathered x as the Q4_0 / Q8_0 default)."""
    dt = torch.float32 if INTERPRET else torch.bfloat16
    n, k, ref, fn = _dot_case(fmt, 16, n=32)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(9)).to(dt).to(DEV)
    fmt_id = {"NF4": NF4, "AWQ": AWQ}[fmt] if fmt in ("NF4", "AWQ") else GGUF_IDS[fmt]
    nch = k // P.CHUNK[fmt_id]          # one chunk a program: the steps divide evenly
    check_product(fn(x, _dot_cfg(16, variant, split=nch)), x, ref, dt)


@pytest.mark.parametrize("variant", ["plain", "pf_join", "join8", "nat", "aff", "aff_plain"])
@pytest.mark.parametrize("m", [3, 16, 20])
@pytest.mark.parametrize("fmt", ["Q4_0", "Q8_0", "Q4_K", "Q6_K", "NF4", "AWQ"])
def test_packed_dot(fmt, m, variant):
    """Odd N, M not a multiple of the 16-row tile (20: two x tiles, a split reduction)."""
    rng = np.random.default_rng(m)
    dt = torch.float32 if INTERPRET else torch.bfloat16
    if fmt in ("Q4_0", "Q8_0", "Q4_K", "Q6_K"):
        n, k = 19, 2 * P.CHUNK[GGUF_IDS[fmt]]
        raw = gguf_bytes(rng, fmt, n, k)
        ref = gguf_dequant_ref(raw, fmt).T
        fn = lambda x: K.qmatmul(x, to_dev(raw.reshape(-1)), quant_type=fmt, n=n, k=k,  # noqa
                                 config=_dot_cfg(m, variant))
    elif fmt == "NF4":
        n, k = 11, 512
        packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
        absmax = rng.uniform(0.1, 2, size=(n, k // 64)).astype(np.float32)
        ref = nf4_reference(packed, absmax, 64).T
        fn = lambda x: K.nf4_matmul(x, to_dev(packed), to_dev(absmax), block_size=64,  # noqa
                                    config=_dot_cfg(m, variant))
    else:
        n, k, gs = 24, 256, 128
        qw = rng.integers(-2 ** 31, 2 ** 31, size=(k, n // 8), dtype=np.int64).astype(np.int32)
        qz = rng.integers(-2 ** 31, 2 ** 31, size=(k // gs, n // 8), dtype=np.int64)
        sc = rng.uniform(-0.05, 0.05, size=(k // gs, n)).astype(np.float16)
        ref = awq_reference(qw, qz.astype(np.int32), sc, gs)
        fn = lambda x: K.awq_matmul(x, to_dev(qw), to_dev(qz.astype(np.int32)),  # noqa
                                    to_dev(sc), group_size=gs, config=_dot_cfg(m, variant))
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dt).to(DEV)
    check_product(fn(x), x, ref, dt)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_K", "AWQ", "Q6_K"])
def test_packed_dot_affine_bit_exact(fmt):
    """The (a, b) pairs of `affine_pairs` (and Q6_K's half-plane scales) decode every weight
    bit for bit as the format's dequantizer: x = the float32 identity, so out[m, n] = W[n, m]
    exactly (rows whose weights are all finite; random bytes and the edge blocks: every
    nibble, extreme scales)."""
    from fuelgraph.backends.cuda.kernels.quant_packed_dot import PackedDotConfig
    rng = np.random.default_rng(31)
    if fmt == "AWQ":
        n, k = 16, 512
        qw, qz, sc, gs, want = awq_case(rng, k, n, edge=True)      # every finite f16 scale
        fn = lambda x, c: K.awq_matmul(x, to_dev(qw), to_dev(qz), to_dev(sc),  # noqa: E731
                                       group_size=gs, config=c)
    else:
        e = P.CHUNK[GGUF_IDS[fmt]]
        raw, n, k = _edge_rows(fmt, max(1, e // GGUF[fmt][0]))
        raw = np.concatenate([raw, gguf_bytes(rng, fmt, 16, k)])
        n += 16
        want = gguf_dequant_ref(raw, fmt)
        fn = lambda x, c: K.qmatmul(x, to_dev(raw.reshape(-1)), quant_type=fmt,  # noqa: E731
                                    n=n, k=k, config=c)
    x = torch.eye(k, dtype=torch.float32).to(DEV)
    cfgs = [PackedDotConfig(64, 64, 1, 1, join=4, nat=1, aff=1)]    # the default's decoding
    if INTERPRET:       # (each a slow float32 compile on the GPU)
        cfgs += [PackedDotConfig(64, 64, 1, 1, aff=1)]
    for cfg in cfgs:
        got = fn(x, cfg).cpu().numpy().T                                   # [N, K]
        fin = np.isfinite(want).all(axis=1)
        same_bits(got[fin] + 0.0, want[fin] + 0.0)


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K"])
def test_few_rows_default_route(qtype):
    """2..16 rows of 16-bit x take the dots on the packed copy by default (float32 x and shapes
    the copy rejects take the tile kernels)."""
    rng = np.random.default_rng(21)
    qk = GGUF[qtype][0]
    for n, k in ((10, 512), (6, 3 * qk if qk == 32 else 2 * qk)):
        raw = gguf_bytes(rng, qtype, n, k)
        w = gguf_dequant_ref(raw, qtype)
        for dt in (torch.float16 if INTERPRET else torch.bfloat16, torch.float32):
            x = torch.randn(5, k, generator=torch.Generator().manual_seed(k)).to(dt).to(DEV)
            out = K.qmatmul(x, to_dev(raw.reshape(-1)), quant_type=qtype, n=n, k=k)
            check_product(out, x, w.T, dt)


@pytest.mark.parametrize("fmt", ["Q6_K", "NF4", "AWQ"])
def test_few_rows_default_route_other_formats(fmt):
    """5 rows by the default route (DOT_16's launch where the format has one, else its rows /
    tile kernels), 16-bit and float32 x."""
    n, k, ref, fn = _dot_case(fmt, 5)
    for dt in (torch.float16 if INTERPRET else torch.bfloat16, torch.float32):
        x = torch.randn(5, k, generator=torch.Generator().manual_seed(k)).to(dt).to(DEV)
        check_product(fn(x, None), x, ref, dt)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (CUDA graphs)")
@pytest.mark.parametrize("kind", [None, "split"])
def test_packed_gemv_in_a_cuda_graph(kind):
    """Warmed up once (the copy made outside), the one-row path captures and replays (also
    with a split-K launch)."""
    cfg = _cfg(kind)
    rng = np.random.default_rng(13)
    n, k = 64, 512
    raw = gguf_bytes(rng, "Q4_0", n, k)
    w = to_dev(raw.reshape(-1))
    x = torch.randn(1, k, device=DEV, dtype=torch.bfloat16)
    K.qmatmul(x, w, quant_type="Q4_0", n=n, k=k, config=cfg)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        K.qmatmul(x, w, quant_type="Q4_0", n=n, k=k, config=cfg)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = K.qmatmul(x, w, quant_type="Q4_0", n=n, k=k, config=cfg)
    x.copy_(torch.randn(1, k, device=DEV, dtype=torch.bfloat16))
    graph.replay()
    check_product(out, x, gguf_dequant_ref(raw, "Q4_0").T, torch.bfloat16)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (CUDA graphs)")
def test_packed_dot_aff_in_a_cuda_graph():
    """A graph captured before the weight's (a, b) pairs exist takes the per-plane scales (the
    pairs are not made inside the capture); made eagerly afterwards, they are used (split K:
    the atomics into a zeroed float32 output replay too)."""
    from fuelgraph.backends.cuda.kernels.quant_packed_dot import PackedDotConfig
    rng = np.random.default_rng(14)
    n, k = 64, 512
    raw = gguf_bytes(rng, "Q4_0", n, k)
    w = to_dev(raw.reshape(-1))
    ref = gguf_dequant_ref(raw, "Q4_0").T
    aff = PackedDotConfig(64, 16, 1, 2, 4, 1, join=4, nat=1, aff=1)
    x = torch.randn(16, k, device=DEV, dtype=torch.bfloat16)
    K.qmatmul(x, w, quant_type="Q4_0", n=n, k=k, config=PackedDotConfig(
        64, 16, 1, 2, 4, 1, join=4, nat=1))
    (pw,) = _entry(w)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side), torch.cuda.graph(graph):
        out = K.qmatmul(x, w, quant_type="Q4_0", n=n, k=k, config=aff)
    assert "affine" not in pw.extra
    x.copy_(torch.randn(16, k, device=DEV, dtype=torch.bfloat16))
    graph.replay()
    check_product(out, x, ref, torch.bfloat16)
    check_product(K.qmatmul(x, w, quant_type="Q4_0", n=n, k=k, config=aff), x, ref,
                  torch.bfloat16)
    assert "affine" in pw.extra
