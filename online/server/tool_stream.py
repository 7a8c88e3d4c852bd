"""Tool calls streamed as they are generated: the name first, then the arguments in pieces.

OpenAI streams a call as ``delta.tool_calls`` chunks: the first carries ``index``, ``id``, ``type`` and
``function.name`` (with empty ``arguments``); the next ones carry ``function.arguments`` fragments
whose concatenation is the arguments' JSON. ``scan_tool_calls`` finds the calls in the text so far
(``<tool_call>`` blocks, or a whole answer that is a bare JSON call) and ``ToolCallStream`` turns
what is new since the last look into such deltas, at most one entry per call in a delta (the first carries the
arguments begun so far: clients that key a chunk's entries by index lose nothing). A call is streamed once its name is a known tool
and its ``"arguments"`` object has begun; anything else is left to the whole-call parse at the end.

Example::

    stream = ToolCallStream({"get_time"}, max_calls=None)
    stream.update('<tool_call>\\n{"name": "get_time", "arguments": {"zo')
    # [{"index": 0, "id": "call_...", "type": "function", "function": {"name": "get_time", "arguments": '{"zo'}}]
    stream.update('<tool_call>\\n{"name": "get_time", "arguments": {"zone": "UTC"}}')
    # [{"index": 0, "function": {"arguments": 'ne": "UTC"}'}}]
"""
from __future__ import annotations

import json
import re
import uuid
from typing import Any

CALL_TAG = "<tool_call>"
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


def json_object_end(text: str) -> int | None:
    """Index just past the JSON object that starts ``text`` (``text[0] == "{"``); None while it is open."""
    depth, in_string, escaped = 0, False, False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None


def scan_tool_calls(text: str, known: set[str]) -> list[tuple[str, str, bool]]:
    """``[(name, arguments text so far, complete)]`` for the calls that can be streamed, in order; stops
    at the first block that is not (yet) a known tool's name followed by an arguments object."""
    if CALL_TAG in text:
        blocks = text.split(CALL_TAG)[1:]
    elif text.lstrip().startswith("{"):
        blocks = [text]
    else:
        return []
    calls = []
    for block in blocks:
        head = _HEAD.match(block)
        if head is None:
            break
        try:
            name = json.loads(f'"{head[1]}"')
        except ValueError:
            break
        args = block[head.end():]
        if name not in known or not args.startswith("{"):
            break
        end = json_object_end(args)
        calls.append((name, args if end is None else args[:end], end is not None))
        if end is None:
            break
    return calls


class ToolCallStream:
    """What of the calls in a growing text has been sent, and the deltas for what has not."""

    def __init__(self, known: set[str], max_calls: int | None) -> None:
        self.known, self.max_calls = known, max_calls
        self.sent_chars: list[int] = []  # per streamed call: arguments characters sent

    @property
    def streamed(self) -> int:
        """How many calls have been started."""
        return len(self.sent_chars)

    def update(self, text: str) -> list[dict[str, Any]]:
        """The ``delta.tool_calls`` entries for what ``text`` (everything held back so far) adds."""
        deltas: list[dict[str, Any]] = []
        for index, (name, args, _) in enumerate(scan_tool_calls(text, self.known)[:self.max_calls]):
            if index == len(self.sent_chars):  # the call's first entry carries its arguments so far too: one
                deltas.append({"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",  # entry
                               "function": {"name": name, "arguments": args}})  # per index in a delta, as OpenAI
                self.sent_chars.append(len(args))
            elif len(args) > self.sent_chars[index]:
                deltas.append({"index": index, "function": {"arguments": args[self.sent_chars[index]:]}})
                self.sent_chars[index] = len(args)
        return deltas
