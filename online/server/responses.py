"""OpenAI-shaped response bodies and server-sent event streams.

Example::

    reply = Reply(request_id="chatcmpl-1", model="smollm2", chat=True)
    reply.full(result)           # {"id", "object": "chat.completion", "choices": [...], "usage": {...}}
    sse(reply.chunk(text="Hi"))  # 'data: {...}\n\n'

With ``token_bytes`` (token id -> its bytes) the choices carry logprobs: chat
``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``, completions
``{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}``. With ``tools``
the text is parsed for tool calls (online.constrain.tools): ``message.tool_calls`` and
``finish_reason: "tool_calls"``; a stream streams content as usual once the text can no longer
be a tool call, and streams a call as ``delta.tool_calls`` chunks: its name, then its arguments as
they are generated (online/server/tool_stream.py).
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any, Callable

from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from online.server.scheduler import GenerationJob, timeout_error
from online.server.tool_stream import CALL_TAG, ToolCallStream, scan_tool_calls


class Reply:
    """Builds OpenAI-shaped response bodies and stream chunks for one request."""

    def __init__(self, request_id: str, model: str, chat: bool, token_bytes: Callable[[int], bytes] | None = None,
                 tools: tuple[Any, ...] | None = None, parallel_tool_calls: bool = True):
        self.id, self.model, self.chat, self.created = request_id, model, chat, int(time.time())
        self.token_bytes = token_bytes  # set when logprobs were asked for
        self.tools = tools  # set when the answer may be a tool call
        self.max_tool_calls = None if parallel_tool_calls else 1
        self.text_bytes: dict[int, bytes] = {}  # completions, per choice: the text so far (for text_offset)

    # --- logprobs ------------------------------------------------------------------------------------
    def _token(self, token_id: int) -> tuple[str, list[int]]:
        raw = self.token_bytes(token_id)
        try:
            return raw.decode("utf-8"), list(raw)
        except UnicodeDecodeError:  # part of a character: spelled as its bytes, as OpenAI does
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), list(raw)

    def logprobs(self, choices: list[Any], index: int = 0) -> dict[str, Any] | None:
        """The ``logprobs`` object of choice ``index`` (or its chunk) for these TokenChoices; None when not asked."""
        if self.token_bytes is None:
            return None
        if self.chat:
            content = []
            for c in choices:
                text, raw = self._token(c.token_id)
                top = []
                for tid, lp in c.top_logprobs:
                    t_text, t_raw = self._token(tid)
                    top.append({"token": t_text, "logprob": lp, "bytes": t_raw})
                content.append({"token": text, "logprob": c.logprob, "bytes": raw, "top_logprobs": top})
            return {"content": content, "refusal": None}
        tokens, offsets = [], []
        for c in choices:  # text_offset: characters before the token (a partial character counts once complete)
            tokens.append(self._token(c.token_id)[0])
            so_far = self.text_bytes.get(index, b"")
            offsets.append(len(so_far.decode("utf-8", errors="ignore")))
            self.text_bytes[index] = so_far + self.token_bytes(c.token_id)
        return {"tokens": tokens, "token_logprobs": [c.logprob for c in choices],
                "top_logprobs": [self._top_dict(c.top_logprobs) for c in choices],
                "text_offset": offsets}

    def _top_dict(self, top: tuple[tuple[int, float], ...]) -> dict[str, float]:
        out: dict[str, float] = {}
        for token_id, logprob in top:  # most likely first: a spelling shared by two tokens keeps the higher
            out.setdefault(self._token(token_id)[0], logprob)
        return out

    def tool_calls(self, result: Any) -> list[dict[str, Any]]:
        """The calls in a result's text; a last call that max_tokens cut off keeps the arguments generated so
        far (as a stream has sent them), with finish_reason "length" (see :meth:`finish_reason`)."""
        from online.constrain import parse_tool_calls
        if not self.tools:
            return []
        found = parse_tool_calls(result.text, list(self.tools))
        if result.finish_reason == "length":
            scanned = scan_tool_calls(result.text, {t.name for t in self.tools})
            if len(scanned) > len(found) and not scanned[-1][2]:
                found.append(scanned[-1][:2])
        return [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                 "function": {"name": name, "arguments": args}}
                for name, args in found[:self.max_tool_calls]]

    @staticmethod
    def finish_reason(result: Any, calls: list[dict[str, Any]]) -> str:
        """"tool_calls" for an answer that called tools, unless max_tokens cut it ("length")."""
        return "tool_calls" if calls and result.finish_reason != "length" else result.finish_reason

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    @staticmethod
    def usage(result: Any) -> dict[str, Any]:
        """OpenAI usage of one result or of the n choices of one request (the prompt counted once)."""
        results = result if isinstance(result, list) else [result]
        prompt, completion = int(results[0].prompt_tokens), sum(len(r.token_ids) for r in results)
        stats = getattr(results[0], "stats", None)
        cached = int(stats.get("cached_tokens", 0)) if isinstance(stats, dict) else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def full(self, result: Any) -> dict[str, Any]:
        results = result if isinstance(result, list) else [result]
        choices = []
        for i, r in enumerate(results):
            logprobs = self.logprobs(getattr(r, "choices", []), index=i)
            if self.chat:
                message: dict[str, Any] = {"role": "assistant", "content": r.text}
                finish = r.finish_reason
                calls = self.tool_calls(r)
                if calls:
                    before = r.text.split(CALL_TAG)[0].strip() if CALL_TAG in r.text else ""
                    message = {"role": "assistant", "content": before or None, "tool_calls": calls}
                    finish = self.finish_reason(r, calls)
                choices.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish})
            else:
                choices.append({"index": i, "text": r.text, "logprobs": logprobs, "finish_reason": r.finish_reason})
        body = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        return {**body, "usage": self.usage(result)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              index: int = 0, choices: list[Any] | None = None,
              tool_calls: list[dict[str, Any]] | None = None, first_call: int = 0) -> dict[str, Any]:
        """One stream chunk; ``tool_calls``: whole calls (numbered from ``first_call``) or, when they
        carry an ``index``, ToolCallStream deltas as they are."""
        logprobs = self.logprobs(choices, index=index) if choices else None
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = [call if "index" in call else {"index": first_call + i, **call}
                                       for i, call in enumerate(tool_calls)]
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        return self._envelope("text_completion", [{"index": index, "text": text or "", "logprobs": logprobs,
                                                   "finish_reason": finish_reason}])

    async def events(self, job: GenerationJob, first: tuple[str, Any], include_usage: bool, timeout_s: float):
        """Server-sent events: role chunk, one chunk per text piece, the finish chunk, ``[DONE]``.
        With n > 1 every choice gets its own chunks (``index``), logprobs and tool-call hold; pieces come as
        ``(text, choices)``, or ``(index, text, choices)`` when n > 1 (see :func:`piece_parts`)."""
        n = getattr(job, "n", 1)
        if self.chat:
            for i in range(n):
                yield sse(self.chunk(role=True, index=i))
        kind, value = first
        held = [ToolCallHold() for _ in range(n)] if self.tools is not None else None
        known = {t.name for t in self.tools or ()}
        calls_out = [ToolCallStream(known, self.max_tool_calls) for _ in range(n)]
        while True:
            if kind == "piece":
                index, text, choices = piece_parts(value)
                if held is not None:
                    text, choices = held[index].push(text, choices)
                if text:
                    yield sse(self.chunk(text=text, index=index, choices=choices))
                deltas = calls_out[index].update(held[index].text) if held is not None else []
                if deltas:  # a call's name, then its arguments as they are generated
                    taken, held[index].choices = held[index].choices, []
                    yield sse(self.chunk(tool_calls=deltas, index=index, choices=taken))
            elif kind == "done":
                for i, result in enumerate(value if isinstance(value, list) else [value]):
                    finish = result.finish_reason
                    if held is not None:  # the held-back tail: calls not streamed yet, or content after all
                        calls, streamed = self.tool_calls(result), calls_out[i].streamed
                        if calls or streamed:
                            finish = self.finish_reason(result, calls)
                            if calls[streamed:] or held[i].choices:
                                yield sse(self.chunk(tool_calls=calls[streamed:], first_call=streamed, index=i,
                                                     choices=held[i].choices))
                        elif held[i].text:
                            yield sse(self.chunk(text=held[i].text, index=i, choices=held[i].choices))
                    yield sse(self.chunk(finish_reason=finish, index=i))
                if include_usage:
                    yield sse({**self._envelope(self.chunk()["object"], []), "usage": self.usage(value)})
                break
            else:
                yield sse(value.body())
                break
            remaining_s = job.deadline_s - time.monotonic()
            try:
                kind, value = await asyncio.wait_for(job.events.get(), timeout=max(remaining_s, 0.0))
            except asyncio.TimeoutError:
                job.cancel("timeouts")
                kind, value = "error", timeout_error(timeout_s)
        yield "data: [DONE]\n\n"



class ToolCallHold:
    """Streaming with tools: text passes as content except what may be a tool call, which is held back
    (``text``, ``choices``) until the end: a whole answer that may be a bare JSON call, everything from
    ``<tool_call>`` on, and a tail that may be the start of that tag."""

    def __init__(self) -> None:
        self.text, self.choices, self.emitted_any, self.in_call = "", [], False, False

    def push(self, text: str, choices: list[Any]) -> tuple[str, list[Any]]:
        """Add a piece; returns the content (and its TokenChoices) that can be sent now."""
        self.text, self.choices = self.text + text, self.choices + list(choices)
        if self.in_call or (not self.emitted_any and may_be_tool_call(self.text)):
            return "", []
        cut = self.text.find(CALL_TAG)
        if cut >= 0:
            self.in_call = True
        else:
            cut = len(self.text) - next((n for n in range(len(CALL_TAG) - 1, 0, -1)
                                         if self.text.endswith(CALL_TAG[:n])), 0)
        out, self.text = self.text[:cut], self.text[cut:]
        out_choices, self.choices = (self.choices, []) if out else ([], self.choices)
        self.emitted_any = self.emitted_any or bool(out)
        return out, out_choices


def may_be_tool_call(text: str) -> bool:
    """The answer so far could still be (the start of) a tool call: ``<tool_call>`` or a bare JSON object."""
    head = text.lstrip()
    return not head or head.startswith((CALL_TAG, "{")) or CALL_TAG.startswith(head)


def piece_parts(value: Any) -> tuple[int, str, list[Any]]:
    """A "piece" event's value -> (choice index, text, TokenChoices): ``text``, ``(text, choices)``,
    ``(index, text)`` or ``(index, text, choices)``."""
    if isinstance(value, str):
        return 0, value, []
    if len(value) == 3:
        return value[0], value[1], list(value[2] or [])
    if isinstance(value[0], int):
        return value[0], value[1], []
    return 0, value[0], list(value[1] or [])


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class JobStreamingResponse(StreamingResponse):
    """A streaming response that cancels its job however the stream ends (done, error, client gone)."""

    def __init__(self, content: Any, job: GenerationJob, **kwargs: Any):
        super().__init__(content, **kwargs)
        self.job = job

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except (ClientDisconnect, OSError):
            pass  # the client went away; the finally below frees the engine
        finally:
            self.job.cancel()
