"""Gemma 3 270M (Q4_K_M GGUF: Q4_K, Q5_0, Q6_K, Q8_0 blocks) against transformers' load of the same file."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "Photosynthesis converts light energy into chemical energy. In plants, this process",
]


@pytest.fixture(scope="module")
def gemma3_path():
    from tandem.core.loading.resolve import resolve_model_path
    return resolve_model_path("gemma3")


@pytest.fixture(scope="module")
def gemma3_engine(gemma3_path):
    from online import Engine
    return Engine.load(str(gemma3_path))


@pytest.fixture(scope="module")
def hf_gemma3(gemma3_path):
    import functools

    import gguf
    from transformers import AutoModelForCausalLM, AutoTokenizer
    # transformers parses the file with gguf-py's reader for the tokenizer, the config and the weights alike
    # (~20 s each on the 262k-token vocabulary): one read-only parse serves all three
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=1)(gguf.GGUFReader))
        model = AutoModelForCausalLM.from_pretrained(str(gemma3_path.parent), gguf_file=gemma3_path.name,
                                                     dtype=torch.float32).eval()
        tok = AutoTokenizer.from_pretrained(str(gemma3_path.parent), gguf_file=gemma3_path.name)
    return model, tok


def test_every_gguf_tensor_decodes_like_gguf(gemma3_path):
    """Our decoders against gguf-py's on the real file's blocks (all four quantized types)."""
    import gguf
    import numpy as np
    from tandem.core.loading.gguf_header import read_gguf_header
    from tandem.core.loading.quants import dequantize
    seen = set()  # our header reader (checked against gguf.GGUFReader in test_gguf_header.py) finds the
    for t in read_gguf_header(gemma3_path).tensors:  # blocks: GGUFReader spends ~20 s on the vocabulary
        name = t.tensor_type.name
        if name in seen or name == "F32":
            continue
        seen.add(name)
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))
        data = np.asarray(t.data)  # [rows, row_bytes] for blocked types
        if data.ndim == 2 and data.shape[0] > 96:  # gguf-py's decoders are slow: the first and last 48 rows
            data = np.concatenate([data[:48], data[-48:]])
            shape = (data.shape[0],) + shape[-1:]
        ref = gguf.quants.dequantize(data, t.tensor_type).reshape(shape)
        assert np.array_equal(dequantize(data, name, shape), ref), t.name
    assert {"Q4_K", "Q6_K", "Q5_0", "Q8_0"} <= seen


@pytest.mark.parametrize("prompt", PROMPTS)
def test_logits_match_transformers(gemma3_engine, hf_gemma3, prompt):
    model, tok = hf_gemma3
    ids = tok(prompt).input_ids
    assert gemma3_engine.tokenizer.encode(prompt, add_special_tokens=True) == ids
    ours = gemma3_engine.logits(ids)
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max() / ref.abs().max() < 1e-3
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


def test_greedy_32_tokens_match_transformers(gemma3_engine, hf_gemma3):
    model, tok = hf_gemma3
    ids = tok("Here are three tips for learning a new language:").input_ids
    ours = gemma3_engine.generate(ids, max_new_tokens=32, temperature=0.0, ignore_eos=True)
    with torch.no_grad():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                             pad_token_id=0)[0, len(ids):].tolist()
    assert ours.token_ids == ref


def test_builtin_gemma_chat_template(gemma3_path):
    """The file ships no chat template: Gemma's turn format is used (as llama.cpp does)."""
    from tandem.core.loading.gguf_loader import read_gguf
    from tandem.core.loading.tokenizer import Tokenizer
    _, fields = read_gguf(gemma3_path)
    assert "tokenizer.chat_template" not in fields
    tok = Tokenizer.from_gguf_metadata(fields)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi "},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Name a planet."}]
    text = tok.apply_chat_template(messages)
    assert text == ("<bos><start_of_turn>user\nBe brief.\n\nHi<end_of_turn>\n<start_of_turn>model\nHello.<end_of_turn>\n"
                    "<start_of_turn>user\nName a planet.<end_of_turn>\n<start_of_turn>model\n")
    ids = tok.encode_chat(messages)
    assert ids[0] == 2 and ids.count(106) == 3  # <bos>, three <end_of_turn>



NEAR_TIE_LOGITS = 0.05  # transformers' own top-2 gap below which either token is a fair greedy choice


def test_fused_decode_greedy_32_tokens_match_transformers(gemma3_path, hf_gemma3):
    """The fused C step (default int8 activations) decodes the real file with its Q5_0 / Q8_0 blocks
    read as int8 and fp32 down rows: greedy text equals transformers' over 32 tokens, teacher-forced on
    transformers' tokens so that one near-tie cannot end the comparison: at every position our argmax is
    transformers' token, unless transformers' own top two logits there are within NEAR_TIE_LOGITS (its
    token 10 here is such a tie, 0.010 apart: a 1-ulp change in a few softmax exponentials flips our pick).
    (int4 re-packs the Q5_0 q/k/v/gate/up blocks: that model, module path and fused step alike, leaves
    this text at token 13.)"""
    from online import Engine
    from tandem.core.generate import prefill
    model, tok = hf_gemma3
    engine = Engine.load(str(gemma3_path), weight_format="int8", sparse=False, down_format="fp32")
    assert engine.decode_path == "fused", engine.decode_path_reason
    ids = tok("Here are three tips for learning a new language:").input_ids
    ours = engine.generate(ids, max_new_tokens=4, temperature=0.0, ignore_eos=True)
    assert ours.stats["decode_path"] == "fused"
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=32, min_new_tokens=32, do_sample=False,
                             pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    ref = out.sequences[0, len(ids):].tolist()  # [32]
    top2 = torch.stack(out.scores)[:, 0].double().topk(2, dim=-1).values  # [32, 2]
    tie = (top2[:, 0] - top2[:, 1] < NEAR_TIE_LOGITS).tolist()
    assert sum(tie) <= 3  # the comparison keeps its teeth
    step = engine.compiled_decode
    cache = engine._kv_cache(len(ids) + 33)
    logits = prefill(engine.model, engine.executor, cache, ids, compiled=step)
    picks = []
    for i, token in enumerate(ref):
        picks.append(int(logits.argmax()))
        logits = step(token, len(ids) + i, cache)  # transformers' token, whatever we picked
    assert ours.token_ids == picks[:4]
    wrong = [(i, p, r) for i, (p, r, t) in enumerate(zip(picks, ref, tie)) if p != r and not t]
    assert not wrong, wrong
