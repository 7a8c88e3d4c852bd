"""Iteration-level scheduling (Orca, vLLM) over the paged KV pool: admit, preempt, step, sample.

Each :meth:`BatchLoop.iteration` picks the sequences to run (policy order, at most
``max_batch_seqs``), gives every decoding sequence one token and the others prefill chunks within
``prefill_chunk_tokens``, runs them all in one :class:`BatchStep`, then samples, streams and
finishes. New sequences join at the next iteration. When the pool runs dry a running sequence is
preempted (recompute: its blocks are freed, its tokens kept; it is re-admitted later and its KV
recomputed, prefix blocks reused where cached), so nothing runs out of memory and every request
completes.

Example::

    loop = BatchLoop(engine, pool, make_policy("fcfs", 128), metrics, prefill_chunk_tokens=128, max_batch_seqs=32,
                     on_piece=lambda seq, text: print(text, end=""), on_finish=print,
                     on_first_admit=lambda seq: None, on_fork=lambda parent: [],
                     on_error=lambda seq, exc: loop.drop(seq))
    loop.add(seq)             # a Sequence (online/server/sequence.py)
    while loop.sequences:
        loop.iteration()      # finished sequences go to on_finish(seq)
"""
from __future__ import annotations

import time
from typing import Any, Callable

from online.kv_pool import KVPool
from tandem.core.sampling import TokenChoice, choose_token
from online.server.batch_spec import DEFAULT_SPEC_MAX_SEQS, BatchSpeculation
from online.server.batch_step import BatchStep
from online.server.sequence import Sequence


class BatchLoop:
    def __init__(self, engine: Any, pool: KVPool, policy: Any, metrics: Any, prefill_chunk_tokens: int,
                 max_batch_seqs: int, on_piece: Callable[[Sequence, str], None],
                 on_finish: Callable[[Sequence], None], on_first_admit: Callable[[Any], None],
                 on_fork: Callable[[Sequence], list[Sequence]],
                 on_error: Callable[[Sequence, Exception], None], prefill: str = "modules",
                 speculation: Any = None, spec_max_seqs: int = DEFAULT_SPEC_MAX_SEQS) -> None:
        self.engine, self.pool, self.policy, self.metrics = engine, pool, policy, metrics
        self.step = BatchStep(engine, pool, prefill_chunk_tokens, prefill)
        self.spec = BatchSpeculation.create(engine, speculation, spec_max_seqs, self.step.fused)
        self.prefill_chunk_tokens, self.max_batch_seqs = prefill_chunk_tokens, max_batch_seqs
        self.on_piece, self.on_finish, self.on_first_admit, self.on_fork = on_piece, on_finish, on_first_admit, on_fork
        self.on_error = on_error  # a sequence whose sampling or streaming failed: it must leave the loop
        self.sequences: list[Sequence] = []
        self._plain_spec: set = set()  # eligible sequences that took a plain step this iteration (auto's cost)

    # --- membership ------------------------------------------------------------------------------
    def add(self, seq: Sequence) -> None:
        self.policy.on_arrival(seq)
        self.sequences.append(seq)

    def drop(self, seq: Sequence) -> None:
        """Remove a sequence (finished, cancelled, failed) and free its blocks."""
        self._release(seq)
        if seq in self.sequences:
            self.sequences.remove(seq)

    def _release(self, seq: Sequence) -> None:
        if seq.allocated:
            self.pool.free(seq.table)
            seq.table, seq.allocated = [], False

    # --- admission and preemption -------------------------------------------------------------------
    def _admit(self, seq: Sequence) -> bool:
        """Give a waiting sequence blocks for all its tokens (prefix blocks from the cache first)."""
        pool, hashes, hits = self.pool, [], 0
        if self.step.prefix_caching:
            hashes = pool.block_hashes(seq.tokens)[:(len(seq.tokens) - 1) // pool.block_tokens]
            hits = self.step.reusable_hits(pool.count_prefix(hashes))
        fresh = pool.blocks_for(len(seq.tokens)) - hits
        if not pool.can_allocate(fresh + pool.cached_unreferenced(hashes[:hits])):
            return False
        seq.table = pool.take_prefix(hashes[:hits]) + pool.allocate(fresh)
        seq.n_computed = seq.n_registered = hits
        seq.n_computed *= pool.block_tokens
        seq.allocated = True
        reused = seq.n_computed if seq.preemptions == 0 else 0
        seq.cached_tokens = max(seq.cached_tokens, min(reused, seq.n_prompt))
        pool.counters.hits_tokens += min(seq.n_computed, seq.n_prompt)
        if seq.started_s == 0.0:
            seq.started_s = time.monotonic()
            self.on_first_admit(seq)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._release(seq)
        seq.n_computed = seq.n_registered = 0
        seq.preemptions += 1
        self.metrics.count_batch("preemptions")

    def _victim(self, protected: set) -> Sequence | None:
        """The allocated sequence to preempt: the lowest in policy order (FCFS: the latest arrival, as
        vLLM), never one in ``protected`` (already in this step's batch)."""
        held = [s for s in self.sequences if s.allocated and s not in protected]
        return max(held, key=self.policy.key) if held else None

    def _room(self, n_blocks: int, protected: set) -> bool:
        while not self.pool.can_allocate(n_blocks):
            victim = self._victim(protected)
            if victim is None:
                return False
            self._preempt(victim)
        return True

    def _prepare_blocks(self, seq: Sequence, n: int, protected: set) -> bool:
        """Blocks for positions ``n_computed .. n_computed+n-1``, the written ones private (copy on write)."""
        pool = self.pool
        missing = pool.blocks_for(seq.n_computed + n) - len(seq.table)
        if missing > 0:
            if not self._room(missing, protected):
                return False
            seq.table += pool.allocate(missing)
        for b in range(seq.n_computed // pool.block_tokens, pool.blocks_for(seq.n_computed + n)):
            if pool.refs[seq.table[b]] > 1:
                if not self._room(1, protected):
                    return False
                pool.writable(seq.table, b)
        return True

    # --- one iteration -----------------------------------------------------------------------------
    def plan(self) -> list[tuple[Sequence, int]]:
        items: list[tuple[Sequence, int]] = []
        protected: set = set()
        budget = self.prefill_chunk_tokens
        admitting = True
        for seq in sorted(self.sequences, key=self.policy.key):
            if len(items) >= self.max_batch_seqs:
                break
            if not seq.allocated:
                if not admitting or budget <= 0:
                    continue
                if not self._admit(seq) and not (self._room_for_admission(seq, protected) and self._admit(seq)):
                    admitting = False  # head of line: later arrivals wait too
                    continue
            n = self.step.chunk_tokens(seq, budget)
            if not seq.decoding and (budget <= 0 or (n > budget and budget < self.prefill_chunk_tokens)):
                continue
            protected.add(seq)
            if not self._prepare_blocks(seq, n, protected):
                continue
            items.append((seq, n))
            if not seq.decoding:
                budget -= n
        items = [(s, n) for s, n in items if s.allocated]
        if self.spec.enabled:
            self._plan_drafts(items)
        return items

    def _plan_drafts(self, items: list[tuple[Sequence, int]]) -> None:
        """Speculation while few sequences run: drafts for eligible decoding sequences, with blocks
        for their positions taken only from free blocks (speculation never preempts anyone)."""
        few = len(self.sequences) <= self.spec.max_seqs
        protected = {s for s, _ in items}
        self._plain_spec = set()
        for seq, n in items:
            seq.draft = []
            if not (few and self.spec.eligible(seq)):
                continue
            k = self.spec.choose(seq, self.pool)
            missing = self.pool.blocks_for(seq.n_computed + 1 + k) - len(seq.table)
            if k >= 1 and (missing <= 0 or self.pool.can_allocate(missing)) and self._prepare_blocks(seq, 1 + k, protected):
                self.spec.draft(seq, k)
            if not seq.draft:
                self._trim_blocks(seq)
                self._plain_spec.add(seq)

    def _trim_blocks(self, seq: Sequence) -> None:
        """Free blocks past the sequence's next position (taken for drafts that were rejected)."""
        keep = self.pool.blocks_for(len(seq.tokens))
        if len(seq.table) > keep:
            self.pool.free(seq.table[keep:])
            del seq.table[keep:]

    def _room_for_admission(self, seq: Sequence, protected: set) -> bool:
        """MLFQ: preempt lower-priority idle sequences for a higher-priority arrival."""
        if self.policy.running_first:
            return False
        need = self.pool.blocks_for(len(seq.tokens))
        key = self.policy.key(seq)
        while not self.pool.can_allocate(need):
            held = [s for s in self.sequences if s.allocated and s not in protected and self.policy.key(s) > key]
            if not held:
                return False
            self._preempt(max(held, key=self.policy.key))
        return True

    def iteration(self) -> int:
        """Run one step over the planned batch; returns its size (0: nothing could run)."""
        items = self.plan()
        if not items:
            return 0
        t0 = time.perf_counter()
        logits = self.step.run(items)
        step_s = time.perf_counter() - t0
        stepped = {seq for seq, _ in items}
        for seq in self.sequences:
            if seq in stepped:
                seq.idle_steps = 0
            else:
                self.policy.on_idle(seq)
        if self.step.prefix_caching:
            for seq, _ in items:
                self._register_blocks(seq)
        for seq, row in logits.items():
            if seq not in self.sequences:  # dropped meanwhile: a sibling choice of a request that failed
                continue
            try:
                self._advance(seq, row, step_s)
            except Exception as exc:  # this request alone fails (e.g. its sampler or grammar); the others go on
                self.on_error(seq, exc)
        self.metrics.observe_batch(len(items))
        return len(items)

    def _advance(self, seq: Sequence, row, step_s: float) -> None:
        """The step's logits row(s) of ``seq``: verify its drafts, or sample its next token (and its
        siblings' first tokens where ``n`` > 1 forks now)."""
        if seq.draft:
            self._emit_verified(seq, self.spec.verify(seq, row, step_s))
            return
        if seq in self._plain_spec:
            self.spec.record_plain(seq, step_s)
        group = [seq]
        if seq.n_generated == 0 and seq.job.n > 1 and not seq.job.forked:
            group += self.on_fork(seq)
        for member in group:
            self._sample(member, row)

    def _register_blocks(self, seq: Sequence) -> None:
        full = self.step.reusable_blocks(seq)
        if full <= seq.n_registered:
            return
        hashes = self.pool.block_hashes(seq.tokens[:full * self.pool.block_tokens])
        for i in range(seq.n_registered, full):
            self.pool.register(hashes[i], seq.table[i])
        seq.n_registered = full

    def _emit_verified(self, seq: Sequence, tokens: list[int]) -> None:
        """The tokens of a verify step, one at a time through the same EOS / stop / length checks."""
        for token in tokens:
            self._take(seq, TokenChoice(token))
            if seq.finished:
                return
        self._trim_blocks(seq)

    def _sample(self, seq: Sequence, logits) -> None:
        # without decode_options this is exactly sample_next (same RNG draws, same greedy choice)
        self._take(seq, choose_token(logits, seq.params, seq.generator, seq.decode_options, seq.state))

    def _take(self, seq: Sequence, choice: TokenChoice) -> None:
        token = choice.token_id
        now = time.monotonic()
        if seq.n_generated == 0 and seq.first_token_s == 0.0:
            seq.first_token_s = now
        elif seq.last_token_s:
            self.metrics.observe_inter_token(now - seq.last_token_s)
        seq.last_token_s = now
        self.policy.on_token(seq)
        if token in seq.eos_ids or (seq.state is not None and seq.state.ends(token)):  # EOS / grammar complete
            seq.finish_reason = "stop"
            return self._finish(seq)
        seq.tokens.append(token)
        seq.choices.append(choice)
        piece, stopped = seq.decoder.push(token)
        if piece:
            self.on_piece(seq, piece)
        if stopped:
            seq.finish_reason = "stop"
            return self._finish(seq)
        if len(seq.tokens) >= seq.max_total_tokens:
            seq.finish_reason = "length"
            self._finish(seq)

    def _finish(self, seq: Sequence) -> None:
        seq.finished = True
        tail = seq.decoder.flush()
        if seq.decoder.stopped:  # a stop string in the held-back tail
            seq.finish_reason = "stop"
        if tail:
            self.on_piece(seq, tail)
        self.drop(seq)
        self.on_finish(seq)
