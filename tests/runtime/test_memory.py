"""fg.plan_report: FLOPs, bytes moved and the peak memory a plan will allocate, predicted
before running, against the peak measured by running it (tracemalloc on NumPy)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph.backends import kernels_for
from fuelgraph.backends.base import KERNELS
from fuelgraph.ir import ops
from fuelgraph.registry.core import FusedOps
from fuelgraph.runtime.strides import c_strides, reshape_strides, view_strides

from viewer_models import demo_graph, gpt_block

MIB = 2 ** 20


@pytest.mark.parametrize("build", [demo_graph, gpt_block], ids=["demo", "gpt_block"])
def test_predicted_peak_within_10_percent_of_measured(build):
    rep = fg.plan_report(build(), measure=True)
    assert rep.peak_bytes > 4 * MIB
    assert 0.9 <= rep.agreement <= 1.1, str(rep)
    assert rep.flops > 1e8 and rep.bytes_moved > rep.peak_bytes
    assert "measured" in str(rep)


def test_totals_match_hand_counts():
    """matmul [64,32]@[32,16] then exp: 2*64*32*16 + 64*16 FLOPs; peak holds both results
    while exp runs (the matmul output dies after it)."""
    a = fg.tensor(np.ones((64, 32), np.float32))
    b = fg.tensor(np.ones((32, 16), np.float32))
    rep = fg.plan_report([(a @ b).exp()])
    assert rep.flops == 2 * 64 * 32 * 16 + 64 * 16
    assert rep.peak_bytes == 2 * 64 * 16 * 4
    assert rep.output_bytes == 64 * 16 * 4
    assert rep.input_bytes == (64 * 32 + 32 * 16) * 4
    # matmul reads both inputs and writes 64x16; exp reads and writes 64x16
    assert rep.bytes_moved == 4 * (64 * 32 + 32 * 16 + 64 * 16) + 4 * 2 * 64 * 16


def test_inplace_reuse_counted(monkeypatch):
    """An in-place affine on a dead intermediate allocates nothing; on a value read later it
    needs a fresh buffer. Predicted and measured agree either way. (Glue regions off: with
    them, the exp and the affine run as one generated kernel, with no buffer to reuse.)"""
    from fuelgraph.opt import regions
    from fuelgraph.runtime import executor
    monkeypatch.setattr(regions, "ENABLED", False)
    executor._PLANS.clear()
    x = fg.tensor(np.ones((256, 1024), np.float32))
    y = x.exp()
    reused = fg.plan_report([F.inplace_affine(y, 2.0, 1.0)], measure=True)
    assert reused.inplace_reused == 1
    assert reused.peak_bytes == 256 * 1024 * 4
    kept = fg.plan_report([F.inplace_affine(y, 2.0, 1.0) + y], measure=True)
    assert kept.inplace_reused == 0
    assert kept.peak_bytes == 3 * 256 * 1024 * 4
    for r in (reused, kept):
        assert 0.95 <= r.agreement <= 1.05, str(r)


def test_views_share_storage_and_strided_inputs_are_copied():
    """A permute is free; a reshape of the permuted array must copy (as NumPy does); a fused
    kernel that wants contiguous input gets a copy that replaces the view in its slot, so the
    exp output that only the view held is freed before the kernel allocates its own."""
    x = fg.tensor(np.ones((16, 64, 256), np.float32))
    p = x.exp().permute(0, 2, 1)
    rep = fg.plan_report([F.softmax_last_dim(p)], measure=True)
    assert rep.copies == 1
    assert rep.peak_bytes == 2 * 16 * 64 * 256 * 4     # the copy and the softmax output
    assert 0.95 <= rep.agreement <= 1.05, str(rep)
    rep2 = fg.plan_report([p.reshape(16, 64 * 256) * 2.0], measure=True)
    assert rep2.copies == 1 and 0.95 <= rep2.agreement <= 1.05, str(rep2)


def test_stride_rules():
    assert reshape_strides((4, 6), c_strides((4, 6)), (2, 2, 6)) == (12, 6, 1)
    t = view_strides(ops.Permute((1, 0)), (4, 6), (6, 1))
    assert t == (1, 6)
    assert reshape_strides((6, 4), t, (24,)) is None                 # merge across a gap
    assert reshape_strides((6, 4), t, (3, 2, 4)) == (2, 1, 6)        # split: still a view
    assert view_strides(ops.BroadcastTo((4, 6)), (1, 6), (6, 1)) == (0, 1)


def test_declared_kernel_workspace_is_counted(monkeypatch):
    """Scratch memory a kernel declares (`@kernel(workspace=...)`) counts while it runs."""
    key = (int(FusedOps.SOFTMAX_LAST_DIM), "numpy")
    kernels_for(key[0], "numpy")
    base = fg.plan_report([F.softmax_last_dim(fg.tensor(np.ones((64, 128), np.float32)))])
    monkeypatch.setitem(KERNELS, key, [dataclasses.replace(k, workspace=lambda s, d, p: 12345)
                                       for k in KERNELS[key]])
    x = fg.tensor(np.ones((64, 128), np.float32))
    assert fg.plan_report([F.softmax_last_dim(x)]).peak_bytes == base.peak_bytes + 12345


def test_explain_report_gives_the_plan_report():
    x = fg.tensor(np.ones((4, 8), np.float32))
    e = (x - x.max(-1, keepdim=True)).exp()
    y = e / e.sum(-1, keepdim=True)
    rep = fg.explain([y]).plan_report()
    assert rep.backend == "numpy" and rep.steps >= 1 and rep.measured_peak_bytes is None


def test_a_contiguous_copy_serves_every_later_reader():
    """Two kernels that want the same permuted value contiguous: one copy, kept in the slot
    for the second reader (attention's grad_out is read so by its delta and its backward)."""
    x = fg.tensor(np.ones((8, 128, 256), np.float32))
    p = x.exp().permute(0, 2, 1)
    outs = [F.softmax_last_dim(p), F.rms_norm_last_dim(p)]
    rep = fg.plan_report(outs, measure=True)
    assert rep.copies == 1 and 0.9 <= rep.agreement <= 1.1, str(rep)
    want = np.exp(np.ones((8, 256, 128)))
    np.testing.assert_allclose(fg.realize(outs)[0], want / want.sum(-1, keepdims=True),
                               rtol=1e-6)
