"""First-come-first-served scheduler: one worker thread owns the (not thread-safe) engine.

Requests wait in a bounded FIFO queue (full -> :class:`QueueFullError`, answered 429). The
worker runs one generation at a time through ``engine.stream`` and hands text pieces to the
request's asyncio loop. A request that is cancelled (client gone) or runs past its deadline is
dropped from the queue at once, or stopped between two tokens with ``stream.close()``.

Example::

    scheduler = Scheduler(engine, max_queue=64, request_timeout_s=300.0, metrics=Metrics())
    scheduler.start()
    job = scheduler.submit("Hello", max_new_tokens=8, sampling={"temperature": 0.0},
                           stream_pieces=True, loop=asyncio.get_running_loop())
    kind, value = await job.events.get()  # ("piece", str) | ("done", GenerationResult) | ("error", ApiError)
    scheduler.close()
"""
from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import jinja2

from online.server.metrics import Metrics
from online.server.schemas import ApiError
from tandem.errors import TandemError

log = logging.getLogger("tandem.server")


class QueueFullError(Exception):
    """The wait queue already holds ``max_queue`` requests."""


class SchedulerClosedError(Exception):
    """The server is shutting down."""


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


class Scheduler:
    """FCFS queue in front of one engine; see the module docstring."""

    def __init__(self, engine: Any, max_queue: int, request_timeout_s: float, metrics: Metrics):
        self.engine = engine
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self._cond = threading.Condition()
        self._queue: collections.deque[GenerationJob] = collections.deque()
        self._running: GenerationJob | None = None
        self._closed = False
        self._thread: threading.Thread | None = None

    # --- state -------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        with self._cond:
            return len(self._queue)

    @property
    def running(self) -> int:
        with self._cond:
            return int(self._running is not None)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._closed = False
            self._thread = threading.Thread(target=self._work, name="tandem-generation", daemon=True)
            self._thread.start()

    def close(self, join_timeout_s: float = 10.0) -> None:
        """Fail queued jobs with 503, stop the running one, and join the worker."""
        with self._cond:
            self._closed = True
            pending, self._queue = list(self._queue), collections.deque()
            running = self._running
            self._cond.notify_all()
        for job in pending:
            job.emit("error", ApiError(503, "the server is shutting down", type="server_error", code="shutting_down"))
        if running is not None:
            running.cancel()
        if self._thread is not None:
            self._thread.join(join_timeout_s)

    # --- producer side (event loop) ------------------------------------------------------------
    def submit(self, prompt: Any, max_new_tokens: int | None, sampling: dict[str, Any], stream_pieces: bool,
               loop: asyncio.AbstractEventLoop) -> GenerationJob:
        job = GenerationJob(prompt=prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                            stream_pieces=stream_pieces, loop=loop,
                            deadline_s=time.monotonic() + self.request_timeout_s, _on_cancel=self._discard)
        with self._cond:
            if self._closed or self._thread is None or not self._thread.is_alive():
                raise SchedulerClosedError("the generation worker is not running (server shutting down)")
            if len(self._queue) >= self.max_queue:
                raise QueueFullError(f"{len(self._queue)} requests are already waiting")
            self._queue.append(job)
            self._cond.notify()
        return job

    def _discard(self, job: GenerationJob) -> None:
        with self._cond:
            try:
                self._queue.remove(job)
            except ValueError:
                return  # running or finished: the worker sees the flag between tokens
        self.metrics.count(job.cancel_reason)

    # --- worker side ----------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                self._running = job
            try:
                self._run(job)
            except BaseException as exc:  # never let the worker die
                log.exception("generation failed")
                job.emit("error", ApiError(500, f"internal error: {type(exc).__name__}", type="server_error"))
            finally:
                with self._cond:
                    self._running = None

    def _run(self, job: GenerationJob) -> None:
        started_s = time.monotonic()
        if job.cancelled:
            self.metrics.count(job.cancel_reason)
            return
        if started_s > job.deadline_s:
            self.metrics.count("timeouts")
            job.emit("error", timeout_error(self.request_timeout_s))
            return
        try:
            max_new_tokens = self._max_new_tokens(job)
            stream = self.engine.stream(job.prompt, max_new_tokens=max_new_tokens, **job.sampling)
        except ApiError as exc:
            job.emit("error", exc)
            return
        except (TandemError, jinja2.TemplateError) as exc:
            job.emit("error", ApiError(400, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
            return
        sent_choices = 0
        try:
            for piece in stream:
                if job.cancelled:
                    self.metrics.count(job.cancel_reason)
                    return
                if time.monotonic() > job.deadline_s:
                    self.metrics.count("timeouts")
                    job.emit("error", timeout_error(self.request_timeout_s))
                    return
                if piece and job.stream_pieces:  # with the TokenChoices (logprobs) of the tokens behind it
                    choices = getattr(stream, "choices", None) or []
                    job.emit("piece", (piece, choices[sent_choices:]))
                    sent_choices = len(choices)
            result = stream.result
        except (TandemError, jinja2.TemplateError) as exc:
            job.emit("error", ApiError(400, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
            return
        finally:
            try:
                stream.close()
            except Exception:  # closing must never take the worker down
                log.exception("closing a generation stream failed")
        self.metrics.observe_generation(result.prompt_tokens, len(result.token_ids), getattr(result, "stats", None),
                                        queue_wait_s=started_s - job.submitted_s)
        job.emit("done", result)

    def _max_new_tokens(self, job: GenerationJob) -> int:
        """The request's max_tokens, checked against the room the prompt leaves in the context."""
        context = int(self.engine.max_context)
        n_prompt = self._count_prompt_tokens(job.prompt)
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

    def _count_prompt_tokens(self, prompt: Any) -> int | None:
        tokenizer = getattr(self.engine, "tokenizer", None)
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return len(prompt)
        if tokenizer is None:
            return None
        if isinstance(prompt, str):
            return len(tokenizer.encode(prompt))
        return len(tokenizer.encode_chat(prompt))
