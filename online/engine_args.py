"""EngineArgs: everything that says how to load an engine, in one frozen, validated record.

``Engine.load(model, **kw)``, ``Engine.from_args``, and the ``generate`` / ``perplexity`` / ``serve`` commands
all go through it; the commands' engine flags are generated from its fields (``add_engine_arguments``), so
they cannot drift apart. Errors name fields (``threads must be >= 1``), not flags.

Example::

    args = EngineArgs(model="smollm2", threads=2, plan="profiles/m/plan-cpu-only-0")
    engine = Engine.from_args(args)           # Engine.load("smollm2", threads=2, plan=...) is the same
    add_engine_arguments(parser)              # --model, --threads, --plan, ... --layer-offload
    args = EngineArgs.from_namespace(parser.parse_args(argv))
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields
from pathlib import Path

from tandem.core.cpus import max_threads
from tandem.core.errors import TandemError, check_int

WEIGHT_FORMATS = ("fp32", "int8", "int4")  # packed CPU weights of hybrid executors
DOWN_FORMATS = ("fp32", "fp16", "int8b", "int8", "int4")  # sparse (transposed) down projection; int8b / int4: Q8_0 / Q4_1 rows (f16 scales)
GPU_DEVICES = ("cuda", "cpu")
KV_CACHE_TYPES = ("f16", "f32")  # element type of the KV caches the fused C step reads (attention.h)


def _flag(flag: str, help: str, **argparse_kw) -> dict:
    """Field metadata: the command-line flag and its argparse keywords."""
    return {"flag": flag, "help": help, **argparse_kw}


@dataclass(frozen=True)
class EngineArgs:
    model: str = field(metadata=_flag("--model", "alias (smollm2), .gguf file or Hugging Face folder", required=True))
    threads: int | None = field(default=None, metadata=_flag("--threads", "CPU threads (default: torch's choice)", type=int))
    plan: str | None = field(default=None, metadata=_flag("--plan", "plan directory from `tandem plan` / `tandem prepare`"))
    context_length: int | None = field(default=None, metadata=_flag(
        "--context", "context length (default: the model's)", type=int))
    weight_format: str | None = field(default=None, metadata=_flag(
        "--weight-format", "packed CPU weights (default: float32 without a plan; with one, int4 for GGUF Q4 models "
        "(their blocks, exactly), else int8)", choices=WEIGHT_FORMATS))
    gpu_budget_bytes: int | None = field(default=None, metadata=_flag(
        "--gpu-budget", "GPU-tier budget, e.g. 2GiB (must fit the plan)", parse="bytes"))
    gpu_device: str | None = field(default=None, metadata=_flag(
        "--gpu-device", "where the GPU tier runs (default: cuda when present, else cpu)", choices=GPU_DEVICES))
    sparse: bool = field(default=True, metadata=_flag("--no-sparse", "compute every FFN neuron (exact)"))
    down_format: str | None = field(default=None, metadata=_flag(
        "--down-format", "storage of the sparse (transposed) down projection (default fp16)", choices=DOWN_FORMATS))
    fused_decode: bool = field(default=True, metadata=_flag(
        "--no-fused-decode", "decode through the module graph instead of the one-call C step"))
    profile: str | None = field(default=None, metadata=_flag(
        "--profile", "profile directory of the plan (default: beside the plan)"))
    predictors: str | None = field(default=None, metadata=_flag(
        "--predictors", "predictors directory of the plan (default: beside the plan)"))
    expert_slots: int | None = field(default=None, metadata=_flag(
        "--expert-slots", "MoE: expert cache slots per layer on the GPU tier (overrides the plan's; works without one)",
        type=int, metavar="N"))
    prefetch: bool = field(default=True, metadata=_flag(
        "--no-prefetch", "MoE: no speculative prefetch of the next layer's experts"))
    layer_offload: bool = field(default=False, metadata=_flag(
        "--layer-offload", "llama.cpp -ngl policy: whole layers on the GPU tier in order until --gpu-budget is spent"))
    kv_cache_type: str = field(default="f16", metadata=_flag(
        "--kv-cache-type", "keys and values of the KV cache where the C step decodes (fused, layer offload): f16 (half "
        "the bytes per attended token, llama.cpp's default) or f32; engines decoding through the module graph or a "
        "GPU step keep float32", choices=KV_CACHE_TYPES))
    step_cache: bool = field(default=True, metadata=_flag(
        "--no-step-cache", "load the model and pack it at every start instead of using (and writing) the plan's "
        "prepared-step cache (plans on the fused CPU step; TANDEM_STEP_CACHE=0 does the same)"))

    def __post_init__(self) -> None:
        for name in ("model", "plan", "profile", "predictors"):  # paths may come as Path
            value = getattr(self, name)
            if isinstance(value, Path):
                object.__setattr__(self, name, str(value))
            elif value is not None and not isinstance(value, str):
                raise TandemError(f"{name} must be a path, got {value!r}")
        if not self.model:
            raise TandemError("model is empty")
        if self.kv_cache_type is None:  # the flag left out
            object.__setattr__(self, "kv_cache_type", "f16")
        check_int("threads", self.threads, 1)
        if self.threads is not None and self.threads > max_threads():
            raise TandemError(f"threads must be at most {max_threads()} (8 per CPU this process may use), "
                              f"got {self.threads}")
        check_int("context_length", self.context_length, 2)  # a prompt token and one more
        check_int("gpu_budget_bytes", self.gpu_budget_bytes, 0)
        check_int("expert_slots", self.expert_slots, 0)
        for name, allowed in (("weight_format", WEIGHT_FORMATS), ("down_format", DOWN_FORMATS),
                              ("gpu_device", GPU_DEVICES), ("kv_cache_type", KV_CACHE_TYPES)):
            if getattr(self, name) is not None and getattr(self, name) not in allowed:
                raise TandemError(f"{name} must be one of {', '.join(allowed)}, got {getattr(self, name)!r}")
        for name in ("sparse", "fused_decode", "prefetch", "layer_offload", "step_cache"):
            if not isinstance(getattr(self, name), bool):
                raise TandemError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self._check_combination()

    def _check_combination(self) -> None:
        packed = self.plan is not None or self.weight_format is not None or self.expert_slots is not None
        for name in ("profile", "predictors"):
            if getattr(self, name) is not None and self.plan is None:
                raise TandemError(f"{name} names a plan's {name} directory: it needs plan")
        if self.gpu_device is not None:
            if self.plan is None and self.expert_slots is None and not self.layer_offload:
                raise TandemError("gpu_device places the GPU tier: it needs plan, expert_slots or layer_offload")
            if self.gpu_device == "cuda":
                import torch  # only here: a named CUDA device is checked before anything loads
                if not torch.cuda.is_available():
                    raise TandemError("gpu_device cuda: no CUDA device is available (gpu_device cpu runs the tier "
                                      "on the CPU)")
        if not self.sparse and not packed:  # (the QA pass: --no-sparse was accepted there and changed nothing)
            raise TandemError("sparse=False (--no-sparse) needs plan or weight_format: the dense float32 runtime "
                              "computes every FFN neuron already")
        if not self.prefetch and self.plan is None and self.expert_slots is None:
            raise TandemError("prefetch=False (--no-prefetch) is for a MoE expert cache: it needs expert_slots or a "
                              "plan that places experts")
        if self.down_format is not None and not packed:
            raise TandemError("down_format needs plan or weight_format (the dense float32 runtime has no packed FFN)")
        if self.layer_offload:
            if self.plan is not None or self.expert_slots is not None:
                raise TandemError("layer_offload replaces a plan: leave plan and expert_slots unset")
            if self.gpu_budget_bytes is None:
                raise TandemError("layer_offload needs gpu_budget_bytes (whole layers go on the GPU tier until it is spent)")
        elif self.gpu_budget_bytes is not None and self.plan is None and self.expert_slots is None:
            raise TandemError("gpu_budget_bytes needs plan (or expert_slots for a MoE model, or layer_offload)")

    @property
    def packed(self) -> bool:
        """Whether FFNs run through a hybrid executor with packed weights (else dense float32)."""
        return self.plan is not None or self.weight_format is not None or self.expert_slots is not None

    @classmethod
    def create(cls, model: str | Path, **kwargs) -> "EngineArgs":
        """``EngineArgs(model, **kwargs)`` with a clear error for an unknown keyword."""
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TandemError(f"unknown engine argument {unknown[0]!r} (known: {', '.join(sorted(names - {'model'}))})")
        return cls(model=model, **kwargs)

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "EngineArgs":
        """The fields from parsed ``add_engine_arguments`` flags (``--gpu-budget 2GiB`` -> bytes)."""
        values = {}
        for f in fields(cls):
            value = getattr(ns, f.name)
            if f.metadata.get("parse") == "bytes" and value is not None:
                from placement.budget import parse_bytes  # placement: only when a budget is given
                value = parse_bytes(value)
            values[f.name] = value
        return cls(**values)


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One ``engine`` flag group, generated from EngineArgs' fields (shared by generate, perplexity and serve)."""
    group = parser.add_argument_group("engine")
    for f in fields(EngineArgs):
        meta = dict(f.metadata)
        flag = meta.pop("flag")
        meta.pop("parse", None)
        if f.type in (bool, "bool"):
            action = "store_false" if f.default else "store_true"
            group.add_argument(flag, dest=f.name, action=action, help=meta["help"])
        else:
            if "choices" not in meta:
                meta.setdefault("metavar", flag[2:].upper().replace("-", "_"))
            group.add_argument(flag, dest=f.name, default=None, **meta)
