"""Q4_K_M / Q5_K_M-style GGUF files whose q/k and v (and gate/up/down) blocks differ in kind decode through
the fused step: q, k and v kept as separate weights (TdmLayer qkv / k / v), against transformers on the
dequantized weights, the module path and the single-token step."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from test_kquants import random_blocks

Q = gguf.GGMLQuantizationType
D, HEADS, KV, HD, FF, VOCAB = 256, 4, 2, 64, 256, 64
# f16 super-block scales giving weights of std ~0.03 (the k-quants' sub-block scales multiply in)
SCALE = {"Q4_K": 3e-4, "Q5_K": 1.5e-4, "Q6_K": 2e-5, "Q5_0": 4e-3}
# per-tensor block kinds: llama.cpp's Q4_K_M (v and down Q6_K) and Q5_K_M (q/k Q5_K, v Q6_K) mixes
MIXES = {"q4_k_m": dict(q="Q4_K", k="Q4_K", v="Q6_K", o="Q4_K", gate="Q4_K", up="Q4_K", down="Q6_K"),
         "q5_k_m": dict(q="Q5_K", k="Q5_K", v="Q6_K", o="Q5_K", gate="Q5_K", up="Q6_K", down="Q6_K")}
PROMPT = [3, 17, 42, 5, 9, 33, 21, 8]


def _blocks(qtype: str, rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(raw bytes [rows, row_bytes], their float32 values [rows, cols] by gguf's dequantizer)."""
    rng = np.random.default_rng(seed)
    if qtype in ("Q8_0", "Q4_0"):  # gguf quantizes these itself
        raw = gguf.quants.quantize((rng.standard_normal((rows, cols)) * 0.03).astype(np.float32), Q[qtype])
    else:
        s = SCALE[qtype]
        raw = random_blocks(qtype, rows, cols, rng, np.array([s, -s / 2], np.float32))
    return raw, gguf.quants.dequantize(raw, Q[qtype]).reshape(rows, cols).astype(np.float32)


def _unpermute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp stores q/k rows rope-interleaved; HF's order back (the loader does the same)."""
    return w.reshape(heads, HD // 2, 2, -1).swapaxes(1, 2).reshape(w.shape)


def write_mixed_llama(path, mix: dict, layers: int = 2):
    """A tiny Llama GGUF with random valid blocks of the mix's kinds, and transformers' model holding
    the same weights dequantized (the independent reference)."""
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=VOCAB, hidden_size=D, intermediate_size=FF, num_hidden_layers=layers,
                         num_attention_heads=HEADS, num_key_value_heads=KV, max_position_embeddings=64,
                         rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    torch.manual_seed(0)
    hf = tf.LlamaForCausalLM(cfg).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    for add, value in ((w.add_block_count, layers), (w.add_context_length, 64), (w.add_embedding_length, D),
                       (w.add_feed_forward_length, FF), (w.add_head_count, HEADS), (w.add_head_count_kv, KV),
                       (w.add_layer_norm_rms_eps, 1e-6), (w.add_rope_freq_base, 10000.0)):
        add(value)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([chr(c) for c in range(0x21, 0x21 + VOCAB - 4)] + ['!"', "<s>", "</s>", "<eos>"])
    w.add_token_types([1] * (VOCAB - 3) + [3, 3, 3])
    w.add_token_merges(['! "'])
    w.add_bos_token_id(VOCAB - 3)
    w.add_eos_token_id(VOCAB - 2)
    rng, seed = np.random.default_rng(1), iter(range(100, 200))
    sd = hf.state_dict()

    def put(gname: str, hname: str, qtype: str, rows: int, cols: int, heads: int = 0) -> None:
        raw, values = _blocks(qtype, rows, cols, next(seed))
        w.add_tensor(gname, raw, raw_dtype=Q[qtype])
        sd[hname].copy_(torch.from_numpy(_unpermute(values, heads) if heads else values))

    emb = (rng.standard_normal((VOCAB, D)) * 0.5).astype(np.float32)
    w.add_tensor("token_embd.weight", emb)
    sd["model.embed_tokens.weight"].copy_(torch.from_numpy(emb))
    for i in range(layers):
        b, h = f"blk.{i}", f"model.layers.{i}"
        for gname, hname in (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")):
            norm = (1.0 + 0.2 * rng.standard_normal(D)).astype(np.float32)
            w.add_tensor(f"{b}.{gname}.weight", norm)
            sd[f"{h}.{hname}.weight"].copy_(torch.from_numpy(norm))
        put(f"{b}.attn_q.weight", f"{h}.self_attn.q_proj.weight", mix["q"], HEADS * HD, D, HEADS)
        put(f"{b}.attn_k.weight", f"{h}.self_attn.k_proj.weight", mix["k"], KV * HD, D, KV)
        put(f"{b}.attn_v.weight", f"{h}.self_attn.v_proj.weight", mix["v"], KV * HD, D)
        put(f"{b}.attn_output.weight", f"{h}.self_attn.o_proj.weight", mix["o"], D, HEADS * HD)
        put(f"{b}.ffn_gate.weight", f"{h}.mlp.gate_proj.weight", mix["gate"], FF, D)
        put(f"{b}.ffn_up.weight", f"{h}.mlp.up_proj.weight", mix["up"], FF, D)
        put(f"{b}.ffn_down.weight", f"{h}.mlp.down_proj.weight", mix["down"], D, FF)
    w.add_tensor("output_norm.weight", np.ones(D, np.float32))
    put("output.weight", "lm_head.weight", "Q6_K", VOCAB, D)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


@pytest.fixture(scope="module", params=sorted(MIXES))
def mixed(request, tmp_path_factory):
    from online.engine import Engine
    path = tmp_path_factory.mktemp("mixed") / f"{request.param}.gguf"
    hf = write_mixed_llama(path, MIXES[request.param])
    return Engine.load(path, weight_format="int8", sparse=False), hf, request.param, path


def test_mixed_blocks_decode_fused_close_to_transformers(mixed):
    from online.execution.quantized_linear import SplitQKVModule
    engine, hf, name, _ = mixed
    assert engine.decode_path == "fused", engine.decode_path_reason
    attn = engine.model.layers[0].self_attn
    assert isinstance(attn.qkv_proj, SplitQKVModule)  # the three kept apart, each in its own blocks
    kinds = [getattr(p.weight, "qtype", type(p.weight).__name__) for p in attn.qkv_proj.parts]
    assert kinds == [{"Q4_K": "Q4KWeight"}.get(MIXES[name][n], MIXES[name][n]) for n in "qkv"]
    layer = engine.compiled_decode._layers[0]
    assert layer.k.data and layer.v.data and layer.qkv.rows == HEADS * HD and layer.v.rows == KV * HD
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPT])).logits[0].float()  # [T, vocab] the dequantized weights in float32
    fused = engine.step_logits(PROMPT)  # the fused step, one token at a time
    modules = engine.logits(PROMPT)  # the module path (SplitQKVModule, batched prefill) on the same blocks
    err_fused, err_modules = (float((x - ref).norm() / ref.norm()) for x in (fused, modules))
    assert err_fused < 0.03 and err_modules < 0.03, (err_fused, err_modules)  # int8 activations only
    torch.testing.assert_close(fused, modules, rtol=0.05, atol=0.05)
    assert float((fused.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.85


def test_mixed_blocks_step_many_equals_single_steps(mixed):
    from tandem.core.kv_cache import KVCache
    engine, _, _, _ = mixed
    step = engine.compiled_decode
    single, multi = KVCache(engine.model.cfg, 16), KVCache(engine.model.cfg, 16)
    want = torch.stack([step(t, pos, single) for pos, t in enumerate(PROMPT)])
    assert torch.equal(step.step_many(PROMPT[:5], 0, multi), want[:5])
    assert torch.equal(step.step_many(PROMPT[5:], 5, multi), want[5:])


def test_mixed_blocks_match_the_reference_arithmetic(mixed):
    """The C step's q/k/v dispatch against helpers_fused's torch re-statement of its arithmetic (residual
    pass on every activation block: a rounding tie flipped by float summation order stays below 1e-4)."""
    from helpers_fused import reference_step
    from online.execution.fused_decode import FusedDecodeStep
    from tandem.core.kv_cache import KVCache
    engine, _, _, _ = mixed
    step = FusedDecodeStep.build(engine.model, engine.executor, residual_ratio=0.0)
    cache, ref_cache = KVCache(engine.model.cfg, 16), KVCache(engine.model.cfg, 16)
    for pos, tok in enumerate(PROMPT[:5]):
        ref, _ = reference_step(engine.model, engine.executor, ref_cache, tok, pos, residual_ratio=0.0)
        torch.testing.assert_close(step(tok, pos, cache), ref.float(), rtol=1e-3, atol=1e-3)


def test_mixed_blocks_step_cache_is_bit_identical(mixed):
    """The step cache (online/engine_cache.py) keeps the separate k / v descriptors."""
    from online.engine import Engine
    _, _, _, path = mixed
    built = Engine.load(path, weight_format="int8", sparse=False, step_cache=False)
    cached = Engine.load(path, weight_format="int8", sparse=False)
    assert cached.runs_on_cached_step and cached._model is None and not built.runs_on_cached_step
    assert np.array_equal(np.asarray(cached.step_logits(PROMPT)), built.step_logits(PROMPT).numpy())


@pytest.mark.parametrize("qk, v, fmt", [("Q4_0", "Q8_0", "int8"), ("Q4_K", "Q8_0", "int8"), ("Q4_K", "Q6_K", "int4"),
                                        ("Q5_0", "Q8_0", "int8")])
def test_other_mixes_decode_fused(tmp_path, qk, v, fmt):
    """Any q/k vs v mix decodes fused; Gemma's Q5_0 + Q8_0 still stacks (Q5_0 widened to int8, as before)."""
    from online.engine import Engine
    from online.execution.quantized_linear import QuantizedLinearModule, SplitQKVModule
    path = tmp_path / "m.gguf"
    write_mixed_llama(path, dict(q=qk, k=qk, v=v, o="Q4_K", gate="Q4_K", up="Q4_K", down="Q6_K"), layers=1)
    engine = Engine.load(path, weight_format=fmt, sparse=False, step_cache=False)
    assert engine.decode_path == "fused", engine.decode_path_reason
    stacked = (qk, v, fmt) == ("Q5_0", "Q8_0", "int8")
    assert isinstance(engine.model.layers[0].self_attn.qkv_proj, QuantizedLinearModule if stacked else SplitQKVModule)
    torch.testing.assert_close(engine.step_logits(PROMPT), engine.logits(PROMPT), rtol=0.05, atol=0.05)


def test_a_part_the_step_cannot_read_is_named():
    from online.execution.quantized_linear import SplitQKVModule, describe_qkv
    from online.kernels.ffn import QuantizedLinear
    from tandem.core.errors import TandemError
    w = torch.randn(64, 64) * 0.05
    parts = [QuantizedLinear.from_float(w, "int8"), QuantizedLinear.from_float(w, "int8"),
             QuantizedLinear.from_float(w, "fp16")]
    with pytest.raises(TandemError, match=r"layer 3 v_proj \(Fp16Weight\): native kernels read float16"):
        describe_qkv(SplitQKVModule(parts), 3)
