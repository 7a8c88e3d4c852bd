"""Grammars for constrained decoding, through llguidance (a maintained Rust grammar engine).

Why llguidance (measured 2026-11-23 on this 2-core machine, contended, SmolLM2's 49,152-token
vocabulary, a 4-property JSON schema, 31 decode steps; script in docs/constrained-decoding.md):

=============  ==========  ===========================================  ===============  ==========
library        wheel       install pulls                                tokenizer setup  mask/step
=============  ==========  ===========================================  ===============  ==========
llguidance     3.1 MB      nothing (abi3 wheel, no dependencies)        0.57 s           15 us median, 1.6 ms first
xgrammar       1.3 MB      triton (~1 GB), apache-tvm-ffi, transformers 0.65 s           4 us median, 0.1 ms max
outlines-core  2.3 MB      nothing                                      0.23 s           430 us median, 4.8 ms max
=============  ==========  ===========================================  ===============  ==========

All three install as prebuilt wheels. llguidance takes the ``tokenizers`` JSON the engine already
builds from the GGUF vocabulary (no transformers, no network), needs no extra packages, and its
mask cost is far below a decode step (milliseconds); xgrammar is faster per step but drags in
~1 GB of triton and needs a transformers tokenizer; outlines-core is 30x slower per step and
compiles a whole regex index per schema (170 ms). Unsupported JSON-schema keywords are reported by
llguidance (``Unimplemented keys: ["not"]``) and become clear errors here.

Example::

    grammar = Grammar.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}})
    factory = GrammarConstraint(grammar_tokenizer(engine), grammar)
    state = factory()                   # one per sequence
    allowed = state.allowed(49152)      # [vocab] bool
    state.advance(token_id)
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import llguidance
import torch

from tandem.errors import TandemError

# JSON is generated compactly but with the spaces models usually write after ':' and ','; no free
# whitespace (a model can otherwise loop on newlines forever).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
JSON_OBJECT_SCHEMA = {"type": "object"}


@dataclass(frozen=True)
class Grammar:
    """A validated llguidance grammar (its serialized form in ``source``); build with the class methods."""
    kind: str  # "json_object" | "json_schema" | "lark"
    source: str

    def __post_init__(self) -> None:
        failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(self.source)
        if failed:
            detail = "; ".join(messages) or "invalid grammar"
            raise TandemError(f"unsupported {self.kind.replace('_', ' ')}: {detail}")

    @classmethod
    def json_object(cls) -> "Grammar":
        return cls.json_schema(JSON_OBJECT_SCHEMA, kind="json_object")

    @classmethod
    def json_schema(cls, schema: Any, kind: str = "json_schema") -> "Grammar":
        """Output constrained to JSON matching ``schema`` (a dict)."""
        if not isinstance(schema, dict):
            raise TandemError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            source = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_OPTIONS)
        except (ValueError, TypeError) as exc:
            raise TandemError(f"invalid JSON schema: {str(exc).splitlines()[0]}") from None
        return cls(kind, source)

    @classmethod
    def lark(cls, text: str) -> "Grammar":
        """A Lark grammar (llguidance dialect: ``%json {schema}`` embeds a JSON schema)."""
        try:
            return cls("lark", llguidance.LLMatcher.grammar_from_lark(text))
        except (ValueError, TypeError) as exc:
            raise TandemError(f"invalid grammar: {str(exc).splitlines()[0]}") from None


def build_grammar_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: list[int]) -> llguidance.LLTokenizer:
    """llguidance's view of an engine tokenizer (online.loading.tokenizer.Tokenizer): built from the
    same ``tokenizers`` JSON (the GGUF's vocabulary and merges), so token ids and bytes agree. ~0.6 s."""
    if tokenizer is None:
        raise TandemError("constrained decoding needs the model's tokenizer")
    if not eos_ids:
        raise TandemError("constrained decoding needs an end-of-sequence token")
    try:
        return llguidance.LLTokenizer(tokenizer.backend.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids))
    except (ValueError, TypeError) as exc:
        raise TandemError(f"cannot use this tokenizer for constrained decoding: {str(exc).splitlines()[0]}") from None


def grammar_tokenizer(engine: Any) -> llguidance.LLTokenizer:
    """The engine's llguidance tokenizer, built once and kept on the engine."""
    cached = getattr(engine, "_grammar_tokenizer", None)
    if cached is None:
        eos = [t for t in (getattr(engine.tokenizer, "eos_token_ids", ()) or ()) if t in engine.eos_token_ids]
        eos = eos or sorted(engine.eos_token_ids)
        cached = build_grammar_tokenizer(engine.tokenizer, engine.config.vocab_size, eos)
        engine._grammar_tokenizer = cached
    return cached


class GrammarConstraint:
    """Constraint factory for DecodeOptions: each call starts a fresh matcher for one sequence."""

    def __init__(self, ll_tokenizer: llguidance.LLTokenizer, grammar: Grammar):
        self.ll_tokenizer = ll_tokenizer
        self.grammar = grammar
        self.eos_tokens = frozenset(int(t) for t in ll_tokenizer.eos_tokens) or {int(ll_tokenizer.eos_token)}

    def __call__(self) -> "GrammarState":
        matcher = llguidance.LLMatcher(self.ll_tokenizer, self.grammar.source, log_level=0)
        if matcher.is_error():
            raise TandemError(f"grammar error: {matcher.get_error()}")
        return GrammarState(matcher, self.eos_tokens)


class GrammarState:
    """One sequence's matcher: the allowed-token mask and its advance by the chosen token."""

    def __init__(self, matcher: llguidance.LLMatcher, eos_tokens: frozenset[int]):
        self.matcher = matcher
        self.eos_tokens = eos_tokens

    @property
    def stopped(self) -> bool:
        """The grammar is complete (its end-of-sequence was consumed) or broken."""
        return self.matcher.is_stopped() or self.matcher.is_error()

    @property
    def accepting(self) -> bool:
        return self.matcher.is_accepting()

    def allowed(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bool: the tokens the grammar allows next (only EOS once complete)."""
        if self.stopped:
            mask = torch.zeros(vocab_size, dtype=torch.bool)
            mask[sorted(self.eos_tokens)] = True
            return mask
        words = torch.frombuffer(bytearray(self.matcher.compute_bitmask()), dtype=torch.int32)  # [ceil(V/32)]
        bits = (words[:, None] >> torch.arange(32, dtype=torch.int32)) & 1  # [ceil(V/32), 32]
        return bits.reshape(-1)[:vocab_size].bool()

    def ends(self, token_id: int) -> bool:
        """``token_id`` (just advanced) is the end-of-sequence that closes the complete grammar."""
        return int(token_id) in self.eos_tokens and self.stopped

    def advance(self, token_id: int) -> None:
        if not self.stopped:
            self.matcher.consume_token(int(token_id))
