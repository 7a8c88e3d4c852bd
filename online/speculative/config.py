"""Speculation settings: which drafter, how many tokens it may draft per verify step.

Example::

    spec = SpeculationConfig.parse("lookup", draft_tokens=6)   # TandemError on a bad value
    spec.enabled, spec.max_draft_tokens                          # True, 6
"""
from __future__ import annotations

from dataclasses import dataclass

from tandem.core.errors import TandemError

MODES = ("off", "lookup", "sparse", "auto")
DEFAULT_DRAFT_TOKENS = 5
MAX_DRAFT_TOKENS = 15  # the verify step runs draft + 1 tokens; the multi-token step takes up to 16


@dataclass(frozen=True)
class SpeculationConfig:
    """``mode``: off | lookup (prompt lookup / n-gram) | sparse (the same weights at looser FFN
    thresholds) | auto (a drafter only where it pays, from measured step costs and acceptance).
    ``draft_tokens``: the most tokens drafted per verify step (k adapts below it unless ``adapt`` is
    False, which tests use to pin k)."""
    mode: str = "off"
    draft_tokens: int = DEFAULT_DRAFT_TOKENS
    adapt: bool = True

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise TandemError(f"--speculate must be one of {', '.join(MODES)}, got {self.mode!r}")
        k = self.draft_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_DRAFT_TOKENS:
            raise TandemError(f"--draft-tokens must be an integer in 1..{MAX_DRAFT_TOKENS}, got {k!r}")

    @classmethod
    def parse(cls, mode: str | None, draft_tokens: int | None = None, adapt: bool = True) -> "SpeculationConfig":
        """From user values (``None`` = defaults): ``draft_tokens`` without a drafter is an error."""
        mode = "off" if mode is None else mode
        if not isinstance(mode, str):
            raise TandemError(f"--speculate must be one of {', '.join(MODES)}, got {mode!r}")
        if draft_tokens is not None and mode == "off":
            raise TandemError("--draft-tokens needs --speculate lookup, sparse or auto")
        return cls(mode, DEFAULT_DRAFT_TOKENS if draft_tokens is None else draft_tokens, adapt)

    @property
    def enabled(self) -> bool:
        return self.mode != "off"

    @property
    def max_draft_tokens(self) -> int:
        return self.draft_tokens


@dataclass
class SpecStats:
    """Counters of one generation; ``as_dict`` gives the result.stats entries."""
    mode: str
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0
    plain_steps: int = 0
    verify_tokens: int = 0  # tokens the verify steps produced (accepted drafts + the verifier's own)
    draft_s: float = 0.0
    decode_s: float = 0.0

    def as_dict(self) -> dict:
        return {"speculate": self.mode, "draft_tokens": self.drafted,
                "acceptance_rate": round(self.accepted / self.drafted, 4) if self.drafted else 0.0,
                "tokens_per_verify_step": round(self.verify_tokens / self.verify_steps, 4) if self.verify_steps else 0.0,
                "verify_steps": self.verify_steps, "plain_steps": self.plain_steps,
                "draft_time_share": round(self.draft_s / self.decode_s, 4) if self.decode_s > 0 else 0.0}
