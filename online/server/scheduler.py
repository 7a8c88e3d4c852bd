"""Continuous-batching scheduler: one worker thread owns the (not thread-safe) engine.

Requests wait in a bounded queue (full -> :class:`QueueFullError`, answered 429). The worker runs
the iteration-level loop of online/server/batch_loop.py: every running sequence advances one token
per step (one ``step_batch`` call on the fused path), new requests join at the next step with
chunked prefill, KV lives in a paged pool with prefix reuse, and text pieces go to each request's
asyncio loop. A request that is cancelled (client gone) or runs past its deadline is dropped
before the next step and its KV blocks are freed. ``n`` > 1 choices share the prompt's KV.

Example::

    scheduler = Scheduler(engine, max_queue=64, request_timeout_s=300.0, metrics=Metrics(), batch=BatchConfig())
    scheduler.start()
    job = scheduler.submit("Hello", max_new_tokens=8, sampling={"temperature": 0.0},
                           stream_pieces=True, loop=asyncio.get_running_loop())
    kind, value = await job.events.get()  # ("piece", (str, [TokenChoice])) | ("done", GenerationResult) | ("error", ApiError)
    # with n > 1: ("piece", (index, str, [TokenChoice])) and ("done", [GenerationResult, ...])
    scheduler.close()
"""
from __future__ import annotations

import asyncio
import collections
import dataclasses
import logging
import threading
import time
from typing import Any

import jinja2

from online.engine import GenerationResult
from tandem.core.sampling import SamplingParams, make_generator
from online.server.batch_config import BatchConfig
from online.server.batch_loop import BatchLoop
from online.server.batch_step import private_kv
from online.server.metrics import Metrics
from online.server.jobs import (GenerationJob, QueueFullError, SchedulerClosedError, max_new_tokens_for,
                                shutting_down, timeout_error)
from online.server.policy import make_policy
from online.server.schemas import ApiError
from online.server.sequence import Sequence, TextDecoder
from tandem.core.errors import TandemError

log = logging.getLogger("tandem.server")


class Scheduler:
    """Bounded queue in front of the batching loop; see the module docstring."""

    def __init__(self, engine: Any, max_queue: int, request_timeout_s: float, metrics: Metrics,
                 batch: BatchConfig | None = None):
        self.engine = engine
        self.max_queue = max_queue
        self.request_timeout_s = request_timeout_s
        self.metrics = metrics
        self.batch = batch or BatchConfig()
        if private_kv(engine) and (self.batch.max_batch_seqs != 1 or self.batch.schedule != "fcfs"):
            log.warning("batching: this plan keeps attention KV on the GPU tier for one sequence: "
                        "serving one sequence at a time, first come first served")
            self.batch = dataclasses.replace(self.batch, max_batch_seqs=1, schedule="fcfs")
        self.pool = self.batch.make_pool(engine)
        metrics.pool = self.pool
        self.policy = make_policy(self.batch.schedule, self.batch.prefill_chunk_tokens)
        self.loop = BatchLoop(engine, self.pool, self.policy, metrics, self.batch.prefill_chunk_tokens,
                              self.batch.max_batch_seqs, on_piece=self._on_piece, on_finish=self._on_finish,
                              on_first_admit=self._on_first_admit, on_fork=self._fork, on_error=self._on_error,
                              prefill=self.batch.prefill, speculation=getattr(engine, "default_speculation", None),
                              spec_max_seqs=self.batch.spec_max_seqs)
        metrics.speculation = self.loop.spec
        self._cond = threading.Condition()
        self._incoming: collections.deque[GenerationJob] = collections.deque()
        self._active: list[GenerationJob] = []  # worker side: jobs with sequences in the loop
        self._waiting_jobs = 0  # submitted, no sequence admitted yet
        self._running_jobs = 0
        self._arrivals = 0
        self._seq_ids = 0
        self._closed = False
        self._thread: threading.Thread | None = None
        if self.loop.step.path != "fused":
            log.info("batching: sequences step one by one through the module path (%s)",
                     getattr(engine, "decode_path_reason", "") or f"decode path {getattr(engine, 'decode_path', '?')}")

    # --- state -------------------------------------------------------------------------------
    @property
    def queue_depth(self) -> int:
        with self._cond:
            return self._waiting_jobs

    @property
    def running(self) -> int:
        with self._cond:
            return self._running_jobs

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._closed

    def describe(self) -> dict[str, Any]:
        """What /health shows about batching."""
        step = self.loop.step
        return {"path": step.path, "prefill": step.prefill, "schedule": self.policy.name, "max_batch_seqs": self.batch.max_batch_seqs,
                "prefill_chunk_tokens": self.batch.prefill_chunk_tokens, "prefix_caching": step.prefix_caching,
                "kv_pool_blocks": self.pool.n_blocks, "kv_block_tokens": self.pool.block_tokens,
                "kv_pool_bytes": self.pool.nbytes, "kv_blocks_used": self.pool.n_used,
                "kv_cache_type": self.pool.kv_cache_type,
                "speculation": self.loop.spec.describe(),
                **({} if step.path == "fused" else
                   {"note": "no fused batched step for this model/plan: sequences step one by one through the "
                            "module path" + ("; attention KV on the GPU tier holds one sequence, so one runs at "
                                             "a time" if step.private_kv else "")})}

    # --- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._closed = False
            self._thread = threading.Thread(target=self._work, name="tandem-generation", daemon=True)
            self._thread.start()

    def close(self, join_timeout_s: float = 10.0) -> None:
        """Fail queued jobs with 503, stop the running ones, and join the worker."""
        with self._cond:
            self._closed = True
            pending, self._incoming = list(self._incoming), collections.deque()
            self._waiting_jobs -= len(pending)
            self._cond.notify_all()
        for job in pending:
            job.emit("error", shutting_down())
        if self._thread is not None:
            self._thread.join(join_timeout_s)

    # --- producer side (event loop) ------------------------------------------------------------
    def submit(self, prompt: Any, max_new_tokens: int | None, sampling: dict[str, Any], stream_pieces: bool,
               loop: asyncio.AbstractEventLoop, n: int = 1, decode_options: Any = None) -> GenerationJob:
        if not 1 <= n <= self.batch.max_n:
            raise ApiError(400, f"n must be between 1 and {self.batch.max_n}", param="n")
        job = GenerationJob(prompt=prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                            stream_pieces=stream_pieces, loop=loop,
                            deadline_s=time.monotonic() + self.request_timeout_s, _on_cancel=self._discard,
                            n=n, decode_options=decode_options)
        with self._cond:
            if self._closed or self._thread is None or not self._thread.is_alive():
                raise SchedulerClosedError("the generation worker is not running (server shutting down)")
            if self._waiting_jobs >= self.max_queue:
                raise QueueFullError(f"{self._waiting_jobs} requests are already waiting")
            self._arrivals += 1
            job.order = self._arrivals
            self._incoming.append(job)
            self._waiting_jobs += 1
            self._cond.notify()
        return job

    def _discard(self, job: GenerationJob) -> None:
        with self._cond:
            try:
                self._incoming.remove(job)
            except ValueError:
                self._cond.notify()  # in the loop or finished: the worker reaps it before the next step
                return
            self._waiting_jobs -= 1
        self.metrics.count(job.cancel_reason)

    # --- worker side ----------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._incoming and not self.loop.sequences and not self._closed:
                    self._cond.wait()
                if self._closed:
                    break
                new, self._incoming = list(self._incoming), collections.deque()
            for job in new:
                try:
                    self._start(job)
                except Exception as exc:  # one request's failure: answer it, never stop the worker
                    log.exception("starting a request failed")
                    self._fail(job, exc)
            self._reap()
            try:
                if not self.loop.iteration() and self.loop.sequences:
                    with self._cond:  # nothing could run: wait for a cancellation or a new request
                        self._cond.wait(0.005)
            except BaseException as exc:  # never let the worker die: fail the jobs in the loop
                log.exception("generation failed")
                for job in list(self._active):
                    self._fail(job, exc)
        for job in list(self._active):
            job.emit("error", shutting_down())
            self._end(job)

    def _start(self, job: GenerationJob) -> None:
        """Tokenize and check a new job, then queue its first sequence in the loop."""
        if job.cancelled:
            self.metrics.count(job.cancel_reason)
            return self._unqueue(job)
        if time.monotonic() > job.deadline_s:
            self.metrics.count("timeouts")
            job.emit("error", timeout_error(self.request_timeout_s))
            return self._unqueue(job)
        try:
            max_new_tokens = max_new_tokens_for(self.engine, job)
            s = job.sampling
            params = SamplingParams(max_new_tokens=max_new_tokens, temperature=s.get("temperature", 0.0),
                                    top_k=s.get("top_k", 0), top_p=s.get("top_p", 1.0), seed=s.get("seed"),
                                    stop=tuple(s.get("stop") or ()))
            if job.decode_options is None:
                job.decode_options = decode_options_for(self.engine, s)
            ids = self.engine.encode_prompt(job.prompt)
            budget = min(max_new_tokens, int(self.engine.max_context) - len(ids))
            if self.pool.blocks_for(len(ids) + budget) > self.pool.n_blocks:
                raise ApiError(400, f"the prompt ({len(ids)} tokens) plus max_tokens ({budget}) needs more KV than "
                               f"the server's pool holds ({self.pool.n_blocks * self.pool.block_tokens} tokens, "
                               f"--kv-budget); lower max_tokens", param="max_tokens", code="context_length_exceeded")
        except ApiError as exc:
            job.emit("error", exc)
            return self._unqueue(job)
        except (TandemError, jinja2.TemplateError) as exc:
            job.emit("error", ApiError(400, str(exc).splitlines()[0] if str(exc) else type(exc).__name__))
            return self._unqueue(job)
        job.prompt_ids = ids
        seq = self._sequence(job, 0, list(ids), params, len(ids) + budget)
        job.sequences = [seq]
        self._active.append(job)
        self.loop.add(seq)

    def _sequence(self, job: GenerationJob, index: int, tokens: list[int], params: SamplingParams,
                  max_total_tokens: int) -> Sequence:
        self._seq_ids += 1
        seed_params = params if index == 0 or params.seed is None else \
            SamplingParams(max_new_tokens=params.max_new_tokens, seed=(params.seed + index) % 2**63)
        eos_ids = set() if job.sampling.get("ignore_eos") else set(self.engine.eos_token_ids)
        return Sequence(seq_id=self._seq_ids, job=job, index=index, tokens=tokens, n_prompt=len(job.prompt_ids),
                        params=params, generator=make_generator(seed_params), eos_ids=eos_ids,
                        max_total_tokens=max_total_tokens, decoder=TextDecoder(self.engine.tokenizer, params.stop),
                        decode_options=job.decode_options,
                        state=job.decode_options.new_state() if job.decode_options is not None else None)

    def _fork(self, parent: Sequence) -> list[Sequence]:
        """n > 1: the other choices start from the parent's prompt KV (shared blocks, copy on write).
        Called before the parent samples its first token: each child has its own fresh constraint state."""
        job = parent.job
        job.forked = True
        children = []
        for index in range(1, job.n):
            child = self._sequence(job, index, list(parent.tokens), parent.params, parent.max_total_tokens)
            child.table, child.allocated = self.pool.fork(parent.table), True
            child.n_computed, child.n_registered = parent.n_computed, parent.n_registered
            child.cached_tokens, child.started_s, child.level = parent.cached_tokens, parent.started_s, parent.level
            children.append(child)
        job.sequences += children
        self.loop.sequences += children
        return children

    def _unqueue(self, job: GenerationJob) -> None:
        with self._cond:
            self._waiting_jobs -= 1

    def _on_first_admit(self, seq: Sequence) -> None:
        job = seq.job
        if job.admitted:
            return
        job.admitted = True
        with self._cond:
            self._waiting_jobs -= 1
            self._running_jobs += 1

    def _end(self, job: GenerationJob) -> None:
        for seq in job.sequences:
            self.loop.drop(seq)
        if job in self._active:
            self._active.remove(job)
            with self._cond:
                if job.admitted:
                    self._running_jobs -= 1
                else:
                    self._waiting_jobs -= 1

    def _reap(self) -> None:
        now = time.monotonic()
        for job in list(self._active):
            if job.cancelled:
                self.metrics.count(job.cancel_reason)
                self._end(job)
            elif now > job.deadline_s:
                self.metrics.count("timeouts")
                job.emit("error", timeout_error(self.request_timeout_s))
                self._end(job)

    def _on_piece(self, seq: Sequence, piece: str) -> None:
        """Emit a text piece with the TokenChoices of the tokens behind it: ``(text, choices)``, or
        ``(index, text, choices)`` when n > 1."""
        if seq.job.stream_pieces and not seq.job.cancelled:
            choices, seq.sent_choices = seq.choices[seq.sent_choices:], len(seq.choices)
            seq.job.emit("piece", (piece, choices) if seq.job.n == 1 else (seq.index, piece, choices))

    def _on_error(self, seq: Sequence, exc: Exception) -> None:
        """One sequence failed after its step: its request gets a 500, the batch goes on."""
        log.error("request failed", exc_info=exc)
        self._fail(seq.job, exc)

    def _fail(self, job: GenerationJob, exc: BaseException) -> None:
        """Answer ``job`` with a 500 and take it out of the loop (or of the waiting count, before it started)."""
        job.emit("error", internal_error(exc))
        if job in self._active:
            self._end(job)
        else:
            self._unqueue(job)

    def _on_finish(self, seq: Sequence) -> None:
        job = seq.job
        end_s = time.monotonic()
        first = seq.first_token_s or end_s
        steps = max(seq.n_generated - 1, 0)
        stats = {"prompt_tokens": seq.n_prompt, "generated_tokens": len(seq.decoder.generated),
                 "ttft_s": round(first - seq.started_s, 6), "total_s": round(end_s - seq.started_s, 6),
                 "decode_tokens_per_s": round(steps / max(end_s - first, 1e-9), 3) if steps else 0.0,
                 "decode_path": f"batched-{self.loop.step.path}", "cached_tokens": seq.cached_tokens,
                 "preemptions": seq.preemptions}
        job.results[seq.index] = GenerationResult(text=seq.decoder.text, token_ids=list(seq.decoder.generated),
                                                  prompt_tokens=seq.n_prompt, finish_reason=seq.finish_reason,
                                                  stats=stats, choices=list(seq.choices))
        if len(job.results) < job.n:
            return
        results = [job.results[i] for i in range(job.n)]
        self.metrics.observe_generation(results[0].prompt_tokens, sum(len(r.token_ids) for r in results),
                                        results[0].stats, queue_wait_s=seq.started_s - job.submitted_s)
        self._end(job)
        job.emit("done", results[0] if job.n == 1 else results)


def internal_error(exc: BaseException) -> ApiError:
    """The 500 a request gets when the server fails on it (the traceback goes to the log)."""
    return ApiError(500, f"internal error: {type(exc).__name__}", type="server_error")


def decode_options_for(engine: Any, sampling: dict[str, Any]) -> Any:
    """The request's DecodeOptions (logprobs, top_logprobs, grammar from ``req.sampling()``); None when plain."""
    logprobs, top, grammar = sampling.get("logprobs", False), sampling.get("top_logprobs", 0), sampling.get("grammar")
    if not logprobs and not top and grammar is None:
        return None
    return engine.decode_options(logprobs=logprobs, top_logprobs=top or 0, grammar=grammar)


__all__ = ["GenerationJob", "QueueFullError", "Scheduler", "SchedulerClosedError", "timeout_error"]
