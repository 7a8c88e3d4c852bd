"""Engine: the Python generation API.

Example::

    from online import Engine
    engine = Engine.load("smollm2", threads=2)
    out = engine.generate([{"role": "user", "content": "Hi!"}], max_new_tokens=32)
    print(out.text, out.stats["decode_tokens_per_s"])
    for piece in engine.stream("Once upon a time", max_new_tokens=16):
        print(piece, end="")
    logits = engine.logits([1, 2, 3])  # [3, vocab] float32
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Iterator

from tandem.core.errors import TandemError
from tandem.core.config import ModelConfig
from tandem.core.loading.detokenize import TextDecoder
from tandem.core.sampling_params import DecodeOptions, SamplingParams, TokenChoice
from tandem.core.step_loop import LoopTimings

from .engine_args import EngineArgs
from .engine_kv import KVCaches, context_capacity
from .engine_lazy import LazyModules, load_fast
from .engine_scoring import Scoring
from .results import GenerationResult, TextStream


class Engine(LazyModules, Scoring, KVCaches):
    def __init__(self, model, executor, tokenizer, cfg: ModelConfig, model_path: Path, model_id: str,
                 model_fingerprint: str, threads: int | None, context_length: int | None = None) -> None:
        self._model, self._executor = model, executor
        self._native_step = None  # NativeStep: plain requests of an engine loaded from its step cache (engine_lazy)
        self.tokenizer = tokenizer
        self.config = cfg
        self.model_path = model_path
        self.model_id = model_id
        self.model_fingerprint = model_fingerprint
        self.threads = threads
        self.max_context = context_capacity(cfg, context_length, model_id)
        eos = set(cfg.eos_token_ids)
        if tokenizer is not None:
            eos |= set(tokenizer.eos_token_ids)
        self.eos_token_ids = eos
        self._cache = None  # KVCache (the module graph) or ArrayKVCache (the cached step)
        self._kv_epoch = 0  # counts the times _kv_cache handed the cache out: a stream holds it while this stays
        self._plan_info = None
        self.args: EngineArgs | None = None  # what from_args was given
        self._layer_offload_gpu_layers: int | None = None
        # the C kernels parallelise decode themselves; torch then runs its small ops on one thread
        self._decode_threads = 1 if executor is not None and executor.packed else None
        self._compiled_decode = None  # online.execution.fused_decode.FusedDecodeStep when available
        self.decode_path = "modules"
        self.decode_path_reason = ""
        self._draft_step = None  # the sparse drafter's step (online/speculative/setup.py), built on first use
        self.draft_thresholds_info = None
        self.default_speculation = None  # SpeculationConfig used when a call passes speculate=None (serve)

    @classmethod
    def load(cls, model: str | Path, **kwargs) -> "Engine":
        """Load a model: alias ("smollm2"), a .gguf file or a Hugging Face folder; ``kwargs`` are EngineArgs
        fields (threads, plan, context_length, weight_format, gpu_budget_bytes, gpu_device, sparse,
        down_format, fused_decode, profile, predictors, expert_slots, prefetch, layer_offload).

        Without ``plan`` and ``weight_format`` the runtime is dense float32 (the reference). With a
        plan (``tandem plan`` / ``tandem prepare``) FFNs run hybrid and sparse as planned, with packed
        weights (``weight_format``: int8 by default; int4 reads GGUF Q4 blocks as they are).
        MoE models get an expert cache on the GPU tier: the plan's slots and pinned experts, or
        ``expert_slots`` per layer (which overrides the plan, and works without one: float32 experts
        unless ``weight_format`` says otherwise); ``prefetch`` speculatively loads the next layer's experts.
        ``down_format``: how the transposed down projection of sparse FFNs is stored (fp16 by
        default; fp32 / int8b / int8, see ExecutionSettings). ``fused_decode``: decode packed
        CPU-only models with the one-call C step (falls back to the module graph, with the reason
        in ``decode_path_reason``, where it does not apply).

        Example::

            engine = Engine.load("smollm2", threads=2, weight_format="int4")
        """
        return cls.from_args(EngineArgs.create(model, **kwargs))

    @classmethod
    def from_args(cls, args: EngineArgs) -> "Engine":
        """The engine ``args`` describes (Engine.load builds the EngineArgs from keywords). A plan that runs
        on the fused CPU step loads from its prepared-step cache (online/engine_cache.py: no torch
        until something needs the module graph), written by the first load that lacks it."""
        if not isinstance(args, EngineArgs):
            raise TandemError(f"from_args takes an EngineArgs, got {type(args).__name__} (Engine.load takes a model "
                              "name or path)")
        return load_fast(cls, args)

    @classmethod
    def _load_modules(cls, args: EngineArgs) -> "Engine":
        """The engine built from the checkpoint: the torch model, its executor and decode step."""
        import torch
        from tandem.core.loading import load_checkpoint
        from tandem.core.model.build import build_model
        from .engine_build import build_executor
        if args.threads is not None:
            torch.set_num_threads(args.threads)
        # packed weights come from the file's blocks: the float32 matrices are decoded one at a time, when
        # a format or a slice needs them, instead of all at once (loading/deferred.py)
        packed = args.packed or args.layer_offload
        ckpt = load_checkpoint(args.model, deferred=True if packed else None)
        if not packed and ckpt.deferred_bytes:
            print(f"note: {ckpt.model_id}'s float32 weights ({ckpt.deferred_bytes / 2**30:.1f} GiB) would crowd this "
                  "machine's memory, so the dense runtime decodes each matrix when it uses it (slower); to "
                  "generate, a plan or --weight-format int4/int8 runs the file's blocks on the fused step",
                  file=sys.stderr)
        if args.expert_slots is not None and not ckpt.config.is_moe:
            raise TandemError(f"expert_slots needs a MoE model; {ckpt.model_id} has no experts")
        net, ffn_layers = build_model(ckpt)
        built = build_executor(args, ckpt, net, ffn_layers)
        engine = cls(net, built.executor, ckpt.tokenizer, ckpt.config, ckpt.source_path, ckpt.model_id,
                     ckpt.fingerprint, args.threads, args.context_length)
        engine.args = args
        engine._plan_info = built.plan_info
        engine._layer_offload_gpu_layers = built.gpu_layers
        if built.gpu_layers is not None:
            if args.fused_decode:
                engine._use_layer_offload_step(built.gpu_layers)
        elif args.fused_decode and built.executor.packed:
            engine._use_fused_decode()
        return engine

    def set_default_speculation(self, speculate: str | None, draft_tokens: int | None = None) -> dict:
        """Speculation for calls that pass none (``tandem serve --speculate``); checked now: an
        explicit sparse drafter that cannot be built raises here, not per request. Returns what
        runs (``speculate`` and, when it is off or a drafter is left out, ``speculate_reason``).

        Example::

            engine.set_default_speculation("lookup", 6)
        """
        from .speculative import SpeculationConfig
        from .speculative.setup import speculation_for
        spec = SpeculationConfig.parse(speculate, draft_tokens)
        check = speculation_for(self, spec)
        self.default_speculation = spec
        out = {"speculate": spec.mode if check.active or not spec.enabled else "off"}
        return out | ({"speculate_reason": check.reason} if check.reason else {})

    def _use_fused_decode(self) -> None:
        from .execution.fused_decode import FusedDecodeStep, FusedDecodeUnavailable
        try:
            self._compiled_decode = FusedDecodeStep.build(self.model, self.executor)
            self.decode_path, self.decode_path_reason = "fused", ""
        except FusedDecodeUnavailable as exc:
            self.decode_path_reason = str(exc)
            tier = getattr(self.executor, "tier", None)
            if tier is not None and tier.is_cuda and tier.used_bytes:
                self.use_gpu_step()

    def use_gpu_step(self, capture: bool = True, backend: str | None = None) -> bool:
        """Decode through the GPU step (online/gpu; CUDA graphs on CUDA, chosen there by itself; on a CPU
        tier the same program eagerly, for tests). Returns whether it applies (else: decode_path_reason)."""
        from .gpu.graph_step import GpuDecodeStep
        from .gpu.stack import GpuStepUnavailable
        try:
            self._compiled_decode = GpuDecodeStep.build(self.model, self.executor, capture=capture, backend=backend)
        except GpuStepUnavailable as exc:
            self.decode_path_reason = str(exc)
            return False
        self.decode_path = "gpu-graph" if self.executor.tier.is_cuda and capture else "gpu-step"
        self.decode_path_reason = ""
        return True

    def _use_layer_offload_step(self, n_gpu_layers: int) -> None:
        from .execution.fused_decode import FusedDecodeUnavailable
        from .execution.layer_offload import LayerOffloadStep
        try:
            self._compiled_decode = LayerOffloadStep.build_offload(self.model, self.executor, n_gpu_layers)
            self.decode_path, self.decode_path_reason = "layer-offload", ""
        except FusedDecodeUnavailable as exc:
            self.decode_path_reason = str(exc)
            if self.executor.tier.is_cuda and n_gpu_layers == self.config.num_layers:
                self.use_gpu_step()  # every layer on the GPU: the whole step there

    # --- prompts ---------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise TandemError("prompt is empty")
            ids = self._require_tokenizer().encode(prompt, add_special_tokens=True)
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            ids = self._require_tokenizer().encode_chat(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            ids = list(prompt)
        elif isinstance(prompt, list) and not prompt:
            raise TandemError("prompt is empty")
        else:
            raise TandemError("prompt must be a string, a list of chat messages or a list of token ids")
        if not ids:
            raise TandemError("prompt is empty after tokenization")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise TandemError(f"token id {bad[0]} is out of range for vocabulary size {self.config.vocab_size}")
        if len(ids) >= self.max_context:
            raise TandemError(f"prompt has {len(ids)} tokens, the context holds {self.max_context}")
        return ids

    def encode_prompt_for_scoring(self, text: str) -> list[int]:
        """Tokenize a whole text for perplexity (no context limit: windows are cut later)."""
        if not text.strip():
            raise TandemError("text is empty")
        return self._require_tokenizer().encode(text, add_special_tokens=True)

    def _require_tokenizer(self):
        if self.tokenizer is None:
            raise TandemError(f"model {self.model_id} has no tokenizer; pass token ids instead of text")
        return self.tokenizer

    # --- generation ------------------------------------------------------------------------
    def generate(self, prompt: str | list, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
                 top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
                 ignore_eos: bool = False, logprobs: bool = False, top_logprobs: int = 0,
                 grammar: Any = None, speculate: str | None = None,
                 draft_tokens: int | None = None) -> GenerationResult:
        """Generate to the end; see :meth:`stream` for the arguments."""
        stream = self.stream(prompt, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                             top_p=top_p, seed=seed, stop=stop, ignore_eos=ignore_eos, logprobs=logprobs,
                             top_logprobs=top_logprobs, grammar=grammar, speculate=speculate,
                             draft_tokens=draft_tokens)
        for _ in stream:
            pass
        return stream.result

    def stream(self, prompt: str | list, max_new_tokens: int = 128, temperature: float = 0.0, top_k: int = 0,
               top_p: float = 1.0, seed: int | None = None, stop: list[str] | None = None,
               ignore_eos: bool = False, logprobs: bool = False, top_logprobs: int = 0,
               grammar: Any = None, speculate: str | None = None,
               draft_tokens: int | None = None) -> TextStream:
        """Text pieces as they are generated. ``logprobs``/``top_logprobs`` (0..20): each token's
        log-probability (log-softmax of the raw logits) and its most likely alternatives, in
        ``stream.choices`` / ``result.choices``. ``grammar`` (online.constrain.Grammar): the output is
        constrained to it token by token (llguidance) and ends when the grammar is complete.
        ``speculate``: off (default) | lookup | sparse | auto, exact speculative decoding
        (online/speculative; off, with ``speculate_reason``, when logprobs or a grammar are asked
        for); ``draft_tokens``: the most tokens drafted per verify step."""
        from .speculative.config import SpeculationConfig
        stop = [stop] if isinstance(stop, str) else stop  # one stop string, not its characters
        if stop is not None and not isinstance(stop, (list, tuple)):
            raise TandemError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
        for name, flag in (("ignore_eos", ignore_eos), ("logprobs", logprobs)):
            if not isinstance(flag, bool):
                raise TandemError(f"{name} must be True or False, got {flag!r}")
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k,
                                top_p=top_p, seed=seed, stop=tuple(stop or ()))
        options = self.decode_options(logprobs, top_logprobs, grammar)
        if speculate is None and draft_tokens is None and self.default_speculation is not None:
            spec = self.default_speculation
        else:
            spec = SpeculationConfig.parse(speculate, draft_tokens)
        prompt_ids = self.encode_prompt(prompt)
        holder: dict = {}
        eos_ids = set() if ignore_eos else self.eos_token_ids
        return TextStream(self._pieces(prompt_ids, params, eos_ids, holder, options, spec), holder)

    def decode_options(self, logprobs: bool = False, top_logprobs: int = 0, grammar: Any = None) -> DecodeOptions | None:
        """DecodeOptions for this engine (the grammar bound to its tokenizer); None when plain."""
        if not logprobs and not top_logprobs and grammar is None:
            return None
        constraint = None
        if grammar is not None:
            from .constrain import Grammar, GrammarConstraint, grammar_tokenizer
            if not isinstance(grammar, Grammar):
                raise TandemError(f"grammar must be an online.constrain.Grammar, got {type(grammar).__name__}")
            constraint = GrammarConstraint(grammar_tokenizer(self), grammar)
        return DecodeOptions(logprobs=bool(logprobs or top_logprobs), top_logprobs=top_logprobs, constraint=constraint)

    def _events(self, cache, prompt_ids: list[int], params: SamplingParams, eos_ids: set[int],
                timings: LoopTimings, speculation, options: DecodeOptions | None):
        """The token events: the speculative loop when it runs, else the plain one."""
        if speculation is not None and speculation.active:
            from .speculative.loop import speculative_token_loop
            return speculative_token_loop(self.model, self.executor, cache, prompt_ids, params, eos_ids,
                                          self.max_context, timings, speculation.step, speculation.drafters,
                                          speculation.policy, speculation.stats, decode_threads=self.decode_threads)
        from tandem.core.generate import token_loop
        return token_loop(self.model, self.executor, cache, prompt_ids, params, eos_ids, self.max_context, timings,
                          decode_threads=self.decode_threads, compiled=self.compiled_decode, options=options)

    def _speculation(self, spec, params: SamplingParams, options: DecodeOptions | None):
        """The request's speculation (online/speculative/setup.py), with its stats; None without a config."""
        from .speculative.loop import SpecStats
        from .speculative.setup import speculation_for
        speculation = None
        if spec is not None and spec.enabled and options is not None:
            speculation = speculation_for(self, type(spec).parse("off", None), params)
            speculation.reason = "logprobs and grammars choose token by token: speculation is off for this request"
        elif spec is not None:
            speculation = speculation_for(self, spec, params)
        if speculation is not None:
            speculation.stats = SpecStats(spec.mode if speculation.active else "off")
        return speculation

    def _pieces(self, prompt_ids: list[int], params: SamplingParams, eos_ids: set[int], holder: dict,
                options: DecodeOptions | None = None, spec=None) -> Iterator[str]:
        speculation, fast = None, self._native_step is not None and options is None and not (spec and spec.enabled)
        timings = LoopTimings()
        if fast:  # the cached C step alone (engine_lazy): no torch
            from tandem.core.step_loop import step_token_loop
            cache = self._kv_cache(len(prompt_ids) + params.max_new_tokens, arrays=True)
            before = self._native_counters()
            events = step_token_loop(self._native_step, cache, prompt_ids, params, eos_ids, self.max_context, timings)
        else:
            speculation = self._speculation(spec, params, options)
            cache = self._kv_cache(len(prompt_ids) + params.max_new_tokens)
            before = self.executor.counters_snapshot()
            events = self._events(cache, prompt_ids, params, eos_ids, timings, speculation, options)
        epoch = self._kv_epoch
        choices: list[TokenChoice] = holder.setdefault("choices", [])
        decoder = TextDecoder(self.tokenizer, params.stop)
        generated = decoder.generated  # the token ids, as the decoder receives them
        finish = "length"
        while True:
            if self._kv_epoch != epoch:  # checked before the next step writes into a cache someone else now holds
                raise TandemError("the engine's KV cache went to a later call (another stream, generate, logits or "
                                  "perplexity) while this stream was open: finish a stream before the next call, "
                                  "or use one engine per concurrent stream (tandem serve batches many)")
            event = next(events, None)
            if event is None:
                break
            if event.finish_reason == "stop":
                finish = "stop"
                break
            choices.append(event.choice)
            if event.finish_reason == "length":
                finish = "length"
            piece, stopped = decoder.push(event.token_id)
            if piece:
                yield piece
            if stopped:
                finish = "stop"
                break
        if timings.end_s == 0.0:
            timings.end_s = time.perf_counter()
        tail = decoder.flush()
        if decoder.stopped:  # a stop string in the held-back tail
            finish = "stop"
        if tail:
            yield tail
        text = decoder.text
        stats = self._stats(prompt_ids, generated, timings, before, fast)
        if fast and spec is not None:
            from .speculative.config import SpecStats
            stats.update(SpecStats("off").as_dict())
        if speculation is not None:
            stats.update(speculation.stats.as_dict())
            if speculation.reason:
                stats["speculate_reason"] = speculation.reason
        holder["result"] = GenerationResult(text=text, token_ids=generated, prompt_tokens=len(prompt_ids),
                                            finish_reason=finish, stats=stats, choices=choices)

    def _stats(self, prompt_ids: list[int], generated: list[int], t: LoopTimings,
               before: dict | None = None, fast: bool = False) -> dict[str, Any]:
        first = t.first_token_s or t.end_s
        decode_s = max(t.end_s - first, 1e-9)
        stats = {
            "prompt_tokens": len(prompt_ids),
            "generated_tokens": len(generated),
            "ttft_s": round(first - t.start_s, 6),
            "prefill_tokens_per_s": round(len(prompt_ids) / max(first - t.start_s, 1e-9), 3),
            "decode_tokens_per_s": round(t.decode_steps / decode_s, 3) if t.decode_steps else 0.0,
            "total_s": round(t.end_s - t.start_s, 6),
            "bytes_moved_per_token": 0,
            "weight_bytes_per_token": (self._cached_facts["weight_bytes_per_token"] if fast
                                       else self.weight_bytes_per_token),
            "threads": self._stat_threads(),
            "decode_path": self.decode_path,
        }
        if fast:
            now = self._native_counters()
            stats.update(self._native_run_stats({k: now[k] - before[k] for k in now}))
            return stats
        if before is not None:
            now = self.executor.counters_snapshot()
            delta = {k: now[k] - before[k] for k in now}
            decode_steps = max(t.decode_steps, 0)
            stats.update(self.executor.run_stats(delta, steps=len(prompt_ids) + decode_steps,
                                                 forward_steps=1 + decode_steps, elapsed_s=t.end_s - t.start_s))
        if self.plan_info is not None:
            stats["plan"] = str(self.plan_info.plan_dir)
        if self.layer_offload_gpu_layers is not None:
            stats["layer_offload_gpu_layers"] = self.layer_offload_gpu_layers
        return stats

    @property
    def weight_bytes_per_token(self) -> int:
        """Weight bytes read per decoded token (attention + FFN, a MoE layer's top-k experts + output head)."""
        from .experts.block_experts import unread_expert_bytes
        layers = self.model.layers  # float parameters + packed (parameter-free) projections
        attn = sum(p.numel() * p.element_size() for p in layers.parameters())
        attn += sum(m.nbytes for m in layers.modules() if hasattr(m, "nbytes"))
        head_bytes = self.executor.head_nbytes or self.model.lm_head.weight.nbytes
        return attn + self.executor.ffn_nbytes - unread_expert_bytes(self.executor, self.config) + head_bytes
