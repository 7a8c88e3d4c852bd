"""A tiny random Llama chat model with a real byte-level BPE tokenizer, for fast end-to-end tests.

Example::

    folder = build_tiny_chat_model(tmp_path)   # config.json, model.safetensors, tokenizer.json, tokenizer_config.json
    engine = Engine.load(str(folder))
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TRAINING_TEXT = [
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time there was a small robot who liked to count tokens.",
    "What is the capital of France? The capital of France is Paris.",
    "Hello, how are you today? I am fine, thank you very much!",
    "Servers answer requests; clients send prompts and read streamed replies.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100 1000. Symbols: {} [] () <> = + - * / % & | ^ ~ ! ? : ;",
    "Über café naïve résumé — Grüße, 東京, Привет, 😀",
    "system user assistant: be helpful, honest and brief.",
]


def build_tiny_tokenizer(vocab_size: int = 400):
    """A byte-level BPE (``tokenizers``) trained on a few sentences, ChatML special tokens first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(TRAINING_TEXT * 4, trainer=trainer)
    return tok


def build_tiny_chat_model(folder: str | Path, vocab_size: int = 400, max_position_embeddings: int = 256,
                          seed: int = 0) -> Path:
    """Write a random 2-layer Llama (hidden 64) and its tokenizer into ``folder``; returns the folder."""
    import transformers as tf

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tok = build_tiny_tokenizer(vocab_size)
    n_vocab = tok.get_vocab_size()
    eos_id = tok.token_to_id("<|im_end|>")
    bos_id = tok.token_to_id("<|endoftext|>")
    cfg = tf.LlamaConfig(vocab_size=n_vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position_embeddings,
                         bos_token_id=bos_id, eos_token_id=eos_id, tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = tf.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # larger logits than the default init, so greedy choices are not near-ties
        model.lm_head.weight.mul_(8.0)
    model.save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "unk_token": None,
        "pad_token": "<|endoftext|>",
        "add_bos_token": False,
        "add_eos_token": False,
        "model_max_length": max_position_embeddings,
        "chat_template": CHATML_TEMPLATE,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2))
    return folder
