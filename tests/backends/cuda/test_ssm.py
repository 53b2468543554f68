"""Triton kernels of the state-space scans (selective scan, SSD) against the torch float64
reference recurrences and the NumPy kernels: forward, last_state and every gradient, with the
optional inputs, float32 / bfloat16 / float16.

On a CUDA GPU the shapes are larger (several tiles and chunks, padded tails, B/C groups
broadcast over heads with stride 0). Without a GPU the module is skipped, unless
TRITON_INTERPRET=1, when tiny shapes run through Triton's CPU interpreter on CPU tensors."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import fuelgraph as fg  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))    # tests/: the shared references
from oracle import assert_flash_rule  # noqa: E402
from ssm_ref import (SS_ORDER, SSD_ORDER, ordered, selective_scan_ref, ss_inputs,  # noqa: E402
                     ssd_inputs, ssd_ref, torch_grads)

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
HAS_CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs a CUDA GPU")]
DEV = "cuda" if HAS_CUDA else "cpu"
DTYPES = [fg.float32, fg.bfloat16, fg.float16]
SLACK = {fg.bfloat16: 1e-2, fg.float16: 2e-3}


if HAS_CUDA or INTERPRET:
    from fuelgraph.backends.cuda.kernels import ssm as KS
    from fuelgraph.backends.cuda.kernels import ssm_ssd as KD
    from fuelgraph.backends.numpy import ssm as KN


def _t(a, dt):
    return torch.tensor(a).to(dt.torch).to(DEV)


def _check(name, got, want64, same, dt, strict=False):
    """strict: the 16-bit rule in the interpreter too (float16 only: it rounds as the GPU)."""
    got = got.double().cpu().numpy()
    want64 = want64.numpy()
    scale = max(np.abs(want64).max(initial=0.0), 1.0)
    if dt == fg.float32:
        err = np.abs(got - want64).max(initial=0.0)
        assert err <= 1e-4 * scale, (name, err)
    elif INTERPRET and not HAS_CUDA and not strict:   # it narrows by truncation: loose bound
        assert np.abs(got - want64).max(initial=0.0) <= 6e-2 * scale, name
    else:
        assert_flash_rule(got, want64, same.float().numpy(), SLACK[dt])


def _case(ref, order, inputs, fwd, bwd, dt, kw_ref, numpy_fwd=None, strict=False):
    names = ordered(inputs, order)
    ts = [_t(inputs[k], dt) for k in names]
    y, h = fwd(ts)
    rng = np.random.default_rng(5)
    gy = rng.standard_normal(tuple(y.shape)).astype(dt.np).astype(np.float64)
    gl = rng.standard_normal(tuple(h.shape)).astype(dt.np).astype(np.float64)
    y64, h64, g64 = torch_grads(ref, inputs, order, gy, gl, dtype=torch.float64, **kw_ref)
    ys, hs, gs = torch_grads(ref, inputs, order, gy, gl, in_dtype=dt.torch, **kw_ref)
    assert y.dtype == dt.torch and h.dtype == dt.torch
    _check("y", y, y64, ys, dt)
    _check("last_state", h, h64, hs, dt)
    grads = bwd(ts, _t(gy, dt), _t(gl, dt))
    assert len(grads) == len(names)
    for k, g in zip(names, grads):
        assert tuple(g.shape) == inputs[k].shape and g.dtype == dt.torch, k
        _check(k, g, g64[k], gs[k], dt, strict)
    if numpy_fwd is not None and dt == fg.float32:      # the CPU reference kernel agrees too
        yn, hn = numpy_fwd([inputs[k].astype(np.float32) for k in names])
        np.testing.assert_allclose(y.cpu().numpy(), yn, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(h.cpu().numpy(), hn, rtol=1e-4, atol=1e-4)


SS_SHAPES = [(2, 7, 5, 4)] + ([(2, 300, 200, 16), (1, 33, 70, 24)] if HAS_CUDA else [])
SS_OPTS = [dict(), dict(d=True, z=True, bias=True, softplus=True)]


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("opts", SS_OPTS, ids=["plain", "all"])
@pytest.mark.parametrize("shape", SS_SHAPES, ids=str)
def test_selective_scan(dt, opts, shape):
    sp = opts.get("softplus", False)
    inputs = ss_inputs(*shape, dt, d=opts.get("d", False), z=opts.get("z", False),
                       bias=opts.get("bias", False), softplus=sp)
    kw = dict(delta_softplus=sp, has_d="d" in inputs, has_z="z" in inputs,
              has_delta_bias="delta_bias" in inputs)
    # several tiles (a padded tail) and channel blocks; 2 of the 4 states through the
    # polynomial exponential (the GPU default sends 3 of 16 there)
    cfg = None if HAS_CUDA else (4, 2, 1, 2)
    bcfg = None if HAS_CUDA else (4, 2, 1)
    _case(selective_scan_ref, SS_ORDER, inputs,
          lambda ts: KS.selective_scan(*ts, **kw, config=cfg),
          lambda ts, gy, gl: KS.selective_scan_backward(*ts, gy, gl, **kw, config=bcfg), dt,
          dict(delta_softplus=sp), lambda a: KN.selective_scan(*a, **kw))


@pytest.mark.parametrize("dt", [fg.float32, fg.bfloat16], ids=lambda d: d.name)
def test_selective_scan_forward_whole_tiles(dt):
    """The forward's whole-tile path (L a multiple of the tile length: no row masks), with
    d, z, bias and softplus, and with the default launch config on the GPU (a share of the
    exponentials on the FMA polynomial)."""
    shape = (2, 256, 96, 16) if HAS_CUDA else (1, 8, 3, 4)
    inputs = ss_inputs(*shape, dt, d=True, z=True, bias=True, softplus=True)
    kw = dict(delta_softplus=True, has_d=True, has_z=True, has_delta_bias=True)
    ts = [_t(inputs[k], dt) for k in ordered(inputs, SS_ORDER)]
    # (the interpreter: b, c of each step loaded a step ahead, pf = 1)
    y, h = KS.selective_scan(*ts, **kw, config=None if HAS_CUDA else (4, 2, 1, 2, 1))
    y64, h64, _ = torch_grads(selective_scan_ref, inputs, SS_ORDER, np.zeros(y.shape),
                              np.zeros(h.shape), dtype=torch.float64, delta_softplus=True)
    ys, hs, _ = torch_grads(selective_scan_ref, inputs, SS_ORDER, np.zeros(y.shape),
                            np.zeros(h.shape), in_dtype=dt.torch, delta_softplus=True)
    _check("y", y, y64, ys, dt)
    _check("last_state", h, h64, hs, dt)


SSD_SHAPES = [(2, 37, 2, 4, 5)] + ([(2, 200, 4, 64, 32), (1, 64, 3, 24, 16)] if HAS_CUDA or os.environ.get("SSD_GPU_CONFIG") else [])
SSD_OPTS = [dict(), dict(d="h", z=True, bias=True, softplus=True, init=True),
            dict(d="hp", init=True)]


@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("opts", SSD_OPTS, ids=["plain", "all", "dhp-init"])
@pytest.mark.parametrize("shape", SSD_SHAPES, ids=str)
def test_ssd_chunk_scan(dt, opts, shape):
    sp = opts.get("softplus", False)
    inputs = ssd_inputs(*shape, dt, d=opts.get("d"), z=opts.get("z", False),
                        bias=opts.get("bias", False), softplus=sp, init=opts.get("init", False))
    kw = dict(chunk_size=1, dt_softplus=sp, has_d="d" in inputs, has_z="z" in inputs,
              has_dt_bias="dt_bias" in inputs, has_initial_states="initial_states" in inputs)
    cfg = bcfg = None
    if not (HAS_CUDA or os.environ.get("SSD_GPU_CONFIG")):
        # 3 chunks with a padded tail, 2 row blocks per chunk, 2 P and 2 N blocks
        cfg = KD.SSDConfig(q=16, bm=8, bk=8, bp=2, bn=4, warps=1, stages=1)
        bcfg = KD.SSDBwdConfig(q=16, warps=1, stages=1, bm=8, bp=2, bn=4)
    _case(ssd_ref, SSD_ORDER, inputs, lambda ts: KD.ssd_chunk_scan(*ts, **kw, config=cfg),
          lambda ts, gy, gl: KD.ssd_chunk_scan_backward(*ts, gy, gl, **kw, config=bcfg), dt,
          dict(dt_softplus=sp), lambda a: KN.ssd_chunk_scan(*a, **kw))


@pytest.mark.skipif(not (HAS_CUDA or INTERPRET), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dt", [fg.float32, fg.bfloat16], ids=lambda d: d.name)
def test_ssd_chunk_256(dt):
    """The kernels' chunk length 256 (the forward's default on long sequences) and the op's
    chunk_size 256, forward and backward, with N and P small enough for the interpreter."""
    inputs = ssd_inputs(1, 512 if HAS_CUDA else 300, 2, 16, 16, dt, d="h", z=True, bias=True,
                        softplus=True)
    kw = dict(chunk_size=256 if HAS_CUDA else 300, dt_softplus=True, has_d=True, has_z=True,
              has_dt_bias=True, has_initial_states=False)
    cfg = None if HAS_CUDA else KD.SSDConfig(q=256, bm=64, bk=64, bp=16, bn=16, warps=4,
                                             stages=1)
    bcfg = None if HAS_CUDA else (256, 4, 1)
    _case(ssd_ref, SSD_ORDER, inputs, lambda ts: KD.ssd_chunk_scan(*ts, **kw, config=cfg),
          lambda ts, gy, gl: KD.ssd_chunk_scan_backward(*ts, gy, gl, **kw, config=bcfg), dt,
          dict(dt_softplus=True))


@pytest.mark.parametrize("sign", [-1, 1], ids=["decay", "growth"])
def test_ssd_backward_split_rows(sign):
    """The split backward with several row blocks a chunk and two chunks with a padded tail,
    a decaying and a growing state (a > 0: dt' a > 0): gradients against the float64
    reference."""
    shape = (1, 200, 2, 32, 16) if HAS_CUDA else (1, 37, 2, 4, 5)
    inputs = ssd_inputs(*shape, fg.float32, d="h", bias=True)
    if sign > 0:                          # ssd_inputs: a < 0
        inputs["a"] = -0.2 * inputs["a"]
    kw = dict(chunk_size=1, dt_softplus=False, has_d=True, has_z=False, has_dt_bias=True,
              has_initial_states=False)
    q, bm = (128, 32) if HAS_CUDA else (32, 8)
    bcfg = KD.SSDBwdConfig(q=q, warps=4, stages=1, split=1, bm=bm, bp=64, bn=64)
    _case(ssd_ref, SSD_ORDER, inputs, lambda ts: KD.ssd_chunk_scan(*ts, **kw),
          lambda ts, gy, gl: KD.ssd_chunk_scan_backward(*ts, gy, gl, **kw, config=bcfg),
          fg.float32, dict(dt_softplus=False))


def test_ssd_backward_split_16bit():
    """The split backward with float16 inputs on chunks of 128 steps: da and ddt_bias add the
    Acum gradient's suffix sums over every step, so its chunk-end term and its decay pairs
    (t, s) must cancel there at float32 rounding (taken from the 16-bit stored state, or from
    differently rounded operands, they missed da by 6x the bound here). The interpreter rounds
    float16 as the GPU does, so the 16-bit rule holds there too."""
    inputs = ssd_inputs(1, 512, 2, 16, 16, fg.float16, d="h", z=True, bias=True, softplus=True)
    kw = dict(chunk_size=256, dt_softplus=True, has_d=True, has_z=True, has_dt_bias=True,
              has_initial_states=False)
    bcfg = KD.SSDBwdConfig(q=128, warps=4, stages=2, split=1, bm=64, bp=16, bn=16)
    _case(ssd_ref, SSD_ORDER, inputs, lambda ts: KD.ssd_chunk_scan(*ts, **kw),
          lambda ts, gy, gl: KD.ssd_chunk_scan_backward(*ts, gy, gl, **kw, config=bcfg),
          fg.float16, dict(dt_softplus=True), strict=True)


@pytest.mark.skipif(not HAS_CUDA, reason="strided inputs: GPU shapes")
def test_ssd_groups_broadcast_over_heads():
    """b and c with one group expanded over the heads (stride 0) give the results of their
    contiguous copies (up to the rounding of C B^T, which the broadcast path forms once in its
    own kernel)."""
    B, L, H, P, N = 2, 128, 4, 32, 16
    g = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(B, L, H, P, generator=g).to(DEV, torch.bfloat16)
    dt = (torch.rand(B, L, H, generator=g) * 0.3 + 0.05).to(DEV, torch.bfloat16)
    a = -torch.rand(H, generator=g).to(DEV, torch.bfloat16) - 0.5
    b1 = torch.randn(B, L, 1, N, generator=g).to(DEV, torch.bfloat16)
    c1 = torch.randn(B, L, 1, N, generator=g).to(DEV, torch.bfloat16)
    kw = dict(chunk_size=64, dt_softplus=False, has_d=False, has_z=False, has_dt_bias=False,
              has_initial_states=False)
    y1, h1 = KD.ssd_chunk_scan(x, dt, a, b1.expand(B, L, H, N), c1.expand(B, L, H, N), **kw)
    y2, h2 = KD.ssd_chunk_scan(x, dt, a, b1.expand(B, L, H, N).contiguous(),
                               c1.expand(B, L, H, N).contiguous(), **kw)
    assert torch.equal(h1, h2)              # the state walk is the same kernel
    scale = y2.float().abs().max().item()
    assert (y1.float() - y2.float()).abs().max().item() <= 1e-2 * scale


@pytest.mark.skipif(not HAS_CUDA, reason="the CUDA backend needs a GPU")
@pytest.mark.parametrize("dt", [fg.float32, fg.bfloat16, fg.float64], ids=lambda d: d.name)
def test_through_the_api_on_cuda(dt):
    """Both ops and their backward helpers run on the CUDA backend (float64: the recipe on the
    GPU) and agree with the CPU (NumPy) run."""
    import fuelgraph.functional as F
    ss = ss_inputs(2, 40, 24, 8, dt, d=True, z=True, bias=True, softplus=True)
    sd = ssd_inputs(2, 32, 3, 16, 8, dt, d="h", z=True, bias=True, softplus=True, init=True)
    res = {}
    for dev in ("cpu", "cuda"):
        T = {k: fg.tensor(v.astype(dt.np), dtype=dt, device=dev, requires_grad=True)
             for k, v in {**ss, **{"s_" + k: v for k, v in sd.items()}}.items()}
        y, h = F.selective_scan(T["u"], T["delta"], T["a"], T["b"], T["c"], d=T["d"], z=T["z"],
                                delta_bias=T["delta_bias"], delta_softplus=True)
        y2, h2 = F.ssd_chunk_scan(T["s_x"], T["s_dt"], T["s_a"], T["s_b"], T["s_c"],
                                  chunk_size=16, d=T["s_d"], z=T["s_z"], dt_bias=T["s_dt_bias"],
                                  dt_softplus=True, initial_states=T["s_initial_states"])
        loss = (y.astype(fg.float32) * y.astype(fg.float32)).sum() + h.astype(fg.float32).sum() \
            + (y2.astype(fg.float32) * 0.5).sum() + h2.astype(fg.float32).sum()
        grads = fg.grad([loss], list(T.values()))
        res[dev] = [t.numpy().astype(np.float64) for t in [y, h, y2, h2] + list(grads)]
    tol = {fg.float64: 1e-9, fg.float32: 1e-3, fg.bfloat16: 5e-2}[dt]
    for a, b in zip(res["cpu"], res["cuda"]):
        assert np.abs(a - b).max() <= tol * max(np.abs(a).max(), 1.0)


@pytest.mark.parametrize("cb", [1, 2], ids=["cb_f32", "cb_input_dtype"])
@pytest.mark.parametrize("dt", [fg.float32, fg.bfloat16], ids=lambda d: d.name)
def test_ssd_heads_share_b_c(dt, cb):
    """b and c with one group broadcast over the heads (head stride 0): C B^T is formed once
    per chunk for all heads (a separate kernel; stored in float32 or in the input dtype);
    forward and gradients against the float64 reference, with a padded tail chunk."""
    B, L, H, P, N = (2, 200, 3, 32, 80) if HAS_CUDA else (1, 37, 2, 4, 5)
    inputs = ssd_inputs(B, L, H, P, N, dt, d="h", z=True, bias=True, softplus=True)
    for k in ("b", "c"):
        inputs[k] = np.ascontiguousarray(np.broadcast_to(inputs[k][:, :, :1], inputs[k].shape))
    kw = dict(chunk_size=1, dt_softplus=True, has_d=True, has_z=True, has_dt_bias=True,
              has_initial_states=False)
    cfg, bcfg = KD.ssd_config(B, L, H, P, N)._replace(cb=cb), None
    if not HAS_CUDA:        # 2 chunks, 4 row blocks each
        cfg = KD.SSDConfig(q=32, bm=8, bk=8, bp=2, bn=4, warps=1, stages=1, cb=cb)
        bcfg = KD.SSDBwdConfig(q=32, warps=1, stages=1, bm=8, bp=2, bn=4)

    def shared(ts):          # b, c as one head expanded (stride 0)
        ts = list(ts)
        for i in (3, 4):
            ts[i] = ts[i][:, :, :1].expand(ts[i].shape)
        return ts
    _case(ssd_ref, SSD_ORDER, inputs,
          lambda ts: KD.ssd_chunk_scan(*shared(ts), **kw, config=cfg),
          lambda ts, gy, gl: KD.ssd_chunk_scan_backward(*shared(ts), gy, gl, **kw, config=bcfg),
          dt, dict(dt_softplus=True))

