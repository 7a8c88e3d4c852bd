"""Exact speculative decoding: drafters propose k tokens, the configured model verifies them in one
multi-token step (``FusedDecodeStep.step_many``) and keeps exactly what it would have produced.

Modules: config (SpeculationConfig), lookup (n-gram drafter), drafters (lookup + sparse self-draft),
verify (greedy / speculative sampling acceptance), policy (adaptive k, auto), loop (the decode
loop), setup (per-engine wiring).

Example::

    out = engine.generate("Quote the passage ...", speculate="lookup", draft_tokens=6)
    out.stats["acceptance_rate"], out.stats["tokens_per_verify_step"]
"""
from .config import MODES, SpeculationConfig
from .lookup import LookupDrafter
from .verify import accept_greedy, accept_sampled

__all__ = ["MODES", "SpeculationConfig", "LookupDrafter", "accept_greedy", "accept_sampled"]
