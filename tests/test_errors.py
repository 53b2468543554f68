"""Every invalid call raises fg.FuelGraphError when the node is built (no plan is compiled,
nothing runs), with a message that names the op and the offending input."""
from __future__ import annotations

import numpy as np
import pytest

import fuelgraph as fg
import fuelgraph.functional as F
from fuelgraph.registry import BackwardKind, call_fused
from fuelgraph.runtime import executor


def _t(shape, dtype=np.float64):
    return fg.tensor(np.zeros(shape, dtype))


# (id, thunk, substrings the message must contain: the op name first, then the input facts)
CASES = [
    ("matmul_inner", lambda: _t((2, 3)) @ _t((4, 5)), ["matmul", "(2, 3)", "(4, 5)"]),
    ("matmul_batch", lambda: _t((2, 3, 4)) @ _t((3, 4, 5)),
     ["matmul", "(2, 3, 4)", "(3, 4, 5)", "broadcast"]),
    ("matmul_0d", lambda: _t((2, 3)) @ _t(()), ["matmul", "()"]),
    ("matmul_1d", lambda: _t((3,)) @ _t((4,)), ["matmul", "(3,)", "(4,)"]),
    ("matmul_int", lambda: _t((2, 3), np.int64) @ _t((3, 2), np.int64), ["matmul", "int64"]),
    ("add_bcast", lambda: _t((2, 3)) + _t((4,)), ["add", "(2, 3)", "(4,)", "broadcast"]),
    ("mul_bcast", lambda: _t((2, 3, 4)) * _t((3, 1, 5)), ["mul", "(2, 3, 4)", "(3, 1, 5)"]),
    ("lt_bcast", lambda: _t((5,)) < _t((4,)), ["lt", "(5,)", "(4,)"]),
    ("where_bcast", lambda: fg.where(_t((2,), bool), _t((3,)), 0.0), ["where", "(2,)", "(3,)"]),
    ("where_cond_dtype", lambda: fg.where(_t((3,)), _t((3,)), _t((3,))),
     ["where", "condition", "float64"]),
    ("broadcast_to", lambda: _t((2, 3)).broadcast_to(3, 3), ["broadcast_to", "(2, 3)", "(3, 3)"]),
    ("sum_axis", lambda: _t((2, 3)).sum(2), ["sum", "axis 2", "(2, 3)"]),
    ("sum_axis_neg", lambda: _t((2, 3)).sum(-3), ["sum", "-3", "(2, 3)"]),
    ("sum_axis_tuple", lambda: _t((2, 3)).sum((0, 5)), ["sum", "5", "(2, 3)"]),
    ("sum_repeated", lambda: _t((2, 3)).sum((1, -1)), ["sum", "repeated"]),
    ("max_axis", lambda: _t((2, 3)).max(4), ["max", "axis 4", "(2, 3)"]),
    ("min_axis", lambda: _t((2, 3)).min(-7, keepdim=True), ["min", "-7", "(2, 3)"]),
    ("mean_axis", lambda: _t((4,)).mean(1), ["mean", "axis 1", "(4,)"]),
    ("prod_axis", lambda: _t(()).prod(0), ["prod", "axis 0", "()"]),
    ("max_empty", lambda: _t((2, 0)).max(1), ["max", "(2, 0)"]),
    ("transpose_axis", lambda: _t((2, 3)).transpose(0, 2), ["transpose", "axis 2", "(2, 3)"]),
    ("transpose_neg", lambda: _t((2, 3)).transpose(-3, 0), ["transpose", "-3", "(2, 3)"]),
    ("permute", lambda: _t((2, 3)).permute(0, 0), ["permute", "(0, 0)", "(2, 3)"]),
    ("permute_rank", lambda: _t((2, 3)).permute(1, 0, 2), ["permute", "(2, 3)"]),
    ("reshape", lambda: _t((2, 3)).reshape(4, 2), ["reshape", "(2, 3)", "(4, 2)"]),
    ("reshape_infer", lambda: _t((2, 3)).reshape(-1, 4), ["reshape", "(2, 3)", "(-1, 4)"]),
    ("reshape_two_infer", lambda: _t((2, 3)).reshape(-1, -1), ["reshape", "(-1, -1)"]),
    ("squeeze", lambda: _t((2, 3)).squeeze(0), ["squeeze", "(2, 3)"]),
    ("pad_pairs", lambda: _t((2, 3)).pad([(1, 1)]), ["pad", "2", "1"]),
    ("softmax_int", lambda: F.softmax_last_dim(_t((2, 3), np.int64)),
     ["softmax_last_dim", "x", "int64"]),
    ("softmax_int32", lambda: F.softmax_last_dim(_t((4,), np.int32)),
     ["softmax_last_dim", "x", "int32"]),
    ("softmax_bool", lambda: F.softmax_last_dim(_t((4,), bool)), ["softmax_last_dim", "bool"]),
    ("softmax_rank0", lambda: F.softmax_last_dim(_t(())), ["softmax_last_dim", "x", "()", "rank"]),
    ("softmax_arity", lambda: call_fused(fg.FusedOps.SOFTMAX_LAST_DIM, _t((3,)), _t((3,))),
     ["softmax_last_dim", "1", "2"]),
    ("softmax_params", lambda: call_fused(fg.FusedOps.SOFTMAX_LAST_DIM, _t((3,)), axis=0),
     ["softmax_last_dim", "axis"]),
    ("softmax_not_tensor", lambda: F.softmax_last_dim(np.zeros(3)),
     ["softmax_last_dim", "input 0", "ndarray"]),
    ("rms_norm_int32", lambda: F.rms_norm_last_dim(_t((3, 4), np.int32)),
     ["rms_norm_last_dim", "x", "int32"]),
    ("layer_norm_empty_rows", lambda: F.layer_norm_last_dim(_t((3, 0), np.float32)),
     ["layer_norm_last_dim", "x", "(3, 0)"]),
    ("reduce_max_bw_grad_shape",
     lambda: F.reduce_max_to_backward(_t((3, 4), np.float32), _t((3, 2), np.float32)),
     ["reduce_max_to_backward", "grad", "(3, 2)", "(3, 4)"]),
    ("softmax_bw_shape", lambda: F.softmax_last_dim_backward(_t((2, 3)), _t((2, 4))),
     ["softmax_last_dim_backward", "grad", "(2, 4)", "(2, 3)"]),
    ("softmax_bw_dtype",
     lambda: F.softmax_last_dim_backward(_t((2, 3)), _t((2, 3), np.float32)),
     ["softmax_last_dim_backward", "grad", "float32", "float64"]),
    ("softmax_bw_int", lambda: F.softmax_last_dim_backward(_t((3,), np.int64), _t((3,), np.int64)),
     ["softmax_last_dim_backward", "y", "int64"]),
    ("softmax_bw_rank0", lambda: F.softmax_last_dim_backward(_t(()), _t(())),
     ["softmax_last_dim_backward", "y", "()"]),
    ("gather_float_index", lambda: _t((2, 3)).gather(1, _t((2, 3))),
     ["gather", "index", "float64"]),
    ("gather_rank", lambda: _t((2, 3)).gather(1, _t((3,), np.int64)),
     ["gather", "(3,)", "(2, 3)"]),
    ("gather_too_big", lambda: _t((2, 3)).gather(1, _t((3, 3), np.int64)),
     ["gather", "(3, 3)", "(2, 3)"]),
    ("gather_axis", lambda: _t((2, 3)).gather(2, _t((2, 3), np.int64)), ["gather", "axis 2"]),
    ("take_float_index", lambda: _t((4,)).take(_t((2,)), 0), ["take", "index", "float64"]),
    ("scatter_add_shapes",
     lambda: _t((2, 3)).scatter_add(1, _t((2, 3), np.int64), _t((2, 2))),
     ["scatter_add", "(2, 3)", "(2, 2)"]),
    ("scatter_add_float_index", lambda: _t((2, 3)).scatter_add(1, _t((2, 3)), _t((2, 3))),
     ["scatter_add", "index", "float64"]),
    ("getitem_range", lambda: _t((2, 3))[2], ["getitem", "2", "axis 0", "size 2"]),
    ("getitem_range_neg", lambda: _t((2, 3))[:, -4], ["getitem", "-4", "axis 1", "size 3"]),
    ("getitem_too_many", lambda: _t((2, 3))[0, 0, 0], ["getitem", "(2, 3)"]),
    ("getitem_two_ellipsis", lambda: _t((2, 3))[..., 0, ...], ["getitem", "ellipsis"]),
    ("getitem_type", lambda: _t((2, 3))["a"], ["getitem", "'a'"]),
    ("cat_rank", lambda: fg.cat([_t((2, 3)), _t((3,))]), ["cat", "(2, 3)", "(3,)"]),
    ("cat_shape", lambda: fg.cat([_t((2, 3)), _t((3, 3))], 1), ["cat", "(3, 3)", "(2, 3)"]),
    ("cat_axis", lambda: fg.cat([_t((2, 3)), _t((2, 3))], 2), ["cat", "axis 2"]),
    ("cat_empty", lambda: fg.cat([]), ["cat"]),
    ("requires_grad_int", lambda: fg.tensor(np.arange(3), requires_grad=True),
     ["tensor", "requires_grad", "int64"]),
    ("requires_grad_bool", lambda: fg.tensor(np.ones(3, bool), requires_grad=True),
     ["tensor", "requires_grad", "bool"]),
    ("requires_grad_setter", lambda: setattr(_t((3,), np.int32), "requires_grad", True),
     ["requires_grad", "int32"]),
    ("grad_nonscalar", lambda: _grad_nonscalar(), ["grad", "(2, 3)", "scalar", "grad_outputs"]),
    ("backward_nonscalar", lambda: _backward_nonscalar(), ["grad", "(4,)", "scalar"]),
    ("grad_output_shape", lambda: _grad_output_shape(), ["grad", "(3,)", "(2, 3)"]),
    ("grad_int_output", lambda: _grad_int_output(), ["grad", "int64"]),
    ("registry_unknown_id", lambda: fg.default_registry().entry(9999), ["registry", "9999"]),
    ("registry_unknown_runtime_id", lambda: fg.default_registry().entry(0x7FFFFF),
     ["registry", str(0x7FFFFF)]),
    ("registry_unknown_name", lambda: fg.default_registry().entry("no_such_op"),
     ["registry", "no_such_op"]),
    ("registry_unassigned", lambda: fg.default_registry().entry(fg.FusedOps.UNASSIGNED),
     ["registry", "0"]),
    ("call_fused_unknown", lambda: call_fused(4242, _t((3,))), ["registry", "4242"]),
    ("dtype_unknown", lambda: fg.tensor([1.0], dtype="complex64"), ["dtype", "complex64"]),
    ("device_unknown", lambda: fg.tensor([1.0], device="tpu"), ["tensor", "device", "tpu"]),
    ("bitwise_float", lambda: _t((3,)) & _t((3,)), ["and", "float64"]),
    ("arith_bool", lambda: _t((3,), bool) + _t((3,), bool), ["add", "bool"]),
    ("bitcast_size", lambda: _t((3,)).bitcast(fg.int32), ["bitcast", "int32"]),
    ("operand_type", lambda: _t((3,)) + "x", ["operand", "str"]),
]


def _grad_nonscalar():
    x = fg.tensor(np.ones((2, 3)), requires_grad=True)
    fg.grad(x * 2.0, [x])


def _backward_nonscalar():
    x = fg.tensor(np.ones(4), requires_grad=True)
    y = x.exp()
    y.backward()


def _grad_output_shape():
    x = fg.tensor(np.ones((2, 3)), requires_grad=True)
    fg.grad([x * 2.0], [x], [fg.tensor(np.ones(3))])


def _grad_int_output():
    x = fg.tensor(np.ones(3), requires_grad=True)
    fg.grad((x * 2.0).astype(fg.int64).sum(), [x])


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_invalid_call_raises_at_build_time(case):
    _, thunk, needles = case
    before = dict(executor.STATS)
    with pytest.raises(fg.FuelGraphError) as ei:
        thunk()
    msg = str(ei.value)
    assert msg.startswith(needles[0]) or f"{needles[0]}:" in msg, msg
    for n in needles[1:]:
        assert n in msg, f"{n!r} not in {msg!r}"
    assert executor.STATS == before, "the error must come before any plan is compiled or run"


def test_errors_are_not_raised_for_the_valid_neighbours():
    """Guard against over-eager validation: the closest valid calls build fine."""
    x = _t((2, 3))
    assert (x @ _t((3, 4))).shape == (2, 4)
    assert (x + _t((3,))).shape == (2, 3)
    assert x.sum(-2).shape == (3,) and x.max((0, 1)).shape == () and x.transpose(-1, 0).shape == (3, 2)
    assert x.reshape(3, -1).shape == (3, 2)
    assert F.softmax_last_dim(_t((1,), np.float32)).shape == (1,)
    assert F.softmax_last_dim_backward(x, x).shape == (2, 3)
    assert x.gather(1, _t((1, 2), np.int32)).shape == (1, 2)
    assert x[-2, -3].shape == () and x[5:].shape == (0, 3)
    assert fg.cat([x, _t((2, 0))], 1).shape == (2, 3)
    assert fg.default_registry().entry("SOFTMAX_LAST_DIM").id == 1


def test_not_differentiable_fused_op_raises_clear_error():
    reg = fg.default_registry()

    def nd_recipe(x):
        return (x * 2.71828).floor() + x

    fid = reg.register("test_errors_not_differentiable", nd_recipe,
                       lambda rng: [rng.standard_normal((2, 3)).astype(np.float32)],
                       backward=BackwardKind.NOT_DIFFERENTIABLE)
    x = fg.tensor(np.ones((2, 3), np.float32), requires_grad=True)
    y = call_fused(fid, x)
    np.testing.assert_array_equal(y.numpy(), np.full((2, 3), 3.0, np.float32))
    with pytest.raises(fg.FuelGraphError, match="test_errors_not_differentiable.*not differentiable"):
        fg.grad(y.sum(), [x])
    with pytest.raises(fg.FuelGraphError, match="not differentiable"):
        y.sum().backward()
    # the same math written in primitives stays differentiable: autograd must not fuse an
    # idiom into an op that refuses to be differentiated
    (g,) = fg.grad(nd_recipe(x).sum(), [x])
    np.testing.assert_array_equal(g.numpy(), np.ones((2, 3), np.float32))


def test_runtime_op_validates_its_inputs():
    reg = fg.default_registry()

    def sq_recipe(x, y):
        return x * y + x * 0.123456

    fid = reg.register("test_errors_xy_plus_x", sq_recipe,
                       lambda rng: [rng.standard_normal((2, 3)).astype(np.float32)] * 2)
    with pytest.raises(fg.FuelGraphError, match="test_errors_xy_plus_x.*input"):
        call_fused(fid, _t((2, 3), np.float32))
    with pytest.raises(fg.FuelGraphError, match="test_errors_xy_plus_x.*input 1"):
        call_fused(fid, _t((2, 3), np.float32), _t((2, 3), np.int32))


# ---- bad calls found in review: every one is a FuelGraphError at build time ------------------
BAD_CALLS = {
    "ragged data": lambda: fg.tensor([[1, 2], [3]]),
    "sum over a float axis": lambda: fg.tensor(np.ones((2, 3))).sum(1.0),
    "full with a string": lambda: fg.full((2,), "a"),
    "arange step 0": lambda: fg.arange(0, 1, 0),
    "int32 plus a too-large int": lambda: fg.tensor(np.ones(2, np.int32)) + 2 ** 40,
    "grad wrt a float": lambda: fg.grad(fg.tensor([1.0]).sum(), [1.0]),
    "grad with a float cotangent": lambda: (lambda x: fg.grad(x.sum(), [x], [1.0]))(
        fg.tensor([1.0], requires_grad=True)),
    "unhashable param": lambda: F.inplace_affine(fg.tensor([1.0]), [1.0], 0.0),
    "unsqueeze out of range": lambda: fg.tensor(np.ones((2, 3))).unsqueeze(10),
    "bool index": lambda: fg.tensor(np.ones((2, 3)))[True],
    "powi with a fractional exp": lambda: F.powi_backward(fg.tensor([4.0]), fg.tensor([1.0]), 1.5),
    "rope interleaved as a string": lambda: F.rope(fg.tensor(np.ones((2, 4))), fg.tensor(np.ones((2, 4))),
                                                   fg.tensor(np.ones((2, 4))), interleaved="False"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_bad_call_raises_fuelgraph_error(case):
    with pytest.raises(fg.FuelGraphError):
        BAD_CALLS[case]()


def test_python_bool_condition_and_array_operands_are_accepted():
    x = fg.tensor(np.arange(3.0))
    np.testing.assert_array_equal(fg.where(True, x, -x).numpy(), np.arange(3.0))
    np.testing.assert_array_equal(fg.cat([x, np.ones(2)]).numpy(), np.r_[np.arange(3.0), 1, 1])
