"""PAGED_ATTN (id 13) and PAGED_CACHE_WRITE (0x120) through the public API, against a float64
torch reference that lays each sequence's keys out densely (gathered through the block table in
logical order) and runs dense attention with the bottom-right causal mask: block sizes 1, 4 and
16, shuffled physical blocks, padded tables, MHA/GQA/MQA, ALiBi, softcap, Sq = 1 and Sq > 1,
int32/uint32 indices, the four float dtypes, the recipe against the kernel, and every error."""
import math
import zlib

import ml_dtypes
import numpy as np
import pytest
import torch

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph import FuelGraphError, FusedOps
from fuelgraph.registry.core import call_fused
from fuelgraph.registry.paged import PAGED_CACHE_WRITE
from oracle import assert_flash_rule

NP = {"float32": np.float32, "float64": np.float64, "bfloat16": ml_dtypes.bfloat16,
      "float16": np.float16}
TORCH = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
         "float16": torch.float16}
IDX = {"int32": np.int32, "uint32": np.uint32}


# ---- reference and case builder (also used by the backend and nn tests) --------------------
def _t(a, dtype=torch.float64):
    a = np.asarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        a = a.astype(np.float32)
    return torch.tensor(a).to(dtype)


def paged_reference(q, kc, vc, table, lens, alibi=None, scale=None, softcap=None,
                    dtype=torch.float64):
    """Dense attention on every sequence's keys gathered in logical order, computed in `dtype`
    (float64: the exact reference; a 16-bit dtype: the same-dtype reference of the 16-bit rule,
    through torch SDPA where it applies). Returns a float64 NumPy array [B, Hq, Sq, D]."""
    q, kc, vc = _t(q, dtype), _t(kc, dtype), _t(vc, dtype)
    B, hq, sq, d = q.shape
    nb, bs, hkv, _ = kc.shape
    g = hq // hkv
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    slopes = None if alibi is None else _t(alibi).reshape(-1, hq).expand(B, hq)
    out = torch.zeros(B, hq, sq, d, dtype=torch.float64)
    for b in range(B):
        n = int(lens[b])
        if n == 0:
            continue
        j = torch.arange(n)
        idx = torch.tensor(np.asarray(table[b], np.int64))[j // bs] * bs + j % bs
        k = kc.reshape(nb * bs, hkv, d)[idx].permute(1, 0, 2).repeat_interleave(g, 0)
        v = vc.reshape(nb * bs, hkv, d)[idx].permute(1, 0, 2).repeat_interleave(g, 0)
        pos = (n - sq + torch.arange(sq))[:, None]
        masked = j[None, :] > pos
        if softcap is None and dtype != torch.float64:
            bias = torch.zeros(hq, sq, n, dtype=dtype)
            if slopes is not None:
                bias = -(slopes[b][:, None, None] * (pos - j[None, :]).abs()).to(dtype)
            bias = bias.masked_fill(masked, -math.inf)
            o = torch.nn.functional.scaled_dot_product_attention(q[b], k, v, attn_mask=bias,
                                                                 scale=scale)
        else:
            s = q[b] @ k.transpose(-1, -2) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            if slopes is not None:
                s = s - (slopes[b][:, None, None] * (pos - j[None, :]).abs()).to(dtype)
            o = torch.softmax(s.masked_fill(masked, -math.inf), -1) @ v
        out[b] = o.double()
    return out.numpy()


def make_case(rng, B=3, hq=4, hkv=2, sq=1, d=16, bs=4, lens=(9, 0, 5), extra_blocks=3,
              dtype="float32", index="int32", mb=None, alibi=False, alibi_per_batch=False):
    """Random q and pools, each sequence's blocks at shuffled physical ids; unused table
    entries hold the index type's maximum."""
    lens = np.asarray(lens, np.int64)
    need = -(-lens // bs)
    mb = mb or max(1, int(need.max()) + 1)
    nb = int(need.sum()) + extra_blocks
    perm = rng.permutation(nb)
    pad = np.iinfo(IDX[index]).max
    table = np.full((B, mb), pad, np.int64)
    c = 0
    for b in range(B):
        table[b, :need[b]] = perm[c:c + need[b]]
        c += need[b]
    arr = lambda *s: rng.standard_normal(s).astype(NP[dtype])   # noqa: E731
    out = dict(q=arr(B, hq, sq, d), k_cache=arr(nb, bs, hkv, d), v_cache=arr(nb, bs, hkv, d),
               block_table=table.astype(IDX[index]), context_lens=lens.astype(IDX[index]))
    if alibi:
        sl = 2.0 ** -np.linspace(0.5, 4, hq)
        out["alibi_slopes"] = (np.stack([sl * (b + 1) for b in range(B)]) if alibi_per_batch
                               else sl).astype(np.float32)
    return out


def run(case, lower_all=False, **kw):
    ts = {k: fg.tensor(v) for k, v in case.items()}
    out = F.paged_attn(**ts, **kw)
    return np.asarray(fg.realize([out], lower_all=lower_all)[0], np.float64), out


def check(case, dtype, **kw):
    got, out = run(case, **kw)
    assert out.shape == case["q"].shape and out.dtype.name == dtype
    ref = paged_reference(case["q"], case["k_cache"], case["v_cache"], case["block_table"],
                          case["context_lens"], case.get("alibi_slopes"),
                          kw.get("softmax_scale"), kw.get("softcap"))
    scale = max(np.abs(ref).max(initial=0.0), 1.0)
    if dtype == "float64":
        assert np.abs(got - ref).max(initial=0) <= 1e-12 * scale
    elif dtype == "float32":
        assert np.abs(got - ref).max(initial=0) <= 2e-6 * scale
    else:
        same = paged_reference(case["q"], case["k_cache"], case["v_cache"], case["block_table"],
                               case["context_lens"], case.get("alibi_slopes"),
                               kw.get("softmax_scale"), kw.get("softcap"), TORCH[dtype])
        assert_flash_rule(got, ref, same)
    return got, ref


# ---- forward against the reference -------------------------------------------------------
SHAPES = {   # name: make_case keywords
    "decode_gqa_bs4": dict(),
    "decode_mha_bs1": dict(hq=2, hkv=2, bs=1, lens=(5, 1, 0)),
    "decode_mqa_bs16": dict(hq=4, hkv=1, bs=16, lens=(40, 17, 3)),
    "prefill_gqa_bs4": dict(sq=5, lens=(9, 5, 0)),
    "prefill_bs16_long": dict(sq=6, bs=16, lens=(37, 6, 16), d=8),
    "prefill_bs1_mqa": dict(hq=3, hkv=1, sq=3, bs=1, lens=(4, 3, 7)),
}


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("shape", list(SHAPES))
def test_forward_matches_reference(dtype, shape):
    rng = np.random.default_rng(zlib.crc32(f"{dtype}{shape}".encode()))
    check(make_case(rng, dtype=dtype, **SHAPES[shape]), dtype)


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("opts", ["alibi", "alibi_per_batch", "softcap", "alibi+softcap+scale"])
def test_alibi_softcap_scale(dtype, opts):
    rng = np.random.default_rng(7)
    case = make_case(rng, sq=3, lens=(11, 3, 0), dtype=dtype, alibi="alibi" in opts,
                     alibi_per_batch=opts == "alibi_per_batch")
    kw = {}
    if "softcap" in opts:
        kw["softcap"] = 1.5
    if "scale" in opts:
        kw["softmax_scale"] = 0.9
    check(case, dtype, **kw)


@pytest.mark.parametrize("index", list(IDX))
def test_index_dtypes_and_padding_never_read(index):
    rng = np.random.default_rng(3)
    case = make_case(rng, index=index, lens=(13, 4, 0), mb=6)
    got, _ = check(case, "float32")
    # padding entries hold the type's maximum: far outside the pool, never dereferenced
    assert (case["block_table"][:, 4:] == np.iinfo(IDX[index]).max).all()
    assert np.isfinite(got).all() and (got[2] == 0).all()


@pytest.mark.parametrize("B,sq", [(0, 1), (2, 0)])
def test_empty_batch_or_no_queries(B, sq):
    kc = np.ones((3, 4, 2, 8), np.float32)
    ts = [fg.tensor(np.zeros((B, 4, sq, 8), np.float32)), fg.tensor(kc), fg.tensor(kc),
          fg.tensor(np.zeros((B, 2), np.int32)), fg.tensor(np.full(B, 5, np.int32))]
    out = F.paged_attn(*ts)
    for lower_all in (False, True):
        assert fg.realize([out], lower_all=lower_all)[0].shape == (B, 4, sq, 8)


def test_default_scale_and_softcap_zero_is_off():
    rng = np.random.default_rng(4)
    case = make_case(rng)
    a, _ = run(case)
    b, _ = run(case, softmax_scale=1 / math.sqrt(16), softcap=0.0)
    np.testing.assert_array_equal(a, b)
    p = F.paged_attn(**{k: fg.tensor(v) for k, v in case.items()}, softcap=0).node.op.params
    assert p.softcap is None and p.softmax_scale == 1 / math.sqrt(16)


def test_sequences_are_independent_and_block_order_only_matters_through_the_table():
    rng = np.random.default_rng(5)
    case = make_case(rng, lens=(9, 7, 5), extra_blocks=0)
    got, _ = run(case)
    # move every block to another physical slot and rewrite the tables to match
    nb = case["k_cache"].shape[0]
    perm = rng.permutation(nb)
    moved = dict(case)
    moved["k_cache"] = np.empty_like(case["k_cache"])
    moved["v_cache"] = np.empty_like(case["v_cache"])
    moved["k_cache"][perm] = case["k_cache"]
    moved["v_cache"][perm] = case["v_cache"]
    t = case["block_table"].astype(np.int64)
    live = t < nb
    t[live] = perm[t[live]]
    moved["block_table"] = t.astype(case["block_table"].dtype)
    np.testing.assert_allclose(run(moved)[0], got, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("opts", [dict(), dict(sq=4, lens=(9, 4, 0), alibi=True)])
def test_recipe_matches_kernel(dtype, opts):
    rng = np.random.default_rng(11)
    case = make_case(rng, dtype=dtype, **opts)
    kern, _ = run(case, softcap=2.0)
    reci, _ = run(case, lower_all=True, softcap=2.0)
    tol = {"float64": 1e-12, "float32": 2e-6}.get(dtype, 2e-2)
    np.testing.assert_allclose(reci, kern, rtol=tol, atol=tol)


if hasattr(F, "flash_attn"):     # the dense op of the attention family, once it is merged
    @pytest.mark.parametrize("sq,alibi,softcap", [(1, False, None), (4, True, None),
                                                  (3, False, 2.0)])
    def test_equals_flash_attn_on_the_keys_laid_out_densely(sq, alibi, softcap):
        rng = np.random.default_rng(12)
        case = make_case(rng, sq=sq, lens=(11, sq, 7), alibi=alibi)
        got, _ = run(case, softcap=softcap)
        bs = case["k_cache"].shape[1]
        for b, n in enumerate(case["context_lens"].tolist()):
            j = np.arange(n)
            idx = case["block_table"][b].astype(np.int64)[j // bs] * bs + j % bs
            k, v = (c.reshape(-1, *c.shape[2:])[idx].transpose(1, 0, 2)[None]
                    for c in (case["k_cache"], case["v_cache"]))
            kw = dict(causal=sq > 1, softcap=softcap)
            if alibi:
                kw["alibi_slopes"] = fg.tensor(case["alibi_slopes"])
            dense = F.flash_attn(fg.tensor(case["q"][b:b + 1]), fg.tensor(np.ascontiguousarray(k)),
                                 fg.tensor(np.ascontiguousarray(v)), **kw)
            np.testing.assert_allclose(got[b:b + 1], np.asarray(dense.numpy(), np.float64),
                                       rtol=2e-6, atol=2e-6)


# ---- not differentiable -------------------------------------------------------------------
def test_gradient_raises():
    rng = np.random.default_rng(0)
    case = make_case(rng)
    ts = {k: fg.tensor(v) for k, v in case.items()}
    ts["q"] = fg.tensor(case["q"], requires_grad=True)
    out = F.paged_attn(**ts)
    assert fg.default_registry().entry(FusedOps.PAGED_ATTN).backward.kind == "not_differentiable"
    with pytest.raises(FuelGraphError, match="paged_attn: not differentiable"):
        out.sum().backward()


# ---- errors -------------------------------------------------------------------------------
def _tensors(case, **over):
    c = dict(case, **over)
    return {k: fg.tensor(v) for k, v in c.items() if v is not None}


BAD = [   # (override of the case, message)
    (dict(q=np.zeros((3, 4, 16), np.float32)), r"q has shape \(3, 4, 16\), expected rank 4"),
    (dict(q=np.zeros((3, 4, 1, 16), np.int32)), "q has dtype int32"),
    (dict(k_cache=np.zeros((8, 4, 2, 16), np.float64)), "k_cache has dtype float64, expected "
                                                        "float32"),
    (dict(v_cache=np.zeros((9, 4, 2, 16), np.float32)), "v_cache has shape"),
    (dict(k_cache=np.zeros((8, 4, 2, 8), np.float32), v_cache=np.zeros((8, 4, 2, 8), np.float32)),
     "head dim 8, expected 16"),
    (dict(k_cache=np.zeros((8, 4, 3, 16), np.float32), v_cache=np.zeros((8, 4, 3, 16), np.float32)),
     r"Hq % Hkv must be 0"),
    (dict(k_cache=np.zeros((0, 4, 2, 16), np.float32), v_cache=np.zeros((0, 4, 2, 16), np.float32)),
     "must be >= 1"),
    (dict(block_table=np.zeros((3, 4), np.int64)), "block_table has dtype int64, expected int32"),
    (dict(block_table=np.zeros((3, 4), np.float32)), "block_table has dtype float32"),
    (dict(context_lens=np.zeros((3,), np.uint8)), "context_lens has dtype uint8"),
    (dict(block_table=np.zeros((2, 4), np.int32)), "must have B = 3 rows"),
    (dict(context_lens=np.zeros((3, 1), np.int32)), "context_lens has shape"),
    (dict(block_table=np.zeros((3, 0), np.int32)), "max_blocks >= 1"),
    (dict(alibi_slopes=np.zeros(3, np.float32)), r"alibi_slopes has shape \(3,\)"),
    (dict(alibi_slopes=np.zeros(4, np.float16)), "alibi_slopes has dtype float16"),
]


@pytest.mark.parametrize("over,msg", BAD, ids=range(len(BAD)))
def test_build_time_errors(over, msg):
    case = make_case(np.random.default_rng(0), extra_blocks=0, lens=(5, 0, 3))
    with pytest.raises(FuelGraphError, match="paged_attn: .*" + msg):
        F.paged_attn(**_tensors(case, **over))


@pytest.mark.parametrize("kw,msg", [(dict(softmax_scale=float("nan")), "softmax_scale is nan"),
                                    (dict(softmax_scale="1"), "softmax_scale is '1'"),
                                    (dict(softcap=-1.0), "softcap is -1.0, expected a finite "
                                                         "number > 0"),
                                    (dict(softcap=float("inf")), "softcap is inf")])
def test_bad_params(kw, msg):
    case = make_case(np.random.default_rng(0))
    with pytest.raises(FuelGraphError, match="paged_attn: " + msg):
        F.paged_attn(**_tensors(case), **kw)


def test_arity():
    case = make_case(np.random.default_rng(0))
    ts = list(_tensors(case).values())
    with pytest.raises(FuelGraphError, match="paged_attn: expected 5 or 6 inputs, got 4"):
        call_fused(FusedOps.PAGED_ATTN, *ts[:4], softmax_scale=1.0)


DATA_BAD = [   # (context_lens, table tweak, Sq, message)
    ((5, 2, 3), None, 3, r"context_lens\[1\] = 2 is smaller than the 3 new query tokens"),
    ((5, 0, 13), None, 1, r"context_lens\[2\] = 13 exceeds max_blocks \* block_size = 3 \* 4"),
    ((5, 0, 3), (0, 1, 99), 1, r"block_table\[0, 1\] = 99 is not a block of the pool"),
    ((-1, 0, 3), None, 1, r"context_lens\[0\] = -1 is negative"),
]


@pytest.mark.parametrize("lens,tweak,sq,msg", DATA_BAD, ids=range(len(DATA_BAD)))
def test_invalid_lengths_raise_at_build_time_when_known(lens, tweak, sq, msg):
    case = make_case(np.random.default_rng(0), sq=sq, lens=(5, 0, 3), mb=3)
    case["context_lens"] = np.asarray(lens, np.int32)
    if tweak:
        case["block_table"] = case["block_table"].copy()
        case["block_table"][tweak[0], tweak[1]] = tweak[2]
    with pytest.raises(FuelGraphError, match="paged_attn: " + msg):
        F.paged_attn(**_tensors(case))
    # the same as a graph constant
    ts = _tensors(case)
    ts["context_lens"] = fg.const(case["context_lens"])
    with pytest.raises(FuelGraphError, match=msg):
        F.paged_attn(**ts)


@pytest.mark.parametrize("lens,tweak,sq,msg", DATA_BAD, ids=range(len(DATA_BAD)))
def test_invalid_lengths_raise_when_run_if_computed(lens, tweak, sq, msg):
    """Lengths computed in the graph are unknown at build time: the kernel raises when the
    graph runs; the recipe (which cannot raise on data) gives NaN rows, never a number."""
    case = make_case(np.random.default_rng(0), sq=sq, lens=(5, 0, 3), mb=3)
    if tweak:
        case["block_table"] = case["block_table"].copy()
        case["block_table"][tweak[0], tweak[1]] = tweak[2]
    ts = _tensors(case)
    ts["context_lens"] = fg.tensor(np.asarray(lens, np.int32)) + 0       # not known at build time
    if tweak:
        ts["block_table"] = ts["block_table"] + 0
    out = F.paged_attn(**ts)
    with pytest.raises(FuelGraphError, match=msg):
        out.numpy()
    low = fg.realize([out], lower_all=True)[0]
    bad = np.isnan(np.asarray(low, np.float64)).all(axis=(1, 2, 3))
    assert bad.any() and np.isfinite(np.asarray(low, np.float64)[~bad]).all()


# ---- cache write --------------------------------------------------------------------------
def _write_case(rng, dtype="float32", index="int32"):
    cache = rng.standard_normal((5, 4, 2, 8)).astype(NP[dtype])
    new = rng.standard_normal((4, 2, 8)).astype(NP[dtype])
    slots = np.array([17, 2, np.iinfo(IDX[index]).max, 8], IDX[index])
    return cache, new, slots


def _write_ref(cache, new, slots):
    out = cache.copy().reshape(20, 2, 8)
    for r, s in enumerate(slots.astype(np.int64)):
        if s != np.iinfo(slots.dtype).max:
            out[s] = new[r]
    return out.reshape(cache.shape)


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("index", list(IDX))
def test_cache_write_values(dtype, index):
    cache, new, slots = _write_case(np.random.default_rng(1), dtype, index)
    c = fg.tensor(cache)
    out = F.paged_cache_write(c, fg.tensor(new), fg.tensor(slots))
    want = _write_ref(cache, new, slots)
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(fg.realize([out], lower_all=True)[0], want)
    np.testing.assert_array_equal(c.numpy(), cache)          # value semantics: input unchanged


def test_cache_write_in_place_when_the_old_cache_is_dead():
    from fuelgraph.runtime.executor import compile_plan
    from fuelgraph.ir.tensor import bound_data
    cache, new, slots = _write_case(np.random.default_rng(2))
    pool = fg.tensor(cache) * 1.0                            # an intermediate buffer
    out = F.paged_cache_write(pool, fg.tensor(new), fg.tensor(slots)) + 0.0
    plan, ins = compile_plan([out.value])
    before = dict(plan.stats)
    got = plan.run([bound_data(n) for n in ins])[0]
    assert plan.stats.get("inplace_reused", 0) - before.get("inplace_reused", 0) == 1
    np.testing.assert_array_equal(got, _write_ref(cache, new, slots))


def test_cache_write_errors():
    cache, new, slots = _write_case(np.random.default_rng(3))
    c, n = fg.tensor(cache), fg.tensor(new)
    w = "paged_cache_write: "
    with pytest.raises(FuelGraphError, match=w + "slot_mapping holds 20, outside the pool of 20"):
        F.paged_cache_write(c, n, fg.tensor(np.array([20, 1, 2, 3], np.int32)))
    with pytest.raises(FuelGraphError, match=w + "slot_mapping writes slot 3 more than once"):
        F.paged_cache_write(c, n, fg.tensor(np.array([3, 1, 2, 3], np.int32)))
    with pytest.raises(FuelGraphError, match=w + "new has shape"):
        F.paged_cache_write(c, fg.tensor(new[:, :1]), fg.tensor(slots))
    with pytest.raises(FuelGraphError, match=w + "new has dtype float64"):
        F.paged_cache_write(c, fg.tensor(new.astype(np.float64)), fg.tensor(slots))
    with pytest.raises(FuelGraphError, match=w + "slot_mapping has dtype int64"):
        F.paged_cache_write(c, n, fg.tensor(slots.astype(np.int64)))
    with pytest.raises(FuelGraphError, match=w + r"slot_mapping has shape \(3,\)"):
        F.paged_cache_write(c, n, fg.tensor(slots[:3]))
    with pytest.raises(FuelGraphError, match=w + "cache has shape"):
        F.paged_cache_write(fg.tensor(cache[0]), n, fg.tensor(slots))
    # slots computed in the graph: the kernel raises when run, the recipe returns NaN
    out = F.paged_cache_write(c, n, fg.tensor(np.array([3, 1, 2, 3], np.int32)) + 0)
    with pytest.raises(FuelGraphError, match="more than once"):
        out.numpy()
    assert np.isnan(fg.realize([out], lower_all=True)[0]).all()
    assert fg.default_registry().entry(PAGED_CACHE_WRITE).destructive_inputs == (0,)
