"""Text pieces of a growing token list, with stop strings: what ``Engine.stream`` and the server's sequences show.

Each token is decoded over IncrementalDecoder's short window, so a token costs O(window) and not O(tokens so
far): both callers decoded the whole generated list at every token until 2026-11-29. On SmolLM2's tokenizer that
cost 0.022 ms per token averaged over 128 generated tokens and 0.134 ms over 1,000 (2% of a decode step there,
growing with the output); this costs ~0.007 ms. Stop strings are searched only where a new one can end.

Example::

    decoder = TextDecoder(tokenizer, stop=("\\n\\n",))
    piece, stopped = decoder.push(token_id)   # text safe to show now; whether a stop string ended the text
    tail = decoder.flush()                    # the held-back rest at the end (decoder.stopped: a stop in it)
    decoder.text                              # the whole text, cut before a stop string
"""
from __future__ import annotations

from typing import Any

from .tokenizer import IncrementalDecoder


class TextDecoder:
    """``push`` returns (new text safe to show, whether a stop string ended the text): the longest tail of the
    text that begins some stop string is held back (it may grow into one; text that cannot is shown at once),
    as is a character still incomplete (IncrementalDecoder); ``flush`` returns the rest, cut before a stop
    string found in it. ``tokenizer`` None: no text (token ids only)."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(stop)
        self.longest_stop = max((len(s) for s in self.stop), default=0)
        self.generated: list[int] = []
        self.text = ""
        self.emitted = 0
        self.stopped = False
        self._incremental = IncrementalDecoder(tokenizer) if tokenizer is not None else None

    def push(self, token_id: int) -> tuple[str, bool]:
        """Add a token: (new text that is safe to show, whether a stop string ended the text)."""
        self.generated.append(token_id)
        if self._incremental is None or self.stopped:
            return "", self.stopped
        return self._append(self._incremental.push(token_id), final=False)

    def flush(self) -> str:
        """The held-back tail at the end of the generation (cut before a stop string it holds)."""
        if self._incremental is None or self.stopped:
            return ""
        piece, _ = self._append(self._incremental.flush(), final=True)
        return piece

    def _append(self, new_text: str, final: bool) -> tuple[str, bool]:
        if new_text:
            start = max(0, len(self.text) - self.longest_stop + 1)  # the text before has no stop string
            self.text += new_text
            cut = min((i for i in (self.text.find(s, start) for s in self.stop) if i >= 0), default=-1)
            if cut >= 0:
                self.text, self.stopped = self.text[:cut], True
                piece = self.text[self.emitted:]
                self.emitted = len(self.text)
                return piece, True
        safe = len(self.text) if final else len(self.text) - self._stop_prefix_tail()
        if safe <= self.emitted:
            return "", False
        piece, self.emitted = self.text[self.emitted:safe], safe
        return piece, False

    def _stop_prefix_tail(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of a stop string (0: none). A stop
        string not yet complete can only start inside it, so everything before it is safe to show."""
        text, held = self.text, 0
        for stop in self.stop:
            if not text or text[-1] not in stop[:-1]:
                continue
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return held
