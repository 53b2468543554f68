"""The attention family on the CUDA backend. Kernel level (a GPU, or TRITON_INTERPRET=1 on tiny
CPU shapes): the Triton forward (out, lse) and backward (dq, dk, dv) kernels against float64 torch references over every option, GQA/MQA, Sq > Sk and Sq < Sk, empty rows,
k_len static and at run time (NaN when out of range, garbage past it never read), strided
inputs; the kernels declare float64 unsupported. API level (a GPU): flash_attn and its
gradients through fuelgraph on device="cuda", float64 lowered to the recipe, and the written
attention idiom fused on the GPU."""
import math

import numpy as np
import pytest

from .cuda_oracle import HAS_CUDA, INTERPRET, KERNEL_TESTS, assert_half_and_f32_only, on_gpu, torch

import fuelgraph as fg  # noqa: E402
import fuelgraph.functional as F  # noqa: E402
from oracle import assert_flash_rule  # noqa: E402
from registry.test_attention import reference  # noqa: E402

if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import attention as K

DEV = "cuda" if HAS_CUDA else "cpu"
TD = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
PARAMS = dict(softmax_scale=0.4, causal=False, window_size_left=None, window_size_right=None,
              softcap=None, k_len=None, has_alibi=False, k_len_input=False)


def _run(q, k, v, go, alibi=None, k_len_tensor=None, **kw):
    """(out, lse, dq, dk, dv) from the Triton kernels."""
    p = dict(PARAMS, **kw)
    opt = []
    if alibi is not None:
        opt.append(alibi)
        p["has_alibi"] = True
    if k_len_tensor is not None:
        opt.append(k_len_tensor)
        p["k_len_input"] = True
    out, lse = K.flash_attn(q, k, v, *opt, **p)
    delta = (go.double() * out.double()).sum(-1).float()
    return (out, lse) + tuple(K.flash_attn_backward(q, k, v, go, lse, delta, *opt, **p))


def _ref(q, k, v, go, alibi=None, k_len=None, dtype=torch.float64, **kw):
    ts = [x.detach().cpu().to(dtype).requires_grad_() for x in (q, k, v)]
    out = reference(*ts, scale=kw.get("softmax_scale", PARAMS["softmax_scale"]),
                    causal=kw.get("causal", False), wl=kw.get("window_size_left"),
                    wr=kw.get("window_size_right"), softcap=kw.get("softcap"),
                    alibi=None if alibi is None else alibi.cpu().numpy(), k_len=k_len)
    gs = torch.autograd.grad((out * go.detach().cpu().to(dtype)).sum(), ts)
    return (out.detach().double(),) + tuple(g.double() for g in gs)


def _data(B, hq, hkv, sq, sk, d, dtype):
    g = torch.Generator().manual_seed(hq * 1000 + sq * 10 + sk)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(TD[dtype]).to(DEV)  # noqa
    return mk(B, hq, sq, d), mk(B, hkv, sk, d), mk(B, hkv, sk, d), mk(B, hq, sq, d)


def _check(got, want, dtype, same=None):
    for name, a, b in zip(("out", "dq", "dk", "dv"), (got[0],) + tuple(got[2:]), want):
        a = a.detach().cpu().double()
        assert a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        if dtype == "float32":
            scale = max(b.abs().max().item(), 1.0)
            torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5 * scale, msg=name)
        else:
            assert_flash_rule(a.numpy(), b.numpy(), same[("out", "dq", "dk", "dv").index(name)]
                              .numpy(), slack=2e-3)


@pytest.fixture(autouse=True, scope="module")
def _one_config_per_flag_set():
    """No autotuning in tests: every flag set and head dim is a compile of each kernel, so the
    GPU run keeps to one config each (the benchmark tunes)."""
    if not (HAS_CUDA or INTERPRET):
        yield
        return
    old, K.TUNE = K.TUNE, False
    yield
    K.TUNE = old


OPTS = [dict(), dict(causal=True), dict(window_size_left=5, window_size_right=0),
        dict(window_size_right=3), dict(softcap=0.7, causal=True), dict(alibi=True),
        dict(k_len=15, causal=True), dict(k_len_tensor=14, window_size_left=6),
        dict(causal=True, softcap=1.1, alibi=True, k_len_tensor=17, window_size_left=9,
             window_size_right=2)]


#: bands a few tiles wide (interpreter tiles are 16 x 16, GPU ones up to 128 x 128): masked
#: edge tiles on both sides of unmasked ones
_W = 300 if HAS_CUDA else 40
BANDS = [dict(causal=True, window_size_left=_W),
         dict(window_size_left=_W - 7, window_size_right=20),
         dict(causal=True, window_size_left=_W - 3, alibi=True, softcap=1.3),
         dict(causal=True, softmax_scale=-0.3)]


def _opts(o, B, hq, sk):
    o = dict(o)
    if o.get("alibi"):
        o["alibi"] = torch.linspace(0.05, 0.4, hq, dtype=torch.float32, device=DEV)
    if "k_len" in o:
        o["k_len"] = min(o["k_len"], sk)
    if "k_len_tensor" in o:
        o["k_len_tensor"] = torch.tensor(min(o["k_len_tensor"], sk), dtype=torch.int32,
                                         device=DEV)
    return o


def _ref_kw(o):
    r = dict(o)
    if "k_len_tensor" in r:
        r["k_len"] = int(r.pop("k_len_tensor"))
    return r


def _cases():
    """(shape, opts): every option on each shape under the interpreter (tiny shapes, BLOCK 16,
    several query and key blocks all the same); on a GPU every option on one shape and the
    other shapes (head dims 128 and 96, MQA, Sq < Sk) causal only -- each head dim and flag set
    is a compile."""
    if not HAS_CUDA:
        shapes = [(1, 2, 1, 37, 21, 8), (1, 2, 2, 9, 40, 24), (1, 1, 1, 1, 33, 16)]
        return [(s, o) for s in shapes for o in OPTS] + \
            [((1, 2, 1, 70, 90, 8), o) for o in BANDS]
    return [((2, 8, 2, 300, 700, 64), o) for o in OPTS] + \
        [((1, 4, 4, 1000, 1000, 128), OPTS[1]), ((2, 4, 1, 257, 129, 96), OPTS[1]),
         ((1, 2, 1, 1, 900, 64), OPTS[1])] + [((1, 4, 2, 1000, 1200, 64), o) for o in BANDS]


@KERNEL_TESTS
@pytest.mark.parametrize("shape,opts", _cases(),
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple)
                         else ",".join(sorted(x)) or "plain")
def test_float32_vs_torch(shape, opts):
    q, k, v, go = _data(*shape, "float32")
    o = _opts(opts, shape[0], shape[1], shape[4])
    got = _run(q, k, v, go, **o)
    assert got[0].dtype == torch.float32 and got[1].dtype == torch.float32
    _check(got, _ref(q, k, v, go, **_ref_kw(o)), "float32")


@KERNEL_TESTS
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("opts", [OPTS[1], OPTS[-1], BANDS[2]], ids=["causal", "all", "band"])
def test_16bit_flash_rule(dtype, opts):
    if dtype == "bfloat16" and not HAS_CUDA:
        pytest.skip("no GPU: Triton 3.6's CPU interpreter multiplies bfloat16 tiles wrongly "
                    "(tl.dot), so bfloat16 runs on a GPU only")
    shape = (1, 4, 2, 40, 50, 32) if not HAS_CUDA else (2, 8, 2, 512, 1024, 64)
    q, k, v, go = _data(*shape, dtype)
    o = _opts(opts, shape[0], shape[1], shape[4])
    got = _run(q, k, v, go, **o)
    assert got[0].dtype == TD[dtype]
    rk = _ref_kw(o)
    _check(got, _ref(q, k, v, go, **rk), dtype, _ref(q, k, v, go, dtype=TD[dtype], **rk))


@KERNEL_TESTS
def test_rows_without_keys_and_lse():
    q, k, v, go = _data(1, 2, 1, 20, 8, 16, "float32")
    out, lse, dq, dk, dv = _run(q, k, v, go, causal=True)   # rows 0..11 see no key
    assert (out[:, :, :12] == 0).all() and torch.isinf(lse[:, :, :12]).all()
    assert (dq[:, :, :12] == 0).all()
    s = (q.cpu().double() @ k.cpu().double().repeat_interleave(2, 1).mT) * PARAMS["softmax_scale"]
    want = torch.logsumexp(s.masked_fill(torch.arange(8)[None] > torch.arange(20)[:, None] - 12,
                                         -math.inf), -1)
    torch.testing.assert_close(lse[:, :, 12:].cpu().double(), want[:, :, 12:], rtol=1e-5,
                               atol=1e-5)
    for kl in (0, torch.tensor(0, dtype=torch.int64, device=DEV)):
        kw = dict(k_len=kl) if isinstance(kl, int) else dict(k_len_tensor=kl)
        out, lse, dq, dk, dv = _run(q, k, v, go, **kw)
        assert not out.any() and not dq.any() and not dk.any() and not dv.any()


@KERNEL_TESTS
def test_k_len_garbage_never_read_and_out_of_range_is_nan():
    q, k, v, go = _data(1, 2, 2, 6, 30, 16, "float32")
    kb, vb = k.clone(), v.clone()
    kb[:, :, 11:] = float("nan")
    vb[:, :, 11:] = float("inf")
    want = _ref(q, k, v, go, k_len=11, causal=True)
    for kw in (dict(k_len=11), dict(k_len_tensor=torch.tensor(11, device=DEV))):
        got = _run(q, kb, vb, go, causal=True, **kw)
        _check(got, want, "float32")
        assert not got[3][:, :, 11:].any() and not got[4][:, :, 11:].any()
    for bad in (31, -1):
        got = _run(q, k, v, go, k_len_tensor=torch.tensor(bad, device=DEV))
        assert all(torch.isnan(t).all() for t in (got[0], got[2], got[3], got[4]))


@KERNEL_TESTS
def test_strided_inputs_and_batch_slopes():
    """[B, S, H, D] tensors viewed as [B, H, S, D] (no copy) and [B, Hq] slopes."""
    B, S, H, D = 2, 19, 4, 16
    q, k, v, go = (torch.randn(B, S, H, D, device=DEV).transpose(1, 2) for _ in range(4))
    assert not q.is_contiguous()
    slopes = torch.rand(B, H, device=DEV)
    got = _run(q, k, v, go, alibi=slopes, causal=True)
    _check(got, _ref(q, k, v, go, alibi=slopes, causal=True), "float32")


@KERNEL_TESTS
def test_kernels_declare_float64_unsupported():
    assert_half_and_f32_only(K.flash_attn, K.flash_attn_backward)
    assert not K.supports([(1, 1, 1, 512), (1, 1, 1, 512)], [fg.float32] * 3, None)


# ---- API level on a GPU ------------------------------------------------------------------------
@on_gpu
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float64"])
def test_api_forward_and_gradients_on_cuda(dtype):
    rng = np.random.default_rng(0)
    arrs = [rng.standard_normal(s) for s in [(2, 8, 128, 64), (2, 2, 200, 64), (2, 2, 200, 64)]]
    g = rng.standard_normal((2, 8, 128, 64))
    kw = dict(causal=True, softcap=20.0, k_len=fg.tensor(np.int32(180), device="cuda"))
    td = {"float64": torch.float64, **TD}[dtype]
    ts = [fg.from_torch(torch.tensor(a, device="cuda").to(td)) for a in arrs]
    out = F.flash_attn(*ts, **kw)
    gs = fg.grad([(out * fg.from_torch(torch.tensor(g, device="cuda").to(td))).sum()], ts)
    rep = fg.explain([out] + gs)
    assert rep.backend == "cuda"
    if dtype == "float64":
        assert "flash_attn" in rep.lowered and not rep.fused_ops
    else:
        assert rep.fused_ops == {"flash_attn": 1, "flash_attn_backward": 1}, rep.fused_ops
    got = [t.to_torch().double().cpu() for t in [out] + gs]
    tt = [torch.tensor(a).requires_grad_() for a in arrs]
    ref = reference(*tt, causal=True, softcap=20.0, k_len=180)
    want = [ref.detach()] + list(torch.autograd.grad((ref * torch.tensor(g)).sum(), tt))
    tol = {"float64": 1e-10, "float32": 2e-4}.get(dtype, 5e-2)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(b.abs().max().item(), 1.0))


@on_gpu
def test_written_attention_fuses_on_cuda():
    rng = np.random.default_rng(1)
    q, k, v = (fg.from_torch(torch.tensor(rng.standard_normal((1, 4, 64, 32)), device="cuda")
                             .float()) for _ in range(3))
    i, j = fg.arange(64, device="cuda")[:, None], fg.arange(64, device="cuda")[None, :]
    s = (q @ k.transpose(-1, -2)) / math.sqrt(32)
    o = fg.where(i >= j, s, float("-inf")).softmax(-1) @ v
    assert fg.explain(o).fused_ops == {"flash_attn": 1}
    want = torch.nn.functional.scaled_dot_product_attention(q.to_torch(), k.to_torch(),
                                                           v.to_torch(), is_causal=True)
    torch.testing.assert_close(o.to_torch(), want, rtol=1e-4, atol=1e-4)


# ---- the warp-specialized forward (attention_ws.py; VARIANTS["WARP_SPEC"]) ----------------------
WS_OPTS = [dict(causal=True, window_size_left=_W), dict(causal=True),
           dict(causal=True, softcap=1.3, alibi=True, k_len=61 if not HAS_CUDA else 690),
           dict(causal=True, window_size_left=5), dict(causal=True, k_len=33)]


def _ws_cases():
    if not HAS_CUDA:     # + 8 heads: B * H a multiple of both tile orders' groups
        return [((1, 2, 1, 70, 90, 16), o, pers) for o in WS_OPTS for pers in (False, True)] \
            + [((1, 8, 4, 140, 150, 16), WS_OPTS[0], True),
               ((1, 8, 4, 140, 150, 16), WS_OPTS[1], False)]
    return [((2, 8, 2, 700, 1000, 128), WS_OPTS[0], False),
            ((1, 4, 4, 1000, 600, 128), WS_OPTS[1], False),
            ((2, 4, 2, 300, 700, 64), WS_OPTS[2], False),
            ((2, 8, 2, 700, 1000, 128), WS_OPTS[0], True),
            ((1, 4, 4, 1000, 600, 128), WS_OPTS[1], True)]


@KERNEL_TESTS
@pytest.mark.parametrize("shape,opts,persist", _ws_cases(),
                         ids=lambda x: "x".join(map(str, x)) if isinstance(x, tuple)
                         else ",".join(sorted(x)) if isinstance(x, dict)
                         else ("persist" if x else "grid"))
def test_warp_specialized_forward(shape, opts, persist, monkeypatch):
    """out and lse of the warp-specialized kernel (16-bit causal masks; a program per tile,
    or persistent) against float64 references: causal and window bands, Sq > Sk, ALiBi +
    softcap with a static k_len off the tile grid."""
    dtype = "bfloat16" if HAS_CUDA else "float16"
    monkeypatch.setitem(K.VARIANTS, "WARP_SPEC", True)
    monkeypatch.setitem(K.VARIANTS, "WS_PERSIST", persist)
    monkeypatch.setitem(K.VARIANTS, "WS_PERSIST_WINDOW", persist)
    used = []
    launch = K._launch_ws
    monkeypatch.setattr(K, "_launch_ws", lambda *a: (used.append(1), launch(*a)))
    q, k, v, go = _data(*shape, dtype)
    o = _opts(opts, shape[0], shape[1], shape[4])
    p = dict(PARAMS, **{n: x for n, x in o.items() if n != "alibi"})
    extra = (o["alibi"],) if "alibi" in o else ()
    out, lse = K.flash_attn(q, k, v, *extra, **dict(p, has_alibi=bool(extra)))
    assert used and out.dtype == TD[dtype]
    want = _ref(q, k, v, go, **o)[0]
    same = _ref(q, k, v, go, dtype=TD[dtype], **o)[0]
    assert_flash_rule(out.cpu().double().numpy(), want.numpy(), same.numpy(), slack=2e-3)
    sq, sk = shape[3], o.get("k_len") or shape[4]
    ref_lse = _ref_lse(q, k, sk, p, o.get("alibi"))
    live = torch.isfinite(ref_lse)
    assert torch.equal(lse.cpu() == math.inf, ~live)      # +inf: no key
    torch.testing.assert_close(lse.cpu().double()[live], ref_lse[live], rtol=2e-2, atol=2e-2)


@KERNEL_TESTS
@pytest.mark.parametrize("shape", [(1, 4, 4, 1024, 1024, 128), (2, 2, 2, 768, 256, 64),
                                   (1, 3, 3, 256, 640, 128)] if HAS_CUDA
                         else [(1, 3, 1, 64, 96, 16), (1, 2, 1, 80, 40, 16)],
                         ids=lambda x: "x".join(map(str, x)))
@pytest.mark.parametrize("variant", [dict(WS_SKIP_MASK=False), dict(WS_HEADS=2),
                                     dict(WS_SKIP_MASK_WINDOW=True, window=300),
                                     dict(WS_SKIP_MASK_WINDOW=True, WS_PERSIST_WINDOW=False,
                                          window=130),
                                     dict(WS_LAZY_RESCALE=True),
                                     dict(WS_LAZY_RESCALE=True, WS_SKIP_MASK_WINDOW=True,
                                          window=300),
                                     dict(WS_CAP_FIXED_REF=False, softcap=1.3),
                                     dict(softcap=50.0, window=300),
                                     dict(WS_ALIBI_HOIST=False, alibi=True),
                                     dict(WS_ALIBI_HOIST=True, alibi=True, softcap=1.3,
                                          window=300),
                                     dict(WS_PERSIST=True),
                                     dict(WS_EDGE_BOUND=False, window=300),
                                     dict(WS_EDGE_BOUND=True, window=254),
                                     dict(WS_LEAN_TILE=False, window=300)],
                         ids=lambda v: "+".join(f"{k}={x}" for k, x in v.items()))
def test_warp_specialized_variants(shape, variant, monkeypatch):
    """The warp-specialized forward's causal variants (the mask on every block or behind a
    branch, tiles dealt a group of heads at a time, the lazy rescale, softcap with the online
    max or a fixed reference, ALiBi's key bias hoisted or per key, every causal case
    persistent; windows: masks behind a branch, persistent or not): out and lse against
    float64 references, Sq = Sk, Sq > Sk (tiles with no key), Sq < Sk, head counts off the
    group."""
    dtype = "bfloat16" if HAS_CUDA else "float16"
    monkeypatch.setitem(K.VARIANTS, "WARP_SPEC", True)
    variant = dict(variant)
    window = variant.pop("window", None)
    softcap = variant.pop("softcap", None)
    alibi = variant.pop("alibi", False)
    if window is not None and not HAS_CUDA:
        window //= 10
    for name, value in variant.items():
        monkeypatch.setitem(K.VARIANTS, name, value)
    used = []
    launch = K._launch_ws
    monkeypatch.setattr(K, "_launch_ws", lambda *a: (used.append(1), launch(*a)))
    q, k, v, go = _data(*shape, dtype)
    if variant.get("WS_LAZY_RESCALE"):      # scores growing along the keys: the lazy
        ramp = torch.linspace(1.0, 6.0, k.shape[2], device=k.device)    # reference moves
        k = (k.float() * ramp[:, None]).to(k.dtype)
    o = dict(causal=True) if window is None else dict(causal=True, window_size_left=window)
    if softcap is not None:
        o["softcap"] = softcap
    p = dict(PARAMS, **o)
    slopes = (torch.linspace(0.05, 0.4, shape[1], dtype=torch.float32, device=DEV)
              if alibi else None)
    out, lse = K.flash_attn(q, k, v, *([slopes] if alibi else []), **dict(p, has_alibi=alibi))
    assert used
    want = _ref(q, k, v, go, alibi=slopes, **o)[0]
    same = _ref(q, k, v, go, alibi=slopes, dtype=TD[dtype], **o)[0]
    assert_flash_rule(out.cpu().double().numpy(), want.numpy(), same.numpy(), slack=2e-3)
    ref_lse = _ref_lse(q, k, shape[4], p, slopes)
    live = torch.isfinite(ref_lse)
    assert torch.equal(lse.cpu() == math.inf, ~live)      # +inf: no key
    torch.testing.assert_close(lse.cpu().double()[live], ref_lse[live], rtol=2e-2, atol=2e-2)


@KERNEL_TESTS
def test_graph_capture_takes_the_triton_forward(monkeypatch):
    """Under fuelgraph's CUDA-graph warm-up and capture the forward takes the Triton kernel,
    not the warp-specialized one, in both: a capture that loaded a kernel for the first time
    was invalidated (the ~1B Llama step fell back to running without its graph)."""
    from fuelgraph.backends.cuda.backend import _graph_capture
    from fuelgraph.backends.cuda.kernels.common import GRAPH_CAPTURE
    monkeypatch.setitem(K.VARIANTS, "WARP_SPEC", True)
    used = []
    launch = K._launch_ws
    monkeypatch.setattr(K, "_launch_ws", lambda *a: (used.append(1), launch(*a)))
    dtype = "bfloat16" if HAS_CUDA else "float16"
    shape = (1, 2, 1, 70, 90, 16) if not HAS_CUDA else (1, 4, 4, 256, 256, 128)
    q, k, v, go = _data(*shape, dtype)
    p = dict(PARAMS, causal=True)
    with _graph_capture():
        assert GRAPH_CAPTURE[0]
        out, _ = K.flash_attn(q, k, v, **p)
    assert not GRAPH_CAPTURE[0] and not used
    want = _ref(q, k, v, go, causal=True)[0]
    same = _ref(q, k, v, go, dtype=TD[dtype], causal=True)[0]
    assert_flash_rule(out.cpu().double().numpy(), want.numpy(), same.numpy(), slack=2e-3)
    K.flash_attn(q, k, v, **p)          # outside the capture the same call takes the other
    assert used


def _ref_lse(q, k, L, p, alibi):
    """Row log-sum-exp of the masked scores in float64 (the masks as the registry recipe's)."""
    qd, kd = q.cpu().double(), k.cpu().double()[:, :, :L]
    kd = kd.repeat_interleave(q.shape[1] // k.shape[1], 1)
    s = (qd @ kd.mT) * p["softmax_scale"]
    if p.get("softcap"):
        s = p["softcap"] * torch.tanh(s / p["softcap"])
    a = torch.arange(q.shape[2])[:, None] + L - q.shape[2]
    kn = torch.arange(L)[None, :]
    if alibi is not None:
        s = s - alibi.cpu().double()[:, None, None] * (a - kn).abs()
    keep = torch.ones_like(kn - a, dtype=torch.bool)
    if p.get("causal"):
        keep &= kn <= a
    if p.get("window_size_left") is not None:
        keep &= kn >= a - p["window_size_left"]
    if p.get("window_size_right") is not None:
        keep &= kn <= a + p["window_size_right"]
    return torch.logsumexp(s.masked_fill(~keep, -math.inf), -1)
