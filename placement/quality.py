"""Quality that travels with a plan: held-out perplexity and greedy agreement with dense, measured
through the runtime the plan describes (its formats, tier placement, thresholds and predictors).

``tandem plan`` measures it right after planning (``--no-quality`` skips it) on a small held-out
slice (the profile's calibration split: every 5th document of the built-in corpus) and records it in
``plan.json`` under ``quality``; ``show-plan`` prints it and loading a plan whose recorded perplexity
increase is above the profile's quality budget warns.

The measurement loads engines, so it lives a floor up (online.plan_measure.measure_plan_quality); this
module holds the pieces that need only an object with ``.logits(tokens)``.

Example::

    quality_warning({"perplexity_increase": 0.05, "max_quality_loss": 0.02})  # "this plan's measured ..."
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from offline.calibration import build_calibration_set
from tandem.core.errors import TandemError

DEFAULT_QUALITY_TOKENS = 256
WINDOW_TOKENS = 128


def held_out_tokens(engine, max_tokens: int, token_docs: list[list[int]] | None = None) -> list[int]:
    """The held-out slice: the calibration split's held-out documents (or ``token_docs``), concatenated."""
    if token_docs is None:
        token_docs = build_calibration_set(engine, max_tokens=max(16, 5 * max_tokens)).held_out
    flat = [t for doc in token_docs for t in doc][:max_tokens]
    if len(flat) < 2:
        raise TandemError("the held-out slice for plan quality has fewer than 2 tokens")
    return flat


def scores(engine, tokens: list[int], window_tokens: int) -> tuple[float, torch.Tensor]:
    """Sum of NLL over scored positions and the greedy choices there (windows of ``window_tokens``, no overlap)."""
    nll, greedy = 0.0, []
    for begin in range(0, len(tokens) - 1, window_tokens):
        window = tokens[begin:begin + window_tokens + 1]
        logits = engine.logits(window)[:-1]  # [W, vocab], predicting window[1:]
        targets = torch.tensor(window[1:])
        nll -= float(F.log_softmax(logits.double(), dim=-1).gather(1, targets[:, None]).sum())
        greedy.append(logits.argmax(dim=-1))
    return nll, torch.cat(greedy)


QUALITY_PENDING, QUALITY_SKIPPED = "pending", "skipped"  # Plan.quality_status when Plan.quality is empty
_NOT_MEASURED = {QUALITY_PENDING: "its quality measurement did not finish",
                 QUALITY_SKIPPED: "it was planned with --no-quality",
                 "unknown": "its quality was not measured (an older plan: --no-quality, or an interrupted measurement)"}


def quality_state(plan) -> str:
    """"measured", "pending" (planned; the measurement has not finished, e.g. it was interrupted),
    "skipped" (planned with --no-quality) or "unknown" (an older plan that did not record why)."""
    if plan.quality:
        return "measured"
    return plan.quality_status if plan.quality_status in (QUALITY_PENDING, QUALITY_SKIPPED) else "unknown"


def quality_shortfall(plan, tokens: int | None = None, gpu_device: str | None = None) -> str | None:
    """Why ``plan``'s recorded quality does not answer a run that wants it measured (on ``tokens``
    held-out tokens, the GPU tier on ``gpu_device``; None: whatever it was measured with), else None."""
    state = quality_state(plan)
    if state != "measured":
        return _NOT_MEASURED[state]
    q = plan.quality
    asked, scored = q.get("requested_tokens"), q.get("held_out_tokens")
    if asked is None and isinstance(scored, int):  # older plans recorded the tokens scored (one fewer) only
        asked = scored + 1
    if tokens is not None and asked != tokens:
        return f"its quality was measured on {asked} held-out tokens, not {tokens}"
    device = str(q.get("tier_device") or "")
    if gpu_device is not None and device.split(":")[0] != gpu_device:
        return f"its quality was measured with the GPU tier on {device or 'an unrecorded device'}, not {gpu_device}"
    return None


def not_measured_line(plan) -> str:
    """``show-plan``'s line for a plan without a quality measurement, saying why."""
    state = quality_state(plan)
    if state == QUALITY_SKIPPED:
        return "quality: not measured (planned with --no-quality)"
    if state == QUALITY_PENDING:
        return ("quality: not measured (the measurement did not finish; `tandem plan` or `tandem prepare` "
                "without --no-quality measures it)")
    return "quality: not measured"


def quality_warning(quality: dict[str, Any]) -> str | None:
    """A one-line warning when the recorded quality is outside its budget, else None."""
    budget = quality.get("max_quality_loss") if quality else None
    increase = quality.get("perplexity_increase") if quality else None
    if budget is None or increase is None or increase <= budget:
        return None
    return (f"this plan's measured held-out perplexity is {increase:.1%} above dense "
            f"(budget {budget:.1%}; greedy agreement {quality.get('greedy_agreement', float('nan')):.1%})")
