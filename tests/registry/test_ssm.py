"""SELECTIVE_SCAN (19) and SSD_CHUNK_SCAN (20) through the public API against the Mamba reference
recurrences written in torch (tests/ssm_ref.py): forward, last_state and every gradient
(arriving through y and last_state) over the optional inputs, L = 1, the four dtypes; the
recipe (lowered to the Scan primitive) against the kernel; chunk_size independence; every
validation error at build time."""
import numpy as np
import pytest
import torch

import fuelgraph as fg
from fuelgraph import FuelGraphError
from oracle import assert_flash_rule
import fuelgraph.functional as F
from ssm_ref import (SS_ORDER, SSD_ORDER, ordered, selective_scan_ref, ss_inputs, ssd_inputs,
                     ssd_ref, torch_grads)

DTYPES = [fg.float32, fg.float64, fg.bfloat16, fg.float16]
SLACK = {fg.bfloat16: 1e-2, fg.float16: 2e-3}
SS_OPTS = [dict(), dict(d=True, z=True, bias=True, softplus=True), dict(z=True, softplus=True),
           dict(d=True, bias=True)]
SSD_OPTS = [dict(), dict(d="h", z=True, bias=True, softplus=True, init=True),
            dict(d="hp", init=True), dict(z=True, softplus=True)]


def _fg(inputs, dt, grad=False):
    return {k: fg.tensor(v.astype(dt.np), dtype=dt, requires_grad=grad) for k, v in inputs.items()}


def _ss_call(T, softplus):
    return F.selective_scan(T["u"], T["delta"], T["a"], T["b"], T["c"], d=T.get("d"),
                            z=T.get("z"), delta_bias=T.get("delta_bias"),
                            delta_softplus=softplus)


def _ssd_call(T, softplus, chunk):
    return F.ssd_chunk_scan(T["x"], T["dt"], T["a"], T["b"], T["c"], chunk_size=chunk,
                            d=T.get("d"), z=T.get("z"), dt_bias=T.get("dt_bias"),
                            dt_softplus=softplus, initial_states=T.get("initial_states"))


def _check(got, ref64, same, dt, tol):
    got = np.asarray(got, np.float64)
    if dt in (fg.float64, fg.float32):
        scale = max(np.abs(ref64).max(initial=0.0), 1.0)
        assert np.abs(got - ref64).max(initial=0.0) <= tol[dt] * scale
    else:
        assert_flash_rule(got, ref64, same, SLACK[dt])


def _run_case(ref, order, inputs, call, dt, kw, seed=1):
    """Forward + all gradients of `call` vs `ref` (float64 oracle, same-dtype reference)."""
    T = _fg(inputs, dt, grad=True)
    y, h = call(T)
    assert y.dtype == dt and h.dtype == dt
    rng = np.random.default_rng(seed)
    gy = rng.standard_normal(y.shape).astype(dt.np).astype(np.float64)
    gl = rng.standard_normal(h.shape).astype(dt.np).astype(np.float64)
    y64, h64, g64 = torch_grads(ref, inputs, order, gy, gl, dtype=torch.float64, **kw)
    ys, hs, gsame = torch_grads(ref, inputs, order, gy, gl, in_dtype=dt.torch, **kw)
    names = ordered(inputs, order)
    got = fg.grad([y, h], [T[k] for k in names],
                  [fg.tensor(gy.astype(dt.np), dtype=dt), fg.tensor(gl.astype(dt.np), dtype=dt)])
    fwd_tol = {fg.float64: 1e-12, fg.float32: 1e-5}
    bwd_tol = {fg.float64: 1e-11, fg.float32: 3e-5}
    _check(y.numpy(), y64.numpy(), ys.float().numpy(), dt, fwd_tol)
    _check(h.numpy(), h64.numpy(), hs.float().numpy(), dt, fwd_tol)
    for k, g in zip(names, got):
        assert g.shape == inputs[k].shape and g.dtype == dt, k
        _check(g.numpy(), g64[k].numpy(), gsame[k].float().numpy(), dt, bwd_tol)


# ---- selective_scan ---------------------------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("opts", SS_OPTS, ids=lambda o: "-".join(o) or "plain")
@pytest.mark.parametrize("shape", [(2, 9, 5, 4), (1, 1, 3, 2)], ids=["B2L9", "L1"])
def test_selective_scan_vs_reference(dt, opts, shape):
    sp = opts.get("softplus", False)
    inputs = ss_inputs(*shape, dt, d=opts.get("d", False), z=opts.get("z", False),
                       bias=opts.get("bias", False), softplus=sp)
    _run_case(selective_scan_ref, SS_ORDER, inputs, lambda T: _ss_call(T, sp), dt,
              dict(delta_softplus=sp))


@pytest.mark.parametrize("opts", SS_OPTS[:2], ids=["plain", "all"])
def test_selective_scan_recipe_matches_kernel(opts):
    sp = opts.get("softplus", False)
    inputs = ss_inputs(2, 6, 3, 4, fg.float64, d=opts.get("d", False), z=opts.get("z", False),
                       bias=opts.get("bias", False), softplus=sp)
    T = _fg(inputs, fg.float64, grad=True)
    y, h = _ss_call(T, sp)
    names = ordered(inputs, SS_ORDER)
    gs = fg.grad([y, h], [T[k] for k in names], [fg.ones(y.shape, fg.float64),
                                                 fg.full(h.shape, 0.5, fg.float64)])
    outs = [y, h] + list(gs)
    assert fg.explain(outs).fused_ops == {"selective_scan": 1, "selective_scan_backward": 1}
    for a, b in zip(fg.realize(outs), fg.realize(outs, lower_all=True)):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


def test_selective_scan_second_order():
    """The backward helper's recipe is differentiable: d/d(delta) of sum(du) matches torch."""
    inputs = ss_inputs(1, 4, 2, 3, fg.float64, z=True, softplus=True)
    T = _fg(inputs, fg.float64, grad=True)
    y, h = _ss_call(T, True)
    (du,) = fg.grad([y, h], [T["u"]], [fg.ones(y.shape, fg.float64), fg.ones(h.shape, fg.float64)])
    (duu,) = fg.grad([du.sum()], [T["delta"]])
    ts = {k: torch.tensor(v, requires_grad=True) for k, v in inputs.items()}
    ty, th = selective_scan_ref(**ts, delta_softplus=True)
    (tdu,) = torch.autograd.grad(ty.sum() + th.sum(), ts["u"], create_graph=True)
    (tduu,) = torch.autograd.grad(tdu.sum(), ts["delta"])
    np.testing.assert_allclose(duu.numpy(), tduu.numpy(), rtol=1e-10, atol=1e-12)


def test_selective_scan_zero_length():
    inputs = ss_inputs(2, 0, 3, 4, fg.float32)
    y, h = _ss_call(_fg(inputs, fg.float32), False)
    assert y.shape == (2, 0, 3) and h.shape == (2, 3, 4)
    assert (h.numpy() == 0).all()


# ---- ssd_chunk_scan ---------------------------------------------------------------------------
@pytest.mark.parametrize("dt", DTYPES, ids=lambda d: d.name)
@pytest.mark.parametrize("opts", SSD_OPTS, ids=lambda o: "-".join(f"{k}{v}" if isinstance(v, str)
                                                                    else k for k, v in o.items())
                         or "plain")
@pytest.mark.parametrize("shape,chunk", [((2, 8, 3, 2, 4), 4), ((1, 1, 2, 3, 2), 1)],
                         ids=["B2L8", "L1"])
def test_ssd_chunk_scan_vs_reference(dt, opts, shape, chunk):
    sp = opts.get("softplus", False)
    inputs = ssd_inputs(*shape, dt, d=opts.get("d"), z=opts.get("z", False),
                        bias=opts.get("bias", False), softplus=sp, init=opts.get("init", False))
    _run_case(ssd_ref, SSD_ORDER, inputs, lambda T: _ssd_call(T, sp, chunk), dt,
              dict(dt_softplus=sp))


@pytest.mark.parametrize("opts", SSD_OPTS[:2], ids=["plain", "all"])
def test_ssd_recipe_matches_kernel(opts):
    sp = opts.get("softplus", False)
    inputs = ssd_inputs(2, 6, 2, 3, 4, fg.float64, d=opts.get("d"), z=opts.get("z", False),
                        bias=opts.get("bias", False), softplus=sp, init=opts.get("init", False))
    T = _fg(inputs, fg.float64, grad=True)
    y, h = _ssd_call(T, sp, 3)
    names = ordered(inputs, SSD_ORDER)
    gs = fg.grad([y, h], [T[k] for k in names], [fg.ones(y.shape, fg.float64),
                                                 fg.full(h.shape, -0.5, fg.float64)])
    outs = [y, h] + list(gs)
    assert fg.explain(outs).fused_ops == {"ssd_chunk_scan": 1, "ssd_chunk_scan_backward": 1}
    for a, b in zip(fg.realize(outs), fg.realize(outs, lower_all=True)):
        np.testing.assert_allclose(a, b, rtol=1e-11, atol=1e-12)


def test_ssd_chunk_size_does_not_change_the_result():
    inputs = ssd_inputs(1, 12, 2, 3, 4, fg.float32, d="h", init=True)
    T = _fg(inputs, fg.float32)
    outs = [np.concatenate([t.numpy().ravel() for t in _ssd_call(T, False, q)])
            for q in (1, 2, 3, 4, 6, 12)]
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_ssd_initial_states_may_be_lazy():
    inputs = ssd_inputs(1, 4, 2, 2, 3, fg.float64, init=True)
    T = _fg(inputs, fg.float64)
    T["initial_states"] = T["initial_states"] * 2.0 - 1.0          # a lazy expression
    y, h = _ssd_call(T, False, 2)
    ts = {k: torch.tensor(v) for k, v in inputs.items()}
    ts["initial_states"] = ts["initial_states"] * 2 - 1
    ry, rh = ssd_ref(**ts)
    np.testing.assert_allclose(y.numpy(), ry.numpy(), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(h.numpy(), rh.numpy(), rtol=1e-12, atol=1e-12)


# ---- validation (build time) ------------------------------------------------------------------
def _z(*shape, dt=fg.float32):
    return fg.zeros(shape, dt)


SS_ARGS = dict(u=(2, 5, 3), delta=(2, 5, 3), a=(3, 4), b=(2, 5, 4), c=(2, 5, 4))


@pytest.mark.parametrize("name,bad,match", [
    ("u", (2, 5), "u has shape"), ("delta", (2, 5, 4), "delta has shape"),
    ("a", (4, 4), "a has shape"), ("b", (2, 5, 3), "b has shape"), ("c", (2, 4, 4), "c has shape"),
    ("d", (4,), "d has shape"), ("z", (2, 5, 2), "z has shape"),
    ("delta_bias", (3, 1), "delta_bias has shape")])
def test_selective_scan_shape_errors(name, bad, match):
    args = {k: _z(*v) for k, v in SS_ARGS.items()}
    args[name] = _z(*bad)
    with pytest.raises(FuelGraphError, match=f"selective_scan: {match}"):
        F.selective_scan(**args)


def test_selective_scan_dtype_errors():
    args = {k: _z(*v) for k, v in SS_ARGS.items()}
    args["b"] = _z(*SS_ARGS["b"], dt=fg.float16)
    with pytest.raises(FuelGraphError, match="selective_scan: b has dtype float16"):
        F.selective_scan(**args)
    args = {k: fg.zeros(v, fg.int32) for k, v in SS_ARGS.items()}
    with pytest.raises(FuelGraphError, match="selective_scan: u has dtype int32"):
        F.selective_scan(**args)


SSD_ARGS = dict(x=(2, 6, 3, 2), dt=(2, 6, 3), a=(3,), b=(2, 6, 3, 4), c=(2, 6, 3, 4))


@pytest.mark.parametrize("name,bad,match", [
    ("x", (2, 6, 3), "x has shape"), ("dt", (2, 6, 2), "dt has shape"), ("a", (3, 1), "a has shape"),
    ("b", (2, 6, 2, 4), "b has shape"), ("c", (2, 6, 3, 5), "c has shape"),
    ("d", (3, 3), "d has shape"), ("z", (2, 6, 3, 3), "z has shape"),
    ("dt_bias", (2,), "dt_bias has shape"), ("initial_states", (2, 3, 2, 5), "initial_states has")])
def test_ssd_shape_errors(name, bad, match):
    args = {k: _z(*v) for k, v in SSD_ARGS.items()}
    args[name] = _z(*bad)
    with pytest.raises(FuelGraphError, match=f"ssd_chunk_scan: {match}"):
        F.ssd_chunk_scan(**args, chunk_size=2)


@pytest.mark.parametrize("chunk,match", [(0, "must be > 0"), (-2, "must be > 0"),
                                         (4, "does not divide"), (2.0, "must be an int")])
def test_ssd_chunk_size_errors(chunk, match):
    args = {k: _z(*v) for k, v in SSD_ARGS.items()}
    with pytest.raises(FuelGraphError, match=match):
        F.ssd_chunk_scan(**args, chunk_size=chunk)


def test_ssd_dtype_error():
    args = {k: _z(*v) for k, v in SSD_ARGS.items()}
    args["a"] = _z(3, dt=fg.float64)
    with pytest.raises(FuelGraphError, match="ssd_chunk_scan: a has dtype float64"):
        F.ssd_chunk_scan(**args, chunk_size=3)
