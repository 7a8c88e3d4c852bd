"""Calibration text: the shipped corpus, users' files, model-generated text, and the train/held-out split.

The shipped corpus (``offline/data/calibration.txt``) was written for this project: prose, dialogue,
code, lists, science, history, instructions and chat turns. Chat documents are stored as
``@role:`` turns and rendered through the model's own chat template at load time.
Every 5th document (index 4, 9, ...) is held out for quality measurement.

Example::

    calib = build_calibration_set(engine)                        # shipped corpus
    calib = build_calibration_set(engine, files=["my_text.txt"])  # users' own text
    calib.train, calib.held_out    # lists of token-id documents
    calib.source                   # JSON-able description (kind, files, token counts)
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from tandem.core.errors import TandemError, check_int

DATA_DIR = Path(__file__).resolve().parent / "data"
CORPUS_PATH = DATA_DIR / "calibration.txt"
SEED_PROMPTS_PATH = DATA_DIR / "seed_prompts.txt"
HOLD_OUT_EVERY = 5
USER_DOC_TOKENS = 256  # users' files are cut into documents of this many tokens
CHAT_ROLES = ("system", "user", "assistant")
SELF_GENERATED_TOKENS_PER_PROMPT = 160
DEFAULT_MAX_QUALITY_LOSS = 0.02  # the perplexity increase a profile's thresholds may cost (2%)


@dataclass(frozen=True)
class CorpusDocument:
    """One shipped document: plain text, or chat turns ((role, content), ...)."""
    kind: str
    title: str
    text: str = ""
    messages: tuple[tuple[str, str], ...] = ()

    @property
    def is_chat(self) -> bool:
        return bool(self.messages)


@dataclass
class CalibrationSet:
    train: list[list[int]]
    held_out: list[list[int]]
    source: dict[str, Any] = field(default_factory=dict)

    @property
    def train_tokens(self) -> int:
        return sum(len(d) for d in self.train)

    @property
    def held_out_tokens(self) -> int:
        return sum(len(d) for d in self.held_out)


def parse_corpus(text: str) -> list[CorpusDocument]:
    """Parse the corpus format: ``=== kind | title`` headers; chat documents hold ``@role:`` turns."""
    docs: list[CorpusDocument] = []
    header: tuple[str, str] | None = None
    lines: list[str] = []

    def flush() -> None:
        if header is None:
            return
        kind, title = header
        body = "\n".join(lines).strip("\n")
        if kind == "chat":
            docs.append(CorpusDocument(kind, title, messages=_parse_turns(body, title)))
        elif body.strip():
            docs.append(CorpusDocument(kind, title, text=body))

    for line in text.splitlines():
        if line.startswith("=== "):
            flush()
            kind, _, title = line[4:].partition("|")
            header, lines = (kind.strip(), title.strip()), []
        elif header is not None:
            lines.append(line)
    flush()
    return docs


def _parse_turns(body: str, title: str) -> tuple[tuple[str, str], ...]:
    turns: list[list[str]] = []
    for line in body.splitlines():
        role, sep, rest = line.partition(":")
        if line.startswith("@") and sep and role[1:] in CHAT_ROLES:
            turns.append([role[1:], rest.strip()])
        elif turns:
            turns[-1][1] += "\n" + line
        elif line.strip():
            raise ValueError(f"chat document {title!r}: text before the first @role: turn")
    if not turns:
        raise ValueError(f"chat document {title!r} has no turns")
    return tuple((role, content.strip()) for role, content in turns)


def builtin_documents() -> list[CorpusDocument]:
    return parse_corpus(CORPUS_PATH.read_text(encoding="utf-8"))


def render_document(doc: CorpusDocument, tokenizer) -> list[int]:
    """Token ids of a document; chat turns go through the chat template (plain "role: text" without one)."""
    if not doc.is_chat:
        return tokenizer.encode(doc.text, add_special_tokens=True)
    messages = [{"role": r, "content": c} for r, c in doc.messages]
    if tokenizer.chat_template:
        return tokenizer.encode_chat(messages, add_generation_prompt=False)
    return tokenizer.encode("\n".join(f"{r}: {c}" for r, c in doc.messages), add_special_tokens=True)


def check_max_quality_loss(max_quality_loss: Any) -> None:
    if isinstance(max_quality_loss, bool) or not isinstance(max_quality_loss, (int, float)) \
            or not 0.0 < max_quality_loss <= 1.0:
        raise TandemError(f"--max-quality-loss must be in (0, 1] (0.02 = 2% perplexity increase), "
                          f"got {max_quality_loss!r}")


def check_calibration_inputs(tokens: int | None, max_quality_loss: float, threads: int | None,
                             calib: Sequence[str] | None) -> None:
    """The calibration settings of ``tandem.pipeline.profile`` and ``prepare``, checked before any work (``prepare``
    checks them when it reuses a profile too: a bad value is an error whether or not it would be used)."""
    check_int("tokens (--tokens)", tokens, 16)
    check_max_quality_loss(max_quality_loss)
    check_int("threads (--threads)", threads, 1)
    if calib:
        read_text_files(calib)


def read_text_files(paths: Sequence[str | Path]) -> list[tuple[str, str]]:
    """(path, text) for each file; a missing, unreadable, non-UTF-8 or empty file is a TandemError."""
    out = []
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise TandemError(f"calibration file not found: {path}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise TandemError(f"calibration file {path} is not UTF-8 text") from None
        except OSError as e:
            raise TandemError(f"cannot read calibration file {path}: {e.strerror}") from None
        if not text.strip():
            raise TandemError(f"calibration file {path} is empty")
        out.append((str(path), text))
    return out


def split_documents(docs: Sequence[list[int]], every: int = HOLD_OUT_EVERY) -> tuple[list[list[int]], list[list[int]]]:
    """Deterministic split: documents with index % every == every - 1 are held out (the last one if none)."""
    docs = [list(d) for d in docs if d]
    if len(docs) < 2:
        raise TandemError(f"calibration text is too short: {sum(len(d) for d in docs)} tokens in {len(docs)} "
                          f"document(s); need at least 2 documents (user files are cut every {USER_DOC_TOKENS} tokens)")
    held_idx = {i for i in range(len(docs)) if i % every == every - 1} or {len(docs) - 1}
    return ([d for i, d in enumerate(docs) if i not in held_idx], [d for i, d in enumerate(docs) if i in held_idx])


def cap_tokens(docs: list[list[int]], max_tokens: int) -> list[list[int]]:
    """The first documents up to ``max_tokens`` tokens in total (the last one cut)."""
    out, left = [], max_tokens
    for d in docs:
        if left <= 0:
            break
        out.append(d[:left])
        left -= len(out[-1])
    return out


def seed_prompts() -> list[str]:
    return [line.strip() for line in SEED_PROMPTS_PATH.read_text(encoding="utf-8").splitlines() if line.strip()]


def self_generated_documents(engine, n_tokens: int, seed: int = 0) -> list[list[int]]:
    """Chat documents (seed prompt + the model's own sampled answer) totalling about ``n_tokens`` new tokens."""
    docs: list[list[int]] = []
    left = n_tokens
    prompts = seed_prompts()
    attempt = 0
    while left > 0:
        produced = 0
        for prompt in prompts:  # one round over the seed prompts (fresh sampling seeds each round)
            if left <= 0:
                break
            messages = [{"role": "user", "content": prompt}]
            result = engine.generate(messages, max_new_tokens=min(SELF_GENERATED_TOKENS_PER_PROMPT, left),
                                     temperature=0.8, top_p=0.95, seed=seed + attempt)
            attempt += 1
            if result.token_ids:
                docs.append(engine.tokenizer.encode_chat(messages) + result.token_ids)
                left -= len(result.token_ids)
                produced += len(result.token_ids)
        if produced == 0:  # the model ends every answer at once: nothing more to gain
            break
    return docs


def build_calibration_set(engine, files: Sequence[str | Path] | None = None, max_tokens: int | None = None,
                          self_generated_tokens: int = 0, seed: int = 0) -> CalibrationSet:
    """Tokenize the calibration text for ``engine``'s model and split it into train / held-out documents.

    ``max_tokens`` caps the total (train + held out, in the natural 4:1 proportion). Model-generated
    documents (``self_generated_tokens``) join the training split only: quality is always measured
    on human-written text.
    """
    tokenizer = engine.tokenizer
    if tokenizer is None:
        raise TandemError(f"model {engine.model_id} has no tokenizer, so calibration text cannot be encoded")
    if max_tokens is not None and max_tokens < 16:
        raise TandemError(f"--tokens must be at least 16, got {max_tokens}")
    if self_generated_tokens < 0:
        raise TandemError(f"--self-generated must be >= 0, got {self_generated_tokens}")
    if files:
        texts = read_text_files(files)
        docs, file_info = [], []
        for name, text in texts:
            ids = tokenizer.encode(text, add_special_tokens=True)
            docs += [ids[i:i + USER_DOC_TOKENS] for i in range(0, len(ids), USER_DOC_TOKENS)]
            file_info.append({"path": name, "sha256": hashlib.sha256(text.encode()).hexdigest()[:16], "tokens": len(ids)})
        source: dict[str, Any] = {"kind": "files", "files": file_info}
    else:
        corpus = builtin_documents()
        docs = [render_document(d, tokenizer) for d in corpus]
        source = {"kind": "builtin", "corpus": CORPUS_PATH.name,
                  "corpus_sha256": hashlib.sha256(CORPUS_PATH.read_bytes()).hexdigest()[:16],
                  "documents": len(corpus), "chat_documents": sum(d.is_chat for d in corpus)}
    train, held_out = split_documents(docs)
    if max_tokens is not None:
        total = sum(map(len, train)) + sum(map(len, held_out))
        held_cap = max(8, round(max_tokens * sum(map(len, held_out)) / max(total, 1)))
        train, held_out = cap_tokens(train, max_tokens - held_cap), cap_tokens(held_out, held_cap)
    if self_generated_tokens:
        generated = self_generated_documents(engine, self_generated_tokens, seed)
        train = train + generated
        source["self_generated_tokens"] = sum(map(len, generated))
    source.update(train_documents=len(train), held_out_documents=len(held_out), hold_out_every=HOLD_OUT_EVERY,
                  train_tokens=sum(map(len, train)), held_out_tokens=sum(map(len, held_out)))
    return CalibrationSet(train, held_out, source)
