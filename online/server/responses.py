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
    def usage(result: Any) -> dict[str, Any]:
        """OpenAI usage of one result or of the n choices of one request (the prompt counted once)."""
        results = result if isinstance(result, list) else [result]
        prompt, completion = int(results[0].prompt_tokens), sum(len(r.token_ids) for r in results)
        cached = int(results[0].stats.get("cached_tokens", 0)) if isinstance(results[0].stats, dict) else 0
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def full(self, result: Any) -> dict[str, Any]:
        results = result if isinstance(result, list) else [result]
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": r.text}, "logprobs": None,
                        "finish_reason": r.finish_reason} for i, r in enumerate(results)]
            body = self._envelope("chat.completion", choices)
        else:
            body = self._envelope("text_completion", [{"index": i, "text": r.text, "logprobs": None,
                                                       "finish_reason": r.finish_reason}
                                                      for i, r in enumerate(results)])
        return {**body, "usage": self.usage(result)}

    def chunk(self, text: str | None = None, finish_reason: str | None = None, role: bool = False,
              index: int = 0) -> dict[str, Any]:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "content": ""} if role else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("chat.completion.chunk", [choice])
        return self._envelope("text_completion", [{"index": index, "text": text or "", "logprobs": None,
                                                   "finish_reason": finish_reason}])

    async def events(self, job: GenerationJob, first: tuple[str, Any], include_usage: bool, timeout_s: float):
        """Server-sent events: role chunk, one chunk per text piece, the finish chunk, ``[DONE]``.
        With n > 1 every choice gets its own chunks (``index``); pieces come as (index, text)."""
        n = getattr(job, "n", 1)
        if self.chat:
            for i in range(n):
                yield sse(self.chunk(role=True, index=i))
        kind, value = first
        while True:
            if kind == "piece":
                index, text = value if isinstance(value, tuple) else (0, value)
                yield sse(self.chunk(text=text, index=index))
            elif kind == "done":
                for i, result in enumerate(value if isinstance(value, list) else [value]):
                    yield sse(self.chunk(finish_reason=result.finish_reason, index=i))
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
