"""One iteration of the batching loop on the model: KV rows of many sequences over the paged pool.

Decode path, chosen once from the engine:

* ``fused`` (packed CPU-only models, the ``cpu-only`` plan): the decode tokens of every running
  sequence go through ONE ``compiled_decode.step_batch`` call (weights read once per step). Each
  position's logits and KV are bit-identical to the single-token step whatever else is in the batch.
* ``modules`` (everything else: dense float32, plans with GPU-tier neurons, layer offload): each
  sequence steps alone through the model's module graph over a :class:`PagedSequenceCache`
  (``write`` scatters into the pool, returns the gathered rows). Where a layer keeps its own
  single-sequence KV (attention on the GPU tier, layer offload: ``private_kv``) the scheduler runs
  one sequence at a time to its end, FCFS, without prefix reuse.

Prefill (``prefill``): ``modules`` (default) runs the prompt through the batched module graph in
chunks at request-relative fixed boundaries (multiples of ``prefill_chunk_tokens`` from position 0),
one chunk per step, as ``Engine.generate`` does; ``step`` (fused path only) puts prompt tokens into
the same ``step_batch`` call as the decode tokens. Either way the arithmetic of a request does not
depend on the load: under load a request gives exactly its served-alone output, and a recompute
after preemption (prompt chunks at the same boundaries, generated tokens one step each) restores
exactly the lost KV. Prefix reuse keeps that: only blocks another request computed the same way
are shared (``reusable_blocks``/``reusable_hits``), so a reused prefix equals a cold prefill.

Example::

    runner = BatchStep(engine, pool, prefill_chunk_tokens=128, prefill="modules")
    logits = runner.run([(seq_a, 1), (seq_b, 37)])   # {seq: [vocab]} for sequences that reached their last token
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from online.kv_pool import KVPool


class PagedSequenceCache:
    """A sequence's block table seen as a ``KVCache`` by ``model(...)``."""

    def __init__(self, pool: KVPool, table: list[int]) -> None:
        self.pool, self.table = pool, table
        self.block_tokens = pool.block_tokens
        self.capacity_tokens = len(table) * pool.block_tokens

    def rows(self, begin: int, end: int) -> torch.Tensor:
        positions = np.arange(begin, end)
        table = np.asarray(self.table, dtype=np.int64)
        return torch.from_numpy(table[positions // self.block_tokens] * self.block_tokens
                                + positions % self.block_tokens)  # [end-begin]

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [T, KV, hd] at positions start.. and return keys/values of 0..start+T [KV, S, hd] in k's
        dtype (a float16 pool is widened for the module graph's attention)."""
        end = start + k.shape[0]
        index = self.rows(0, end)  # [S]
        self.pool.keys[layer][:, index[start:]] = k.transpose(0, 1).to(self.pool.keys.dtype)
        self.pool.values[layer][:, index[start:]] = v.transpose(0, 1).to(self.pool.values.dtype)
        return self.pool.keys[layer][:, index].to(k.dtype), self.pool.values[layer][:, index].to(v.dtype)  # [KV, S, hd]


def private_kv(engine: Any) -> bool:
    """Whether some layer keeps its own single-sequence KV cache instead of using the one passed in
    (attention on the GPU tier, layer offload): then sequences must not interleave."""
    return any(getattr(m, "on_tier", False) and hasattr(m, "keys") for m in engine.model.modules())


def fused_batching(engine: Any) -> bool:
    """Whether the engine's decode step batches sequences over a paged pool (the fused C step)."""
    compiled = getattr(engine, "compiled_decode", None)
    return compiled is not None and getattr(engine, "decode_path", "") == "fused" and hasattr(compiled, "step_batch")


class BatchStep:
    """Runs one iteration's work items ``(sequence, n_tokens)`` on the engine (see the module docstring)."""

    def __init__(self, engine: Any, pool: KVPool, prefill_chunk_tokens: int, prefill: str = "modules") -> None:
        self.engine, self.pool = engine, pool
        self.prefill_chunk_tokens = prefill_chunk_tokens
        self.fused = fused_batching(engine)
        self.path = "fused" if self.fused else "modules"
        self.prefill = "step" if self.fused and prefill == "step" else "modules"
        self.private_kv = private_kv(engine)
        self.prefix_caching = not self.private_kv  # the tier's own KV is not in the pool

    def reusable_blocks(self, seq: Any) -> int:
        """Leading blocks of ``seq`` whose KV any request with the same tokens would compute bit for bit:
        every block on the all-step path; else only blocks inside whole prefill chunks of the prompt
        (a chunk at the same request-relative boundaries with the same tokens is the same arithmetic)."""
        bt = self.pool.block_tokens
        if self.prefill == "step":
            return seq.n_computed // bt
        whole_chunks = min(seq.n_computed, seq.n_prompt) // self.prefill_chunk_tokens * self.prefill_chunk_tokens
        return whole_chunks // bt

    def reusable_hits(self, n_blocks: int) -> int:
        """Of ``n_blocks`` cached leading blocks, how many a new sequence may take (whole chunks only
        when prefill runs through the modules)."""
        if self.prefill == "step":
            return n_blocks
        per_chunk = self.prefill_chunk_tokens // self.pool.block_tokens
        return n_blocks // per_chunk * per_chunk

    def _by_step(self, seq: Any) -> bool:
        """Through ``step_batch``: generated tokens (decode, recompute), and prompt tokens with ``prefill="step"``."""
        return self.fused and (self.prefill == "step" or seq.n_computed >= seq.n_prompt)

    def chunk_tokens(self, seq: Any, budget: int) -> int:
        """How many of the sequence's missing KV rows to compute now, within ``budget`` prefill tokens."""
        if seq.n_computed < seq.n_prompt and not self._by_step(seq):  # a module prefill chunk
            to_boundary = self.prefill_chunk_tokens - seq.n_computed % self.prefill_chunk_tokens
            return min(to_boundary, seq.n_prompt - seq.n_computed)
        if seq.decoding or not self.fused:  # modules: generated tokens one at a time, as decoded
            return 1
        return min(seq.remaining, budget)

    def run(self, items: list[tuple[Any, int]]) -> dict[Any, torch.Tensor]:
        """Compute KV for each item's next ``n`` tokens; logits [vocab] of sequences now complete."""
        if not items:
            return {}
        by_step = [(seq, n) for seq, n in items if self._by_step(seq)]
        out = self._run_fused(by_step) if by_step else {}
        out.update(self._run_modules([(seq, n) for seq, n in items if not self._by_step(seq)]))
        for seq, n in items:
            seq.n_computed += n
        return out

    @torch.inference_mode()
    def _run_fused(self, items: list[tuple[Any, int]]) -> dict[Any, torch.Tensor]:
        tokens, positions, tables, wanted, owners = [], [], [], [], []
        for seq, n in items:
            table = np.asarray(seq.table, dtype=np.int32)
            last = seq.n_computed + n == len(seq.tokens)
            drafted = seq.draft if last else []  # speculation: the pending token + drafts, logits for each
            for pos in range(seq.n_computed, seq.n_computed + n):
                tokens.append(seq.tokens[pos])
                positions.append(pos)
                tables.append(table)
                wanted.append(last and pos == seq.n_computed + n - 1)
            for i, token in enumerate(drafted):
                tokens.append(token)
                positions.append(seq.n_computed + n + i)
                tables.append(table)
                wanted.append(True)
            if last:
                owners.append((seq, 1 + len(drafted) if drafted else 0))
        threads = torch.get_num_threads()
        if self.engine.decode_threads:  # the C step has its own OpenMP pool: keep torch's out of its way
            torch.set_num_threads(self.engine.decode_threads)
        try:
            logits = self.engine.compiled_decode.step_batch(tokens, positions, tables, self.pool, wanted)  # [k, vocab]
        finally:
            torch.set_num_threads(threads)
        out, row = {}, 0
        for seq, rows in owners:  # a drafting sequence gets its [k+1, vocab] rows, the others [vocab]
            out[seq] = logits[row:row + rows] if rows else logits[row]
            row += max(rows, 1)
        return out

    @torch.inference_mode()
    def _run_modules(self, items: list[tuple[Any, int]]) -> dict[Any, torch.Tensor]:
        engine, out = self.engine, {}
        prefill_threads = torch.get_num_threads()
        try:
            for seq, n in items:
                chunk = torch.tensor(seq.tokens[seq.n_computed:seq.n_computed + n], dtype=torch.long)  # [n]
                threads = engine.decode_threads if n == 1 and engine.decode_threads else prefill_threads
                torch.set_num_threads(threads)
                cache = PagedSequenceCache(self.pool, seq.table)
                logits = engine.model(chunk, seq.n_computed, cache, engine.executor)[-1]  # [vocab]
                if seq.n_computed + n == len(seq.tokens):
                    out[seq] = logits
        finally:
            torch.set_num_threads(prefill_threads)
        return out
