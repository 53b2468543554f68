"""fuelgraph.models Mamba-2 against transformers: logits, gradients, greedy generation through
the recurrent step, AdamW training steps, fusion report."""
import numpy as np
import pytest
import torch

import fuelgraph as fg
import fuelgraph.models as M

from .train_oracle import adamw_steps_vs_torch

USED = {"causal_conv1d", "ssd_chunk_scan", "rms_norm_last_dim"}


def test_logits_match_transformers(hf_mamba2, ids):
    path, hf = hf_mamba2
    model = M.from_pretrained(path)
    assert isinstance(model, M.Mamba2ForCausalLM)
    assert set(dict(model.named_parameters())) == set(hf.state_dict()) - {"lm_head.weight"}
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(model(ids).numpy(), ref, rtol=1e-4, atol=2e-5)


def test_fused_report(hf_mamba2, ids):
    model = M.from_pretrained(hf_mamba2[0])
    rep = fg.explain([model(ids, labels=ids)])
    assert rep.fused_ops["causal_conv1d"] == 2 and rep.fused_ops["ssd_chunk_scan"] == 2
    assert rep.fused_ops["rms_norm_last_dim"] == 5          # 2 blocks x 2 + final
    loss_ops = {"fused_softmax_cross_entropy", "fused_linear_cross_entropy"}
    assert sum(rep.fused_ops.get(k, 0) for k in loss_ops) == 1
    assert not (set(rep.near_misses) & (USED | loss_ops)), rep.near_misses
    assert not rep.near_misses, rep.near_misses
    assert not rep.lowered


def test_loss_and_gradients_match_torch(hf_mamba2, ids):
    path, hf = hf_mamba2
    model = M.from_pretrained(path).train()
    loss = model(ids, labels=ids)
    loss.backward()
    hf.zero_grad()
    ref = hf(torch.tensor(ids), labels=torch.tensor(ids)).loss
    ref.backward()
    np.testing.assert_allclose(loss.item(), ref.item(), rtol=1e-5)
    params, tref = dict(model.named_parameters()), dict(hf.named_parameters())
    for name in ("backbone.layers.0.mixer.in_proj.weight", "backbone.layers.1.mixer.conv1d.weight",
                 "backbone.layers.0.mixer.A_log", "backbone.layers.1.mixer.dt_bias",
                 "backbone.layers.0.mixer.D", "backbone.layers.1.mixer.norm.weight",
                 "backbone.embeddings.weight"):
        g, r = params[name].grad.numpy(), tref[name].grad.numpy()
        np.testing.assert_allclose(g, r, rtol=2e-3, atol=2e-5 * np.abs(r).max(), err_msg=name)
    hf.zero_grad()


def test_greedy_generate_matches_transformers(hf_mamba2, ids):
    path, hf = hf_mamba2
    model = M.from_pretrained(path)
    prompt = ids[:, :2]                       # shorter than the conv window: zero-padded state
    for p in (prompt, ids[:, :9]):
        out = model.generate(p, max_new_tokens=10)
        with torch.no_grad():
            ref = hf.generate(torch.tensor(p), max_new_tokens=10, do_sample=False,
                              eos_token_id=None, pad_token_id=0).numpy()
        np.testing.assert_array_equal(out, ref)
    dec = model.decoder(2)
    assert dec.step.stats == {"traces": 1, "replays": 17}    # the decode step is traced once
    assert dec.prompt_step.stats == {"traces": 2, "replays": 0}   # one per prompt length
    np.testing.assert_array_equal(model.generate(p, max_new_tokens=10), out)
    assert dec.step.stats["traces"] == 1 and dec.prompt_step.stats["replays"] == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")
def test_decode_on_cuda_replays_one_cuda_graph_per_token(hf_mamba2, ids):
    """On the GPU the recurrent decode step is one CUDA graph, captured once; the states are
    copied back into the graph's buffers (no copy-in per token); tokens as transformers'."""
    path, hf = hf_mamba2
    model = M.from_pretrained(path, device="cuda")
    prompt = ids[:, :9]
    out = model.generate(prompt, max_new_tokens=8)
    with torch.no_grad():
        ref = hf.generate(torch.tensor(prompt), max_new_tokens=8, do_sample=False,
                          eos_token_id=None, pad_token_id=0).numpy()
    np.testing.assert_array_equal(out, ref)
    dec = model.decoder(2)
    (entry,) = [e for es in dec.step.cache.values() for e in es]
    graph = entry.graphed
    assert graph not in (None, False) and not graph.moved
    ptr = dec.ssms[0].to_torch().data_ptr()
    np.testing.assert_array_equal(model.generate(prompt, max_new_tokens=8), out)
    assert entry.graphed is graph and dec.ssms[0].to_torch().data_ptr() == ptr


def test_adamw_steps_equal_torch(hf_mamba2, ids):
    model, tm, ours, ref, step = adamw_steps_vs_torch(*hf_mamba2, ids[:, :32], lr=2e-3)
    np.testing.assert_allclose(ours, ref, rtol=2e-4)
    assert ours[-1] < ours[0]
