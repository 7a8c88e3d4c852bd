"""Grammars for constrained decoding, through llguidance (a maintained Rust grammar engine).

Why llguidance (measured against xgrammar and outlines-core: ``bench/grammar_mask.py``, numbers in
bench/RESULTS.md "Grammar libraries"): all three install as wheels and mask a 49k vocabulary far
faster than a decode step; llguidance has no dependencies (xgrammar pulls ~1 GB of triton and needs a
transformers tokenizer), reads the ``tokenizers`` JSON the engine builds from the GGUF vocabulary
(no network, no transformers), compiles a schema lazily (outlines-core builds a regex index per
schema), and names unsupported JSON-schema keywords (``Unimplemented keys: ["not"]``), which become
clear errors (HTTP 400) here.

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
import numpy as np
import torch

from tandem.core.errors import TandemError

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
    """llguidance's view of an engine tokenizer (tandem.core.loading.tokenizer.Tokenizer): built from the
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
        packed = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)  # [ceil(V/32) * 4], bit i = token i
        bits = np.unpackbits(packed, count=vocab_size, bitorder="little")  # [vocab] 0/1
        return torch.from_numpy(bits.view(np.bool_))

    def ends(self, token_id: int) -> bool:
        """``token_id`` (just advanced) is the end-of-sequence that closes the complete grammar."""
        return int(token_id) in self.eos_tokens and self.stopped

    def advance(self, token_id: int) -> None:
        if not self.stopped:
            self.matcher.consume_token(int(token_id))
