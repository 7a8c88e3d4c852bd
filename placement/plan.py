"""The plan artifact: ``DIR/plan.json`` + ``DIR/plan.safetensors``, written atomically.

Tensors (L = layers, F = FFN neurons per layer, E = experts, 0 for dense models):
    gpu_neuron_mask        [L, F] bool   neurons whose rows live on the GPU tier
    layers.{i}.gpu_neurons [n_i]  int64  the same, as ascending indices (one tensor per layer)
    attention_on_gpu       [L]    bool   attention weights + KV cache of layer i on the GPU
    expert_pinned          [L, E] bool   experts kept on the GPU
    expert_cache_slots     [L]    int64  LRU expert cache slots per layer on the GPU

``plan.json`` holds the fingerprints (model, profile, predictors, hardware, settings), the budget,
the hardware profile, the solver's status/gap and the greedy comparison, GPU bytes by kind, the
modeled per-layer time split and the modeled tokens/s beside the baselines.

Example::

    plan = load_plan("profiles/m/plan-rtx4090-2GiB", model_fingerprint=ckpt.fingerprint,
                     hardware=load_hardware("rtx4090"), gpu_budget_bytes=2 * 2**30)
    plan.gpu_neurons(3)   # tensor of neuron indices on the GPU in layer 3
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.core.artifacts import load_artifact, save_artifact
from tandem.core.errors import ArtifactError

from .budget import format_bytes
from .hardware import HardwareProfile
from .settings import PlanSettings

PLAN_SCHEMA_VERSION = 1


@dataclass
class Plan:
    model_fingerprint: str
    model_id: str
    profile_fingerprint: str
    predictors_fingerprint: str
    hardware: HardwareProfile
    gpu_budget_bytes: int
    settings: PlanSettings
    model_config: dict[str, Any]
    solver: dict[str, Any]  # status, gap_rel, chosen, objectives, times, chunking
    modeled: dict[str, Any]  # time_per_token_s, tokens_per_s and the baselines (all "modeled")
    gpu_bytes_by_kind: dict[str, int]
    layers: list[dict[str, Any]]  # per layer: placement summary + modeled time split
    output_head_on_gpu: bool
    embeddings_on_gpu: bool
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    quality: dict[str, Any] = field(default_factory=dict)  # measured through the runtime (placement/quality.py)
    # why ``quality`` is empty: "pending" (planned, its measurement has not finished), "skipped" (--no-quality);
    # "" for older plans and measured ones (placement.quality.quality_state)
    quality_status: str = ""

    # --- accessors ---------------------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return int(self.tensors["attention_on_gpu"].shape[0])

    @property
    def gpu_neuron_mask(self) -> torch.Tensor:  # [L, F] bool
        return self.tensors["gpu_neuron_mask"]

    @property
    def attention_on_gpu(self) -> list[bool]:
        return [bool(x) for x in self.tensors["attention_on_gpu"].tolist()]

    @property
    def expert_pinned(self) -> torch.Tensor:  # [L, E] bool
        return self.tensors["expert_pinned"]

    @property
    def expert_cache_slots(self) -> torch.Tensor:  # [L] int64
        return self.tensors["expert_cache_slots"]

    def gpu_neurons(self, layer: int) -> torch.Tensor:  # [n] int64, ascending
        return self.tensors[f"layers.{layer}.gpu_neurons"]

    @property
    def gpu_bytes(self) -> int:
        return int(sum(self.gpu_bytes_by_kind.values()))

    def to_meta(self) -> dict[str, Any]:
        return {"kind": "plan", "schema_version": PLAN_SCHEMA_VERSION,
                "model_fingerprint": self.model_fingerprint, "model_id": self.model_id,
                "profile_fingerprint": self.profile_fingerprint, "predictors_fingerprint": self.predictors_fingerprint,
                "hardware": self.hardware.to_dict(), "hardware_fingerprint": self.hardware.fingerprint,
                "gpu_budget_bytes": int(self.gpu_budget_bytes),
                "settings": self.settings.to_dict(), "settings_fingerprint": self.settings.fingerprint,
                "model_config": self.model_config, "solver": self.solver, "modeled": self.modeled,
                "gpu_bytes_by_kind": self.gpu_bytes_by_kind, "gpu_bytes": self.gpu_bytes, "layers": self.layers,
                "output_head_on_gpu": self.output_head_on_gpu, "embeddings_on_gpu": self.embeddings_on_gpu,
                "quality": self.quality, "quality_status": self.quality_status}


def save_plan(plan: Plan, out_dir: str | Path) -> Path:
    """Write the plan atomically (the whole directory is replaced in one rename)."""
    return save_artifact(out_dir, "plan", plan.tensors, plan.to_meta())


def _check_tensors(plan: Plan, plan_dir: Path) -> None:
    tensors, num_layers = plan.tensors, len(plan.layers)
    required = ("gpu_neuron_mask", "attention_on_gpu", "expert_pinned", "expert_cache_slots")
    missing = [k for k in required if k not in tensors]
    if missing:
        raise ArtifactError(f"plan in {plan_dir} is corrupted: missing tensors {', '.join(missing)}")
    mask = tensors["gpu_neuron_mask"]
    if mask.dtype != torch.bool or mask.dim() != 2 or mask.shape[0] != num_layers:
        raise ArtifactError(f"plan in {plan_dir} is corrupted: gpu_neuron_mask has shape {list(mask.shape)}")
    for i in range(num_layers):
        key = f"layers.{i}.gpu_neurons"
        if key not in tensors or not torch.equal(tensors[key], mask[i].nonzero().flatten()):
            raise ArtifactError(f"plan in {plan_dir} is corrupted: {key} disagrees with gpu_neuron_mask")
    if tensors["attention_on_gpu"].shape != (num_layers,) or tensors["expert_cache_slots"].shape != (num_layers,):
        raise ArtifactError(f"plan in {plan_dir} is corrupted: per-layer tensors do not have {num_layers} entries")


def read_plan(plan_dir: str | Path) -> Plan:
    """Load and validate a plan without checking what it was made for (``show-plan``)."""
    plan_dir = Path(plan_dir)
    tensors, meta = load_artifact(plan_dir, "plan", kind="plan", schema_version=PLAN_SCHEMA_VERSION)
    try:
        plan = Plan(model_fingerprint=meta["model_fingerprint"], model_id=meta["model_id"],
                    profile_fingerprint=meta["profile_fingerprint"], predictors_fingerprint=meta["predictors_fingerprint"],
                    hardware=HardwareProfile.from_dict(meta["hardware"], source=f"plan in {plan_dir}"),
                    gpu_budget_bytes=int(meta["gpu_budget_bytes"]), settings=PlanSettings.from_dict(meta["settings"]),
                    model_config=meta["model_config"], solver=meta["solver"], modeled=meta["modeled"],
                    gpu_bytes_by_kind=meta["gpu_bytes_by_kind"], layers=meta["layers"],
                    output_head_on_gpu=bool(meta["output_head_on_gpu"]), embeddings_on_gpu=bool(meta["embeddings_on_gpu"]),
                    tensors=tensors, quality=dict(meta.get("quality") or {}),
                    quality_status=str(meta.get("quality_status") or ""))
    except (KeyError, TypeError, ValueError) as e:
        raise ArtifactError(f"plan metadata in {plan_dir} is incomplete or malformed ({e})") from None
    if meta.get("hardware_fingerprint") != plan.hardware.fingerprint or meta.get("settings_fingerprint") != plan.settings.fingerprint:
        raise ArtifactError(f"plan in {plan_dir} is corrupted: its metadata does not match its fingerprints")
    _check_tensors(plan, plan_dir)
    return plan


def load_plan(plan_dir: str | Path, *, model_fingerprint: str, profile_fingerprint: str | None = None,
              predictors_fingerprint: str | None = None, hardware: HardwareProfile | str | None = None,
              gpu_budget_bytes: int | None = None, settings: PlanSettings | None = None,
              command: str = "plan") -> Plan:
    """Load a plan and refuse it when anything it was made for changed (each check names what).

    ``hardware`` may be a HardwareProfile or its fingerprint; checks with ``None`` are skipped,
    except the model's, which is always checked. A plan made for another budget is refused.
    ``command``: the ``tandem`` command the refusal tells the user to run again with --replan.
    """
    plan = read_plan(plan_dir)
    plan_dir = Path(plan_dir)
    replan = f"run `tandem {command}` again (with --replan to overwrite it)"
    if plan.model_fingerprint != model_fingerprint:
        raise ArtifactError(f"plan in {plan_dir} was made for another model ({plan.model_id}, fingerprint "
                            f"{plan.model_fingerprint}, this model is {model_fingerprint}); {replan}")
    if profile_fingerprint is not None and plan.profile_fingerprint != profile_fingerprint:
        raise ArtifactError(f"plan in {plan_dir} was made from another profile (fingerprint {plan.profile_fingerprint}, "
                            f"this profile is {profile_fingerprint}); {replan}")
    if predictors_fingerprint is not None and plan.predictors_fingerprint != predictors_fingerprint:
        raise ArtifactError(f"plan in {plan_dir} was made with other predictors ({plan.predictors_fingerprint}, "
                            f"now {predictors_fingerprint}); {replan}")
    if hardware is not None:
        wanted = hardware.fingerprint if isinstance(hardware, HardwareProfile) else str(hardware)
        if plan.hardware.fingerprint != wanted:
            name = f" ({hardware.name})" if isinstance(hardware, HardwareProfile) else ""
            raise ArtifactError(f"plan in {plan_dir} was made for other hardware ({plan.hardware.name}, fingerprint "
                                f"{plan.hardware.fingerprint}; now{name} {wanted}); {replan}")
    if gpu_budget_bytes is not None and plan.gpu_budget_bytes != int(gpu_budget_bytes):
        raise ArtifactError(f"plan in {plan_dir} was made for a GPU budget of {format_bytes(plan.gpu_budget_bytes)} "
                            f"({plan.gpu_budget_bytes} bytes), not {format_bytes(gpu_budget_bytes)} "
                            f"({int(gpu_budget_bytes)} bytes); {replan}")
    if settings is not None and plan.settings != settings:
        changed = sorted(k for k, v in settings.to_dict().items() if plan.settings.to_dict().get(k) != v)
        raise ArtifactError(f"plan in {plan_dir} was made with other planner settings ({', '.join(changed)}); {replan}")
    return plan
