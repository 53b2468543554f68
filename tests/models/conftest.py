"""Tiny random Hugging Face checkpoints written once per session with transformers'
save_pretrained (the files fuelgraph.models loads), plus the torch models that wrote them."""
import numpy as np
import pytest
import torch

VOCAB = 96


def _save(model, path):
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def hf_llama(tmp_path_factory):
    """(directory, transformers model): 2 layers, GQA 4/2 heads, rope_theta 5000, untied head."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rope_theta=5000.0, rms_norm_eps=1e-5)
    m = LlamaForCausalLM(cfg).eval()
    return _save(m, tmp_path_factory.mktemp("llama")), m


@pytest.fixture(scope="session")
def hf_mamba2(tmp_path_factory):
    """(directory, transformers model): 2 layers, 8 heads of 16, 2 groups, state 16."""
    from transformers import Mamba2Config, Mamba2ForCausalLM
    torch.manual_seed(0)
    cfg = Mamba2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, state_size=16,
                       expand=2, head_dim=16, num_heads=8, n_groups=2, chunk_size=16,
                       tie_word_embeddings=True)
    m = Mamba2ForCausalLM(cfg).eval()
    with torch.no_grad():                      # make the SSM dynamics matter in 64 steps
        for layer in m.backbone.layers:
            layer.mixer.dt_bias.uniform_(-2.0, 0.5)
            layer.mixer.D.uniform_(0.5, 1.5)
    return _save(m, tmp_path_factory.mktemp("mamba2")), m


@pytest.fixture(scope="session")
def ids():
    """Teacher-forced batch: B=2, S=64."""
    return np.random.default_rng(0).integers(0, VOCAB, (2, 64))
