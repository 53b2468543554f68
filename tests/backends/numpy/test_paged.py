"""NumPy kernels of the paged family, called directly on arrays: paged attention against the
float64 dense reference (several online-softmax chunks per sequence, block sizes 1 and 16,
shuffled blocks, GQA/MQA, ALiBi, softcap, Sq = 1 and Sq > 1, the four dtypes), the data errors
it raises, and the cache write in place and into a fresh buffer. The attention tests run both
paths (per sequence with an online softmax; the whole batch at once for short contexts)."""
import math

import numpy as np
import pytest

from fuelgraph import FuelGraphError
from fuelgraph.backends.numpy import paged as K
from registry.test_paged import NP, make_case, paged_reference, TORCH
from oracle import assert_flash_rule


def _run(case, **kw):
    args = [case[k] for k in ("q", "k_cache", "v_cache", "block_table", "context_lens")]
    if "alibi_slopes" in case:
        args.append(case["alibi_slopes"])
    kw.setdefault("softmax_scale", 1 / math.sqrt(case["q"].shape[3]))
    return K.paged_attn(*args, **kw)


def _ref(case, dtype=None, **kw):
    import torch
    return paged_reference(case["q"], case["k_cache"], case["v_cache"], case["block_table"],
                           case["context_lens"], case.get("alibi_slopes"),
                           kw.get("softmax_scale"), kw.get("softcap"),
                           TORCH[dtype] if dtype else torch.float64)


CASES = {
    "decode_bs16_gqa": dict(hq=8, hkv=2, bs=16, lens=(70, 33, 0), d=32),
    "decode_bs1_mqa": dict(hq=4, hkv=1, bs=1, lens=(21, 1, 9)),
    "decode_full_blocks": dict(B=2, hq=4, hkv=2, bs=4, lens=(8, 8)),   # no padding, no empty row
    "prefill_bs16": dict(hq=4, hkv=2, bs=16, sq=7, lens=(50, 7, 0)),
    "prefill_bs1": dict(hq=2, hkv=2, bs=1, sq=4, lens=(19, 4, 4), alibi=True),
}


@pytest.fixture(params=["per_sequence", "batched"])
def path(request, monkeypatch):
    """Both attention paths: per sequence and kv head with an online softmax (long contexts),
    and the whole batch in one pass (short contexts)."""
    if request.param == "per_sequence":
        monkeypatch.setattr(K, "BATCHED_MAX_ELEMS", 0)
    else:
        monkeypatch.setattr(K, "BATCHED_MAX_ELEMS", 1 << 30)
    return request.param


@pytest.mark.parametrize("chunk", [2048, 8])         # 8 keys: many online-softmax steps
@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name, chunk, path, monkeypatch):
    monkeypatch.setattr(K, "CHUNK_KEYS", chunk)
    case = make_case(np.random.default_rng(len(name) + chunk), **CASES[name])
    for kw in (dict(), dict(softcap=1.25, softmax_scale=0.4)):
        got = _run(case, **kw)
        assert got.dtype == np.float32 and got.shape == case["q"].shape
        np.testing.assert_allclose(got, _ref(case, **kw), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("dtype", list(NP))
def test_dtypes(dtype, path, monkeypatch):
    monkeypatch.setattr(K, "CHUNK_KEYS", 16)
    case = make_case(np.random.default_rng(9), dtype=dtype, bs=4, sq=3, lens=(30, 3, 0),
                     alibi=True, alibi_per_batch=True)
    got = _run(case, softcap=3.0)
    assert got.dtype == NP[dtype]
    ref = _ref(case, softcap=3.0)
    got = np.asarray(got, np.float64)
    if dtype in ("float32", "float64"):
        tol = 1e-12 if dtype == "float64" else 2e-6
        np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)
    else:
        assert_flash_rule(got, ref, _ref(case, dtype, softcap=3.0))


def test_only_live_blocks_are_read(path):
    """Table entries past a sequence's blocks may name anything (here ids far outside the pool)
    and the pool's other blocks may hold NaN: neither reaches the result."""
    case = make_case(np.random.default_rng(1), lens=(9, 5, 0), extra_blocks=4, mb=5)
    used = set(case["block_table"][case["block_table"] < 1000].tolist())
    for c in ("k_cache", "v_cache"):
        case[c] = case[c].copy()
        case[c][[b for b in range(case[c].shape[0]) if b not in used]] = np.nan
    case["block_table"] = case["block_table"].copy()
    case["block_table"][:, 3:] = -5
    got = _run(case)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _ref(case), rtol=2e-6, atol=2e-6)


def test_rows_past_a_length_inside_its_last_block_are_never_read():
    """The rows of a sequence's last block past its length hold NaN (stale or never written):
    a decode step (the whole batch at once, shorter sequences padded) keeps them out."""
    case = make_case(np.random.default_rng(4), hq=8, hkv=2, bs=16, lens=(37, 20, 5), d=16)
    for c in ("k_cache", "v_cache"):
        case[c] = case[c].copy()
        for b, n in enumerate(case["context_lens"].astype(np.int64)):
            last = case["block_table"][b, (n - 1) // 16]
            case[c][last, (n - 1) % 16 + 1:] = np.nan
    got = _run(case)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, _ref(case), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("lens,bad,msg", [
    ((5, 2), None, r"context_lens\[1\] = 2 is smaller than the 3 new"),
    ((5, 13), None, r"context_lens\[1\] = 13 exceeds max_blocks \* block_size = 3 \* 4 = 12"),
    ((5, 3), (1, 0, 40), r"block_table\[1, 0\] = 40 is not a block of the pool"),
])
def test_data_errors(lens, bad, msg, path):
    case = make_case(np.random.default_rng(2), B=2, sq=3, lens=(5, 3), mb=3)
    case["context_lens"] = np.asarray(lens, np.int32)
    if bad:
        case["block_table"] = case["block_table"].copy()
        case["block_table"][bad[0], bad[1]] = bad[2]
    with pytest.raises(FuelGraphError, match="paged_attn: " + msg):
        _run(case)


def test_cost_follows_the_table_capacity():
    c = K.paged_attn_cost([(2, 8, 1, 64), (10, 16, 2, 64), (10, 16, 2, 64), (2, 4), (2,)])
    assert c.flops == 4 * 2 * 8 * 64 * 64 and c.bytes > 2 * 2 * 2 * 64 * 64 * 2


def test_cache_write_in_place_and_into_out():
    rng = np.random.default_rng(0)
    cache = rng.standard_normal((3, 2, 2, 4)).astype(np.float32)
    new = rng.standard_normal((3, 2, 4)).astype(np.float32)
    slots = np.array([5, np.iinfo(np.uint32).max, 0], np.uint32)
    want = cache.copy().reshape(6, 2, 4)
    want[5], want[0] = new[0], new[2]
    out = np.empty_like(cache)
    r = K.paged_cache_write(cache, new, slots, out=out)
    assert r is out and np.array_equal(out.reshape(6, 2, 4), want)
    assert not np.array_equal(cache.reshape(6, 2, 4), want)          # input only read
    r = K.paged_cache_write(cache, new, slots)
    assert r is cache and np.array_equal(cache.reshape(6, 2, 4), want)
    with pytest.raises(FuelGraphError, match="outside the pool of 6 slots"):
        K.paged_cache_write(cache, new, np.array([6, 0, 1], np.int32))


def test_checked_remembers_frozen_arrays_and_their_frozen_views():
    """Index arrays are checked once while the same read-only array (or read-only row of a
    read-only array, as the cache prepares a decode loop's inputs) comes back."""
    from fuelgraph.backends.numpy.paged import _Checked, _frozen
    packed = np.arange(12, dtype=np.int32).reshape(3, 4).copy()
    assert not _frozen(packed) and not _frozen(packed[1])
    packed.flags.writeable = False
    row = packed[1]
    assert _frozen(packed) and _frozen(row)
    writable_base = np.arange(4, dtype=np.int32)
    view = writable_base[:2]
    view.flags.writeable = False
    assert not _frozen(view)                  # its base can still change
    c = _Checked()
    c.remember((row,), 7)
    assert c.seen((row,), 7) and not c.seen((row,), 8) and not c.seen((packed[1],), 7)
    c.remember((view,), 7)
    assert not c.seen((view,), 7)


def test_decode_layout_is_worked_out_once_per_step():
    """Layers of one decode step share the read-only table and lengths: the batch layout is
    reused (the same result as worked out afresh), and new lengths give a new one."""
    case = make_case(np.random.default_rng(5), hq=8, hkv=2, bs=16, lens=(37, 20, 5), d=16)
    for k in ("block_table", "context_lens"):
        case[k] = case[k].copy()
        case[k].flags.writeable = False
    first = _run(case)
    assert K._LAYOUT[0] is not None and K._LAYOUT[0][0][0] is case["block_table"]
    np.testing.assert_array_equal(_run(case), first)
    np.testing.assert_allclose(first, _ref(case), rtol=2e-6, atol=2e-6)
    case["context_lens"] = np.asarray((38, 21, 6), case["context_lens"].dtype)
    np.testing.assert_allclose(_run(case), _ref(case), rtol=2e-6, atol=2e-6)
