"""NumPy kernels of the state-space scans, called directly: the selective scan over several
time blocks and channel spans (threads), the chunked SSD over several chunks with a padded
tail, forward and backward, against the torch float64 reference recurrences; chunk_size never
changes the result; float64 stays float64 and halves come back in their dtype."""
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import fuelgraph as fg
from fuelgraph.backends.numpy import ssm as K

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))    # tests/: the shared references
from ssm_ref import (SS_ORDER, SSD_ORDER, ordered, selective_scan_ref, ss_inputs, ssd_inputs,
                     ssd_ref, torch_grads)


def _errs(ref, inputs, order, fwd, bwd, dt, kw_ref):
    names = ordered(inputs, order)
    arrs = [inputs[k].astype(dt.np) for k in names]
    y, h = fwd(arrs)
    rng = np.random.default_rng(3)
    gy, gl = rng.standard_normal(y.shape), rng.standard_normal(h.shape)
    y64, h64, g64 = torch_grads(ref, inputs, order, gy, gl, dtype=torch.float64, **kw_ref)
    grads = bwd(arrs, gy.astype(dt.np), gl.astype(dt.np))
    out = {"y": (y, y64), "last_state": (h, h64)}
    out.update({k: (g, g64[k]) for k, g in zip(names, grads)})
    res = {}
    for k, (got, want) in out.items():
        assert got.dtype == dt.np, k
        want = want.numpy()
        res[k] = np.abs(got.astype(np.float64) - want).max() / max(np.abs(want).max(), 1.0)
    return res


@pytest.mark.parametrize("dt,tol", [(fg.float64, 1e-12), (fg.float32, 5e-5)],
                         ids=["f64", "f32"])
@pytest.mark.parametrize("opts", [dict(), dict(d=True, z=True, bias=True, softplus=True)],
                         ids=["plain", "all"])
def test_selective_scan_blocks_and_spans(monkeypatch, dt, tol, opts):
    monkeypatch.setattr(K, "SS_BLOCK_ELEMS", 64)          # several time blocks
    monkeypatch.setattr(K, "NUM_THREADS", 3)              # three channel spans
    sp = opts.get("softplus", False)
    inputs = ss_inputs(2, 41, 256, 4, dt, d=opts.get("d", False), z=opts.get("z", False),
                       bias=opts.get("bias", False), softplus=sp)
    kw = dict(delta_softplus=sp, has_d="d" in inputs, has_z="z" in inputs,
              has_delta_bias="delta_bias" in inputs)
    errs = _errs(selective_scan_ref, inputs, SS_ORDER,
                 lambda a: K.selective_scan(*a, **kw),
                 lambda a, gy, gl: K.selective_scan_backward(*a, gy, gl, **kw), dt,
                 dict(delta_softplus=sp))
    assert max(errs.values()) <= tol, errs


@pytest.mark.parametrize("dt,tol", [(fg.float64, 1e-12), (fg.float32, 5e-5)],
                         ids=["f64", "f32"])
@pytest.mark.parametrize("opts", [dict(), dict(d="hp", z=True, bias=True, softplus=True,
                                               init=True)], ids=["plain", "all"])
def test_ssd_chunks_groups_and_padding(monkeypatch, dt, tol, opts):
    monkeypatch.setattr(K, "SSD_CHUNK", 8)                 # 45 steps: 6 chunks, padded tail
    monkeypatch.setattr(K, "SSD_CHUNK_BWD", 16)
    monkeypatch.setattr(K, "SSD_GROUP_ELEMS", 200)         # several head groups
    monkeypatch.setattr(K, "SSD_GROUP_ELEMS_BWD", 200)
    sp = opts.get("softplus", False)
    inputs = ssd_inputs(2, 45, 3, 4, 5, dt, d=opts.get("d"), z=opts.get("z", False),
                        bias=opts.get("bias", False), softplus=sp, init=opts.get("init", False))
    kw = dict(chunk_size=5, dt_softplus=sp, has_d="d" in inputs, has_z="z" in inputs,
              has_dt_bias="dt_bias" in inputs, has_initial_states="initial_states" in inputs)
    errs = _errs(ssd_ref, inputs, SSD_ORDER, lambda a: K.ssd_chunk_scan(*a, **kw),
                 lambda a, gy, gl: K.ssd_chunk_scan_backward(*a, gy, gl, **kw), dt,
                 dict(dt_softplus=sp))
    assert max(errs.values()) <= tol, errs


@pytest.mark.parametrize("dt,tol", [(fg.float64, 1e-12), (fg.float32, 5e-5)],
                         ids=["f64", "f32"])
@pytest.mark.parametrize("opts", [dict(), dict(d="h", z=True, bias=True, softplus=True,
                                               init=True), dict(d="hp", init=True)],
                         ids=["plain", "all", "hp"])
def test_ssd_one_token_step(monkeypatch, dt, tol, opts):
    """L = 1 (a decode step) takes the recurrence path, in parts of a few head rows."""
    monkeypatch.setattr(K, "SSD_STEP_ROWS", 4)             # 3 x 5 head rows: 4 parts
    sp = opts.get("softplus", False)
    inputs = ssd_inputs(3, 1, 5, 4, 6, dt, d=opts.get("d"), z=opts.get("z", False),
                        bias=opts.get("bias", False), softplus=sp, init=opts.get("init", False))
    kw = dict(chunk_size=1, dt_softplus=sp, has_d="d" in inputs, has_z="z" in inputs,
              has_dt_bias="dt_bias" in inputs, has_initial_states="initial_states" in inputs)
    errs = _errs(ssd_ref, inputs, SSD_ORDER, lambda a: K.ssd_chunk_scan(*a, **kw),
                 lambda a, gy, gl: K.ssd_chunk_scan_backward(*a, gy, gl, **kw), dt,
                 dict(dt_softplus=sp))
    assert max(errs.values()) <= tol, errs


def _strided(names, arrs):
    """The arrays as the Mamba-2 model hands them over: b and c broadcast over the heads,
    everything else a slice of a wider array."""
    out = []
    for k, v in zip(names, arrs):
        if k in ("b", "c"):
            out.append(np.broadcast_to(v[:, :, :1], v.shape))
        else:
            wide = np.zeros(v.shape[:-1] + (v.shape[-1] + 3,), v.dtype)
            wide[..., 1:-2] = v
            out.append(wide[..., 1:-2])
    return out


@pytest.mark.parametrize("L", [1, 21])
def test_ssd_strided_inputs(L):
    """Broadcast and sliced inputs (the kernels take strided inputs) give the reference."""
    inputs = ssd_inputs(2, L, 3, 4, 5, fg.float64, d="h", z=True, bias=True, softplus=True,
                        init=True)
    for k in ("b", "c"):                                   # one group shared by the heads
        inputs[k] = np.broadcast_to(inputs[k][:, :, :1], inputs[k].shape).copy()
    names = ordered(inputs, SSD_ORDER)
    kw = dict(chunk_size=1, dt_softplus=True, has_d=True, has_z=True, has_dt_bias=True,
              has_initial_states=True)
    errs = _errs(ssd_ref, inputs, SSD_ORDER,
                 lambda a: K.ssd_chunk_scan(*_strided(names, a), **kw),
                 lambda a, gy, gl: K.ssd_chunk_scan_backward(*_strided(names, a), gy, gl, **kw),
                 fg.float64, dict(dt_softplus=True))
    assert max(errs.values()) <= 1e-12, errs


def test_ssd_chunk_size_param_is_ignored():
    inputs = ssd_inputs(1, 12, 2, 3, 4, fg.float32)
    arrs = [inputs[k].astype(np.float32) for k in ordered(inputs, SSD_ORDER)]
    kw = dict(dt_softplus=False, has_d=False, has_z=False, has_dt_bias=False,
              has_initial_states=False)
    ys = [K.ssd_chunk_scan(*arrs, chunk_size=q, **kw)[0] for q in (1, 3, 12)]
    for y in ys[1:]:
        np.testing.assert_array_equal(y, ys[0])


@pytest.mark.parametrize("dt", [fg.bfloat16, fg.float16], ids=lambda d: d.name)
def test_halves_round_once(dt):
    """16-bit inputs: computed in float32 from the rounded inputs, rounded once on return."""
    inputs = ss_inputs(1, 6, 4, 3, dt, d=True, softplus=True)
    names = ordered(inputs, SS_ORDER)
    kw = dict(delta_softplus=True, has_d=True, has_z=False, has_delta_bias=False)
    y16, h16 = K.selective_scan(*[inputs[k].astype(dt.np) for k in names], **kw)
    y32, h32 = K.selective_scan(*[inputs[k].astype(np.float32) for k in names], **kw)
    assert y16.dtype == dt.np
    np.testing.assert_array_equal(y16, y32.astype(dt.np))
    np.testing.assert_array_equal(h16, h32.astype(dt.np))


def test_zero_extents():
    kw = dict(delta_softplus=False, has_d=False, has_z=False, has_delta_bias=False)
    y, h = K.selective_scan(np.zeros((2, 0, 3)), np.zeros((2, 0, 3)), np.zeros((3, 4)),
                            np.zeros((2, 0, 4)), np.zeros((2, 0, 4)), **kw)
    assert y.shape == (2, 0, 3) and (h == 0).all() and h.shape == (2, 3, 4)
    g = K.selective_scan_backward(np.zeros((2, 0, 3)), np.zeros((2, 0, 3)), np.ones((3, 4)),
                                  np.zeros((2, 0, 4)), np.zeros((2, 0, 4)), np.zeros((2, 0, 3)),
                                  np.ones((2, 3, 4)), **kw)
    assert [x.shape for x in g] == [(2, 0, 3), (2, 0, 3), (3, 4), (2, 0, 4), (2, 0, 4)]
    assert (g[2] == 0).all()
    init = np.random.default_rng(0).standard_normal((1, 2, 3, 4))
    kw = dict(chunk_size=1, dt_softplus=False, has_d=False, has_z=False, has_dt_bias=False,
              has_initial_states=True)
    y, h = K.ssd_chunk_scan(np.zeros((1, 0, 2, 3)), np.zeros((1, 0, 2)), -np.ones(2),
                            np.zeros((1, 0, 2, 4)), np.zeros((1, 0, 2, 4)), init, **kw)
    np.testing.assert_array_equal(h, init)
