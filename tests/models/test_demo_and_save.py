"""`fuelgraph demo --model ...` end to end, and save_pretrained files that transformers reads."""
import numpy as np
import torch

import fuelgraph.models as M
from fuelgraph.cli import main


def test_demo_model_runs(capsys):
    assert main(["demo", "--model", "mamba2", "--tokens", "3"]) == 0
    out = capsys.readouterr().out
    assert "loaded Mamba2ForCausalLM" in out and "ssd_chunk_scan x4" in out
    assert "tokens/s" in out


def test_save_pretrained_is_read_by_transformers(tmp_path):
    from transformers import AutoModelForCausalLM
    cfg = M.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1, rope_theta=1e4,
                        tie_word_embeddings=True)
    model = M.init_random(M.LlamaForCausalLM(cfg), seed=1)
    path = model.save_pretrained(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = np.arange(20)[None] % 64
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    np.testing.assert_allclose(model(ids).numpy(), ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(M.from_pretrained(path)(ids).numpy(), ref, rtol=1e-4, atol=1e-5)
