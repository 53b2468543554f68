"""fuelgraph.models Llama against transformers: logits, gradients, greedy generation with the
paged KV cache, AdamW training steps, rope scalings, fusion report, config errors."""
import json

import numpy as np
import pytest

from .train_oracle import adamw_steps_vs_torch
import torch

import fuelgraph as fg
import fuelgraph.models as M
from fuelgraph import FuelGraphError
from fuelgraph.models.llama import LlamaConfig, rope_inv_freq

#: ops every Llama forward must run fused, and that must never show up as a near miss
USED = {"flash_attn", "rms_norm_last_dim", "rope"}


def _ref_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor(ids)).logits.numpy()


def test_logits_match_transformers(hf_llama, ids):
    path, hf = hf_llama
    model = M.from_pretrained(path)
    assert isinstance(model, M.LlamaForCausalLM) and not model.training
    out = model(ids)
    assert tuple(out.shape) == (2, 64, 96)
    np.testing.assert_allclose(out.numpy(), _ref_logits(hf, ids), rtol=1e-4, atol=1e-5)


def test_parameters_are_named_leaves(hf_llama):
    model = M.from_pretrained(hf_llama[0])
    names = dict(model.named_parameters())
    assert set(names) == set(hf_llama[1].state_dict())
    assert all(p.requires_grad and p.is_leaf for p in names.values())


def test_fused_report(hf_llama, ids):
    model = M.from_pretrained(hf_llama[0])
    rep = fg.explain([model(ids, labels=ids)])
    assert rep.fused_ops["flash_attn"] == 2 and rep.fused_ops["rope"] == 4
    assert rep.fused_ops["rms_norm_last_dim"] == 5
    loss_ops = {"fused_softmax_cross_entropy", "fused_linear_cross_entropy"}
    assert sum(rep.fused_ops.get(k, 0) for k in loss_ops) == 1
    assert not rep.near_misses, rep.near_misses          # the issue: nothing as a near miss
    assert not rep.lowered


def test_loss_and_gradients_match_torch(hf_llama, ids):
    path, hf = hf_llama
    model = M.from_pretrained(path).train()
    loss = model(ids, labels=ids)
    loss.backward()
    hf.zero_grad()
    ref = hf(torch.tensor(ids), labels=torch.tensor(ids)).loss
    ref.backward()
    np.testing.assert_allclose(loss.item(), ref.item(), rtol=1e-5)
    params = dict(model.named_parameters())
    tref = dict(hf.named_parameters())
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                 "model.layers.0.mlp.down_proj.weight", "model.layers.1.input_layernorm.weight",
                 "model.embed_tokens.weight", "lm_head.weight"):
        g, r = params[name].grad.numpy(), tref[name].grad.numpy()
        np.testing.assert_allclose(g, r, rtol=1e-3, atol=1e-5 * np.abs(r).max(), err_msg=name)
    hf.zero_grad()


def test_greedy_generate_matches_transformers(hf_llama, ids):
    path, hf = hf_llama
    model = M.from_pretrained(path)
    prompt = ids[:, :11]                       # decode crosses a KV block boundary (16)
    out = model.generate(prompt, max_new_tokens=12)
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt), max_new_tokens=12, do_sample=False,
                          eos_token_id=None, pad_token_id=0).numpy()
    assert out.shape == (2, 23) and out.dtype == np.int64
    np.testing.assert_array_equal(out, ref)


def test_decode_loop_traces_once(hf_llama, ids):
    """Each decode token replays one traced step (no graph building per token); the KV pools
    are written in place; a later generate of a similar size reuses the decoder's traces."""
    from fuelgraph.ir.tensor import _DATA
    model = M.from_pretrained(hf_llama[0])
    out = model.generate(ids[:, :11], max_new_tokens=12)
    dec = model.decoder(2, 23)
    assert dec.prompt_step.stats == {"traces": 1, "replays": 0}
    assert dec.step.stats == {"traces": 1, "replays": 10}    # decode token 1, then 2..11 replay
    pool = dec.cache.pools(1)[1]
    buf = _DATA[pool.value.node]
    again = model.generate(ids[:, :9], max_new_tokens=20)    # new prompt length, same capacity
    assert model.decoder(2, 29) is dec
    assert dec.prompt_step.stats == {"traces": 2, "replays": 0}   # the new prompt length
    assert dec.step.stats == {"traces": 1, "replays": 29}
    assert np.shares_memory(buf, _DATA[pool.value.node])
    np.testing.assert_array_equal(model.generate(ids[:, :11], max_new_tokens=12), out)
    np.testing.assert_array_equal(model.generate(ids[:, :9], max_new_tokens=20), again)
    with torch.no_grad():
        ref = hf_llama[1].generate(torch.tensor(ids[:, :9]), max_new_tokens=20, do_sample=False,
                                   eos_token_id=None, pad_token_id=0).numpy()
    np.testing.assert_array_equal(again, ref)
    assert (dec.prompt_step.stats["traces"], dec.step.stats["traces"]) == (2, 1)


def test_decode_merges_projections_and_follows_new_weights(hf_llama, ids):
    """Decoding at batch 1 computes q/k/v and gate/up with one product each (the same tokens as
    transformers): the projections' weights become row views of one merged weight (no second
    copy). Weights loaded after that are merged again (the decoder's steps retraced): the
    tokens are a fresh model's."""
    from fuelgraph.ir.tensor import _DATA
    path, hf = hf_llama
    model = M.from_pretrained(path)
    prompt = ids[:1, :11]
    out = model.generate(prompt, max_new_tokens=8)
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0).numpy()
    np.testing.assert_array_equal(out, ref)
    attn = model.model.layers[1].self_attn
    q, k, v = (_DATA[p.weight.value.node] for p in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert q.base is not None and q.base is k.base is v.base          # rows of one array
    model.generate(ids[:, :11], max_new_tokens=8)       # another decoder shares the merge
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=8), out)
    assert model.decoder(1, 19).step.stats["traces"] == 1
    rng = np.random.default_rng(1)
    state = {n: p.numpy() * (1 + 0.5 * rng.standard_normal(p.shape)).astype(np.float32)
             for n, p in model.named_parameters()}
    model.load_state_dict(state)
    fresh = M.from_pretrained(path)
    fresh.load_state_dict(state)
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=8),
                                  fresh.generate(prompt, max_new_tokens=8))
    assert model.decoder(1, 19).step.stats["traces"] == 2       # retraced on the new weights
    np.testing.assert_array_equal(model.model.layers[0].mlp.up_proj.weight.numpy(),
                                  state["model.layers.0.mlp.up_proj.weight"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_decode_on_cuda_replays_one_cuda_graph_per_token(hf_llama, ids):
    """On the GPU the decode step is captured as a CUDA graph once and replayed per token, the
    weights captured where they are (no copy per replay); the tokens stay transformers'."""
    model = M.from_pretrained(hf_llama[0], device="cuda")
    prompt = ids[:, :11]
    out = model.generate(prompt, max_new_tokens=12)
    with torch.no_grad():
        ref = hf_llama[1].generate(torch.tensor(prompt), max_new_tokens=12, do_sample=False,
                                   eos_token_id=None, pad_token_id=0).numpy()
    np.testing.assert_array_equal(out, ref)
    dec = model.decoder(2, 23)
    assert dec.step.stats == {"traces": 1, "replays": 10}
    (entry,) = [e for es in dec.step.cache.values() for e in es]
    graph = entry.graphed
    assert graph not in (None, False), "the decode step was not captured as a CUDA graph"
    assert graph.persistent and not graph.moved            # weights read in place
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=12), out)
    assert entry.graphed is graph                            # replayed, not captured again


def test_sampling_is_seeded_and_in_vocab(hf_llama, ids):
    model = M.from_pretrained(hf_llama[0])
    a = model.generate(ids[:1, :5], max_new_tokens=6, do_sample=True, top_k=20, top_p=0.9, seed=3)
    b = model.generate(ids[:1, :5], max_new_tokens=6, do_sample=True, top_k=20, top_p=0.9, seed=3)
    np.testing.assert_array_equal(a, b)
    assert a.shape == (1, 11) and a.min() >= 0 and a.max() < 96
    # eos: a finished sequence repeats it and the loop stops when all have finished
    first = int(model.generate(ids[:1, :5], max_new_tokens=1)[0, -1])
    out = model.generate(ids[:1, :5], max_new_tokens=6, eos_token_id=first)
    assert out.shape == (1, 6) and out[0, -1] == first


def test_adamw_steps_equal_torch(hf_llama, ids):
    model, tm, ours, ref, step = adamw_steps_vs_torch(*hf_llama, ids[:, :32], lr=3e-3)
    assert step.stats == {"traces": 1, "replays": 3}
    np.testing.assert_allclose(ours, ref, rtol=2e-4)
    assert ours[-1] < ours[0]
    w = dict(model.named_parameters())["model.layers.1.mlp.up_proj.weight"].numpy()
    np.testing.assert_allclose(w, tm.model.layers[1].mlp.up_proj.weight.detach().numpy(),
                               rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("scaling", [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 32}])
def test_rope_scalings_match_transformers(scaling, tmp_path, ids):
    from transformers import LlamaConfig as HFConfig, LlamaForCausalLM as HFLlama
    torch.manual_seed(1)
    cfg = HFConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                   rope_parameters={"rope_theta": 500.0, **scaling}, tie_word_embeddings=True)
    hf = HFLlama(cfg).eval()
    hf.save_pretrained(tmp_path)
    model = M.from_pretrained(tmp_path)
    assert model.config.tie_word_embeddings and "lm_head.weight" not in dict(
        model.named_parameters())
    with torch.no_grad():
        inv = hf.model.rotary_emb.inv_freq.numpy()
    np.testing.assert_allclose(rope_inv_freq(model.config), inv, rtol=1e-6)
    np.testing.assert_allclose(model(ids).numpy(), _ref_logits(hf, ids), rtol=1e-4, atol=1e-5)


def test_config_errors(tmp_path, hf_llama):
    with pytest.raises(FuelGraphError, match="no config.json"):
        M.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(FuelGraphError, match="GPT2LMHeadModel.*not supported"):
        M.from_pretrained(tmp_path)
    cfg = json.loads(open(f"{hf_llama[0]}/config.json").read())
    cfg["rope_parameters"] = {"rope_theta": 1e4, "rope_type": "yarn", "factor": 2.0}
    with pytest.raises(FuelGraphError, match="rope_type 'yarn' is not supported"):
        rope_inv_freq(LlamaConfig.from_hf(cfg))
    (tmp_path / "config.json").write_text(json.dumps(dict(cfg, rope_parameters={
        "rope_theta": 1e4, "rope_type": "default"})))
    with pytest.raises(FuelGraphError, match="no .safetensors file"):
        M.from_pretrained(tmp_path)
    model = M.from_pretrained(hf_llama[0])
    with pytest.raises(FuelGraphError, match=r"input_ids must be \[B, S\]"):
        model(np.zeros(4, np.int64))
    with pytest.raises(FuelGraphError, match="max_new_tokens"):
        model.generate(np.zeros((1, 3), np.int64), max_new_tokens=-1)
