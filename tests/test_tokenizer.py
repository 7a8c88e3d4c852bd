"""Tokenizer vs transformers: the default model's GGUF tokenizer, an HF folder and a tiny SentencePiece GGUF."""
from __future__ import annotations

import random

import numpy as np
import pytest

from tandem.core.loading.gguf_loader import read_gguf
from tandem.core.loading.detokenize import IncrementalDecoder
from tandem.core.loading.tokenizer import Tokenizer
from tandem.core.errors import TandemError

TRICKY = [
    "Hello world", " leading space", "trailing space ", "multiple    spaces  here", "tabs\tand\ttabs",
    "newlines\n\nand\r\nCRLF\n", "Ünïcödé çà và ÀÉÎ ß", "emoji 🚀🔥 and a family 👨‍👩‍👧", "中文字符和日本語のテキスト",
    "digits 1234567890 and 3.14159 and 1,000,000", "def f(x):\n    return x**2  # square\n",
    "<|im_start|>user\nHi<|im_end|>\n", "<|endoftext|>text<repo_name>x", "a fake <|im_start| token",
    "", "  ", "\n", "don't I'll we've they're", "non\u00a0breaking\u200bzero-width", "\x00\x01 control bytes",
    "x" * 70, "mixed: Привет, мир! مرحبا 👋",
]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello! 👋"}, {"role": "user", "content": "2+2?\n  Explain."}],
]


@pytest.fixture(scope="module")
def smol_tok(smollm2_path) -> Tokenizer:
    _, fields = read_gguf(smollm2_path)
    return Tokenizer.from_gguf_metadata(fields)


def hf_chat_ids(hf_tok, messages, add_generation_prompt):
    out = hf_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                     return_dict=False)
    return list(out["input_ids"] if isinstance(out, dict) or hasattr(out, "input_ids") else out)


def stream_text(tok, ids):
    dec = IncrementalDecoder(tok)
    pieces = [dec.push(i) for i in ids]
    return pieces, "".join(pieces) + dec.flush()


# --- the default model (byte-level BPE, pre "smollm") ---------------------------------------------
@pytest.mark.parametrize("text", TRICKY)
def test_smollm2_encode_decode_match_transformers(smol_tok, hf_smollm2_tokenizer, text):
    hf = hf_smollm2_tokenizer
    assert smol_tok.encode(text) == hf.encode(text)
    assert smol_tok.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    ids = hf.encode(text)
    assert smol_tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert smol_tok.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)


@pytest.mark.parametrize("messages", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_smollm2_chat_template_matches_transformers(smol_tok, hf_smollm2_tokenizer, messages, add_generation_prompt):
    hf = hf_smollm2_tokenizer
    ref = hf.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    assert smol_tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt) == ref
    assert smol_tok.encode_chat(messages, add_generation_prompt) == hf_chat_ids(hf, messages, add_generation_prompt)


def test_smollm2_special_ids(smol_tok, hf_smollm2_tokenizer):
    hf = hf_smollm2_tokenizer
    assert smol_tok.bos_token_id == hf.bos_token_id
    assert smol_tok.eos_token_ids[0] == hf.eos_token_id
    assert hf.convert_tokens_to_ids("<|im_end|>") in smol_tok.eos_token_ids
    assert smol_tok.vocab_size == len(hf)
    assert not smol_tok.add_bos_token


def test_incremental_decoder_equals_full_decode(smol_tok):
    rng = random.Random(0)
    sequences = [smol_tok.encode(t) for t in TRICKY]
    sequences += [[rng.randrange(smol_tok.vocab_size) for _ in range(40)] for _ in range(20)]  # invalid UTF-8 too
    sequences.append(smol_tok.encode("🚀") + [2] + smol_tok.encode(" done é"))
    for ids in sequences:
        for skip in (True, False):
            dec = IncrementalDecoder(smol_tok, skip_special_tokens=skip)
            text = "".join(dec.push(i) for i in ids) + dec.flush()
            assert text == smol_tok.decode(ids, skip_special_tokens=skip)


def test_incremental_decoder_holds_back_partial_characters(smol_tok):
    ids = smol_tok.encode("🚀")
    assert len(ids) > 1  # the emoji is split into byte pieces
    pieces, text = stream_text(smol_tok, ids)
    assert pieces[:-1] == [""] * (len(ids) - 1) and pieces[-1] == "🚀" and text == "🚀"


def test_hf_folder_matches_transformers(tmp_path, hf_smollm2_tokenizer):
    hf = hf_smollm2_tokenizer
    hf.save_pretrained(tmp_path)
    tok = Tokenizer.from_hf_folder(tmp_path)
    for text in TRICKY:
        assert tok.encode(text) == hf.encode(text)
        assert tok.decode(hf.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    for messages in CHATS:
        assert tok.apply_chat_template(messages) == hf.apply_chat_template(messages, add_generation_prompt=True,
                                                                           tokenize=False)
    assert tok.bos_token_id == hf.bos_token_id and tok.eos_token_ids[0] == hf.eos_token_id


@pytest.mark.parametrize("bad", [
    "hello", [], [{"role": "user"}], [{"role": 1, "content": "x"}], [{"role": "user", "content": None}],
    ["user: hi"], [{"role": "user", "content": ["a", "b"]}],
])
def test_bad_messages_are_tandem_errors(smol_tok, bad):
    with pytest.raises(TandemError):
        smol_tok.apply_chat_template(bad)


def test_template_helpers_and_errors(smollm2_path):
    _, fields = read_gguf(smollm2_path)
    template = ("{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
                "{{ raise_exception('bad role ' + m['role']) }}{% endif %}{{ m['content'] | tojson }}"
                "{% generation %}!{% endgeneration %}{% endfor %}{{ strftime_now('%Y') }}")
    tok = Tokenizer.from_gguf_metadata({**fields, "tokenizer.chat_template": template})
    from datetime import datetime
    assert tok.apply_chat_template([{"role": "user", "content": "é\""}]) == f'"é\\""!{datetime.now().year}'
    with pytest.raises(TandemError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    no_template = Tokenizer.from_gguf_metadata({k: v for k, v in fields.items() if k != "tokenizer.chat_template"})
    with pytest.raises(TandemError, match="no chat template"):
        no_template.apply_chat_template([{"role": "user", "content": "x"}])
    with pytest.raises(TandemError, match="unsupported GGUF tokenizer"):
        Tokenizer.from_gguf_metadata({**fields, "tokenizer.ggml.model": "bert"})
    with pytest.raises(TandemError):
        tok.decode([10 ** 9])


# --- a tiny SentencePiece-style ("llama") GGUF ----------------------------------------------------
SP_PIECES = ["▁", *"abcdefghijklmnopqrstuvwxyzTHIW.,!?'", "th", "he", "▁t", "▁the", "in", "▁a", "er", "an",
             "▁w", "ou", "▁o", "re", "on", "is", "▁i", "at", "en", "▁s", "ing", "▁is", "▁th", "▁in",
             "▁T", "▁Th", "▁The", "or", "ld", "▁wor", "▁world", "ll", "▁he", "▁hell", "▁hello", "▁▁", "▁▁▁▁"]


def write_tokenizer_gguf(path, tokens: list[str], types: list[int], *, model: str, scores=None, merges=None,
                         pre: str | None = None, bos: int = 1, eos: int = 2, template: str | None = None) -> None:
    """A GGUF with just enough of a llama model around a tokenizer for transformers to read it."""
    import gguf
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(2)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if scores is not None:
        w.add_token_scores(scores)
    if merges is not None:
        w.add_token_merges(merges)
    w.add_bos_token_id(bos)
    w.add_eos_token_id(eos)
    if template is not None:
        w.add_chat_template(template)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_sentencepiece_gguf(path) -> None:
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{b:02X}>" for b in range(256)], *SP_PIECES]
    types = [2, 3, 3, *[6] * 256, *[1] * len(SP_PIECES)]  # UNKNOWN, CONTROL, BYTE, NORMAL
    scores = [0.0, 0.0, 0.0, *[0.0] * 256, *[-float(i) for i in range(len(SP_PIECES))]]
    write_tokenizer_gguf(path, tokens, types, model="llama", scores=scores,
                         template="{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
                                  "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant]{% endif %}")


SP_TEXTS = ["hello world", "The world is in the house", " leading", "two  spaces   three", "new\nline",
            "héllo wörld 🚀", "中文", "HELLO", "", "a", "<s>the</s>", "at the end. ", "Is it? I think so!"]


@pytest.fixture(scope="module")
def sp_pair(tmp_path_factory):
    from transformers import AutoTokenizer
    folder = tmp_path_factory.mktemp("sp")
    write_sentencepiece_gguf(folder / "sp.gguf")
    _, fields = read_gguf(folder / "sp.gguf")
    return Tokenizer.from_gguf_metadata(fields), AutoTokenizer.from_pretrained(str(folder), gguf_file="sp.gguf")


@pytest.mark.parametrize("text", SP_TEXTS)
def test_sentencepiece_gguf_matches_transformers(sp_pair, text):
    ours, hf = sp_pair
    assert ours.encode(text) == hf.encode(text)
    assert ours.encode(text, add_special_tokens=False) == hf.encode(text, add_special_tokens=False)
    ids = hf.encode(text)
    assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert ours.decode(ids, skip_special_tokens=False) == hf.decode(ids, skip_special_tokens=False)
    assert stream_text(ours, ids)[1] == ours.decode(ids)


def test_sentencepiece_gguf_bos_and_chat(sp_pair):
    ours, hf = sp_pair
    assert ours.add_bos_token and ours.encode("hello")[0] == 1
    messages = CHATS[1]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(messages, add_generation_prompt=True,
                                                                        tokenize=False)
    assert ours.encode_chat(messages) == hf_chat_ids(hf, messages, True)


def test_sentencepiece_incremental_byte_fallback(sp_pair):
    ours, _ = sp_pair
    ids = ours.encode("é🚀 hello", add_special_tokens=False)
    assert ours.token_to_id("<0xF0>") in ids  # the emoji went through byte fallback
    pieces, text = stream_text(ours, ids)
    assert text == ours.decode(ids) and "\ufffd" not in "".join(pieces)
    rng = random.Random(1)
    for _ in range(20):
        ids = [rng.randrange(ours.vocab_size) for _ in range(30)]
        assert stream_text(ours, ids)[1] == ours.decode(ids)


# --- byte-level BPE with the split regexes of other `tokenizer.ggml.pre` values ---------------------
def gpt2_alphabet() -> list[str]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    return [*map(chr, printable), *map(chr, range(0x100, 0x144))]  # the 256 byte characters


PRE_MERGES = ["1 2", "12 3", "4 5", "45 6", "Ġ 1", "Ġ t", "h e", "Ġt he", "' s", "' t", "Ċ Ċ", "Ġ Ġ", "ĠĠ Ġ",
              "l l", "' ll", "Ġ 4", "x y", "Ġ x", "Ġx y", "' S"]
PRE_TEXTS = ["123456 7890 12 45", "the 123 45\n\n\nhe's it'll don't THE'S", "  spaces   and\ttabs\n",
             "xy xyxy 1xy x1y 🚀12", "ab12cd 4.5 6,7", "1245 x1245 HE'S"]


def write_bpe_gguf(folder, pre: str) -> list[str]:
    merged = [a + b for a, b in (m.split(" ") for m in PRE_MERGES)]
    tokens = [*gpt2_alphabet(), *dict.fromkeys(merged), "<|endoftext|>", "<|im_end|>"]
    types = [1] * (len(tokens) - 2) + [3, 3]
    write_tokenizer_gguf(folder / "bpe.gguf", tokens, types, model="gpt2", merges=PRE_MERGES, pre=pre,
                         bos=len(tokens) - 2, eos=len(tokens) - 1)
    return tokens


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "smollm", "default"])
def test_byte_level_pre_tokenizers_match_transformers(tmp_path, pre):
    from transformers import AutoTokenizer
    tokens = write_bpe_gguf(tmp_path, pre)
    ours = Tokenizer.from_gguf_metadata(read_gguf(tmp_path / "bpe.gguf")[1])
    hf = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="bpe.gguf")
    for text in PRE_TEXTS:
        assert ours.encode(text) == hf.encode(text), text
        assert ours.decode(ours.encode(text)) == hf.decode(hf.encode(text), skip_special_tokens=True)
    assert ours.eos_token_ids == (len(tokens) - 1, len(tokens) - 2)  # eos, then <|endoftext|> (end of turn)


def test_pre_tokenizer_choice_matters(tmp_path):
    # the comparisons above only mean something if the split regexes give different tokens on these texts
    results = {}
    for pre in ("llama-bpe", "qwen2", "default"):
        (tmp_path / pre).mkdir()
        write_bpe_gguf(tmp_path / pre, pre)
        tok = Tokenizer.from_gguf_metadata(read_gguf(tmp_path / pre / "bpe.gguf")[1])
        results[pre] = [tok.encode(t) for t in PRE_TEXTS]
    assert results["llama-bpe"] != results["default"] != results["qwen2"] != results["llama-bpe"]
