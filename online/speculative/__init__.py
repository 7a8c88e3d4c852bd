"""Exact speculative decoding: drafters propose k tokens, the configured model verifies them in one
multi-token step (``FusedDecodeStep.step_many``) and keeps exactly what it would have produced.

Modules: config (SpeculationConfig), lookup (n-gram drafter), drafters (lookup + sparse self-draft),
verify (greedy / speculative sampling acceptance), policy (adaptive k, auto), loop (the decode
loop), setup (per-engine wiring).

Example::

    out = engine.generate("Quote the passage ...", speculate="lookup", draft_tokens=6)
    out.stats["acceptance_rate"], out.stats["tokens_per_verify_step"]
"""
from importlib import import_module

from .config import MODES, SpeculationConfig

__all__ = ["MODES", "SpeculationConfig", "LookupDrafter", "accept_greedy", "accept_sampled"]
_LAZY = {"LookupDrafter": "lookup", "accept_greedy": "verify", "accept_sampled": "verify"}  # torch: on first use


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
