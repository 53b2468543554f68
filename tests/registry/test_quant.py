"""QMATMUL (14), NF4_MATMUL (21), AWQ_MATMUL (25) and their activation-gradient helpers through
the public API: dequantization bit-exact with gguf-py (all ten GGUF types, random and edge
bytes) and with bitsandbytes' NF4 layout, AWQ against a packing reference written from AutoAWQ's
layout; products and gradients with respect to a vs torch on the dequantized weight in four
dtypes (kernel and lowered recipe); a .gguf file round trip; validation errors."""
import zlib

import gguf
import ml_dtypes
import numpy as np
import pytest
import torch

import fuelgraph as fg
import fuelgraph.functional as F
import fuelgraph.quant as Q
from fuelgraph import FuelGraphError
from fuelgraph import gguf as fg_gguf
from oracle import assert_close_dtype
from quant_cases import (GGUF, NF4_PUBLISHED, awq_pack, awq_reference, awq_unpack,
                         gguf_bytes, gguf_edge_bytes, nf4_reference, same_bits)

NP = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16,
      "float16": np.float16}
TORCH = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
         "float16": torch.float16}
TYPES = list(GGUF)


def _rng(*key):
    return np.random.default_rng(zlib.crc32(repr(key).encode()))


def _gguf_ref(raw, qtype):
    with np.errstate(all="ignore"):
        return gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[qtype])


def _check_product(got, a, w_as_b, dtype):
    """got vs torch: a @ B in float64 and in `dtype` (B rounded to dtype, as torch would)."""
    ta = torch.tensor(np.asarray(a, np.float64))
    tb = torch.tensor(np.asarray(w_as_b, np.float64))
    ref64 = (ta @ tb).numpy()
    same = (ta.to(TORCH[dtype]) @ tb.to(TORCH[dtype])).double().numpy()
    assert_close_dtype(got, ref64, same, dtype)


# ---- GGUF dequantization -----------------------------------------------------------------------
@pytest.mark.parametrize("qtype", TYPES)
def test_gguf_dequantize_bit_exact_random_bytes(qtype):
    """Any bytes, including f16 fields that decode to inf / NaN / subnormals."""
    qk, bb, _ = GGUF[qtype]
    n, k = 3, 2 * qk
    raw = _rng(qtype).integers(0, 256, size=(n, k // qk * bb), dtype=np.uint8)
    got = Q.dequantize_gguf(fg.tensor(raw), qtype, n, k).numpy()
    same_bits(got, _gguf_ref(raw, qtype))


@pytest.mark.parametrize("qtype", TYPES)
def test_gguf_dequantize_bit_exact_edge_bytes(qtype):
    """Every byte value in every payload position; zero, extreme, subnormal, inf, NaN scales."""
    raw, n, k = gguf_edge_bytes(qtype)
    same_bits(Q.dequantize_gguf(fg.tensor(raw), qtype, n, k).numpy(), _gguf_ref(raw, qtype))


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("qtype", TYPES)
def test_qmatmul_matches_torch(qtype, dtype):
    qk = GGUF[qtype][0]
    rng = _rng(qtype, dtype)
    n, k = 5, 2 * qk
    raw = gguf_bytes(rng, qtype, n, k)
    w = _gguf_ref(raw, qtype)
    a = rng.standard_normal((2, 3, k)).astype(NP[dtype])
    out = F.qmatmul(fg.tensor(a), fg.tensor(raw), qtype, n, k)
    assert out.shape == (2, 3, n) and out.dtype.name == dtype
    assert fg.explain(out).fused_ops == {"qmatmul": 1}
    got = out.numpy()
    assert got.dtype == NP[dtype]
    _check_product(got, a, w.T, dtype)
    _check_product(fg.realize([out], lower_all=True)[0], a, w.T, dtype)


def test_qmatmul_accepts_enum_lowercase_and_shapes():
    rng = _rng("enum")
    raw = gguf_bytes(rng, "Q4_K", 4, 256)
    a = fg.tensor(rng.standard_normal(256).astype(np.float32))
    ref = a.numpy() @ _gguf_ref(raw, "Q4_K").T
    for qt in ("Q4_K", "q4_k", gguf.GGMLQuantizationType.Q4_K, 12):
        out = F.qmatmul(a, fg.tensor(raw), qt, 4, 256)      # [N, bytes] or flat: either
        assert out.shape == (4,)
        np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)
    flat = F.qmatmul(a, fg.tensor(raw.reshape(-1)), "Q4_K", 4, 256)
    np.testing.assert_allclose(flat.numpy(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("qtype", ["Q4_0", "Q5_1", "Q3_K", "Q6_K"])
def test_qmatmul_grad_a_matches_torch(qtype, dtype):
    qk = GGUF[qtype][0]
    rng = _rng("grad", qtype, dtype)
    n, k = 6, qk
    raw = gguf_bytes(rng, qtype, n, k)
    w = _gguf_ref(raw, qtype)
    a = rng.standard_normal((4, k)).astype(NP[dtype])
    g = rng.standard_normal((4, n)).astype(NP[dtype])
    ta = fg.tensor(a, requires_grad=True)
    (ga,) = fg.grad([F.qmatmul(ta, fg.tensor(raw), qtype, n, k)], [ta], [fg.tensor(g)])
    assert ga.shape == a.shape and ga.dtype.name == dtype
    assert fg.explain(ga).fused_ops == {"qmatmul_grad_a": 1}
    _check_product(ga.numpy(), g, w, dtype)
    _check_product(fg.realize([ga], lower_all=True)[0], g, w, dtype)


def test_second_order_gradient_uses_the_forward():
    rng = _rng("second")
    raw = gguf_bytes(rng, "Q8_0", 4, 64)
    w = _gguf_ref(raw, "Q8_0").astype(np.float64)
    a = fg.tensor(rng.standard_normal((3, 64)), requires_grad=True)
    out = F.qmatmul(a, fg.tensor(raw), "Q8_0", 4, 64)
    (g1,) = fg.grad([(out * out).sum()], [a])
    (g2,) = fg.grad([(g1 * g1).sum()], [a])
    # g1 = 2 a W^T W, so d(sum g1^2)/da = 8 a (W^T W)^2
    m = w.T @ w
    np.testing.assert_allclose(g2.numpy(), 8 * a.numpy() @ m @ m, rtol=1e-10)


# ---- NF4 ---------------------------------------------------------------------------------------
def test_nf4_code_book_is_bitsandbytes():
    np.testing.assert_array_equal(Q.NF4_CODE, np.array(NF4_PUBLISHED, np.float32))


# produced by bitsandbytes 0.50.2: quantize_4bit(w, blocksize=32, quant_type="nf4") of this w
_BNB_W = bytes.fromhex(
    "000000000000803f000080bf0000003f000000bf0ad7233d0ad723bd0ad7a33ded43d5bf4affaf3e832f03bf"
    "ef70a93f533b5cbf82fd043f3bf0a1bf552f0ac07395de3e6ddcdd3f8327053ff84680bf9664893e9065443f"
    "9a7b983f0a2694bf5e3f323f90e8b33eaec504bd8df7573c53e32dbf30db1ebf3a65aa3f7b86843e0f85f6be"
    "7b791fc07c6660bf0c6901bf943da4bf3448aabf4074533fef257dbef88fd9bf4ae6aabf456a99befeb18e3f"
    "01d2c0bfcb88cb3fb082f9be6505dbbfe159033fa1f2b73f9e2063bed718263fa2c2a2be24de33bc5e2cd53f"
    "4252653fd6ee99bf172d33408fb682bf8a1d593faf04ff3ebdefacbd695a4f3eb4bc27bed424093cc573e9bb"
    "6a5f40bc5ebc9b3bcf538e3c011ab3ba24898b3c544267ba78237f3c57d81d3c7349ab3bf08a193c851e09bc"
    "318a803ae4a880bcbfce91bcca8a163cd962c3ba73c3243c4fbaab3ae44ffdbb071aed3cdb9e613c07bbe03a"
    "083a69395563873cb3f152bbe0c8793c4780d63b679158bcf18bf33b5912373c5710b33b51f31d3c663e613c"
    "cbfba0bb3ea4b83cbad4d33a389b083c4c7181bc0593253caa8aec3b9b3ebfbb39c1df3b2899a53b2f14243c"
    "548dea3b79a7b5bba9dd0f3a35278bbc3f0e61396dfda8bb5e1e2f3ca4f75b3cf224d23b0db597bc6eb5aa3b"
    "8b0735bc8d7a8f3b3d71cf3a7aad32bce63858bc9867093caca6ad3c")
_BNB_PACKED = bytes.fromhex(
    "7c2a5777194d3a209ea29bd2b97744d8504532b6226c2d519d6a67db3f3b9786a439d6d7db9b4721b6b84fc8"
    "7d6da3abacd5f8b1cb4bacb47175cda1a29822bf")
_BNB_ABSMAX = [2.1591389179229736, 2.7996270656585693, 0.028943074867129326,
               0.022539254277944565]


def test_nf4_quantize_matches_bitsandbytes_output():
    w = np.frombuffer(_BNB_W, np.float32).reshape(2, 64)
    packed, absmax = Q.quantize_nf4(w, block_size=32)
    assert packed.shape == (2, 32) and packed.dtype == fg.uint8
    assert packed.numpy().tobytes() == _BNB_PACKED
    np.testing.assert_array_equal(absmax.numpy().reshape(-1), np.float32(_BNB_ABSMAX))
    try:   # where bitsandbytes' CPU path is installed, compare with it live as well
        import bitsandbytes.functional as bnb
    except ImportError:
        return
    w2 = _rng("bnb").standard_normal((8, 128)).astype(np.float32)
    q, state = bnb.quantize_4bit(torch.tensor(w2), blocksize=64, quant_type="nf4")
    packed, absmax = Q.quantize_nf4(w2)
    np.testing.assert_array_equal(packed.numpy().reshape(-1), q.numpy().reshape(-1))
    np.testing.assert_array_equal(absmax.numpy().reshape(-1), state.absmax.numpy())
    same_bits(Q.dequantize_nf4(packed, absmax).numpy(), bnb.dequantize_4bit(q, state).numpy())


def test_nf4_dequantize_matches_layout_reference():
    rng = _rng("nf4deq")
    packed = rng.integers(0, 256, size=(5, 64), dtype=np.uint8)
    absmax = rng.uniform(0, 3, size=(5, 4)).astype(np.float32)
    absmax[0, 0] = 0.0
    got = Q.dequantize_nf4(fg.tensor(packed), fg.tensor(absmax), 32).numpy()
    same_bits(got, nf4_reference(packed, absmax, 32))


@pytest.mark.parametrize("dtype", list(NP))
def test_nf4_matmul_and_grad_match_torch(dtype):
    rng = _rng("nf4", dtype)
    n, k, bs = 6, 128, 64
    packed = rng.integers(0, 256, size=(n, k // 2), dtype=np.uint8)
    absmax = rng.uniform(0.1, 2, size=(n, k // bs)).astype(np.float32)
    w = nf4_reference(packed, absmax, bs)
    a = rng.standard_normal((2, 3, k)).astype(NP[dtype])
    ta = fg.tensor(a, requires_grad=True)
    out = F.nf4_matmul(ta, fg.tensor(packed), fg.tensor(absmax), block_size=bs)
    assert out.shape == (2, 3, n) and out.dtype.name == dtype
    _check_product(out.numpy(), a, w.T, dtype)
    _check_product(fg.realize([out], lower_all=True)[0], a, w.T, dtype)
    g = rng.standard_normal((2, 3, n)).astype(NP[dtype])
    (ga,) = fg.grad([out], [ta], [fg.tensor(g)])
    _check_product(ga.numpy(), g, w, dtype)
    _check_product(fg.realize([ga], lower_all=True)[0], g, w, dtype)


# ---- AWQ ---------------------------------------------------------------------------------------
def test_awq_quantize_packs_in_autoawq_order():
    rng = _rng("awqq")
    k, n, gs = 128, 32, 64
    w = rng.standard_normal((k, n)).astype(np.float32)
    qweight, qzeros, scales = Q.quantize_awq(w, gs)
    assert (qweight.shape, qzeros.shape, scales.shape) == ((k, n // 8), (k // gs, n // 8),
                                                           (k // gs, n))
    assert (qweight.dtype, qzeros.dtype, scales.dtype) == (fg.int32, fg.int32, fg.float16)
    q, z = awq_unpack(qweight.numpy()), awq_unpack(qzeros.numpy())
    np.testing.assert_array_equal(awq_pack(q), qweight.numpy())
    np.testing.assert_array_equal(awq_pack(z), qzeros.numpy())
    # AutoAWQ's zero-point rule on the stored fp16 scales
    g = w.reshape(k // gs, gs, n)
    s = scales.numpy().astype(np.float32)
    zr = np.clip(np.round(-g.min(axis=1) / s), 0, 15)
    np.testing.assert_array_equal(z, zr)
    qr = np.clip(np.round(g / s[:, None]) + zr[:, None], 0, 15).reshape(k, n)
    np.testing.assert_array_equal(q, qr)
    deq = awq_reference(qweight.numpy(), qzeros.numpy(), scales.numpy(), gs)
    assert np.abs(deq - w).max() <= 1.01 * s.max()      # within one step of the grid
    same_bits(Q.dequantize_awq(qweight, qzeros, scales, gs).numpy(), deq)


def test_awq_dequantize_random_words_matches_layout_reference():
    rng = _rng("awqdeq")
    qweight = rng.integers(-2 ** 31, 2 ** 31, size=(64, 4), dtype=np.int64).astype(np.int32)
    qzeros = rng.integers(-2 ** 31, 2 ** 31, size=(2, 4), dtype=np.int64).astype(np.int32)
    scales = rng.uniform(-1, 1, size=(2, 32)).astype(np.float16)
    got = Q.dequantize_awq(fg.tensor(qweight), fg.tensor(qzeros), fg.tensor(scales), 32)
    same_bits(got.numpy(), awq_reference(qweight, qzeros, scales, 32))


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("group_size", [32, -1])
def test_awq_matmul_and_grad_match_torch(dtype, group_size):
    rng = _rng("awq", dtype, group_size)
    k, n = 64, 16
    qweight = rng.integers(-2 ** 31, 2 ** 31, size=(k, n // 8), dtype=np.int64).astype(np.int32)
    gs = k if group_size == -1 else group_size
    qzeros = rng.integers(-2 ** 31, 2 ** 31, size=(k // gs, n // 8), dtype=np.int64)
    qzeros = qzeros.astype(np.int32)
    scales = rng.uniform(0.005, 0.05, size=(k // gs, n)).astype(np.float16)
    w = awq_reference(qweight, qzeros, scales, gs)
    a = rng.standard_normal((5, k)).astype(NP[dtype])
    ta = fg.tensor(a, requires_grad=True)
    out = F.awq_matmul(ta, fg.tensor(qweight), fg.tensor(qzeros), fg.tensor(scales), group_size)
    assert out.shape == (5, n) and out.dtype.name == dtype
    _check_product(out.numpy(), a, w, dtype)
    _check_product(fg.realize([out], lower_all=True)[0], a, w, dtype)
    g = rng.standard_normal((5, n)).astype(NP[dtype])
    (ga,) = fg.grad([out], [ta], [fg.tensor(g)])
    _check_product(ga.numpy(), g, w.T, dtype)


# ---- .gguf files -------------------------------------------------------------------------------
def test_gguf_file_round_trip(tmp_path):
    rng = _rng("file")
    path = tmp_path / "tiny.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_uint32("llama.block_count", 1)
    T = gguf.GGMLQuantizationType
    w40 = gguf.quants.quantize(rng.standard_normal((8, 64)).astype(np.float32), T.Q4_0)
    w80 = Q.quantize_gguf(rng.standard_normal((4, 96)).astype(np.float32), "Q8_0").numpy()
    w6k = gguf_bytes(rng, "Q6_K", 3, 256)
    experts = gguf_bytes(rng, "Q4_K", 2 * 4, 256).reshape(2, 4, -1)
    f32 = rng.standard_normal((3, 5)).astype(np.float32)
    f16 = rng.standard_normal(7).astype(np.float16)
    writer.add_tensor("w40", w40, raw_dtype=T.Q4_0)
    writer.add_tensor("w80", w80, raw_dtype=T.Q8_0)
    writer.add_tensor("w6k", w6k, raw_dtype=T.Q6_K)
    writer.add_tensor("experts", experts, raw_dtype=T.Q4_K)
    writer.add_tensor("f32", f32)
    writer.add_tensor("f16", f16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    f = fg_gguf.open_gguf(path)
    assert f.metadata["llama.block_count"] == 1
    np.testing.assert_array_equal(f.tensors["f32"].numpy(), f32)
    assert f.tensors["f16"].dtype == fg.float16
    np.testing.assert_array_equal(f.tensors["f16"].numpy(), f16)
    for name, raw, qt in (("w40", w40, "Q4_0"), ("w80", w80, "Q8_0"), ("w6k", w6k, "Q6_K"),
                          ("experts", experts, "Q4_K")):
        qw = f.tensors[name]
        assert qw.quant_type == qt
        w = _gguf_ref(raw, qt).reshape(qw.n, qw.k)
        same_bits(qw.dequantize().numpy(), w)
        a = rng.standard_normal((2, qw.k)).astype(np.float32)
        np.testing.assert_allclose(F.qmatmul(fg.tensor(a), *qw).numpy(), a @ w.T, rtol=1e-5,
                                   atol=1e-5)
        np.testing.assert_allclose(qw.matmul(fg.tensor(a)).numpy(), a @ w.T, rtol=1e-5,
                                   atol=1e-5)
    assert f.tensors["experts"].shape == (2, 4, 256) and f.tensors["experts"].n == 8


# ---- gradients of the weights, validation ------------------------------------------------------
def test_packed_weights_have_no_gradient():
    rng = _rng("nograd")
    packed, absmax = Q.quantize_nf4(rng.standard_normal((4, 64)).astype(np.float32))
    a = fg.tensor(rng.standard_normal((2, 64)).astype(np.float32), requires_grad=True)
    am = fg.tensor(absmax.numpy(), requires_grad=True)
    with pytest.raises(FuelGraphError, match="nf4_matmul: absmax is part of the quantized"):
        F.nf4_matmul(a, packed, am).sum().backward()
    qw, qz, sc = Q.quantize_awq(rng.standard_normal((64, 8)).astype(np.float32), 32)
    with pytest.raises(FuelGraphError, match="awq_matmul: scales is part of the quantized"):
        fg.grad([F.awq_matmul(a, qw, qz, sc, 32).sum()], [sc])
    with pytest.raises(FuelGraphError, match="requires_grad"):
        fg.tensor(packed.numpy(), requires_grad=True)
    # the activations still get theirs
    (ga,) = fg.grad([F.nf4_matmul(a, packed, absmax).sum()], [a])
    assert ga.shape == (2, 64)


def _gguf_args():
    raw = gguf_bytes(_rng("val"), "Q4_0", 4, 64)
    return fg.tensor(np.zeros((2, 64), np.float32)), fg.tensor(raw)


@pytest.mark.parametrize("call,match", [
    (lambda a, w: F.qmatmul(a, w, "Q9_9", 4, 64), "unknown or unsupported quant_type 'Q9_9'"),
    (lambda a, w: F.qmatmul(a, w, gguf.GGMLQuantizationType.IQ2_XXS, 4, 64), "quant_type"),
    (lambda a, w: F.qmatmul(a, w, "Q4_0", 5, 64), "holds 144 bytes, expected 180"),
    (lambda a, w: F.qmatmul(a, w.astype(fg.int32), "Q4_0", 4, 64), "w_bytes has dtype int32"),
    (lambda a, w: F.qmatmul(a, w, "Q4_K", 1, 64), "K = 64 is not a positive multiple of the Q4_K block of 256"),
    (lambda a, w: F.qmatmul(a, w, "Q4_0", 4, 48), "K = 48 is not a positive multiple of the Q4_0 block"),
    (lambda a, w: F.qmatmul(a[:, :32], w, "Q4_0", 4, 64), r"a has shape \(2, 32\), expected"),
    (lambda a, w: F.qmatmul(a.astype(fg.int32), w, "Q4_0", 4, 64), "a has dtype int32"),
    (lambda a, w: F.qmatmul(a, w, "Q4_0", True, 64), "param n must be an integer"),
    (lambda a, w: F.qmatmul(a, w, "Q4_0", 0, 64), "param n must be an integer >= 1"),
])
def test_qmatmul_validation(call, match):
    a, w = _gguf_args()
    with pytest.raises(FuelGraphError, match=match):
        call(a, w)


def _nf4_args():
    return (fg.tensor(np.zeros((2, 128), np.float32)), fg.tensor(np.zeros((3, 64), np.uint8)),
            fg.tensor(np.ones((3, 2), np.float32)))


@pytest.mark.parametrize("call,match", [
    (lambda a, p, s: F.nf4_matmul(a, p.astype(fg.int32), s), "w_packed has dtype int32"),
    (lambda a, p, s: F.nf4_matmul(a, p.reshape(-1), s), r"w_packed has shape \(192,\)"),
    (lambda a, p, s: F.nf4_matmul(a, p, s.astype(fg.float16)), "absmax has dtype float16"),
    (lambda a, p, s: F.nf4_matmul(a, p, s[:, :1]), r"absmax has shape \(3, 1\), expected \(3, 2\)"),
    (lambda a, p, s: F.nf4_matmul(a, p, s, block_size=48), "not a positive multiple of block_si"),
    (lambda a, p, s: F.nf4_matmul(a, p, s, block_size=0), "block_size must be an integer >= 1"),
    (lambda a, p, s: F.nf4_matmul(a[:, :64], p, s), "expected \\[..., 128\\]"),
    (lambda a, p, s: F.nf4_matmul(a.astype(fg.uint8), p, s), "a has dtype uint8"),
])
def test_nf4_validation(call, match):
    with pytest.raises(FuelGraphError, match=match):
        call(*_nf4_args())


def _awq_args():
    return (fg.tensor(np.zeros((2, 64), np.float32)), fg.tensor(np.zeros((64, 2), np.int32)),
            fg.tensor(np.zeros((2, 2), np.int32)), fg.tensor(np.ones((2, 16), np.float16)))


@pytest.mark.parametrize("call,match", [
    (lambda a, q, z, s: F.awq_matmul(a, q.astype(fg.uint32), z, s, 32), "qweight has dtype uint32"),
    (lambda a, q, z, s: F.awq_matmul(a, q, z.astype(fg.int64), s, 32), "qzeros has dtype int64"),
    (lambda a, q, z, s: F.awq_matmul(a, q, z, s.astype(fg.float32), 32), "scales has dtype float32"),
    (lambda a, q, z, s: F.awq_matmul(a, q, z, s, 64), r"qzeros has shape \(2, 2\), expected \(1, 2\)"),
    (lambda a, q, z, s: F.awq_matmul(a, q, z[:1], s, 32), r"qzeros has shape \(1, 2\)"),
    (lambda a, q, z, s: F.awq_matmul(a, q, z, s[:, :8], 32), r"scales has shape \(2, 8\)"),
    (lambda a, q, z, s: F.awq_matmul(a, q, z, s, 48), "not a positive multiple of group_size 48"),
    (lambda a, q, z, s: F.awq_matmul(a, q, z, s, 0), "group_size must be an integer >= 1"),
    (lambda a, q, z, s: F.awq_matmul(a[:, :32], q, z, s, 32), "expected \\[..., 64\\]"),
])
def test_awq_validation(call, match):
    with pytest.raises(FuelGraphError, match=match):
        call(*_awq_args())


def test_quantizer_errors():
    with pytest.raises(FuelGraphError, match="quantize_nf4"):
        Q.quantize_nf4(np.zeros((2, 48), np.float32))
    with pytest.raises(FuelGraphError, match="quantize_awq"):
        Q.quantize_awq(np.zeros((64, 12), np.float32), 32)
    with pytest.raises(FuelGraphError, match="no quantizer for Q4_K"):
        Q.quantize_gguf(np.zeros((2, 256), np.float32), "Q4_K")


def test_a_format_without_its_math_is_refused_when_declared():
    """Every GGUF format states its dequantization recipe and has a NumPy tile kernel: one
    missing either is a TypeError when the class is written, not a failure at run time."""
    from fuelgraph.backends.numpy.quant_gguf import _Format
    from fuelgraph.registry.quant_gguf import GGUFFormat
    with pytest.raises(TypeError, match="defines no recipe"):
        type("Q9_X", (GGUFFormat,), {"name": "Q9_X", "code": 99, "block": 32, "type_size": 9})
    with pytest.raises(TypeError, match="defines no tile"):
        type("Q9_X", (_Format,), {"name": "Q9_X", "block": 32, "type_size": 9})
