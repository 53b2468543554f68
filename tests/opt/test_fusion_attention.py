"""Attention as people write it fuses into exactly one flash_attn (and differentiates through
its backward ops: the three of one backward run as one combined node), with the same value and gradients as torch: the scale as a multiply
or a divide by sqrt(D); softmax in primitives or softmax_last_dim; masks built from constants
(triu/tril of a constant array as an additive mask, a where() or a masked fill; causal masks
from positions with fg.arange in their mirrored spellings, with and without the Sk - Sq
offset); sliding windows and top-left masks (decoded into windows / k_len); softcap; GQA
written by expanding k and v. A mask read from data is never fused (and stays correct); a
mask that leaves a row empty, or that no flash_attn setting reproduces, is not fused either,
and explain says why."""
import math

import numpy as np
import pytest
import torch

import fuelgraph as fg
import fuelgraph.functional as F

B, H, HKV, D = 1, 4, 2, 8
NEG = float("-inf")


def inputs(sq, sk, dtype=np.float64, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, sq, D)).astype(dtype)
    k = rng.standard_normal((B, HKV, sk, D)).astype(dtype)
    v = rng.standard_normal((B, HKV, sk, D)).astype(dtype)
    return q, k, v


def expand(x, lib):
    """repeat_kv written out: [B, Hkv, S, D] -> [B, H, S, D]."""
    b, h, s, d = x.shape
    return x.reshape(b, h, 1, s, d).expand(b, h, H // h, s, d).reshape(b, H, s, d)


def causal_bool(sq, sk, off=True):
    """Admissible keys: j <= i + (sk - sq) (bottom-right) or j <= i (top-left)."""
    return np.tril(np.ones((sq, sk), bool), (sk - sq) if off else 0)


def written(lib, q, k, v, mask=None, *, div=False, fused_softmax=False, cap=None):
    """The idiom on fuelgraph tensors (lib=fg) or torch tensors (lib=torch). `mask(s)` returns
    the masked scores."""
    s = q @ expand(k, lib).transpose(-1, -2)
    s = s / math.sqrt(D) if div else s * (1 / math.sqrt(D))
    if cap is not None:
        s = cap * (s / cap).tanh()
    if mask is not None:
        s = mask(s)
    if lib is fg:
        p = F.softmax_last_dim(s) if fused_softmax else s.softmax(-1)
    else:
        p = torch.softmax(s, -1)
    return p @ expand(v, lib)


def const_add(sq, sk):
    m = np.where(causal_bool(sq, sk), 0.0, NEG)
    return (lambda s: s + fg.const(m.astype(s.dtype.np))), (lambda s: s + torch.tensor(m))


def const_where(sq, sk):
    m = causal_bool(sq, sk)
    return (lambda s: fg.where(fg.const(m), s, NEG)), \
        (lambda s: s.masked_fill(~torch.tensor(m), NEG))


def const_fill(sq, sk):
    m = ~causal_bool(sq, sk)         # torch.triu(ones, diagonal=1)-style blocked positions
    return (lambda s: fg.where(fg.const(m), NEG, s)), \
        (lambda s: s.masked_fill(torch.tensor(m), NEG))


def iota(sq, sk, spelling, off=True, additive=False):
    """Causal masks from positions: i >= j, j <= i, j > i, i < j."""
    def cond(i, j):
        return {"ge": i >= j, "le": j <= i, "gt": j > i, "lt": i < j}[spelling]
    flip = spelling in ("gt", "lt")

    def fgmask(s):
        i = fg.arange(sq)[:, None]
        if off:
            i = i + (sk - sq)
        c = cond(i, fg.arange(sk)[None, :])
        if additive:
            return s + (fg.where(c, NEG, 0.0) if flip else fg.where(c, 0.0, NEG)).astype(s.dtype)
        return fg.where(c, NEG, s) if flip else fg.where(c, s, NEG)
    m = torch.tensor(causal_bool(sq, sk, off))
    return fgmask, (lambda s: s.masked_fill(~m, NEG))


def run_both(sq, sk, mask=None, dtype=np.float64, **kw):
    """(fuelgraph out, explain, dq dk dv) and the torch (out, grads)."""
    q, k, v = inputs(sq, sk, dtype)
    g = np.random.default_rng(9).standard_normal((B, H, sq, D)).astype(dtype)
    ts = [fg.tensor(x) for x in (q, k, v)]
    out = written(fg, *ts, None if mask is None else mask[0], **kw)
    rep = fg.explain(out)
    gs = fg.grad([(out * fg.tensor(g)).sum()], ts)
    grep = fg.explain(gs)
    tt = [torch.tensor(np.asarray(x, np.float64), requires_grad=True) for x in (q, k, v)]
    tkw = {x: y for x, y in kw.items() if x != "fused_softmax"}
    tout = written(torch, *tt, None if mask is None else mask[1], **tkw)
    tgs = torch.autograd.grad((tout * torch.tensor(np.asarray(g, np.float64))).sum(), tt)
    return (out.numpy(), fg.realize(gs), rep, grep), (tout.detach().numpy(),
                                                     [t.numpy() for t in tgs])


def assert_fused_and_equal(ours, ref, tol=1e-10):
    out, gs, rep, grep = ours
    assert rep.fused_ops == {"flash_attn": 1}, (rep.fused_ops, rep.near_misses)
    assert grep.fused_ops == {"flash_attn": 1, "flash_attn_backward": 1}, grep.fused_ops
    scale = lambda a: max(np.abs(a).max(), 1.0)  # noqa: E731
    np.testing.assert_allclose(out, ref[0], rtol=tol, atol=tol * scale(ref[0]))
    for a, b in zip(gs, ref[1]):
        np.testing.assert_allclose(a, b, rtol=tol, atol=tol * scale(b))


@pytest.mark.parametrize("kw", [dict(), dict(div=True), dict(fused_softmax=True),
                                dict(cap=3.0), dict(div=True, cap=0.7)],
                         ids=["mul", "div", "softmax_last_dim", "softcap", "div_softcap"])
def test_unmasked_spellings(kw):
    assert_fused_and_equal(*run_both(5, 7, **kw))


@pytest.mark.parametrize("sq,sk", [(5, 7), (6, 6), (1, 4)])
@pytest.mark.parametrize("make", [const_add, const_where, const_fill])
def test_constant_causal_masks(make, sq, sk):
    assert_fused_and_equal(*run_both(sq, sk, make(sq, sk)))


def test_constant_mask_with_fused_softmax_and_softcap():
    assert_fused_and_equal(*run_both(4, 6, const_fill(4, 6), fused_softmax=True))
    assert_fused_and_equal(*run_both(4, 6, const_add(4, 6), cap=2.5))


@pytest.mark.parametrize("additive", [False, True], ids=["where", "additive"])
@pytest.mark.parametrize("spelling", ["ge", "le", "gt", "lt"])
@pytest.mark.parametrize("sq,sk,off", [(5, 8, True), (6, 6, False), (6, 6, True), (3, 7, False)],
                         ids=["offset", "square", "square_offset0", "top_left"])
def test_causal_masks_from_positions(spelling, additive, sq, sk, off):
    assert_fused_and_equal(*run_both(sq, sk, iota(sq, sk, spelling, off, additive)))


def test_softcap_with_positions_mask():
    assert_fused_and_equal(*run_both(4, 9, iota(4, 9, "ge"), cap=1.5))


@pytest.mark.parametrize("wl,wr", [(2, 1), (3, None), (None, 2), (1, 0)])
def test_sliding_window_constant_masks_decode(wl, wr):
    from fuelgraph.registry.attention import admissible
    sq, sk = 6, 9
    m = admissible(sq, sk, window_size_left=wl, window_size_right=wr)
    mask = (lambda s: fg.where(fg.const(m), s, NEG)), \
        (lambda s: s.masked_fill(~torch.tensor(m), NEG))
    ours, ref = run_both(sq, sk, mask)
    assert_fused_and_equal(ours, ref)
    out = written(fg, *(fg.tensor(x) for x in inputs(sq, sk)), mask[0])
    node = fg.optimize([out]).outputs[0].node
    assert node.op.params.window_size_left == wl
    assert node.op.params.window_size_right == (None if wr == 0 else wr)
    assert node.op.params.causal == (wr == 0)


def test_top_left_constant_mask_becomes_k_len():
    m = causal_bool(3, 7, off=False)
    mask = (lambda s: fg.where(fg.const(m), s, NEG)), \
        (lambda s: s.masked_fill(~torch.tensor(m), NEG))
    ours, ref = run_both(3, 7, mask)
    assert_fused_and_equal(ours, ref)


def test_16bit_idiom_fuses():
    q, k, v = inputs(6, 6, np.float16)
    out = written(fg, *(fg.tensor(x) for x in (q, k, v)), iota(6, 6, "ge", off=False)[0])
    assert fg.explain(out).fused_ops == {"flash_attn": 1}
    want = written(torch, *(torch.tensor(x.astype(np.float64)) for x in (q, k, v)),
                   iota(6, 6, "ge", off=False)[1])
    np.testing.assert_allclose(out.numpy().astype(np.float64), want.numpy(), atol=2e-3)


def test_mask_from_data_is_never_fused():
    sq, sk = 5, 5
    m = np.where(causal_bool(sq, sk), 0.0, NEG)
    data = fg.tensor(m)             # same contents as the causal mask, but an input
    ts = [fg.tensor(x) for x in inputs(sq, sk)]
    out = written(fg, *ts, lambda s: s + data)
    rep = fg.explain(out)
    assert "flash_attn" not in rep.fused_ops
    assert "found input" in rep.near_misses["flash_attn"], rep.near_misses   # names the mask
    want = written(torch, *(torch.tensor(x) for x in inputs(sq, sk)),
                   lambda s: s + torch.tensor(m))
    np.testing.assert_allclose(out.numpy(), want.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("case", ["empty_rows_const", "empty_rows_positions", "not_a_band"])
def test_masks_flash_attn_cannot_reproduce_stay_unfused(case):
    sq, sk = (7, 4) if case != "not_a_band" else (5, 5)
    if case == "empty_rows_const":
        mask, why = const_where(sq, sk), "no admissible key"
    elif case == "empty_rows_positions":
        mask, why = iota(sq, sk, "ge"), "leaves a query row without a key"
    else:
        m = np.eye(sq, dtype=bool) | np.eye(sq, k=-2, dtype=bool)
        mask = (lambda s: fg.where(fg.const(m), s, NEG)), None
        why = "not a causal / sliding-window / k_len mask"
    ts = [fg.tensor(x) for x in inputs(sq, sk)]
    rep = fg.explain(written(fg, *ts, mask[0]))
    assert "flash_attn" not in rep.fused_ops
    assert why in rep.near_misses["flash_attn"], rep.near_misses


def test_probabilities_used_elsewhere_are_not_duplicated():
    ts = [fg.tensor(x) for x in inputs(4, 4)]
    s = ts[0] @ expand(ts[1], fg).transpose(-1, -2) * 0.5
    p = s.softmax(-1)
    out = p @ expand(ts[2], fg)
    rep = fg.explain([out, p.sum()])
    assert "flash_attn" not in rep.fused_ops
    assert "another consumer" in rep.near_misses["flash_attn"]
