"""State-space scans fuse: the recipes of selective_scan and ssd_chunk_scan (every setting of
their optional inputs and flags, 32- and 16-bit) re-fuse into one op whose second output is
the last state when the graph reads it, and the recurrence written by hand with the Scan
primitive (as the recipes write it) fuses with torch's values and gradients."""
import numpy as np
import pytest

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph.ir import ops
from fuelgraph.ir.node import toposort
from fuelgraph.registry.core import FusedOps
from ssm_ref import SS_ORDER, SSD_ORDER, ordered, selective_scan_ref, ss_inputs, ssd_inputs, \
    ssd_ref, torch_grads


def fused_nodes(outs):
    res = fg.optimize(list(outs))
    return [n for n in toposort(res.outputs) if isinstance(n.op, ops.Fused)]


def refuses(entry_id, srcs, params, outputs=(0, 1)):
    """The op's recipe (as lower_all builds it), fused again: one node, same params, and the
    outputs read are that node's."""
    lowered = fg.default_registry().entry(entry_id).lower(srcs, params)
    nodes = fused_nodes([lowered[i] for i in outputs])
    assert [n.op.id for n in nodes] == [entry_id]
    assert nodes[0].op.params == params
    assert [s.dtype for s in nodes[0].srcs] == [s.dtype for s in srcs]   # 16-bit stays 16-bit
    return lowered


SS_FLAGS = [dict(), dict(d=True), dict(z=True, softplus=True), dict(bias=True),
            dict(d=True, z=True, bias=True, softplus=True)]


@pytest.mark.parametrize("outputs", [(0, 1), (0,)])
@pytest.mark.parametrize("dtype", [fg.float32, fg.bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("flags", SS_FLAGS, ids=str)
def test_selective_scan_recipe_refuses(flags, dtype, outputs):
    inp = ss_inputs(2, 5, 3, 4, dtype, **flags)
    ts = {k: fg.tensor(v, dtype=dtype) for k, v in inp.items()}
    y, h = F.selective_scan(*(ts[k] for k in SS_ORDER[:5]), d=ts.get("d"), z=ts.get("z"),
                            delta_bias=ts.get("delta_bias"),
                            delta_softplus=flags.get("softplus", False))
    low = refuses(FusedOps.SELECTIVE_SCAN, [fg.Tensor(s) for s in y.node.srcs],
                  y.node.op.params, outputs)
    got = fg.realize([low[0], low[1]])
    want = fg.realize([y, h])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g.astype(np.float64), w.astype(np.float64), rtol=2e-2,
                                   atol=2e-2)


SSD_FLAGS = [dict(), dict(d="h", init=True), dict(d="hp", z=True, softplus=True),
             dict(bias=True, init=True), dict(d="h", z=True, bias=True, softplus=True, init=True)]


@pytest.mark.parametrize("dtype", [fg.float32, fg.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("flags", SSD_FLAGS, ids=str)
def test_ssd_chunk_scan_recipe_refuses(flags, dtype):
    inp = ssd_inputs(1, 64, 2, 2, 3, dtype, **flags)
    ts = {k: fg.tensor(v, dtype=dtype) for k, v in inp.items()}
    y, h = F.ssd_chunk_scan(*(ts[k] for k in SSD_ORDER[:5]), chunk_size=64, d=ts.get("d"),
                            z=ts.get("z"), dt_bias=ts.get("dt_bias"),
                            dt_softplus=flags.get("softplus", False),
                            initial_states=ts.get("initial_states"))
    refuses(FusedOps.SSD_CHUNK_SCAN, [fg.Tensor(s) for s in y.node.srcs], y.node.op.params)


def test_ssd_chunk_size_is_read_as_a_divisor_of_L():
    """chunk_size tiles the kernels only and is not in the graph: a re-fused scan over L = 48
    takes 16 (the result does not depend on it)."""
    inp = ssd_inputs(1, 48, 2, 2, 3, fg.float32)
    ts = [fg.tensor(inp[k], dtype=fg.float32) for k in SSD_ORDER[:5]]
    y, _ = F.ssd_chunk_scan(*ts, chunk_size=48)
    low = fg.default_registry().entry(FusedOps.SSD_CHUNK_SCAN).lower(ts, y.node.op.params)
    (node,) = fused_nodes([low[0]])
    assert node.op.params.chunk_size == 16


# ---- the recurrence written by hand ----------------------------------------------------------
def _time_first(t):
    return t.permute(1, 0, *range(2, t.ndim))


def selective_scan_by_hand(u, delta, a, b, c, d, z):
    """Mamba-1 as a user writes it with fg.scan: softplus step size, the state update and
    readout per step, then the skip term and the gate."""
    B, L, D = u.shape

    def step(carry, xt, consts):
        (h,) = carry
        dt_t, u_t, b_t, c_t = xt
        (a_,) = consts
        h = (dt_t.unsqueeze(-1) * a_).exp() * h + (dt_t * u_t).unsqueeze(-1) * b_t.unsqueeze(1)
        return [h], [(h * c_t.unsqueeze(1)).sum(-1)]

    (h,), (ys,) = fg.scan(step, [fg.zeros((B, D, a.shape[1]))],
                          [_time_first(t) for t in (delta.softplus(), u, b, c)], [a])
    return (_time_first(ys) + u * d) * z.silu(), h


def ssd_by_hand(x, dt, a, b, c, h0):
    """Mamba-2 as a user writes it with fg.scan, from a given initial state."""
    def step(carry, xt, consts):
        (h,) = carry
        dt_t, x_t, b_t, c_t = xt
        (a_,) = consts
        gate = (dt_t * a_).exp().unsqueeze(-1).unsqueeze(-1)
        h = gate * h + (dt_t.unsqueeze(-1) * x_t).unsqueeze(-1) * b_t.unsqueeze(2)
        return [h], [(h * c_t.unsqueeze(2)).sum(-1)]

    (h,), (ys,) = fg.scan(step, [h0], [_time_first(t) for t in (dt, x, b, c)], [a])
    return _time_first(ys), h


def check_against_torch(build, ref, inp, order, fused_id, **kw):
    names = ordered(inp, order)
    xs = [fg.tensor(inp[k], dtype=fg.float32) for k in names]
    y, h = build(*xs)
    nodes = fused_nodes([y, h])
    assert [n.op.id for n in nodes] == [fused_id]
    rng = np.random.default_rng(9)
    gy, gl = rng.standard_normal(y.shape), rng.standard_normal(h.shape)
    ty, th, tg = torch_grads(ref, inp, order, gy, gl, **kw)
    np.testing.assert_allclose(y.numpy(), ty.numpy(), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(h.numpy(), th.numpy(), rtol=1e-4, atol=1e-4)
    loss = (y * fg.tensor(gy.astype(np.float32))).sum() + \
        (h * fg.tensor(gl.astype(np.float32))).sum()
    for k, g in zip(names, fg.grad(loss, xs)):
        np.testing.assert_allclose(g.numpy(), tg[k].numpy(), rtol=1e-4, atol=1e-4, err_msg=k)


def test_selective_scan_by_hand_fuses():
    inp = ss_inputs(2, 6, 3, 4, fg.float32, d=True, z=True, softplus=True)
    check_against_torch(selective_scan_by_hand, selective_scan_ref, inp, SS_ORDER,
                        FusedOps.SELECTIVE_SCAN, delta_softplus=True)
    xs = [fg.tensor(inp[k], dtype=fg.float32) for k in ordered(inp, SS_ORDER)]
    rep = fg.explain(list(selective_scan_by_hand(*xs)))
    assert rep.fused_ops == {"selective_scan": 1}, str(rep)
    assert "selective_scan x1" in str(rep)


def test_ssd_by_hand_fuses():
    inp = ssd_inputs(1, 8, 2, 2, 3, fg.float32, init=True)

    def ref(x, dt, a, b, c, initial_states, dtype=None):
        return ssd_ref(x, dt, a, b, c, initial_states=initial_states, dtype=dtype)
    check_against_torch(ssd_by_hand, ref, inp, SSD_ORDER, FusedOps.SSD_CHUNK_SCAN)
    xs = [fg.tensor(inp[k], dtype=fg.float32) for k in ordered(inp, SSD_ORDER)]
    rep = fg.explain(list(ssd_by_hand(*xs)))
    assert rep.fused_ops == {"ssd_chunk_scan": 1}, str(rep)


def test_a_gate_read_off_the_last_state_stays_outside():
    """The gate z computed from the last state: a fused node cannot both produce h and read a
    z made from it (nor fuse y alone: the scan would run twice). The scan with its skip term
    fuses, the gate stays outside, values stay."""
    inp = ss_inputs(1, 4, 2, 3, fg.float32, d=True, softplus=True)
    u, delta, a, b, c, d = [fg.tensor(inp[k], dtype=fg.float32) for k in ordered(inp, SS_ORDER)]

    def step(carry, xt, consts):
        (h,) = carry
        dt_t, u_t, b_t, c_t = xt
        (a_,) = consts
        h = (dt_t.unsqueeze(-1) * a_).exp() * h + (dt_t * u_t).unsqueeze(-1) * b_t.unsqueeze(1)
        return [h], [(h * c_t.unsqueeze(1)).sum(-1)]

    (h,), (ys,) = fg.scan(step, [fg.zeros((1, 2, 3))],
                          [_time_first(t) for t in (delta.softplus(), u, b, c)], [a])
    z = h.sum(-1).reshape(1, 1, 2).broadcast_to(u.shape) * 0.1
    y = (_time_first(ys) + u * d) * z.silu()
    (node,) = [n for n in fused_nodes([y, h]) if n.op.id == FusedOps.SELECTIVE_SCAN]
    assert (node.op.params.has_d, node.op.params.has_z) == (True, False)
    got = fg.realize([y, h])
    want = fg.realize([y, h], lower_all=True)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
