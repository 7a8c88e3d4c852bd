"""A generation request as the scheduler sees it, its errors, and the checks made before it runs.

Example::

    job = GenerationJob(prompt="Hi", max_new_tokens=8, sampling={"temperature": 0.0}, stream_pieces=True,
                        loop=asyncio.get_running_loop(), deadline_s=time.monotonic() + 300)
    budget = max_new_tokens_for(engine, job)   # ApiError 400 when the prompt + max_tokens exceed the context
    job.cancel()                               # dropped before the next step
"""
from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from online.server.schemas import ApiError


class QueueFullError(Exception):
    """The wait queue already holds ``max_queue`` requests."""


class SchedulerClosedError(Exception):
    """The server is shutting down."""


def shutting_down() -> ApiError:
    return ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")


def timeout_error(timeout_s: float) -> ApiError:
    return ApiError(504, f"the request did not finish within the server's timeout of {timeout_s:g} s",
                    type="timeout_error", code="timeout")


@dataclass(eq=False)
class GenerationJob:
    """One queued generation; its events go to ``events`` on the request's event loop."""

    prompt: Any  # str | list[dict] chat messages | list[int]
    max_new_tokens: int | None  # None -> up to the end of the context
    sampling: dict[str, Any]
    stream_pieces: bool
    loop: asyncio.AbstractEventLoop
    deadline_s: float  # time.monotonic() deadline
    submitted_s: float = field(default_factory=time.monotonic)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    _cancelled: threading.Event = field(default_factory=threading.Event)
    _on_cancel: Any = None
    cancel_reason: str = "cancelled"
    n: int = 1  # choices
    decode_options: Any = None  # DecodeOptions; None: built at start from sampling's logprobs/top_logprobs/grammar
    order: int = 0  # arrival number
    # worker side
    sequences: list = field(default_factory=list)
    results: dict = field(default_factory=dict)  # choice index -> GenerationResult
    forked: bool = False
    admitted: bool = False
    prompt_ids: list = field(default_factory=list)

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def cancel(self, reason: str = "cancelled") -> None:
        """Stop this job: dropped if still queued, stopped before its next token if running.

        ``reason`` names the metric it is counted under: ``cancelled`` or ``timeouts``.
        """
        if not self._cancelled.is_set():
            self.cancel_reason = reason
            self._cancelled.set()
            if self._on_cancel is not None:
                self._on_cancel(self)

    def emit(self, kind: str, value: Any) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))
        except RuntimeError:  # the request's loop is closed: nobody is listening any more
            pass



def max_new_tokens_for(engine: Any, job: GenerationJob) -> int:
    """The request's max_tokens, checked against the room the prompt leaves in the context."""
    context = int(engine.max_context)
    n_prompt = count_prompt_tokens(engine, job.prompt)
    if n_prompt is None:
        return job.max_new_tokens if job.max_new_tokens is not None else context
    if n_prompt >= context:
        raise ApiError(400, f"the prompt has {n_prompt} tokens but the model's context is {context} tokens",
                       param="messages" if isinstance(job.prompt, list) and job.prompt
                       and isinstance(job.prompt[0], dict) else "prompt", code="context_length_exceeded")
    room = context - n_prompt
    if job.max_new_tokens is None:
        return room
    if job.max_new_tokens > room:
        raise ApiError(400, f"the prompt ({n_prompt} tokens) plus max_tokens ({job.max_new_tokens}) exceeds the "
                       f"model's context of {context} tokens; lower max_tokens to at most {room}",
                       param="max_tokens", code="context_length_exceeded")
    return job.max_new_tokens

def count_prompt_tokens(engine: Any, prompt: Any) -> int | None:
    tokenizer = getattr(engine, "tokenizer", None)
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if tokenizer is None:
        return None
    if isinstance(prompt, str):
        return len(tokenizer.encode(prompt))
    return len(tokenizer.encode_chat(prompt))
