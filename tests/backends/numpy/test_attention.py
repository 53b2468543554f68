"""The NumPy attention kernels called directly against float64 torch references: the forward
(out and the row log-sum-exp) and the backward (dq, dk, dv in one pass), every option,
GQA/MQA, the tiling paths (several key and query blocks, head chunks, both thread splits,
the online-softmax rescale), the four dtypes, garbage past k_len, fully masked rows, empty
shapes, and the run-time k_len check."""
import math

import numpy as np
import pytest
import torch

from fuelgraph import FuelGraphError
from fuelgraph.backends.numpy import attention as A
from fuelgraph.backends.numpy import common
from oracle import assert_flash_rule
from registry.test_attention import NP, TD, reference

PARAMS = dict(softmax_scale=0.35, causal=False, window_size_left=None, window_size_right=None,
              softcap=None, k_len=None, has_alibi=False, k_len_input=False)


def run(q, k, v, go=None, alibi=None, k_len_tensor=None, **kw):
    """(out, lse, dq, dk, dv) from the kernels."""
    p = dict(PARAMS, **kw)
    opt = []
    if alibi is not None:
        opt.append(np.asarray(alibi, np.float32))
        p["has_alibi"] = True
    if k_len_tensor is not None:
        opt.append(np.asarray(k_len_tensor))
        p["k_len_input"] = True
    out, lse = A.flash_attn(q, k, v, *opt, **p)
    if go is None:
        return out, lse
    delta = (np.asarray(go, np.float64) * np.asarray(out, np.float64)).sum(-1).astype(lse.dtype)
    return (out, lse) + tuple(A.flash_attn_backward(q, k, v, go, lse, delta, *opt, **p))


def torch_ref(q, k, v, go, alibi=None, k_len=None, dtype=torch.float64, **kw):
    """(out, lse, dq, dk, dv) from `reference` in torch `dtype` (lse in float64)."""
    ts = [torch.from_numpy(np.asarray(x, np.float64)).to(dtype).requires_grad_() for x in (q, k, v)]
    rk = dict(scale=kw.get("softmax_scale", PARAMS["softmax_scale"]),
              causal=kw.get("causal", False), wl=kw.get("window_size_left"),
              wr=kw.get("window_size_right"), softcap=kw.get("softcap"), alibi=alibi, k_len=k_len)
    out = reference(*ts, **rk)
    gs = torch.autograd.grad((out * torch.from_numpy(np.asarray(go, np.float64)).to(dtype)).sum(),
                             ts)
    return (out.detach().double().numpy(), _lse64(q, k, **rk)) + \
        tuple(g.double().numpy() for g in gs)


def _lse64(q, k, scale, causal, wl, wr, softcap, alibi, k_len):
    """Row log-sum-exp over the admissible keys in float64 (+inf for an empty row)."""
    B, hq, sq, _ = q.shape
    sk = k.shape[2]
    L = sk if k_len is None else k_len
    kk = np.repeat(np.asarray(k, np.float64)[:, :, :L], hq // k.shape[1], axis=1)
    s = scale * np.asarray(q, np.float64) @ kk.transpose(0, 1, 3, 2)
    if softcap is not None:
        s = softcap * np.tanh(s / softcap)
    a = np.arange(sq)[:, None] + L - sq
    j = np.arange(L)[None, :]
    if alibi is not None:
        sl = np.asarray(alibi, np.float64)
        s = s - sl.reshape((1,) * (2 - sl.ndim) + sl.shape + (1, 1)) * np.abs(a - j)
    adm = np.ones((sq, L), bool)
    if causal:
        adm &= j <= a
    if wl is not None:
        adm &= j >= a - wl
    if wr is not None:
        adm &= j <= a + wr
    s = np.where(adm, s, -np.inf)
    with np.errstate(divide="ignore", invalid="ignore"):
        m = s.max(-1, initial=-np.inf)
        ms = np.where(np.isfinite(m), m, 0)
        lse = ms + np.log(np.exp(s - ms[..., None]).sum(-1))
    return np.where(adm.any(-1), lse, np.inf)


def data(rng, B, hq, hkv, sq, sk, d, dt="float64"):
    q = rng.standard_normal((B, hq, sq, d)).astype(NP[dt])
    k = rng.standard_normal((B, hkv, sk, d)).astype(NP[dt])
    v = rng.standard_normal((B, hkv, sk, d)).astype(NP[dt])
    go = rng.standard_normal((B, hq, sq, d)).astype(NP[dt])
    return q, k, v, go


def assert_all_close(got, want, tol):
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        a = np.asarray(a, np.float64)
        assert a.shape == b.shape, name
        np.testing.assert_array_equal(np.isinf(a), np.isinf(b), err_msg=name)
        fa, fb = np.where(np.isinf(b), 0, a), np.where(np.isinf(b), 0, b)
        scale = max(np.abs(fb).max(initial=0.0), 1.0)
        np.testing.assert_allclose(fa, fb, rtol=tol, atol=tol * scale, err_msg=name)


OPTS = [dict(), dict(causal=True), dict(window_size_left=3, window_size_right=2),
        dict(causal=True, window_size_left=40), dict(softcap=1.2), dict(alibi="h", causal=True),
        dict(alibi="bh", window_size_right=0), dict(k_len=20, causal=True),
        dict(k_len_tensor=np.int32(33), window_size_left=7),
        dict(causal=True, softcap=0.9, alibi="h", k_len_tensor=np.int64(50),
             window_size_left=30, window_size_right=5)]


def _opts(o, B, hq):
    o = dict(o)
    if o.get("alibi") == "h":
        o["alibi"] = np.linspace(0.02, 0.3, hq).astype(np.float32)
    elif o.get("alibi") == "bh":
        o["alibi"] = np.linspace(0.02, 0.3, B * hq).reshape(B, hq).astype(np.float32)
    return o


def _ref_kw(o):
    r = {k: v for k, v in o.items() if k not in ("k_len_tensor",)}
    if "k_len_tensor" in o:
        r["k_len"] = int(o["k_len_tensor"])
    return r


# shapes that cross several key blocks (256 or more keys) and query blocks, with GQA / MQA
SHAPES = [(1, 4, 2, 70, 300, 16), (2, 3, 1, 300, 90, 8), (1, 2, 2, 1, 520, 32)]


@pytest.mark.parametrize("opts", OPTS, ids=lambda o: ",".join(sorted(o)) or "plain")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_float64_vs_torch(shape, opts):
    rng = np.random.default_rng(0)
    q, k, v, go = data(rng, *shape)
    o = _opts(opts, shape[0], shape[1])
    assert_all_close(run(q, k, v, go, **o), torch_ref(q, k, v, go, **_ref_kw(o)), 1e-10)


@pytest.mark.parametrize("opts", OPTS[:2] + OPTS[-2:], ids=lambda o: ",".join(sorted(o)) or "plain")
def test_float32_vs_torch(opts, chunking):
    rng = np.random.default_rng(1)
    shape = (2, 4, 2, 130, 270, 16)
    q, k, v, go = data(rng, *shape, dt="float32")
    o = _opts(opts, shape[0], shape[1])
    got = run(q, k, v, go, **o)
    assert got[0].dtype == np.float32 and got[1].dtype == np.float32
    assert_all_close(got, torch_ref(q, k, v, go, **_ref_kw(o)), 2e-5)


@pytest.mark.parametrize("dt", ["bfloat16", "float16"])
def test_16bit_flash_rule(dt):
    rng = np.random.default_rng(2)
    shape = (1, 4, 2, 90, 200, 32)
    q, k, v, go = data(rng, *shape, dt=dt)
    o = dict(causal=True, softcap=2.0, alibi=np.full(4, 0.05, np.float32))
    got = run(q, k, v, go, **o)
    want = torch_ref(q, k, v, go, **o)
    same = torch_ref(q, k, v, go, dtype=TD[dt], **o)
    assert got[0].dtype == NP[dt] and got[1].dtype == np.float32
    for a, b, c in zip(got, want, same):
        if a is got[1]:
            np.testing.assert_allclose(a, b, rtol=1e-5)
            continue
        assert_flash_rule(a, b, c, slack=1e-3)


def test_thread_splits_and_head_chunks(monkeypatch):
    """Tiny tiles: many head chunks and query blocks; both backward thread splits (threads own
    heads / private dk, dv per thread) give the single-threaded result."""
    rng = np.random.default_rng(3)
    q, k, v, go = data(rng, 2, 6, 3, 40, 50, 8)
    base = run(q, k, v, go, causal=True)
    monkeypatch.setattr(A, "TILE_ELEMS", 64)
    monkeypatch.setattr(A, "BLOCK_K", 8)
    monkeypatch.setattr(A, "BLOCK_ROWS", 8)
    monkeypatch.setattr(A, "PARALLEL_MIN", 0)
    monkeypatch.setattr(A, "NUM_THREADS", 2)
    tiled = run(q, k, v, go, causal=True)
    for a, b in zip(tiled, base):
        np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-12)
    q1, k1, v1, go1 = data(rng, 1, 2, 1, 40, 50, 8)          # one head chunk: query split
    base1 = A.flash_attn(q1, k1, v1, **PARAMS)
    assert_all_close(run(q1, k1, v1, go1), torch_ref(q1, k1, v1, go1), 1e-10)
    np.testing.assert_allclose(A.flash_attn(q1, k1, v1, **PARAMS)[0], base1[0], rtol=1e-12)


def test_online_softmax_rescales_when_the_max_jumps(monkeypatch):
    """Scores growing along the keys: every key tile raises the running max past the
    threshold, and an ALiBi slope keeps rows far apart."""
    monkeypatch.setattr(A, "BLOCK_K", 16)
    monkeypatch.setattr(A, "TILE_ELEMS", 64)
    sk = 100
    q = np.ones((1, 1, 4, 2), np.float32)
    k = np.stack([np.arange(sk) * 0.5, np.zeros(sk)], -1).reshape(1, 1, sk, 2).astype(np.float32)
    v = np.random.default_rng(4).standard_normal((1, 1, sk, 2)).astype(np.float32)
    go = np.ones_like(q)
    for o in (dict(), dict(alibi=np.array([0.3], np.float32), causal=True)):
        assert_all_close(run(q, k, v, go, softmax_scale=1.0, **o),
                         torch_ref(q, k, v, go, softmax_scale=1.0, **o), 2e-5)


@pytest.mark.parametrize("dt", ["float32", "float64"])
def test_scores_far_below_zero(dt):
    """Every score near -120 (exp underflows float32) and one row block near +60: the forward
    without a max pass falls back to true maxima for the first and shifts for the second."""
    rng = np.random.default_rng(8)
    q = np.ones((1, 2, 6, 4), NP[dt])
    q[:, 1] = -1
    k = (-30 + 0.1 * rng.standard_normal((1, 1, 20, 4))).astype(NP[dt])
    v = rng.standard_normal((1, 1, 20, 4)).astype(NP[dt])
    go = np.ones_like(q)
    for o in (dict(), dict(causal=True, alibi=np.array([0.5, 0.2], np.float32))):
        assert_all_close(run(q, k, v, go, softmax_scale=1.0, **o),
                         torch_ref(q, k, v, go, softmax_scale=1.0, **o),
                         1e-4 if dt == "float32" else 1e-10)   # scores ~120: float32 digits


def test_garbage_past_k_len_and_empty_rows():
    rng = np.random.default_rng(5)
    q, k, v, go = data(rng, 1, 2, 1, 12, 30, 8)
    kb, vb = k.copy(), v.copy()
    kb[:, :, 10:] = np.nan
    vb[:, :, 10:] = np.inf
    for kw in (dict(k_len=10), dict(k_len_tensor=np.int64(10))):
        got = run(q, kb, vb, go, causal=True, **kw)
        assert_all_close(got, torch_ref(q, k, v, go, causal=True, k_len=10), 1e-10)
        assert not got[3][:, :, 10:].any() and not got[4][:, :, 10:].any()
        assert (got[0][:, :, :2] == 0).all() and np.isinf(got[1][:, :, :2]).all()
        assert (got[2][:, :, :2] == 0).all()


@pytest.mark.parametrize("shape", [(1, 2, 1, 0, 5, 4), (0, 2, 2, 3, 5, 4), (1, 2, 1, 3, 0, 4)])
def test_empty_shapes(shape):
    rng = np.random.default_rng(6)
    q, k, v, go = data(rng, *shape)
    out, lse, dq, dk, dv = run(q, k, v, go)
    assert out.shape == q.shape and lse.shape == q.shape[:3] and dk.shape == k.shape
    assert not out.any() and np.isinf(lse).all() and not dq.any() and not dk.any()


def test_run_time_k_len_out_of_range_raises():
    rng = np.random.default_rng(7)
    q, k, v, go = data(rng, 1, 1, 1, 2, 6, 4)
    for n in (7, -2):
        with pytest.raises(FuelGraphError, match=rf"flash_attn: k_len = {n} is outside"):
            run(q, k, v, k_len_tensor=np.int32(n))
        with pytest.raises(FuelGraphError, match=rf"flash_attn_backward: k_len = {n}"):
            A.flash_attn_backward(q, k, v, go, np.zeros(q.shape[:3]), np.zeros(q.shape[:3]),
                                  np.int64(n), **dict(PARAMS, k_len_input=True))


def test_blas_thread_limit_is_found_and_restored():
    """The per-thread OpenBLAS limit is applied around pool work and restored after; with a
    BLAS that has no per-thread count, the work still runs (unlimited) and the pooled GEMMs
    fall back to the process-wide limit."""
    calls = []
    fn = common._find_set_local()
    assert common.has_blas_single() == (fn is not None)
    if fn is None:
        assert common.blas_single(lambda: calls.append(1) or 7) == 7 and calls == [1]
        return
    before = fn(1)
    fn(before if before > 0 else 0)
    assert common.blas_single(lambda: calls.append(1) or 7) == 7
    after = fn(1)
    fn(after if after > 0 else 0)
    assert calls == [1] and after == before
    assert math.isfinite(common.NUM_THREADS)
