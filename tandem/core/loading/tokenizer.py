"""Tokenizer: GGUF metadata or a Hugging Face folder -> a ``tokenizers`` pipeline + chat template.

Two GGUF vocabularies are supported, built so that token ids match what transformers builds from
the same file:

- ``gpt2``: byte-level BPE from ``tokenizer.ggml.tokens`` + ``merges``, split with the regex of
  ``tokenizer.ggml.pre`` (GPT-2's own regex for "default"/"smollm"/unknown names),
- ``llama``: SentencePiece-style BPE with byte fallback (``<0xNN>`` pieces), ``▁`` for spaces,
  merges from the file or, when absent, derived from the token scores; BOS added by default.

Example::

    tok = Tokenizer.from_gguf_metadata(fields)          # fields: GGUF key -> plain Python value
    ids = tok.encode_chat([{"role": "user", "content": "Hi"}])
    text = tok.decode(ids)        # streamed token by token: detokenize.IncrementalDecoder
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as Backend

from tandem.core.errors import TandemError
from .chat_templates import builtin_template

TOKEN_TYPE_CONTROL, TOKEN_TYPE_USER_DEFINED = 3, 4  # tokenizer.ggml.token_type values
# Texts of end-of-turn tokens: generation also stops on these when the vocabulary has them.
END_OF_TURN_TEXTS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>",
                     "<|endoftext|>", "<|end_of_text|>", "<EOT>")

_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> split regex; names not listed use GPT-2's regex (ByteLevel's built-in one)
PRE_TOKENIZER_SPLITS = {
    "llama3": _LLAMA3_SPLIT, "llama-v3": _LLAMA3_SPLIT, "llama-bpe": _LLAMA3_SPLIT,
    "smaug-bpe": _LLAMA3_SPLIT, "dbrx": _LLAMA3_SPLIT, "falcon3": _LLAMA3_SPLIT,
    "qwen2": _QWEN2_SPLIT, "deepseek-r1-qwen": _QWEN2_SPLIT, "megrez": _QWEN2_SPLIT,
}


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (printable Latin-1 bytes map to themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a scored vocabulary: every split of a token into two vocabulary pieces,
    best merged-token score first; ties: longer left piece, longer right piece, vocabulary order."""
    ids = {tok: i for i, tok in enumerate(tokens)}
    score_of = dict(zip(tokens, scores))
    first_pos: dict[str, int] = {}
    for i, tok in enumerate(tokens):
        first_pos.setdefault(tok, i)
    ranked = []
    for tok, pos in first_pos.items():
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in ids and right in ids:
                ranked.append((-score_of[tok], -len(left), -len(right), pos, ids[left], ids[right], left, right))
    ranked.sort(key=lambda r: r[:6])
    return [(r[6], r[7]) for r in ranked]


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` (assistant-mask markers): rendered as plain text."""
    tags = {"generation"}

    def parse(self, parser: Any) -> Any:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _compile_template(template: str) -> jinja2.Template:
    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateError as e:
        raise TandemError(f"invalid chat template: {e}") from None


def _validate_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise TandemError("messages must be a non-empty list of {'role': str, 'content': str} dicts")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise TandemError(f"message {i} must be a dict with 'role' and 'content', got {type(m).__name__}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str):
                raise TandemError(f"message {i}: '{key}' must be a string, got {type(m.get(key)).__name__}")
    return [json.loads(json.dumps(dict(m), default=str)) for m in messages]  # plain copies


class Tokenizer:
    """Text <-> token ids, chat template rendering and end-of-sequence ids for one model."""

    def __init__(self, backend: Backend, *, special_tokens: Mapping[str, str | None], add_bos: bool,
                 add_eos: bool, chat_template: str | None, extra_eos_ids: Iterable[int] = (),
                 vocab_size: int | None = None) -> None:
        self._backend = backend
        self._special = {k: v for k, v in special_tokens.items() if v is not None}
        self._add_bos, self._add_eos = add_bos, add_eos
        self.chat_template = chat_template
        self._template: jinja2.Template | None = None
        self._vocab_size = vocab_size or backend.get_vocab_size(with_added_tokens=True)
        self._bos_id = self.token_to_id(self._special.get("bos_token"))
        eos_id = self.token_to_id(self._special.get("eos_token"))
        ids = [i for i in (eos_id, *extra_eos_ids) if i is not None]
        added = {tid for tid, tok in backend.get_added_tokens_decoder().items() if tok.special}
        for text in END_OF_TURN_TEXTS:
            tid = backend.token_to_id(text)
            if tid is not None and tid in added:
                ids.append(tid)
        self._eos_ids = tuple(dict.fromkeys(ids))  # unique, eos first
        byte_ids = (backend.token_to_id(f"<0x{b:02X}>") for b in range(256))
        self._byte_piece_ids = frozenset(i for i in byte_ids if i is not None)  # byte-fallback pieces

    # --- construction -----------------------------------------------------------------------
    @classmethod
    def from_gguf_metadata(cls, fields: Mapping[str, Any]) -> "Tokenizer":
        """Build from GGUF metadata (key -> plain value, e.g. ``tokenizer.ggml.tokens`` -> list[str])."""
        kind = fields.get("tokenizer.ggml.model")
        tokens = fields.get("tokenizer.ggml.tokens")
        if not isinstance(tokens, list) or not tokens:
            raise TandemError("GGUF has no tokenizer vocabulary (tokenizer.ggml.tokens)")
        token_types = list(fields.get("tokenizer.ggml.token_type") or [])
        if kind not in ("gpt2", "llama"):
            raise TandemError(f"unsupported GGUF tokenizer {kind!r} (supported: gpt2, llama)")
        try:
            if kind == "gpt2":
                backend, usable = _byte_level_backend(tokens, fields)
            else:
                backend, usable = _sentencepiece_backend(tokens, fields), None
        except TandemError:
            raise
        except Exception as e:  # tokenizers raises plain Exception on inconsistent vocab/merges
            raise TandemError(f"invalid {kind} tokenizer in GGUF: {str(e).splitlines()[0]}") from None
        add_bos_default = kind == "llama"  # llama.cpp adds BOS to SentencePiece vocabularies by default

        def token_at(key: str) -> str | None:
            tid = fields.get(f"tokenizer.ggml.{key}")
            return tokens[tid] if isinstance(tid, int) and 0 <= tid < len(tokens) else None

        special = {"bos_token": token_at("bos_token_id"), "eos_token": token_at("eos_token_id"),
                   "unk_token": token_at("unknown_token_id"), "pad_token": token_at("padding_token_id")}
        spelled = usable or (lambda t: True)
        control = [t for t, ty in zip(tokens, token_types) if ty == TOKEN_TYPE_CONTROL and spelled(t)]
        control += [t for t in special.values() if t is not None and t not in control and spelled(t)]
        backend.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in control])
        vocab = backend.get_vocab(with_added_tokens=False)
        user = [t for t, ty in zip(tokens, token_types) if ty == TOKEN_TYPE_USER_DEFINED and t in vocab]
        if user:
            backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])
        extra = [fields.get(f"tokenizer.ggml.{k}") for k in ("eot_token_id", "eom_token_id")]
        return cls(backend, special_tokens=special,
                   add_bos=bool(fields.get("tokenizer.ggml.add_bos_token", add_bos_default)),
                   add_eos=bool(fields.get("tokenizer.ggml.add_eos_token", False)),
                   chat_template=fields.get("tokenizer.chat_template") or builtin_template(fields, tokens),
                   extra_eos_ids=[i for i in extra if isinstance(i, int) and 0 <= i < len(tokens)],
                   vocab_size=len(tokens))

    @classmethod
    def from_hf_folder(cls, folder: str | Path) -> "Tokenizer":
        """Build from a Hugging Face folder: ``tokenizer.json`` + ``tokenizer_config.json``."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.is_file():
            raise TandemError(f"no tokenizer.json in {folder}")
        try:
            backend = Backend.from_file(str(path))
            config = _read_json(folder / "tokenizer_config.json")
            gen_config = _read_json(folder / "generation_config.json")
        except Exception as e:  # tokenizers raises plain Exception subclasses; json ValueError; OSError
            detail = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise TandemError(f"cannot read tokenizer in {folder}: {detail}") from None
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": ..., "template": ...}]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text()
        special = {k: _token_content(config.get(k)) for k in ("bos_token", "eos_token", "unk_token", "pad_token")}
        explicit = "add_bos_token" in config or "add_eos_token" in config
        if explicit:  # like transformers: the config's flags replace the file's post-processor
            backend.post_processor = None
        extra = gen_config.get("eos_token_id")
        extra = extra if isinstance(extra, list) else [extra]
        return cls(backend, special_tokens=special, add_bos=explicit and bool(config.get("add_bos_token")),
                   add_eos=explicit and bool(config.get("add_eos_token")), chat_template=template,
                   extra_eos_ids=[i for i in extra if isinstance(i, int)])

    # --- properties -------------------------------------------------------------------------
    @property
    def bos_token_id(self) -> int | None:
        return self._bos_id

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos_ids

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    @property
    def add_bos_token(self) -> bool:
        return self._add_bos

    @property
    def backend(self) -> Backend:
        return self._backend

    def is_byte_piece(self, token_id: int) -> bool:
        """A byte-fallback piece (``<0xNN>``): its text depends on the neighbouring byte pieces."""
        return token_id in self._byte_piece_ids

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    # --- text <-> ids -----------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS/EOS only when the model's metadata asks for them."""
        if not isinstance(text, str):
            raise TandemError(f"text to encode must be a string, got {type(text).__name__}")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # e.g. bytes that were not UTF-8 on a command line (surrogate escapes)
            raise TandemError(f"the text is not valid UTF-8: a lone surrogate at character {e.start}") from None
        ids = self._backend.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens:
            if self._add_bos and self._bos_id is not None:
                ids = [self._bos_id, *ids]
            if self._add_eos and self._eos_ids:
                ids = [*ids, self._eos_ids[0]]
        return ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        ids = [int(i) for i in ids]
        bad = [i for i in ids if not 0 <= i < self._vocab_size]
        if bad:
            raise TandemError(f"token id {bad[0]} out of range 0..{self._vocab_size - 1}")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    # --- chat -------------------------------------------------------------------------------
    @property
    def supports_tools(self) -> bool:
        """The chat template renders a ``tools`` list itself (it refers to the variable)."""
        return bool(self.chat_template) and "tools" in self.chat_template

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tools: list[dict[str, Any]] | None = None) -> str:
        """Render ``messages`` with the model's chat template (as transformers does); ``tools``:
        OpenAI-style function tools, for templates that take them."""
        messages = _validate_messages(messages)
        if not self.chat_template:
            raise TandemError("this model has no chat template; pass a plain prompt instead")
        if self._template is None:
            self._template = _compile_template(self.chat_template)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=tools, documents=None, **self._special)
        except jinja2.exceptions.TemplateError as e:
            raise TandemError(f"chat template error: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Render then encode without extra special tokens (the template writes them)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools), add_special_tokens=False)


# --- builders ---------------------------------------------------------------------------------
def _byte_level_backend(tokens: list[str], fields: Mapping[str, Any]) -> tuple[Backend, Any]:
    table = byte_alphabet()
    alphabet = set(table.values())

    def usable(tok: str) -> bool:  # spelled in the byte alphabet (else it cannot be a real token)
        return set(tok) <= alphabet

    vocab = {(t if usable(t) else "".join(table[b] for b in t.encode("utf-8"))): i for i, t in enumerate(tokens)}
    merges = fields.get("tokenizer.ggml.merges")
    if not isinstance(merges, list):
        raise TandemError("GGUF byte-level tokenizer has no merges (tokenizer.ggml.merges)")
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                                 end_of_word_suffix="", fuse_unk=False))
    split = PRE_TOKENIZER_SPLITS.get(fields.get("tokenizer.ggml.pre"))
    if split is None:
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    else:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    backend.decoder = decoders.ByteLevel()
    return backend, usable


def _sentencepiece_backend(tokens: list[str], fields: Mapping[str, Any]) -> Backend:
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = fields.get("tokenizer.ggml.merges")
    if isinstance(merges, list) and merges:
        pairs = [tuple(m.split(" ", 1)) for m in merges]
    else:
        scores = fields.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise TandemError("GGUF sentencepiece tokenizer needs merges or one score per token")
        pairs = sentencepiece_merges(tokens, [float(s) for s in scores])
    backend = Backend(models.BPE(vocab=vocab, merges=pairs, fuse_unk=True, byte_fallback=True, dropout=None))
    prefix_space = bool(fields.get("tokenizer.ggml.add_space_prefix", True))
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if prefix_space else "never", split=False)
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)
    return backend


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _token_content(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None
