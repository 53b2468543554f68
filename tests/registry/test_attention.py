"""FLASH_ATTN (12), FLASH_ATTN_BACKWARD_Q/K/V (22-24) and FLASH_ATTN_BACKWARD (0x111) through the
public API, against float64 torch references built from softmax(q k^T * scale + bias + mask) v
(and scaled_dot_product_attention where it applies): every option and their combinations,
Sq > Sk, Sq < Sk, Sq = 1, fully masked rows, GQA and MQA, k_len as an int and as a tensor, the
four dtypes (16-bit: FlashAttention's 2x rule), forward and all three gradients, second order,
recipe vs kernel, and every validation error at build time."""
import math

import numpy as np
import pytest
import torch

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph import FuelGraphError
from fuelgraph.registry.attention import FLASH_ATTN_BACKWARD, admissible, decode_mask
from fuelgraph.registry.core import BackwardKind, FusedOps, call_fused
from oracle import assert_flash_rule

NP = {"float32": np.float32, "float64": np.float64, "bfloat16": fg.bfloat16.np,
      "float16": np.float16}
TD = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16,
      "float16": torch.float16}


# ---- the reference (also used by the backend tests) -----------------------------------------
def reference(q, k, v, scale=None, causal=False, wl=None, wr=None, softcap=None, alibi=None,
              k_len=None):
    """Attention on torch tensors [B, H, S, D] in their own dtype, written as the math: keys
    >= k_len dropped, bottom-right aligned masks, rows without a key give 0 (and no
    gradient). Differentiable."""
    B, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    L = sk if k_len is None else int(k_len)
    scale = 1 / math.sqrt(d) if scale is None else scale
    kk = k[:, :, :L].repeat_interleave(hq // hkv, 1)
    vv = v[:, :, :L].repeat_interleave(hq // hkv, 1)
    s = (q @ kk.transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    a = torch.arange(sq)[:, None] + (L - sq)
    j = torch.arange(L)[None, :]
    if alibi is not None:
        sl = torch.as_tensor(np.asarray(alibi, np.float64)).to(s.dtype)
        sl = sl.reshape((1,) * (2 - sl.dim()) + tuple(sl.shape) + (1, 1))
        s = s - sl * (a - j).abs().to(s.dtype)
    adm = torch.ones(sq, L, dtype=torch.bool)
    if causal:
        adm &= j <= a
    if wl is not None:
        adm &= j >= a - wl
    if wr is not None:
        adm &= j <= a + wr
    live = adm.any(-1, keepdim=True)
    s = torch.where(live, s.masked_fill(~adm, -math.inf), 0.0)
    p = torch.softmax(s, -1) * live
    return p @ vv


def make(rng, B, hq, hkv, sq, sk, d, dtype="float64", scale=1.0):
    q = (rng.standard_normal((B, hq, sq, d)) * scale).astype(NP[dtype])
    k = (rng.standard_normal((B, hkv, sk, d)) * scale).astype(NP[dtype])
    v = rng.standard_normal((B, hkv, sk, d)).astype(NP[dtype])
    return q, k, v


def ours(q, k, v, kw, grad=None):
    """(out, dq, dk, dv) through the public API on NumPy inputs; kw may hold alibi (NumPy) and
    k_len ('t32'/'t64' + value: as a tensor)."""
    kw = dict(kw)
    if kw.get("alibi_slopes") is not None:
        kw["alibi_slopes"] = fg.tensor(np.asarray(kw["alibi_slopes"], np.float32))
    if isinstance(kw.get("k_len"), tuple):
        kind, n = kw["k_len"]
        kw["k_len"] = fg.tensor(np.asarray(n, np.int32 if kind == "t32" else np.int64))
    ts = [fg.tensor(x, requires_grad=grad is not None) for x in (q, k, v)]
    out = F.flash_attn(*ts, **kw)
    if grad is None:
        return (out.numpy(),)
    gs = fg.grad([(out * fg.tensor(grad)).sum()], ts)
    return tuple(fg.realize([out] + gs))


def theirs(q, k, v, kw, grad=None, dtype=torch.float64):
    """The same through `reference` in torch `dtype`."""
    kl = kw.get("k_len")
    kl = kl[1] if isinstance(kl, tuple) else kl
    ts = [torch.from_numpy(np.asarray(x, np.float64)).to(dtype).requires_grad_(grad is not None)
          for x in (q, k, v)]
    out = reference(*ts, scale=kw.get("softmax_scale"), causal=bool(kw.get("causal")),
                    wl=kw.get("window_size_left"), wr=kw.get("window_size_right"),
                    softcap=kw.get("softcap"), alibi=kw.get("alibi_slopes"), k_len=kl)
    if grad is None:
        return (out.detach().double().numpy(),)
    gs = torch.autograd.grad((out * torch.from_numpy(np.asarray(grad, np.float64)).to(dtype)).sum(),
                             ts)
    return tuple(t.detach().double().numpy() for t in (out,) + gs)


# (B, Hq, Hkv, Sq, Sk, D): GQA with Sq < Sk, MQA with Sq > Sk, Sq = 1, square MHA
SHAPES = [(2, 4, 2, 5, 7, 8), (1, 3, 1, 9, 4, 5), (2, 2, 2, 1, 6, 8), (1, 2, 2, 6, 6, 16)]
SLOPES4 = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
OPTS = [
    dict(),
    dict(causal=True),
    dict(window_size_left=2),
    dict(window_size_right=1),
    dict(window_size_left=1, window_size_right=0),
    dict(causal=True, window_size_left=2),
    dict(softcap=0.8, softmax_scale=2.0),
    dict(alibi_slopes="h"),
    dict(alibi_slopes="bh", causal=True),
    dict(k_len=3),
    dict(k_len=("t32", 2), causal=True),
    dict(k_len=("t64", 4), window_size_left=1, window_size_right=2),
    dict(causal=True, softcap=1.5, alibi_slopes="h", k_len=("t64", 3), window_size_left=3),
    dict(softmax_scale=None, causal=None, window_size_left=None, window_size_right=None,
         softcap=None, k_len=None, alibi_slopes=None),
]


def _resolve(opts, shape):
    B, hq, _, _, sk, _ = shape
    kw = dict(opts)
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = SLOPES4[:hq] * 4
    elif kw.get("alibi_slopes") == "bh":
        kw["alibi_slopes"] = np.stack([SLOPES4[:hq] * (b + 1) for b in range(B)])
    kl = kw.get("k_len")
    if isinstance(kl, int):
        kw["k_len"] = min(kl, sk)
    elif isinstance(kl, tuple):
        kw["k_len"] = (kl[0], min(kl[1], sk))
    return kw


def _close(got, want, tol):
    scale = max(np.abs(want).max(initial=0.0), 1.0)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol * scale)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("opts", OPTS, ids=lambda o: ",".join(sorted(o)) or "plain")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_gradients_vs_torch(shape, opts, dtype):
    rng = np.random.default_rng(hash((shape, str(opts))) % 2**32)
    kw = _resolve(opts, shape)
    q, k, v = make(rng, *shape, dtype=dtype)
    g = rng.standard_normal(q.shape).astype(NP[dtype])
    got = ours(q, k, v, kw, g)
    want = theirs(q, k, v, kw, g)
    assert got[0].dtype == NP[dtype] and got[0].shape == q.shape
    tol = 1e-10 if dtype == "float64" else 3e-5
    for name, a, b in zip(("out", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        _close(a, b, tol)


LOW_OPTS = [dict(), dict(causal=True), dict(softcap=1.0, window_size_left=2),
            dict(alibi_slopes="h", k_len=("t32", 5), causal=True)]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("opts", LOW_OPTS, ids=lambda o: ",".join(sorted(o)) or "plain")
@pytest.mark.parametrize("shape", [(2, 4, 2, 24, 40, 32), (1, 2, 1, 33, 17, 16)],
                         ids=lambda s: "x".join(map(str, s)))
def test_16bit_within_twice_torch_same_dtype_error(shape, opts, dtype):
    rng = np.random.default_rng(7)
    kw = _resolve(opts, shape)
    q, k, v = make(rng, *shape, dtype=dtype)
    g = rng.standard_normal(q.shape).astype(NP[dtype])
    got = ours(q, k, v, kw, g)
    want = theirs(q, k, v, kw, g)
    same = theirs(q, k, v, kw, g, dtype=TD[dtype])
    assert got[0].dtype == NP[dtype]
    for a, b, c in zip(got, want, same):
        assert_flash_rule(a, b, c, slack=1e-3)


def test_matches_torch_sdpa_where_it_applies():
    rng = np.random.default_rng(1)
    q, k, v = make(rng, 2, 4, 2, 6, 6, 8)
    tq, tk, tv = (torch.from_numpy(x) for x in (q, k, v))
    for causal in (False, True):
        want = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal,
                                                                enable_gqa=True)
        got = F.flash_attn(fg.tensor(q), fg.tensor(k), fg.tensor(v), causal=causal).numpy()
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-12, atol=1e-12)


def test_fully_masked_rows_give_zero_and_no_gradient():
    rng = np.random.default_rng(2)
    q, k, v = make(rng, 1, 2, 1, 7, 3, 4)         # Sq > Sk, causal: rows 0..3 see no key
    g = rng.standard_normal(q.shape)
    out, dq, dk, dv = ours(q, k, v, dict(causal=True), g)
    assert (out[:, :, :4] == 0).all() and (dq[:, :, :4] == 0).all()
    assert np.isfinite(out).all() and np.isfinite(dq).all()
    _close(out, theirs(q, k, v, dict(causal=True))[0], 1e-12)
    # no key at all (k_len = 0, static and at run time): zeros everywhere
    for kl in (0, ("t32", 0)):
        out, dq, dk, dv = ours(q, k, v, dict(k_len=kl), g)
        assert not out.any() and not dq.any() and not dk.any() and not dv.any()


def test_keys_past_k_len_are_never_read():
    rng = np.random.default_rng(3)
    q, k, v = make(rng, 1, 2, 2, 4, 9, 8)
    kb, vb = k.copy(), v.copy()
    kb[:, :, 5:] = np.nan
    vb[:, :, 5:] = np.inf
    g = rng.standard_normal(q.shape)
    want = theirs(q, k, v, dict(k_len=5, causal=True), g)
    for kl in (5, ("t64", 5)):
        got = ours(q, kb, vb, dict(k_len=kl, causal=True), g)
        for a, b in zip(got, want):
            _close(a, b, 1e-10)
        assert not got[2][:, :, 5:].any() and not got[3][:, :, 5:].any()


def test_run_time_k_len_reuses_one_plan():
    rng = np.random.default_rng(4)
    q, k, v = make(rng, 1, 2, 1, 3, 8, 4)
    outs = []
    for n in (8, 5, 3):
        t = F.flash_attn(fg.tensor(q), fg.tensor(k), fg.tensor(v), causal=True,
                         k_len=fg.tensor(np.int64(n)))
        outs.append(t.numpy())
        _close(outs[-1], theirs(q, k, v, dict(causal=True, k_len=n))[0], 1e-12)
    from fuelgraph.runtime.executor import STATS
    hits = STATS["plan_hits"]
    F.flash_attn(fg.tensor(q), fg.tensor(k), fg.tensor(v), causal=True,
                 k_len=fg.tensor(np.int64(6))).numpy()
    assert STATS["plan_hits"] == hits + 1


def test_run_time_k_len_out_of_range_raises_when_realized():
    rng = np.random.default_rng(5)
    q, k, v = make(rng, 1, 1, 1, 2, 4, 4)
    for n in (5, -1):
        t = F.flash_attn(fg.tensor(q), fg.tensor(k), fg.tensor(v), k_len=fg.tensor(np.int32(n)))
        with pytest.raises(FuelGraphError, match=r"flash_attn: k_len = .* outside \[0, Sk = 4\]"):
            t.numpy()
    # the recipe cannot raise: it answers NaN
    t = F.flash_attn(fg.tensor(q), fg.tensor(k), fg.tensor(v), k_len=fg.tensor(np.int32(7)))
    assert np.isnan(fg.realize([t], lower_all=True)[0]).all()


def test_flash_attn_backward_builds_three_ops_and_matches_autograd():
    rng = np.random.default_rng(6)
    q, k, v = make(rng, 2, 4, 2, 5, 6, 8)
    g = rng.standard_normal(q.shape)
    kw = dict(causal=True, softcap=2.0, alibi_slopes=SLOPES4, k_len=("t32", 5))
    want = theirs(q, k, v, kw, g)[1:]
    kw2 = dict(kw, alibi_slopes=fg.tensor(SLOPES4), k_len=fg.tensor(np.int32(5)))
    grads = F.flash_attn_backward(fg.tensor(q), fg.tensor(k), fg.tensor(v), fg.tensor(g), **kw2)
    assert [t.node.op.id for t in grads] == [22, 23, 24]
    rep = fg.explain(list(grads))          # the three ops run as one combined node
    assert rep.fused_ops == {"flash_attn": 1, "flash_attn_backward": 1}, rep.fused_ops
    assert rep.lowered == {"flash_attn_backward_q": 1, "flash_attn_backward_k": 1,
                           "flash_attn_backward_v": 1}
    for a, b in zip(fg.realize(list(grads)), want):
        _close(a, b, 1e-10)
    for a, b in zip(fg.realize(list(grads), lower_all=True), want):
        _close(a, b, 1e-10)


def test_autograd_dispatches_to_the_three_backward_ops():
    e = fg.default_registry().entry(FusedOps.FLASH_ATTN)
    assert e.backward == BackwardKind.fused(FusedOps.FLASH_ATTN_BACKWARD_Q)
    assert e.outputs == ("out", "lse")
    rng = np.random.default_rng(7)
    ts = [fg.tensor(x, requires_grad=True) for x in make(rng, 1, 2, 1, 3, 4, 8)]
    gs = fg.grad([F.flash_attn(*ts, causal=True).sum()], ts)
    assert [g.node.op.id for g in gs] == [22, 23, 24]
    assert fg.explain(gs).fused_ops == {"flash_attn": 1, "flash_attn_backward": 1}
    (gk,) = fg.grad([F.flash_attn(*ts).sum()], [ts[1]])
    assert gk.node.op.id == 23 and fg.explain(gk).lowered == {"flash_attn_backward_k": 1}


def test_the_three_ops_are_the_combined_ops_outputs():
    rng = np.random.default_rng(8)
    q, k, v = make(rng, 1, 4, 2, 5, 7, 8)
    g = rng.standard_normal(q.shape)
    kw = dict(softmax_scale=0.3, causal=True, window_size_left=None, window_size_right=None,
              softcap=None, k_len=None, has_alibi=False, k_len_input=False)
    tq, tk, tv, tg = (fg.tensor(x) for x in (q, k, v, g))
    out, lse = call_fused(FusedOps.FLASH_ATTN, tq, tk, tv, **kw)
    delta = (tg * out).sum(-1)
    both = call_fused(FLASH_ATTN_BACKWARD, tq, tk, tv, tg, lse, delta, **kw)
    sep = [call_fused(i, tq, tk, tv, tg, lse, delta, **kw) for i in (22, 23, 24)]
    for i, t in enumerate(sep):           # lowering gives the very combined node's outputs
        e = fg.default_registry().entry(22 + i)
        assert e.recipe_only == ("numpy", "cuda")
        (low,) = e.lower([tq, tk, tv, tg, lse, delta], t.node.op.params)
        assert low.value == both[i].value
    for a, b in zip(fg.realize(list(both)), fg.realize(sep)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(fg.realize(list(both), lower_all=True), fg.realize(sep)):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


def test_gradient_through_lse_too():
    """The row log-sum-exp output is differentiable as well (its cotangent enters delta)."""
    rng = np.random.default_rng(9)
    q, k, v = make(rng, 1, 2, 1, 4, 5, 8)
    w, u = rng.standard_normal(q.shape), rng.standard_normal(q.shape[:3])
    kw = dict(softmax_scale=0.5, causal=True, window_size_left=None, window_size_right=None,
              softcap=None, k_len=None, has_alibi=False, k_len_input=False)
    ts = [fg.tensor(x) for x in (q, k, v)]
    out, lse = call_fused(FusedOps.FLASH_ATTN, *ts, **kw)
    gs = fg.grad([(out * fg.tensor(w)).sum() + (lse * fg.tensor(u)).sum()], ts)
    tt = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
    s = (tt[0] @ tt[1].repeat_interleave(2, 1).mT) * 0.5
    s = s.masked_fill(torch.arange(5)[None] > torch.arange(4)[:, None] + 1, -math.inf)
    tout = torch.softmax(s, -1) @ tt[2].repeat_interleave(2, 1)
    loss = (tout * torch.from_numpy(w)).sum() + (torch.logsumexp(s, -1) * torch.from_numpy(u)).sum()
    for a, b in zip(fg.realize(gs), torch.autograd.grad(loss, tt)):
        _close(a, b.numpy(), 1e-10)


def test_second_order_vs_torch():
    rng = np.random.default_rng(10)
    q, k, v = make(rng, 1, 2, 1, 4, 5, 4)
    w, z = rng.standard_normal(q.shape), rng.standard_normal(q.shape)
    kw = dict(causal=True, softcap=1.5, window_size_left=2)
    ts = [fg.tensor(x) for x in (q, k, v)]
    (dq,) = fg.grad([(F.flash_attn(*ts, **kw) * fg.tensor(w)).sum()], [ts[0]])
    gg = fg.grad([(dq * fg.tensor(z)).sum()], ts)
    tt = [torch.from_numpy(x).requires_grad_() for x in (q, k, v)]
    tout = reference(*tt, causal=True, softcap=1.5, wl=2)
    (tdq,) = torch.autograd.grad((tout * torch.from_numpy(w)).sum(), tt[0], create_graph=True)
    tgg = torch.autograd.grad((tdq * torch.from_numpy(z)).sum(), tt)
    for a, b in zip(fg.realize(gg), tgg):
        _close(a, b.numpy(), 1e-9)


@pytest.mark.parametrize("dtype", list(NP))
@pytest.mark.parametrize("opts", [dict(causal=True, softcap=3.0, alibi_slopes="bh"),
                                  dict(window_size_left=1, k_len=("t32", 5)),
                                  dict(window_size_right=0, k_len=4)],
                         ids=["causal_softcap_alibi", "window_klen_tensor", "wr0_klen_int"])
def test_recipe_matches_kernel(dtype, opts):
    rng = np.random.default_rng(11)
    shape = (2, 4, 2, 6, 7, 8)
    kw = _resolve(opts, shape)
    q, k, v = make(rng, *shape, dtype=dtype)
    g = rng.standard_normal(q.shape).astype(NP[dtype])
    kw["alibi_slopes"] = None if kw.get("alibi_slopes") is None else \
        fg.tensor(np.asarray(kw["alibi_slopes"], np.float32))
    if isinstance(kw.get("k_len"), tuple):
        kw["k_len"] = fg.tensor(np.int32(kw["k_len"][1]))
    ts = [fg.tensor(x) for x in (q, k, v)]
    outs = [F.flash_attn(*ts, **kw)] + list(F.flash_attn_backward(*ts, fg.tensor(g), **kw))
    tol = {"float64": 1e-12, "float32": 2e-6}.get(dtype, 2e-2)
    for a, b in zip(fg.realize(outs), fg.realize(outs, lower_all=True)):
        _close(np.asarray(a, np.float64), np.asarray(b, np.float64), tol)


def test_default_scale_and_explicit_nones():
    rng = np.random.default_rng(12)
    q, k, v = make(rng, 1, 2, 2, 3, 4, 9)
    a = F.flash_attn(fg.tensor(q), fg.tensor(k), fg.tensor(v)).numpy()
    b = F.flash_attn(fg.tensor(q), fg.tensor(k), fg.tensor(v), None, None, False, None, None,
                     None, None).numpy()
    c = F.flash_attn(fg.tensor(q), fg.tensor(k), fg.tensor(v), softmax_scale=1 / 3).numpy()
    np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(a, c, rtol=1e-15)


def test_mask_codec():
    for kw in (dict(), dict(causal=True), dict(window_size_left=2, window_size_right=1),
               dict(causal=True, window_size_left=0), dict(k_len=6, causal=True)):
        adm = admissible(5, 7, **kw)
        assert np.array_equal(admissible(5, 7, **decode_mask(adm)), adm)
    with pytest.raises(ValueError, match="no admissible key"):
        decode_mask(admissible(6, 3, causal=True))
    with pytest.raises(ValueError, match="not a causal"):
        decode_mask(np.eye(4, dtype=bool)[::-1])


# ---- validation: every error at build time ---------------------------------------------------
def _t(shape, dtype=np.float32):
    return fg.tensor(np.zeros(shape, dtype))


Q, K = (1, 4, 3, 8), (1, 2, 5, 8)
BAD = [
    (dict(q=(4, 3, 8)), r"flash_attn: q has shape \(4, 3, 8\), expected rank 4"),
    (dict(k=(1, 2, 5)), r"flash_attn: k has shape \(1, 2, 5\), expected rank 4"),
    (dict(v=(1, 2, 6, 8)), r"flash_attn: v has shape \(1, 2, 6, 8\), expected \(1, 2, 5, 8\)"),
    (dict(k=(1, 2, 5, 4), v=(1, 2, 5, 4)), r"k has head dim 4, expected 8"),
    (dict(k=(2, 2, 5, 8), v=(2, 2, 5, 8)), r"k has batch 2, expected 1"),
    (dict(k=(1, 3, 5, 8), v=(1, 3, 5, 8)), r"q has 4 heads, not a multiple of the 3 heads"),
    (dict(kdt=np.float64), r"k has dtype float64, expected float32 \(same as q\)"),
    (dict(qdt=np.int32), r"q has dtype int32"),
    (dict(kw=dict(window_size_left=-1)), r"window_size_left must be None or an int >= 0"),
    (dict(kw=dict(window_size_right=1.5)), r"window_size_right must be None or an int >= 0"),
    (dict(kw=dict(softcap=0.0)), r"softcap must be None or a finite number > 0"),
    (dict(kw=dict(softcap=-2)), r"softcap must be None or a finite number > 0"),
    (dict(kw=dict(softmax_scale=math.inf)), r"softmax_scale must be a finite real number"),
    (dict(kw=dict(causal=1)), r"causal must be a bool"),
    (dict(alibi=((3,), np.float32)), r"alibi_slopes has shape \(3,\), expected \(4,\) or \(1, 4\)"),
    (dict(alibi=((4,), np.float64)), r"alibi_slopes has dtype float64, expected float32"),
    (dict(kw=dict(k_len=2.0)), r"k_len must be an int or a 0-d int32/int64 tensor"),
    (dict(kw=dict(k_len=6)), r"k_len = 6 is outside \[0, Sk = 5\]"),
    (dict(kw=dict(k_len=-1)), r"k_len = -1 is outside \[0, Sk = 5\]"),
    (dict(klen=((), np.float32)), r"k_len has shape \(\) and dtype float32, expected a 0-d"),
    (dict(klen=((1,), np.int32)), r"k_len has shape \(1,\) and dtype int32, expected a 0-d"),
]


@pytest.mark.parametrize("case,msg", BAD, ids=[m[:40] for _, m in BAD])
def test_validation_errors_at_build_time(case, msg):
    q = _t(case.get("q", Q), case.get("qdt", np.float32))
    k = _t(case.get("k", K), case.get("kdt", np.float32))
    v = _t(case.get("v", case.get("k", K)), case.get("kdt", np.float32))
    kw = dict(case.get("kw", {}))
    if "alibi" in case:
        kw["alibi_slopes"] = _t(*case["alibi"])
    if "klen" in case:
        kw["k_len"] = _t(*case["klen"])
    with pytest.raises(FuelGraphError, match=msg):
        F.flash_attn(q, k, v, **kw)


def test_backward_validation_errors():
    q, k = _t(Q), _t(K)
    with pytest.raises(FuelGraphError, match=r"flash_attn_backward: grad_out is \(1, 4, 3, 7\)"):
        F.flash_attn_backward(q, k, k, _t((1, 4, 3, 7)))
    with pytest.raises(FuelGraphError, match="grad_out must be a Tensor"):
        F.flash_attn_backward(q, k, k, np.zeros(Q))
    kw = dict(softmax_scale=1.0, causal=False, window_size_left=None, window_size_right=None,
              softcap=None, k_len=None, has_alibi=False, k_len_input=False)
    with pytest.raises(FuelGraphError, match=r"flash_attn_backward_q: lse is \(1, 4, 3\) "
                                             r"float64, expected \(1, 4, 3\) float32"):
        call_fused(22, q, k, k, q, _t(Q[:3], np.float64), _t(Q[:3]), **kw)
    with pytest.raises(FuelGraphError, match=r"flash_attn_backward_v: expected 7 inputs"):
        call_fused(24, q, k, k, q, _t(Q[:3]), _t(Q[:3]), **dict(kw, has_alibi=True))
    with pytest.raises(FuelGraphError, match="alibi_slopes must be a Tensor"):
        F.flash_attn(q, k, k, alibi_slopes=np.ones(4, np.float32))
