"""Test data for the quantized matmuls, written from the formats' layout descriptions (not from
fuelgraph's code): GGUF block bytes with chosen f16 scale fields, edge-case blocks, and reference
NF4 / AWQ (un)packing."""
import numpy as np

# GGUF: (block elements, block bytes, byte offsets of the block's f16 fields)
GGUF = {"Q4_0": (32, 18, (0,)), "Q4_1": (32, 20, (0, 2)), "Q5_0": (32, 22, (0,)),
        "Q5_1": (32, 24, (0, 2)), "Q8_0": (32, 34, (0,)), "Q2_K": (256, 84, (80, 82)),
        "Q3_K": (256, 110, (108,)), "Q4_K": (256, 144, (0, 2)), "Q5_K": (256, 176, (0, 2)),
        "Q6_K": (256, 210, (208,))}
# halves at the edges: zeros, the largest finite, the smallest subnormal and normal, inf, NaN
EDGE_HALVES = np.array([0.0, -0.0, 65504.0, -65504.0, 2.0 ** -24, -(2.0 ** -24), 2.0 ** -14,
                        1.0, np.inf, -np.inf, np.nan], np.float16)


def gguf_bytes(rng, qtype, n, k, scale=0.02):
    """Random block bytes of an [n, k] weight whose f16 fields are finite, |d| <= scale."""
    qk, bb, offs = GGUF[qtype]
    raw = rng.integers(0, 256, size=(n * k // qk, bb), dtype=np.uint8)
    for off in offs:
        d = rng.uniform(-scale, scale, size=raw.shape[0]).astype(np.float16)
        raw[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return raw.reshape(n, -1)


def gguf_edge_bytes(qtype):
    """One block per row, 256 rows: row i has every payload byte equal to i (so every nibble,
    crumb and bit value occurs in every position) and f16 fields cycling through EDGE_HALVES."""
    qk, bb, offs = GGUF[qtype]
    raw = np.repeat(np.arange(256, dtype=np.uint8)[:, None], bb, axis=1)
    for j, off in enumerate(offs):
        h = EDGE_HALVES[(np.arange(256) + 3 * j) % len(EDGE_HALVES)]
        raw[:, off:off + 2] = h.view(np.uint8).reshape(-1, 2)
    return raw, 256, qk


def same_bits(got, want):
    """Bit-identical float32 arrays, except that any NaN equals any NaN."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


# NF4: bitsandbytes' code book, as published (functional.py, create_normal_map / get_4bit_type)
NF4_PUBLISHED = [-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
                 -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
                 0.07958029955625534, 0.16093020141124725, 0.24611230194568634,
                 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                 0.7229568362236023, 1.0]


def nf4_reference(packed, absmax, block_size):
    """W [N, K]: byte j of a row holds element 2j in its high nibble, 2j+1 in its low one."""
    code = np.array(NF4_PUBLISHED, np.float32)
    n, half = packed.shape
    w = np.empty((n, 2 * half), np.float32)
    w[:, 0::2] = code[packed >> 4]
    w[:, 1::2] = code[packed & 15]
    return w * np.repeat(absmax, block_size, axis=1)


# AWQ (AutoAWQ GEMM): logical column 8c + ORDER[i] is stored in nibble i (bits 4i..4i+3) of
# word c; so logical column 8c + e is read from nibble REVERSE[e]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
AWQ_REVERSE = [0, 4, 1, 5, 2, 6, 3, 7]


def awq_unpack(packed):
    """int32 [R, C] -> int [R, 8C] codes, one nibble at a time."""
    u = packed.astype(np.int64) & 0xFFFFFFFF
    r, c = u.shape
    out = np.empty((r, 8 * c), np.int64)
    for col in range(8 * c):
        out[:, col] = (u[:, col // 8] >> (4 * AWQ_REVERSE[col % 8])) & 15
    return out


def awq_pack(codes):
    """int codes [R, 8C] in [0, 15] -> int32 [R, C]."""
    r, n = codes.shape
    word = np.zeros((r, n // 8), np.int64)
    for i in range(8):
        word |= codes[:, AWQ_ORDER[i]::8].astype(np.int64) << (4 * i)
    return word.astype(np.uint32).view(np.int32)


def awq_reference(qweight, qzeros, scales, group_size):
    """W [K, N] = (q - z) * s, computed in float64 (exact in float32)."""
    q = awq_unpack(qweight)
    z = np.repeat(awq_unpack(qzeros), group_size, axis=0)
    s = np.repeat(scales.astype(np.float64), group_size, axis=0)
    return ((q - z) * s).astype(np.float32)


def awq_case(rng, k, n, edge=False):
    """(qweight, qzeros, scales, group_size, reference W [N, K]) of random AutoAWQ tensors:
    group 128, or (edge) group 64 with random f16 bit patterns as scales (every finite
    magnitude and both signs)."""
    gs = 64 if edge else 128
    qw = rng.integers(-2 ** 31, 2 ** 31, size=(k, n // 8), dtype=np.int64).astype(np.int32)
    qz = rng.integers(-2 ** 31, 2 ** 31, size=(k // gs, n // 8), dtype=np.int64).astype(np.int32)
    if edge:
        bits = rng.integers(0, 0x7C00, size=(k // gs, n)) | (rng.integers(0, 2, (k // gs, n)) << 15)
        sc = bits.astype(np.uint16).view(np.float16)
    else:
        sc = rng.uniform(-0.05, 0.05, size=(k // gs, n)).astype(np.float16)
    return qw, qz, sc, gs, awq_reference(qw, qz, sc, gs).T
