"""Debuggability: repr shows values (small tensors computed, large ones summarized), a kernel
error names the op and the user's line that built it, explain near misses name ops and user
lines, CUDA unavailable and torch operands give clean FuelGraphErrors."""
import inspect

import numpy as np
import pytest
import torch

import fuelgraph as fg
from fuelgraph import FuelGraphError


def test_repr_shows_values_like_torch():
    x = fg.tensor(np.array([[1.0, 2.5], [3.0, -4.0]], np.float32))
    assert repr(x) == "tensor([[ 1. ,  2.5],\n        [ 3. , -4. ]])"
    assert str(x * 2).startswith("tensor([[ 2.,  5.]")
    assert "requires_grad=True" in repr(fg.tensor([1.0], requires_grad=True))
    assert "dtype=fg.bfloat16" in repr(x.astype(fg.bfloat16))
    big = fg.ones((100, 100)) * 2
    r = repr(big)
    assert "not computed yet" in r and "(100, 100)" in r
    big.realize()
    r = repr(big)
    assert "..." in r and r.count("\n") < 10      # summarized corners


def test_runtime_error_names_op_and_user_line():
    x = fg.tensor(np.arange(5, dtype=np.float32))
    line = inspect.currentframe().f_lineno + 1
    y = x.take(fg.tensor(np.array([1, 7])))       # index 7 is out of range at run time
    with pytest.raises(FuelGraphError) as e:
        y.numpy()
    msg = str(e.value)
    assert msg.startswith("take: index 7 out of range") and f"built at {__file__}:{line}" in msg


def test_gradient_errors_name_the_forward_line():
    w = fg.tensor(np.ones((3, 2), np.float32), requires_grad=True)
    line = inspect.currentframe().f_lineno + 1
    y = w.take(fg.tensor(np.array([0, 5])), 0)
    y.sum().backward()
    with pytest.raises(FuelGraphError, match=f"test_debug.py:{line}"):
        w.grad.numpy()


def test_explain_near_misses_name_ops_and_lines():
    x = fg.tensor(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    e = (x - x.max(-1, keepdim=True)).exp()
    line = inspect.currentframe().f_lineno + 1
    s = e.sum(-1, keepdim=True)
    y = e / s
    why = fg.explain([y, s]).near_misses["softmax_last_dim"]
    assert f"[sum built at {__file__}:{line}" in why and "%" not in why


def test_cuda_unavailable_is_a_clean_error():
    if fg.available_backends()["cuda"] is None:
        pytest.skip("a GPU is present")
    with pytest.raises(FuelGraphError, match="backend cuda is unavailable"):
        fg.tensor(np.ones(3), device="cuda")
    with pytest.raises(FuelGraphError, match="backend cuda is unavailable"):
        fg.zeros(3, device="cuda").numpy()


def test_torch_operand_says_what_to_call():
    x = fg.ones(3)
    for bad in (lambda: x + torch.ones(3), lambda: torch.ones(3) + x, lambda: x * torch.ones(3)):
        with pytest.raises((FuelGraphError, TypeError), match="fuelgraph.from_torch"):
            bad()
