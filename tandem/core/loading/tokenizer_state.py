"""A built Tokenizer as bytes and back: the ``tokenizers`` pipeline's own JSON plus the settings
around it (special tokens, BOS/EOS flags, chat template, end-of-sequence ids). Rebuilding from these
bytes skips the GGUF vocabulary read and the BPE construction (the step cache stores them).

Example::

    blob = tokenizer_to_bytes(tok)            # UTF-8 JSON
    same = tokenizer_from_bytes(blob)         # encodes, decodes and renders chats as ``tok`` does
"""
from __future__ import annotations

import json

from tandem.core.errors import TandemError

from .tokenizer import Backend, Tokenizer

STATE_VERSION = 1


def tokenizer_to_bytes(tok: Tokenizer) -> bytes:
    state = {"version": STATE_VERSION, "special": tok._special, "add_bos": tok._add_bos, "add_eos": tok._add_eos,
             "chat_template": tok.chat_template, "eos_ids": list(tok.eos_token_ids), "vocab_size": tok.vocab_size,
             "backend": tok.backend.to_str()}
    return json.dumps(state).encode("utf-8")


def tokenizer_from_bytes(blob: bytes) -> Tokenizer:
    try:
        state = json.loads(blob.decode("utf-8"))
        if state.get("version") != STATE_VERSION:
            raise ValueError("version")
        backend = Backend.from_str(state["backend"])
        return Tokenizer(backend, special_tokens=state["special"], add_bos=bool(state["add_bos"]),
                         add_eos=bool(state["add_eos"]), chat_template=state["chat_template"],
                         extra_eos_ids=[int(i) for i in state["eos_ids"]], vocab_size=int(state["vocab_size"]))
    except TandemError:
        raise
    except Exception as exc:  # json / tokenizers errors on a corrupt state
        raise TandemError(f"cannot rebuild the tokenizer from its saved state ({type(exc).__name__})") from None
