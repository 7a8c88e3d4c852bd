"""OpenAI-shaped response bodies and server-sent event streams.

Example::

    reply = Reply(request_id="chatcmpl-1", model="smollm2", chat=True)
    reply.full(result)           # {"id", "object": "chat.completion", "choices": [...], "usage": {...}}
    sse(reply.chunk(text="Hi"))  # 'data: {...}\n\n'
"""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any

from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from online.server.scheduler import GenerationJob, timeout_error


class Reply:
    """Builds OpenAI-shaped response bodies and stream chunks for one request."""

    def __init__(self, request_id: str, model: str, chat: bool):
        self.id, self.model, self.chat, self.created = request_id, model, chat, int(time.time())

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    @staticmethod
    def usage(result: Any) -> dict[str, int]:
        prompt, completion = int(result.prompt_tokens), len(result.token_ids)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def full(self, result: Any) -> dict[str, Any]:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text}}
            body = self._envelope("chat.completion", [{**choice, "logprobs": None,
                                                       "finish_reason": result.finish_reason}])
        else:
            body = self._envelope("text_completion", [{"index": 0, "text": result.text, "logprobs": None,
                                                       "finish_reason": result.finish_reason}])
        return {**body, "usage": self.usage(result)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        return self._envelope("text_completion", [{"index": 0, "text": text or "", "logprobs": None,
                                                   "finish_reason": finish_reason}])

    async def events(self, job: GenerationJob, first: tuple[str, Any], include_usage: bool, timeout_s: float):
        """Server-sent events: role chunk, one chunk per text piece, the finish chunk, ``[DONE]``."""
        if self.chat:
            yield sse(self.chunk(role=True))
        kind, value = first
        while True:
            if kind == "piece":
                yield sse(self.chunk(text=value))
            elif kind == "done":
                yield sse(self.chunk(finish_reason=value.finish_reason))
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
