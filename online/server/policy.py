"""Which sequences run in the next iteration: FCFS, or FastServe's skip-join MLFQ.

FCFS: sequences holding KV run first (oldest admitted first), then waiting ones join in arrival
order (a preempted sequence keeps its arrival, so it goes back to the head of the line).

MLFQ (FastServe, skip-join): queue ``i`` has a quantum of ``base_tokens * 2**i`` generated tokens.
A new request skips the queues whose quantum is shorter than its estimated first-token cost
(``ceil(prompt / prefill_chunk_tokens)`` iterations), so a long prompt does not jump ahead of every
short one; a sequence that used up its queue's quantum is demoted one queue. Each iteration runs
the highest-priority sequences (lowest queue, then arrival); lower ones wait with their KV kept and
are preempted first when a higher one needs room. Short requests therefore finish ahead of long ones;
a sequence that waited ``MLFQ_STARVATION_STEPS`` steps is promoted to the top queue.

Example::

    policy = make_policy("mlfq", prefill_chunk_tokens=128)
    policy.on_arrival(seq)
    ordered = sorted(seqs, key=policy.key)
    policy.on_token(seq)
"""
from __future__ import annotations

import math
from typing import Any

from tandem.core.errors import TandemError

SCHEDULES = ("fcfs", "mlfq")
MLFQ_BASE_TOKENS = 8
MLFQ_LEVELS = 6
MLFQ_STARVATION_STEPS = 256  # steps a sequence may wait before it is promoted to the top queue


class FcfsPolicy:
    name = "fcfs"
    running_first = True  # sequences that hold KV are never passed over

    def on_arrival(self, seq: Any) -> None:
        seq.level = 0

    def key(self, seq: Any) -> tuple:
        return (not seq.allocated, seq.job.order, seq.index)

    def on_token(self, seq: Any) -> None:
        pass

    def on_idle(self, seq: Any) -> None:
        pass


class MlfqPolicy:
    name = "mlfq"
    running_first = False

    def __init__(self, prefill_chunk_tokens: int, base_tokens: int = MLFQ_BASE_TOKENS, levels: int = MLFQ_LEVELS,
                 starvation_steps: int = MLFQ_STARVATION_STEPS):
        self.prefill_chunk_tokens, self.base_tokens, self.levels = prefill_chunk_tokens, base_tokens, levels
        self.starvation_steps = starvation_steps

    def quantum(self, level: int) -> int:
        return self.base_tokens * 2 ** level

    def on_arrival(self, seq: Any) -> None:
        """Skip-join: the first queue whose quantum covers the prompt's first-token cost."""
        cost = math.ceil(seq.n_prompt / self.prefill_chunk_tokens)
        level = 0
        while level < self.levels - 1 and self.quantum(level) < cost:
            level += 1
        seq.level, seq.level_tokens = level, 0

    def key(self, seq: Any) -> tuple:
        return (seq.level, seq.job.order, seq.index)

    def on_token(self, seq: Any) -> None:
        seq.level_tokens += 1
        if seq.level_tokens >= self.quantum(seq.level) and seq.level < self.levels - 1:
            seq.level, seq.level_tokens = seq.level + 1, 0

    def on_idle(self, seq: Any) -> None:
        """Starvation guard (as FastServe): a sequence left waiting ``starvation_steps`` steps goes to the top."""
        seq.idle_steps += 1
        if seq.idle_steps >= self.starvation_steps:
            seq.level, seq.level_tokens, seq.idle_steps = 0, 0, 0


def make_policy(name: str, prefill_chunk_tokens: int):
    if name == "fcfs":
        return FcfsPolicy()
    if name == "mlfq":
        return MlfqPolicy(prefill_chunk_tokens)
    raise TandemError(f"unknown schedule {name!r} (choose from {', '.join(SCHEDULES)})")
