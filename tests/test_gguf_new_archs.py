"""Qwen3 and Gemma 3 GGUF files (llama.cpp's names and conventions) against transformers' models."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from tandem.core.ffn import DenseExecutor
from tandem.core.generate import prefill
from tandem.core.kv_cache import KVCache
from tandem.core.loading.gguf_loader import load_gguf
from tandem.core.model.build import build_model

Q = gguf.GGMLQuantizationType
RENAMES = [("model.embed_tokens", "token_embd"), ("model.norm", "output_norm"), ("model.layers.", "blk."),
           ("input_layernorm", "attn_norm"), ("self_attn.q_norm", "attn_q_norm"), ("self_attn.k_norm", "attn_k_norm"),
           ("self_attn.q_proj", "attn_q"), ("self_attn.k_proj", "attn_k"), ("self_attn.v_proj", "attn_v"),
           ("self_attn.o_proj", "attn_output"), ("mlp.gate_proj", "ffn_gate"), ("mlp.up_proj", "ffn_up"),
           ("mlp.down_proj", "ffn_down")]
GEMMA_NORMS = [("post_attention_layernorm", "post_attention_norm"), ("pre_feedforward_layernorm", "ffn_norm"),
               ("post_feedforward_layernorm", "post_ffw_norm")]
LLAMA_NORMS = [("post_attention_layernorm", "ffn_norm")]


def tiny_model(kind: str):
    import transformers as tf
    torch.manual_seed(3)
    common = dict(vocab_size=96, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=128, head_dim=32)
    if kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(num_hidden_layers=2, tie_word_embeddings=False, **common))
    else:  # llama.cpp's Gemma 3: every 6th layer global, windowed layers on rope base 10000
        cfg = tf.Gemma3TextConfig(num_hidden_layers=6, query_pre_attn_scalar=32, sliding_window=8,
                                  final_logit_softcapping=3.0, **common,
                                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                                                   "full_attention": {"rope_type": "default", "rope_theta": 1e6}})
        model = tf.Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.3)
    return model.eval()


def write_gguf(path, kind: str, model, qtypes: tuple[str, ...] = ("F32", "Q8_0", "F16")) -> None:
    cfg = model.config
    w = gguf.GGUFWriter(str(path), kind)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    if kind == "gemma3":
        w.add_rope_freq_base(1e6)
        w.add_sliding_window(cfg.sliding_window)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)
    else:
        w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    tokens = [chr(c) for c in range(0x21, 0x21 + cfg.vocab_size - 4)] + ['!"', "<s>", "</s>", "<eos>"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * (cfg.vocab_size - 3) + [3, 3, 3])
    w.add_token_merges(["! \""])
    w.add_bos_token_id(cfg.vocab_size - 3)
    w.add_eos_token_id(cfg.vocab_size - 2)
    for k, (name, t) in enumerate(model.state_dict().items()):
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        value = t.float().numpy()
        if kind == "gemma3" and name.endswith("norm.weight"):
            value = value + 1.0  # llama.cpp's converter stores Gemma norms as 1 + w
        gname = "output.weight" if name == "lm_head.weight" else name
        for ours, theirs in (GEMMA_NORMS if kind == "gemma3" else LLAMA_NORMS) + RENAMES:
            gname = gname.replace(ours, theirs)
        if value.ndim == 1:
            w.add_tensor(gname, value)
        else:
            qtype = qtypes[k % len(qtypes)]
            stored = gguf.quants.quantize(value, Q[qtype])
            w.add_tensor(gname, stored, raw_dtype=None if qtype in ("F32", "F16") else Q[qtype])
            with torch.no_grad():  # the reference model gets the weights as stored
                t.copy_(torch.from_numpy(gguf.quants.dequantize(stored, Q[qtype]).reshape(value.shape)))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("kind", ["qwen3", "gemma3"])
def test_tiny_gguf_matches_transformers(tmp_path, kind):
    hf_model = tiny_model(kind)
    write_gguf(tmp_path / "m.gguf", kind, hf_model)
    ckpt = load_gguf(tmp_path / "m.gguf", with_tokenizer=False)
    cfg = ckpt.config
    assert cfg.arch == kind and cfg.qk_norm
    if kind == "gemma3":
        assert cfg.layer_windows == (8, 8, 8, 8, 8, 0) and cfg.rope_local_theta == 10000.0
        assert cfg.final_logit_softcap == 3.0 and cfg.hidden_act == "gelu_tanh" and cfg.tie_word_embeddings
    model, ffn_layers = build_model(ckpt)
    executor = DenseExecutor(model.cfg, ffn_layers)
    ids = torch.randint(0, 96, (30,), generator=torch.Generator().manual_seed(4)).tolist()
    with torch.no_grad():
        ref = hf_model(torch.tensor([ids])).logits[0].float()  # [T, vocab]
    cache = KVCache(model.cfg, 32)
    ours = torch.cat([prefill(model, executor, cache, ids[:11], all_logits=True),
                      prefill(model, executor, cache, ids[11:], start_pos=11, all_logits=True)])
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_tiny_gemma3_packed_engine_close_to_dense(tmp_path, fmt):
    """Packed attention / FFN kernels on a Gemma 3 GGUF whose blocks they read exactly (Q8_0 / Q5_0
    for int8, Q4_1 for int4): only the int8 activations differ from the dense float32 model."""
    from online import Engine
    hf_model = tiny_model("gemma3")
    write_gguf(tmp_path / "m.gguf", "gemma3", hf_model, ("Q8_0", "Q5_0") if fmt == "int8" else ("Q4_1",))
    dense = Engine.load(str(tmp_path / "m.gguf"))
    packed = Engine.load(str(tmp_path / "m.gguf"), weight_format=fmt, sparse=False)
    ids = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    ref, ours = dense.logits(ids), packed.logits(ids)
    assert float((ours - ref).abs().max() / ref.abs().max()) < 0.05
    assert packed.generate(ids, max_new_tokens=4, ignore_eos=True).token_ids  # decode path runs


def test_q8_0_ffn_blocks_kept_as_they_are_for_int8(tmp_path):
    """An int8 engine on an all-Q8_0 GGUF keeps every FFN's gate / up blocks exactly (gguf's own decode of the
    file's bytes), and decodes them through the fused step; before, they were re-packed with one scale per row."""
    from online import Engine
    from online.kernels.quantize import BlockInt8Weight
    hf_model = tiny_model("qwen3")
    write_gguf(tmp_path / "m.gguf", "qwen3", hf_model, ("Q8_0",))
    reader = gguf.GGUFReader(str(tmp_path / "m.gguf"))
    stored = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in reader.tensors}
    engine = Engine.load(str(tmp_path / "m.gguf"), weight_format="int8", sparse=False)
    for i, split in enumerate(engine.executor.splits):
        for name in ("gate", "up"):
            w = getattr(split.cpu, name)
            assert isinstance(w, BlockInt8Weight), (i, name, type(w).__name__)
            assert np.array_equal(w.dequantize(), stored[f"blk.{i}.ffn_{name}.weight"]), (i, name)
    assert engine.decode_path == "fused", engine.decode_path_reason
    assert engine.generate([5, 9, 14], max_new_tokens=4, ignore_eos=True).token_ids
