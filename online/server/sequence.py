"""One generated sequence (a request's choice) in the batching loop, with its detokenizer (TextDecoder).

Example::

    seq = Sequence(seq_id=0, job=job, index=0, tokens=prompt_ids, n_prompt=len(prompt_ids),
                   params=params, generator=make_generator(params), eos_ids={2}, max_total_tokens=96,
                   decoder=TextDecoder(tokenizer, params.stop))
    piece, stopped = seq.decoder.push(token_id)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.core.loading.detokenize import TextDecoder


@dataclass(eq=False)
class Sequence:
    """KV state and sampling state of one choice; ``tokens`` = prompt + generated so far."""

    seq_id: int
    job: Any  # GenerationJob
    index: int  # choice index within the request (n > 1)
    tokens: list[int]
    n_prompt: int
    params: Any  # SamplingParams
    generator: Any  # numpy's Generator (tandem.core.sampling.make_generator): the request's random draws
    eos_ids: set[int]
    max_total_tokens: int  # n_prompt + the generation budget
    decoder: TextDecoder
    decode_options: Any = None  # DecodeOptions (logprobs, grammar constraint) or None: choose_token's options
    state: Any = None  # this sequence's constraint state (decode_options.new_state()), advanced by choose_token
    choices: list = field(default_factory=list)  # TokenChoice of each generated token (EOS excluded)
    sent_choices: int = 0  # choices already emitted with a streamed piece
    table: list[int] = field(default_factory=list)  # KV block ids
    n_computed: int = 0  # KV rows written (positions 0..n_computed-1)
    n_registered: int = 0  # leading full blocks published for prefix reuse
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    allocated: bool = False
    finished: bool = False
    finish_reason: str = "length"
    level: int = 0  # MLFQ queue
    level_tokens: int = 0  # tokens generated at this level
    idle_steps: int = 0  # steps passed over in a row (MLFQ starvation guard)
    preemptions: int = 0
    first_token_s: float = 0.0
    last_token_s: float = 0.0
    started_s: float = 0.0  # first admission
    spec: Any = None  # SeqSpec (online/server/batch_spec.py): drafters and policy, with serve --speculate
    draft: list[int] = field(default_factory=list)  # tokens drafted after the pending one for this step
    draft_probs: Any = None  # [len(draft), vocab] q rows of a sampling drafter, else None

    @property
    def n_generated(self) -> int:
        return len(self.tokens) - self.n_prompt

    @property
    def decoding(self) -> bool:
        """Only the last token's KV is missing: one decode step samples the next token."""
        return self.n_computed == len(self.tokens) - 1

    @property
    def remaining(self) -> int:
        """Tokens whose KV is still to compute (prompt chunks, or a whole recompute after preemption)."""
        return len(self.tokens) - self.n_computed
