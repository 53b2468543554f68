"""paged_attn fuses from its recipe (with and without ALiBi slopes and a softcap, 32- and
16-bit, decode and chunked prefill), the form with the recipe's guards written out by hand:
value equal to a float64 reference, softmax_scale and softcap read back. Attention written
plainly over the gathered blocks does not fuse: it differs from paged_attn on valid data (an
empty sequence), which a plan cached by structure cannot see."""
import math

import numpy as np
import pytest

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph.ir import ops
from fuelgraph.ir.node import toposort
from fuelgraph.registry.core import FusedOps
from fuelgraph.registry.paged import paged_attn_recipe, plain_paged_attention
from registry.test_paged import make_case, paged_reference


def fused_nodes(outs):
    res = fg.optimize(outs if isinstance(outs, list) else [outs])
    return [n for n in toposort(res.outputs) if isinstance(n.op, ops.Fused)]


FORMS = [dict(), dict(softcap=20.0), dict(alibi=True), dict(alibi=True, softcap=5.0)]


@pytest.mark.parametrize("sq", [1, 3])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("form", FORMS, ids=str)
def test_paged_attn_recipe_refuses(form, dtype, sq):
    case = make_case(np.random.default_rng(0), sq=sq, lens=(9, 0, 5), dtype=dtype,
                     alibi=form.get("alibi", False))
    ts = [fg.tensor(v) for v in case.values()]
    y = F.paged_attn(*ts[:5], alibi_slopes=ts[5] if len(ts) == 6 else None,
                     softcap=form.get("softcap"))
    (low,) = fg.default_registry().entry(FusedOps.PAGED_ATTN).lower(ts, y.node.op.params)
    (node,) = fused_nodes(low)
    assert node.op.id == FusedOps.PAGED_ATTN and node.op.params == y.node.op.params
    assert [s.dtype for s in node.srcs] == [t.dtype for t in ts]     # 16-bit stays 16-bit
    np.testing.assert_allclose(low.numpy().astype(np.float64), y.numpy().astype(np.float64),
                               rtol=2e-2, atol=2e-2)


def test_guarded_attention_written_by_hand_fuses_and_matches_torch():
    case = make_case(np.random.default_rng(1), sq=2, lens=(9, 0, 5), alibi=True)
    ts = [fg.tensor(v) for v in case.values()]
    y = paged_attn_recipe(*ts, softmax_scale=0.3, softcap=10.0)
    rep = fg.explain(y)
    assert rep.fused_ops == {"paged_attn": 1}, str(rep)
    assert "paged_attn x1" in str(rep)
    ref = paged_reference(*case.values(), scale=0.3, softcap=10.0)
    np.testing.assert_allclose(y.numpy(), ref, rtol=1e-5, atol=1e-5)


def test_plain_attention_over_gathered_blocks_does_not_fuse():
    """Attention as first written over the gathered blocks: an empty sequence (context_lens 0)
    gives NaN rows here and zeros in paged_attn, so it keeps its own values; explain's near
    miss says why."""
    case = make_case(np.random.default_rng(2), hq=2, hkv=2, lens=(9, 0, 5), extra_blocks=0)
    case["block_table"] = np.where(case["block_table"] == np.iinfo(np.int32).max, 0,
                                   case["block_table"]).astype(np.int32)
    ts = [fg.tensor(v) for v in case.values()]
    y = plain_paged_attention(*ts, softmax_scale=1.0 / math.sqrt(16))
    rep = fg.explain(y)
    assert "paged_attn" not in rep.fused_ops
    assert "context_lens 0 gives NaN rows" in rep.near_misses["paged_attn"]   # says why
    got = y.numpy()
    assert np.isnan(got[1]).all()
    ref = paged_reference(*case.values())
    np.testing.assert_allclose(got[[0, 2]], ref[[0, 2]], rtol=1e-5, atol=1e-5)


def test_every_pattern_holds_the_ops_its_entry_needs():
    """The fuser skips deriving an op's patterns when the graph lacks an op type the entry
    declares in pattern_needs: that is only sound if every pattern holds one."""
    from fuelgraph.opt.pattern import patterns_of
    declared = [e for e in fg.default_registry() if e.pattern_needs]
    assert {e.name for e in declared} >= {"paged_attn", "qmatmul", "nf4_matmul",
                                          "selective_scan", "ssd_chunk_scan"}
    for e in declared:
        for p in patterns_of(e):
            held = {type(n.op) for n in toposort([p.root])}
            assert set(e.pattern_needs) <= held, (e.name, p.name)
