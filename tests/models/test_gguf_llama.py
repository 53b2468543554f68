"""fuelgraph.models.from_gguf: a GGUF written with gguf.GGUFWriter from the tiny transformers
Llama (q/k rows permuted to llama.cpp's interleaved rotary layout, as its converter does).
The quantized model equals its dequantized float twin to float32 rounding, and transformers'
logits to within the quantization error."""
import gguf
import numpy as np
import pytest
import torch

import fuelgraph as fg
import fuelgraph.models as M
from fuelgraph import FuelGraphError

Q = gguf.GGMLQuantizationType
NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
         "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
         "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
         "ffn_down": "mlp.down_proj"}


def interleave_rows(w, heads):
    """Rotate-half rows of each head -> GPT-J pair order (row 2i+h <- row h*D/2 + i)."""
    d = w.shape[0] // heads
    return w.reshape(heads, 2, d // 2, -1).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, hf, qtype, arch="llama"):
    c = hf.config
    st = {k: v.detach().numpy() for k, v in hf.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])

    def put(name, a):
        if qtype is None or a.ndim == 1:
            w.add_tensor(name, a.astype(np.float32))
        else:
            w.add_tensor(name, gguf.quants.quantize(a.astype(np.float32), qtype), raw_dtype=qtype)
    put("token_embd.weight", st["model.embed_tokens.weight"])
    put("output_norm.weight", st["model.norm.weight"])
    put("output.weight", st["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        for g, h in NAMES.items():
            a = st[f"model.layers.{i}.{h}.weight"]
            if g == "attn_q":
                a = interleave_rows(a, c.num_attention_heads)
            elif g == "attn_k":
                a = interleave_rows(a, c.num_key_value_heads)
            put(f"blk.{i}.{g}.weight", a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


@pytest.mark.parametrize("qtype,err", [(None, 1e-5), (Q.Q8_0, 0.02), (Q.Q4_0, 0.3)])
def test_quantized_model_vs_float_twin_and_transformers(hf_llama, ids, tmp_path, qtype, err):
    path = write_gguf(tmp_path / "m.gguf", hf_llama[1], qtype)
    model = M.from_gguf(path)
    twin = M.from_gguf(path, dequantize=True)
    out = model(ids)
    np.testing.assert_allclose(out.numpy(), twin(ids).numpy(), rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        ref = hf_llama[1](torch.tensor(ids)).logits.numpy()
    assert np.abs(out.numpy() - ref).max() <= err * np.abs(ref).max()
    rep = fg.explain([out])
    if qtype is not None:
        assert rep.fused_ops["qmatmul"] == 2 * 7 + 1     # every projection and the head
        assert not any(isinstance(p, fg.Tensor) and p.dtype == fg.float32 and p.ndim == 2 and
                       p.shape[0] != 96 for p in model.parameters())   # only the embedding
    assert rep.fused_ops["rope"] == 4 and rep.fused_ops["flash_attn"] == 2
    assert not ({"qmatmul", "rope", "flash_attn", "rms_norm_last_dim"} & set(rep.near_misses))


def test_gguf_generate_matches_float_model(hf_llama, ids, tmp_path):
    path = write_gguf(tmp_path / "f.gguf", hf_llama[1], None)
    with torch.no_grad():
        ref = hf_llama[1].generate(torch.tensor(ids[:, :7]), max_new_tokens=8, do_sample=False,
                                   eos_token_id=None, pad_token_id=0).numpy()
    np.testing.assert_array_equal(M.from_gguf(path).generate(ids[:, :7], max_new_tokens=8), ref)


def test_gguf_errors(hf_llama, tmp_path):
    path = write_gguf(tmp_path / "g.gguf", hf_llama[1], None, arch="gpt2")
    with pytest.raises(FuelGraphError, match="architecture 'gpt2'"):
        M.from_gguf(path)
    with pytest.raises(FuelGraphError, match="cannot read"):
        M.from_gguf(tmp_path / "missing.gguf")
