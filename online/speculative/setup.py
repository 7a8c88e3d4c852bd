"""What a generation speculates with: the engine's decode step, drafters and policy (or why not).

Example::

    plan = speculation_for(engine, SpeculationConfig.parse("auto"))
    plan.reason            # "" when it runs, else why it is off (e.g. the module decode path)
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.core.errors import TandemError
from .config import SpeculationConfig
from .drafters import LookupProposer, SparseDrafter
from .policy import SpecPolicy


@dataclass
class Speculation:
    config: SpeculationConfig
    step: object | None = None  # FusedDecodeStep (has step_many)
    drafters: dict = field(default_factory=dict)
    policy: SpecPolicy | None = None
    reason: str = ""  # why speculation is off or a drafter is left out ("" = as asked)
    stats: object | None = None  # the generation's SpecStats (online/speculative/loop.py)

    @property
    def active(self) -> bool:
        return self.policy is not None


def verifier_step(engine):
    """The engine's multi-token-capable decode step, or raise with the reason there is none."""
    step = engine.compiled_decode
    if step is None or not hasattr(step, "step_many"):
        why = f": {engine.decode_path_reason}" if engine.decode_path_reason else ""
        raise TandemError(f"speculation needs the fused decode step; this engine decodes through the "
                          f"{engine.decode_path} path{why}")
    return step


def draft_step(engine):
    """The engine's sparse drafter step (built once): its decode step at the profile's draft thresholds."""
    cached = getattr(engine, "_draft_step", None)
    if cached is not None:
        return cached
    from ..execution.fused_decode import FusedDecodeStep
    step = verifier_step(engine)
    if type(step) is not FusedDecodeStep:
        raise TandemError(f"no sparse drafter on the {engine.decode_path} decode path (the CPU fused step only)")
    info = engine.plan_info
    if info is None or info.profile_dir is None:
        raise TandemError("the sparse drafter needs a plan with a profile (--plan): its looser FFN thresholds "
                          "come from the profile")
    from offline.draft_thresholds import draft_thresholds
    from offline.profile_artifact import load_profile
    draft = draft_thresholds(load_profile(info.profile_dir, expected_model_fingerprint=engine.model_fingerprint))
    engine._draft_step = step.with_thresholds(draft.thresholds)
    engine.draft_thresholds_info = draft
    return engine._draft_step


def speculation_for(engine, config: SpeculationConfig, params=None) -> Speculation:
    """Off (with the reason) where the decode path has no multi-token step; ``sparse`` asked for
    explicitly and impossible raises; ``auto`` leaves the sparse drafter out and says why. Seeded
    sampling (``params``) pins k: timing-driven choices would change which random draws make which
    token, so the same seed would not give the same text."""
    spec = Speculation(config)
    if not config.enabled:
        return spec
    try:
        spec.step = verifier_step(engine)
    except TandemError as exc:
        spec.reason = str(exc)
        return spec
    names = {"lookup": ("lookup",), "sparse": ("sparse",), "auto": ("lookup", "sparse")}[config.mode]
    for name in names:
        if name == "lookup":
            spec.drafters[name] = LookupProposer()
            continue
        try:
            drafter = SparseDrafter(draft_step(engine))
            if config.mode == "auto" and not drafter.step.thresholds_cut_reads():
                raise TandemError("its step reads the verifier's bytes (dense down rows), so a drafted token costs "
                                  "a plain step and drafting cannot pay")
            spec.drafters[name] = drafter
        except TandemError as exc:
            if config.mode == "sparse":
                raise
            spec.reason = f"sparse drafter left out: {exc}"
    seeded_sampling = params is not None and not params.greedy and params.seed is not None
    spec.policy = SpecPolicy(config.max_draft_tokens, tuple(spec.drafters), adapt=config.adapt and not seeded_sampling,
                             allow_plain=config.mode == "auto")
    return spec
