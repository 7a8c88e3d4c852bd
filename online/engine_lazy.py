"""One Engine, two ways to stand up: from the checkpoint (the torch model, its executor, the fused
step), or from the plan's prepared-step cache (online/engine_cache.py): config, tokenizer and the
fused C step only (NativeStep), no torch. A cached engine runs plain requests (no logprobs, grammar
or speculation) on NativeStep; anything that needs the module graph (``engine.model``,
``engine.executor``, ``compiled_decode``, ``plan_info``, scoring, speculation, the server) builds it
on first use, as a normal load would.

Example::

    engine = load_fast(Engine, EngineArgs(model="smollm2", plan=plan_dir, threads=2))
    engine.generate("Hi", max_new_tokens=8)      # NativeStep, torch never imported
    engine.logits([1, 2, 3])                     # builds the module graph first
"""
from __future__ import annotations

import sys
from pathlib import Path

from tandem.core.config import ModelConfig

from .engine_args import EngineArgs
from .engine_cache import CachedParts, cache_applies, load_cached, save_cached


def load_fast(cls, args: EngineArgs):
    """``cls`` (the Engine) for ``args``: from the step cache when it applies (written first when it is
    missing or stale), else from the checkpoint."""
    if not (args.step_cache and cache_applies(args) and _native_available()):
        return cls._load_modules(args)
    parts = load_cached(args)
    built = None
    if parts is None:
        built = cls._load_modules(args)
        if save_cached(built, args) is None:
            return built
        parts = load_cached(args)
        if parts is None:
            return built
    elif parts.engine.get("plan_warning"):
        print(f"warning: {args.plan}: {parts.engine['plan_warning']}", file=sys.stderr)
    return _from_parts(cls, args, parts, built)


def _native_available() -> bool:
    """The cached step runs on the C library; without it (no compiler, TANDEM_NATIVE=0) the modules decode."""
    from .kernels.native import NativeUnavailable, load_native
    try:
        load_native()
    except NativeUnavailable:
        return False
    return True


def _from_parts(cls, args: EngineArgs, parts: CachedParts, built=None):
    from tandem.core.loading.tokenizer_state import tokenizer_from_bytes
    from .execution.native_step import NativeStep
    facts = parts.engine
    cfg = ModelConfig.from_dict(facts["config"])
    tokenizer = None
    if "extra.tokenizer" in parts.arrays:
        tokenizer = built.tokenizer if built is not None else tokenizer_from_bytes(parts.arrays["extra.tokenizer"].tobytes())
    engine = cls(None, None, tokenizer, cfg, Path(facts["model_path"]), facts["model_id"], facts["model_fingerprint"],
                 args.threads, args.context_length)
    engine.args = args
    engine._native_step = NativeStep.from_cache(parts.description, parts.arrays, args.threads or facts["threads"],
                                                cfg.vocab_size)
    engine._cached_facts = facts
    engine.decode_path, engine.decode_path_reason = "fused", ""
    if built is not None:
        engine._adopt(built)
    return engine


class LazyModules:
    """The Engine's module-graph attributes, built on first use for an engine loaded from the cache."""
    _cached_facts: dict | None = None

    def _materialize(self) -> None:
        if self._model is None and self.args is not None and self._cached_facts is not None:
            self._adopt(type(self)._load_modules(self.args))

    def _adopt(self, built) -> None:
        self._model, self._executor = built._model, built._executor
        self._compiled_decode, self._plan_info = built._compiled_decode, built._plan_info
        self._layer_offload_gpu_layers, self._decode_threads = built._layer_offload_gpu_layers, built._decode_threads
        self.decode_path, self.decode_path_reason = built.decode_path, built.decode_path_reason

    def _lazy(name: str):  # noqa: N805 (a property factory used in the class body)
        def get(self):
            self._materialize()
            return getattr(self, name)
        return property(get)

    model = _lazy("_model")
    executor = _lazy("_executor")
    plan_info = _lazy("_plan_info")
    layer_offload_gpu_layers = _lazy("_layer_offload_gpu_layers")
    decode_threads = _lazy("_decode_threads")

    @property
    def compiled_decode(self):
        self._materialize()
        return self._compiled_decode

    @compiled_decode.setter
    def compiled_decode(self, step) -> None:
        """A step set from outside replaces the cached one for every request (tests set their own)."""
        self._materialize()
        self._compiled_decode, self._native_step = step, None

    @property
    def runs_on_cached_step(self) -> bool:
        """Whether plain requests run on the cached C step (NativeStep, numpy; no torch)."""
        return self._native_step is not None

    def _stat_threads(self) -> int:
        if "torch" not in sys.modules:
            return int(self._native_step._desc.threads)
        import torch
        return torch.get_num_threads()

    def _native_counters(self) -> dict:
        step = self._native_step
        return {"ffn_neurons_total": step.ffn_neurons_total, "ffn_neurons_active": step.ffn_neurons_active}

    def _native_run_stats(self, delta: dict) -> dict:
        """The executor's run_stats for a cached-step generation: its saved template (nothing moves on
        the fused CPU path), with this generation's FFN sparsity."""
        stats = dict(self._cached_facts["run_stats"])
        stats["ffn_sparsity"] = round(1.0 - delta["ffn_neurons_active"] / max(delta["ffn_neurons_total"], 1), 4)
        if "experts_cpu_per_token" in stats:  # an expert runtime without slots: every token's experts on the CPU
            cfg = self.config
            moe_layers = sum(map(cfg.is_moe_layer, range(cfg.num_layers)))
            stats["experts_cpu_per_token"] = float(cfg.num_experts_per_tok * moe_layers)
        if self._cached_facts.get("plan_dir") is not None:
            stats["plan"] = self._cached_facts["plan_dir"]
        return stats
