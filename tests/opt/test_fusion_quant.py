"""Quantized matmuls fuse: every recipe (each GGUF format, NF4, AWQ; 32- and 16-bit
activations) re-fuses into its op with n, k, block_size and group_size read back off the shapes,
and the weight dequantized by formula from its packed tensors then multiplied (`a @ W.T` for
GGUF and NF4, `a @ W` for AWQ, activations of any rank; NF4 also as a code-book lookup) fuses
once, with torch's value and gradient; a code book fed as data does not fuse."""
import gguf
import numpy as np
import pytest
import torch

import fuelgraph as fg
from fuelgraph.ir import ops
from fuelgraph.ir.node import toposort
from fuelgraph.registry import quant as RQ
from fuelgraph.registry.core import FusedOps
from quant_cases import NF4_PUBLISHED, awq_reference, gguf_bytes, nf4_reference


def fused_nodes(outs):
    res = fg.optimize(outs if isinstance(outs, list) else [outs])
    return [n for n in toposort(res.outputs) if isinstance(n.op, ops.Fused)]


def refuses(entry_id, srcs, params):
    """lower_all's recipe of the op, fused again: the single op with the same params."""
    lowered = fg.default_registry().entry(entry_id).lower(srcs, params)
    nodes = fused_nodes(list(lowered))
    assert [n.op.id for n in nodes] == [entry_id]
    assert nodes[0].op.params == params
    assert [s.dtype for s in nodes[0].srcs] == [s.dtype for s in srcs]
    return lowered


def check_value_and_grad(build, a, w_ref, transpose, rtol=1e-5):
    """build(a) fuses to one op; value and d(sum(out * G))/da equal torch's a @ W(.T)."""
    x = fg.tensor(a)
    y = build(x)
    assert len(fused_nodes(y)) == 1
    at = torch.tensor(a, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w_ref, dtype=torch.float64)
    yt = at @ (wt.T if transpose else wt)
    g = np.random.default_rng(5).standard_normal(tuple(yt.shape))
    yt.backward(torch.tensor(g))
    want = yt.detach().numpy()     # float32 sums: errors scale with the largest entry
    np.testing.assert_allclose(y.numpy(), want, rtol=rtol, atol=rtol * np.abs(want).max())
    (ga,) = fg.grad((y * fg.tensor(g.astype(np.float32))).sum(), [x])
    want = at.grad.numpy()
    np.testing.assert_allclose(ga.numpy(), want, rtol=rtol, atol=rtol * np.abs(want).max())
    return y


def rand(shape, seed):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ---- GGUF ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [fg.float32, fg.bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("qt", list(RQ.FORMATS))
def test_qmatmul_recipe_refuses(qt, dtype):
    wb = fg.tensor(gguf_bytes(np.random.default_rng(1), qt, 4, 256).reshape(-1))
    a = fg.tensor(rand((2, 3, 256), 0), dtype=dtype)
    y = RQ.qmatmul(a, wb, qt, 4, 256)
    low = refuses(FusedOps.QMATMUL, [a, wb], y.node.op.params)
    np.testing.assert_allclose(low[0].numpy().astype(np.float64),
                               y.numpy().astype(np.float64), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape", [(3, 256), (2, 3, 256)])
@pytest.mark.parametrize("qt", list(RQ.FORMATS))
def test_qmatmul_idiom_fuses(qt, shape):
    raw = gguf_bytes(np.random.default_rng(2), qt, 4, 256)
    w_ref = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType(RQ.FORMATS[qt].code))
    wb = fg.tensor(raw)
    y = check_value_and_grad(lambda a: a @ RQ.dequantize_gguf(wb, qt, 4, 256).T,
                             rand(shape, 3), w_ref, True)
    (node,) = fused_nodes(y)
    assert (node.op.name, node.op.params) == ("qmatmul", RQ.QMatMulParams(qt, 4, 256))


# ---- NF4 -----------------------------------------------------------------------------------------
def nf4_inputs(seed=0, n=4, k=128, block_size=32):
    rng = np.random.default_rng(seed)
    packed = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    absmax = rng.uniform(0.5, 2.0, (n, k // block_size)).astype(np.float32)
    return packed, absmax


@pytest.mark.parametrize("dtype", [fg.float32, fg.float16], ids=lambda d: d.name)
@pytest.mark.parametrize("block_size", [32, 64, 128])
def test_nf4_recipe_refuses(block_size, dtype):
    packed, absmax = nf4_inputs(block_size=block_size)
    srcs = [fg.tensor(rand((2, 3, 128), 0), dtype=dtype), fg.tensor(packed), fg.tensor(absmax)]
    y = RQ.nf4_matmul(*srcs, block_size=block_size)
    refuses(FusedOps.NF4_MATMUL, srcs, y.node.op.params)


def codebook_by_hand(w, absmax, block_size, code):
    """NF4 as people write it: nibbles (high first), code book lookup, absmax per block."""
    n, k = w.shape[0], 2 * w.shape[1]
    codes = fg.stack([w >> 4, w & 15], -1).reshape(n, k)
    return code[codes] * absmax.repeat_interleave(block_size, 1)


@pytest.mark.parametrize("spelling", ["library", "codebook"])
@pytest.mark.parametrize("shape", [(3, 128), (2, 3, 128)])
def test_nf4_idiom_fuses(shape, spelling):
    packed, absmax = nf4_inputs(1)
    w, s = fg.tensor(packed), fg.tensor(absmax)
    if spelling == "library":
        deq = lambda: RQ.dequantize_nf4(w, s, 32)        # noqa: E731
    else:
        code = fg.const(np.array(NF4_PUBLISHED, np.float32))
        deq = lambda: codebook_by_hand(w, s, 32, code)   # noqa: E731
    y = check_value_and_grad(lambda a: a @ deq().T, rand(shape, 4),
                             nf4_reference(packed, absmax, 32), True)
    (node,) = fused_nodes(y)
    assert (node.op.name, node.op.params) == ("nf4_matmul", RQ.NF4Params(32))


def test_nf4_codebook_fed_as_data_does_not_fuse():
    """A code book that is an input could hold other values on the next run of the cached
    plan: it is not the NF4 constant, so nothing fuses."""
    packed, absmax = nf4_inputs(2)
    code = fg.tensor(np.array(NF4_PUBLISHED, np.float32))
    a = fg.tensor(rand((3, 128), 5))
    y = a @ codebook_by_hand(fg.tensor(packed), fg.tensor(absmax), 32, code).T
    assert fg.explain(y).fused_ops == {}


# ---- AWQ -----------------------------------------------------------------------------------------
def awq_inputs(seed=0, k=128, n=16, group_size=32):
    rng = np.random.default_rng(seed)
    qw = rng.integers(-2 ** 31, 2 ** 31, (k, n // 8), dtype=np.int64).astype(np.int32)
    qz = rng.integers(-2 ** 31, 2 ** 31, (k // group_size, n // 8), dtype=np.int64)
    sc = rng.uniform(0.01, 0.1, (k // group_size, n)).astype(np.float16)
    return qw, qz.astype(np.int32), sc


@pytest.mark.parametrize("dtype", [fg.float32, fg.bfloat16], ids=lambda d: d.name)
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_awq_recipe_refuses(group_size, dtype):
    srcs = [fg.tensor(rand((2, 3, 128), 0), dtype=dtype)] + \
        [fg.tensor(t) for t in awq_inputs(group_size=group_size)]
    y = RQ.awq_matmul(*srcs, group_size=group_size)
    refuses(FusedOps.AWQ_MATMUL, srcs, y.node.op.params)


@pytest.mark.parametrize("shape", [(3, 128), (2, 3, 128)])
def test_awq_idiom_fuses(shape):
    qw, qz, sc = awq_inputs(1)
    ts = [fg.tensor(t) for t in (qw, qz, sc)]
    y = check_value_and_grad(lambda a: a @ RQ.dequantize_awq(*ts, 32), rand(shape, 6),
                             awq_reference(qw, qz, sc, 32), False)
    (node,) = fused_nodes(y)
    assert (node.op.name, node.op.params) == ("awq_matmul", RQ.AWQParams(32))


def test_explain_lists_the_quantized_idioms():
    a = fg.tensor(rand((3, 256), 7))
    wb = fg.tensor(gguf_bytes(np.random.default_rng(3), "Q4_K", 4, 256))
    packed, absmax = nf4_inputs(3, k=256)
    qw, qz, sc = awq_inputs(3, k=256)
    y = (a @ RQ.dequantize_gguf(wb, "Q4_K", 4, 256).T).sum() + \
        (a @ RQ.dequantize_nf4(fg.tensor(packed), fg.tensor(absmax), 32).T).sum() + \
        (a @ RQ.dequantize_awq(*(fg.tensor(t) for t in (qw, qz, sc)), 32)).sum()
    rep = fg.explain(y)
    for name in ("qmatmul", "nf4_matmul", "awq_matmul"):
        assert rep.fused_ops.get(name) == 1, str(rep)
        assert name in str(rep)
    # the lowered op fuses back under explain too
    low = fg.default_registry().entry(FusedOps.QMATMUL).lower(
        [a, wb], RQ.QMatMulParams("Q4_K", 4, 256))
    assert fg.explain(low[0]).fused_ops == {"qmatmul": 1}
