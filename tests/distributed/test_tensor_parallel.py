"""Tensor parallelism over two gloo processes: a Llama-style model built from fuelgraph.nn
(grouped-query attention with RoPE, a SiLU-gated MLP with biases) converted by `parallelize`
(column/row-parallel projections, head-parallel attention, a gathered output head) and loaded
from a full safetensors checkpoint by `load_sharded` gives the single-device model's logits,
and trains step for step like it (each process's slice of every weight); so does
fuelgraph.models' Llama split by `llama_plan()` and loaded from a checkpoint directory. In one
process: slicing of checkpoints and the errors of `parallelize`."""
import numpy as np
import pytest

import fuelgraph as fg
import fuelgraph.distributed as dist
import fuelgraph.nn as nn
from fuelgraph import FuelGraphError
from fuelgraph.registry.collective import register_group, unregister_group
from tests.distributed import scenarios as S
from tests.distributed.harness import results


def test_logits_equal_the_single_device_model():
    for r in results("tensor_parallel"):
        assert r["logits"].shape == (S.TP["batch"], S.TP["seq"], S.TP["vocab"])
        np.testing.assert_allclose(r["logits"], r["logits_full"], rtol=1e-5, atol=1e-5)


def test_training_steps_equal_the_single_device_model():
    for rank, r in enumerate(results("tensor_parallel")):
        for tp_loss, full_loss in r["losses"]:
            np.testing.assert_allclose(tp_loss, full_loss, rtol=1e-5)
        _check_shards(r, rank)


def _check_shards(r, rank, rtol=1e-4, atol=1e-5):
    for k, v in r["tp_params"].items():
        owner, _, local = k.rpartition(".")
        axis = r["shard_axes"][owner].get(local)
        want = r["full_params"][k]
        if axis is not None:
            want = np.split(want, 2, axis)[rank]
        np.testing.assert_allclose(v, want, rtol=rtol, atol=atol, err_msg=k)


def test_llama_from_a_checkpoint_directory_equals_the_single_device_llama():
    """fuelgraph.models.LlamaForCausalLM split by llama_plan() (biased attention, GQA, untied
    head), loaded from a save_pretrained directory: logits, loss and one step."""
    for rank, r in enumerate(results("tensor_parallel_llama")):
        assert r["heads"] == (2, 1)
        np.testing.assert_allclose(r["logits"], r["logits_full"], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(*r["losses"], rtol=1e-6)
        _check_shards(r, rank)


def test_replicated_parameters_stay_identical():
    a, b = results("tensor_parallel")
    for k in a["tp_params"]:
        owner, _, local = k.rpartition(".")
        if a["shard_axes"][owner].get(local) is None:
            np.testing.assert_array_equal(a["tp_params"][k], b["tp_params"][k], err_msg=k)


@pytest.fixture(params=[0, 1])
def half(request):
    """A 2-process group seen from process `param` (slicing needs no peers)."""
    register_group("half", 2, request.param)
    yield request.param
    unregister_group("half")


def test_load_sharded_reads_this_process_slices(half, tmp_path):
    full = S.tiny_lm(seed=0)
    path = tmp_path / "full.safetensors"
    fg.save(full.state_dict(), path)
    for source in (str(path), full.state_dict()):
        tp = dist.parallelize(S.tiny_lm(seed=3), S.tp_plan(), group="half")
        dist.load_sharded(tp, source, group="half")
        sd = tp.state_dict()
        for k, v in full.state_dict().items():
            owner, _, local = k.rpartition(".")
            axis = getattr(dict(tp.named_modules())[owner], "shard_axes", {}).get(local)
            want = v.numpy() if axis is None else np.split(v.numpy(), 2, axis)[half]
            np.testing.assert_array_equal(sd[k].numpy(), want, err_msg=k)
    attn = tp.blocks[0].attn
    assert (attn.heads, attn.kv_heads) == (2, 1)
    assert tp.blocks[1].mlp.down.weight.shape == (S.TP["dim"], S.TP["ffn"] // 2)


def test_parallel_layers_initialize_as_the_full_linear(half):
    fg.manual_seed(4)
    lin = nn.Linear(6, 8)
    fg.manual_seed(4)
    col = dist.ColumnParallelLinear(6, 8, group="half")
    np.testing.assert_array_equal(col.weight.numpy(), lin.weight.numpy()[4 * half:4 * half + 4])
    fg.manual_seed(4)
    row = dist.RowParallelLinear(8, 6, group="half")
    fg.manual_seed(4)
    lin = nn.Linear(8, 6)
    np.testing.assert_array_equal(row.weight.numpy(), lin.weight.numpy()[:, 4 * half:4 * half + 4])
    np.testing.assert_array_equal(row.bias.numpy(), lin.bias.numpy())


def test_parallelize_errors(half):
    with pytest.raises(FuelGraphError, match="matches no module"):
        dist.parallelize(S.tiny_lm(), {"nothing.*": "column"}, group="half")
    with pytest.raises(FuelGraphError, match="applies to fuelgraph.nn.Linear"):
        dist.parallelize(S.tiny_lm(), {"norm": "row"}, group="half")
    with pytest.raises(FuelGraphError, match="unknown style"):
        dist.parallelize(S.tiny_lm(), {"head": "diagonal"}, group="half")
    with pytest.raises(FuelGraphError, match="expected an int"):
        dist.parallelize(S.tiny_lm(), {"blocks.*.attn": dist.Heads("wq")}, group="half")
    with pytest.raises(FuelGraphError, match="not divisible by the group size 2"):
        dist.parallelize(nn.Sequential(nn.Linear(3, 5)), {"0": "column"}, group="half")
    tp = dist.parallelize(S.tiny_lm(), S.tp_plan(), group="half")
    with pytest.raises(FuelGraphError, match=r"expected \(48, 32\)"):
        dist.load_sharded(tp, {**S.tiny_lm().state_dict(), "emb.weight": np.zeros((4, 4))},
                          group="half")
    with pytest.raises(FuelGraphError, match="unexpected keys"):
        dist.load_sharded(tp, {**S.tiny_lm().state_dict(), "extra": np.zeros(2)}, group="half")
