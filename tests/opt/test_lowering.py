"""Lowering a fused op that a backend runs as its recipe: the recipe lands on the very nodes of
the same idiom written by hand (canonical form, hash-consed), so a graph holding both -- as
autograd builds one, its backward reading a prefused copy of the forward -- computes it once.
The GPU runs silu_mul as its recipe; these tests hide the NumPy kernel to get the same
situation on the CPU."""
import numpy as np
import pytest
from transformers import LlamaConfig

import fuelgraph as fg
import fuelgraph.models as M
import fuelgraph.nn.functional as NF
from fuelgraph.ir.node import toposort
from fuelgraph.opt import passes
from fuelgraph.opt.passes import optimize
from fuelgraph.registry.core import call_fused
from fuelgraph.registry.linear import SILU_MUL


@pytest.fixture
def silu_mul_recipe_only(monkeypatch):
    """NumPy without a silu_mul kernel: the optimizer lowers it, as it does on the GPU."""
    real = passes.has_kernel
    monkeypatch.setattr(passes, "has_kernel", lambda op_id, *a, **k:
                        int(op_id) != int(SILU_MUL) and real(op_id, *a, **k))


def _names(vals):
    return [n.op.name for n in toposort(vals) if n.srcs]


def test_lowered_recipe_is_the_hand_written_idiom(silu_mul_recipe_only):
    gu = fg.tensor(np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32))
    g, u = gu[:, :4], gu[:, 4:]
    by_hand = NF.silu(g) * u
    fused = call_fused(SILU_MUL, g, u)
    res = optimize([by_hand.value, fused.value], "numpy")
    assert res.lowered == {"silu_mul": 1}
    assert res.outputs[0] == res.outputs[1]       # one node: computed once
    np.testing.assert_array_equal(by_hand.numpy(), fused.numpy())


@pytest.mark.parametrize("layers", [1, 3])
def test_training_step_computes_each_layer_once(silu_mul_recipe_only, layers):
    """A Llama step's loss and gradients: one attention forward per layer and the loss with its
    gradient as one fused_linear_cross_entropy_fwd_bwd node (the first version of silu_mul
    lowered to a differently ordered graph: every layer after the first ran twice, ~25% more
    time for the ~1B Llama step on the H200)."""
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64)
    cfg_cls, cls = M.ARCHITECTURES["LlamaForCausalLM"]
    model = cls(cfg_cls.from_hf(cfg.to_dict()), dtype=fg.float32)
    x = fg.tensor(np.random.default_rng(1).integers(0, 64, (1, 16)).astype(np.int64))
    loss = model(x, labels=x)
    loss.backward()
    grads = [p.grad.value for _, p in model.named_parameters()]
    names = _names(optimize([loss.value] + grads, "numpy").outputs)
    assert names.count("flash_attn") == layers
    assert names.count("fused_linear_cross_entropy_fwd_bwd") == 1
    assert "silu_mul" not in names and "silu_mul_backward" in names
