"""llama.cpp's layer offload (``-ngl``) on Tandem's own kernels: whole layers on the GPU tier in order
until the budget is spent, the rest on the CPU, decoded by one C call (decode.c ``tdm_decode_range``).

A tier layer holds its attention (q/k/v/o in the tier format + its KV cache, ``tier_units.TierAttention``)
and its whole FFN (every neuron "hot"). A decode token = the tier layers (torch) + one C call for the
CPU layers and the output layer. Prefill runs through the modules.

Example::

    n = gpu_layer_count(cfg, budget_bytes=64 << 20, tier_format="q4", kv_dtype=torch.float16, kv_capacity_tokens=2048)
    engine = Engine.load("smollm2", layer_offload=True, gpu_budget_bytes=64 << 20, gpu_device="cpu")
    engine.layer_offload_gpu_layers
"""
from __future__ import annotations

import ctypes

import torch

from tandem.core.kv_cache import KVCache
from .fused_decode import FusedDecodeStep, FusedDecodeUnavailable, _check_model
from tandem.core.tier_format import BLOCK, TIER_FORMATS
from .tier_units import place_plan_units


def _matrix_bytes(rows: int, cols: int, fmt: str) -> int:
    cols_padded = cols if fmt in ("fp32", "fp16") else -(-cols // BLOCK) * BLOCK
    return int(rows * cols_padded * TIER_FORMATS[fmt])


def layer_tier_bytes(cfg, tier_format: str, kv_dtype: torch.dtype, kv_capacity_tokens: int) -> int:
    """Tier bytes of one whole dense layer: attention + KV cache + every FFN neuron (as the tier stores them)."""
    return _attention_bytes(cfg, tier_format, kv_dtype, kv_capacity_tokens) + _ffn_bytes(cfg, tier_format)


def _attention_bytes(cfg, tier_format: str, kv_dtype: torch.dtype, kv_capacity_tokens: int) -> int:
    """A layer's attention on the tier: q/k/v/o, their fp32 biases, the KV cache."""
    d, q_dim, kv_dim = cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    attention = _matrix_bytes(q_dim + 2 * kv_dim, d, tier_format) + _matrix_bytes(d, q_dim, tier_format)
    attention += 4 * ((q_dim + 2 * kv_dim) if cfg.attention_bias else 0) + 4 * (d if cfg.attention_out_bias else 0)
    return attention + 2 * kv_dim * kv_capacity_tokens * torch.empty(0, dtype=kv_dtype).element_size()


def _ffn_bytes(cfg, tier_format: str) -> int:
    """A layer's FFN with every neuron hot on the tier: its matrices, the neuron index, the biases."""
    n_ff, mats = cfg.intermediate_size, 3 if cfg.mlp_gated else 2
    return mats * _matrix_bytes(n_ff, cfg.hidden_size, tier_format) + 8 * n_ff + (4 * n_ff * (mats - 1) if cfg.mlp_bias else 0)


def gpu_layer_count(cfg, budget_bytes: int, tier_format: str, kv_dtype: torch.dtype, kv_capacity_tokens: int) -> int:
    """How many leading layers fit in ``budget_bytes`` (llama.cpp's -ngl for that budget)."""
    per_layer = layer_tier_bytes(cfg, tier_format, kv_dtype, kv_capacity_tokens)
    return min(cfg.num_layers, budget_bytes // per_layer) if per_layer > 0 else cfg.num_layers


def head_tier_format(cfg, tier_format: str, raw: dict | None) -> str:
    """The output layer's tier format: its GGUF Q8_0 blocks as they are (llama.cpp keeps them), else the layers'."""
    raw = raw or {}
    blocks = raw.get("model.embed_tokens.weight") if cfg.tie_word_embeddings else raw.get("lm_head.weight")
    return "q8" if getattr(blocks, "qtype", None) == "Q8_0" else tier_format


def offload_layers(model, executor, tier, n_gpu_layers: int, tier_format: str, kv_dtype: torch.dtype,
                   kv_capacity_tokens: int, raw: dict | None = None) -> None:
    """Attention of the first ``n_gpu_layers`` on the tier (their FFNs went there with all neurons hot); the
    output layer too when every layer is there and it fits (llama.cpp's -ngl past the last layer)."""
    cfg = model.cfg
    attention = [i < n_gpu_layers for i in range(cfg.num_layers)]
    head_format = head_tier_format(cfg, tier_format, raw)
    head_bytes = _matrix_bytes(cfg.vocab_size, cfg.hidden_size, head_format)
    head = n_gpu_layers == cfg.num_layers and cfg.num_layers > 0 and tier.free_bytes - _attention_bytes(
        cfg, tier_format, kv_dtype, kv_capacity_tokens) * n_gpu_layers >= head_bytes
    formats = (lambda role, layer=None: head_format if role == "output" else tier_format)
    place_plan_units(model, executor, tier, attention_on_gpu=attention, output_head_on_gpu=head,
                     embeddings_on_gpu=False, tier_format=formats, kv_dtype=kv_dtype,
                     kv_capacity_tokens=kv_capacity_tokens, raw=raw)


class LayerOffloadStep(FusedDecodeStep):
    """Decode step: layers ``[0, n_gpu)`` through the tier modules, ``[n_gpu, L)`` + head in one C call."""

    @classmethod
    def build_offload(cls, model, executor, n_gpu_layers: int) -> "LayerOffloadStep":
        from ..kernels.native import NativeUnavailable, load_native
        from ..kernels.native.structs import TdmLayer
        cpu_layers = range(n_gpu_layers, model.cfg.num_layers)
        if not cpu_layers:
            raise FusedDecodeUnavailable("no fused decode: every layer is on the GPU tier")
        _check_model_range(model, executor, n_gpu_layers)
        try:
            native = load_native()
        except NativeUnavailable as exc:
            raise FusedDecodeUnavailable(str(exc)) from None
        layers, keep = cls._describe_layers(_LayerView(model, n_gpu_layers), _SplitView(executor, n_gpu_layers), native)
        layers = [TdmLayer() for _ in range(n_gpu_layers)] + layers  # tier layers: never run by C
        step = cls(model, executor, native, layers, keep)
        step.n_gpu_layers = n_gpu_layers
        step.gpu_layers = None
        if executor.tier.is_cuda and n_gpu_layers:
            step.use_gpu_program()
        return step

    def use_gpu_program(self, capture: bool = True, backend: str | None = None) -> str:
        """Run the tier layers as one program (online/gpu: a CUDA graph on CUDA) instead of the modules;
        returns "" or why it does not apply."""
        from ..gpu.graph_step import GpuLayers
        from ..gpu.stack import GpuStepUnavailable
        try:
            self.gpu_layers = GpuLayers(self.model, self.executor, 0, self.n_gpu_layers, head=False,
                                        capture=capture, backend=backend)
        except GpuStepUnavailable as exc:
            return str(exc)
        return ""

    def _describe_model(self):
        ex = self.executor
        first_cpu = next(s for s in ex.splits if s is not None and s.gpu is None)
        splits0 = ex.splits[0]
        ex.splits[0] = first_cpu  # the descriptor reads n_ff from layer 0's CPU part
        try:
            return super()._describe_model()
        finally:
            ex.splits[0] = splits0

    def __call__(self, token_id: int, pos: int, cache: KVCache) -> torch.Tensor:
        model, k = self.model, self.n_gpu_layers
        if self._bound_cache is None or self._bound_cache() is not cache:
            self._bind(cache)
        if self.gpu_layers is not None:  # the tier layers as one program: the residual comes back once
            self.gpu_layers.run(token_id, pos, cache)
            res = self.gpu_layers.ctx.x_host.clone()  # [d]
        else:
            x = model.embed(torch.tensor([token_id]), pos)  # [1, d]
            x = model.forward_layers(x, pos, cache, self.executor, 0, k)
            res = x[0].contiguous().clone()  # [d] float32, updated in place by C
        logits = torch.empty(self._desc.vocab, dtype=torch.float32)
        active = self.native.lib.tdm_decode_range(ctypes.byref(self._desc), k, self.cfg.num_layers, pos,
                                                  res.data_ptr(), logits.data_ptr())
        counters = self.executor.counters
        counters.ffn_neurons_total += (self.cfg.num_layers - k) * self._desc.n_ff
        counters.ffn_neurons_active += int(active)
        return logits


class _LayerView:
    """The model as ``_describe_layers`` sees it: only the CPU layers."""
    def __init__(self, model, first: int) -> None:
        self.layers, self.cfg = list(model.layers)[first:], model.cfg
        self.rope_local_cos, self.rope_local_sin = model.rope_local_cos, model.rope_local_sin


class _SplitView:
    def __init__(self, executor, first: int) -> None:
        self.splits = executor.splits[first:]
        self.settings = executor.settings


def _check_model_range(model, executor, n_gpu_layers: int) -> None:
    """The fused step's checks, on the CPU layers only."""
    cpu_blocks = list(model.layers)[n_gpu_layers:]

    class _M:
        cfg, embed_tokens = model.cfg, model.embed_tokens
        layers = cpu_blocks
        rope_local_cos = model.rope_local_cos

    class _E:
        packed = executor.packed
        splits = executor.splits[n_gpu_layers:]
        head = executor.head
    _check_model(_M, _E)


TIER_FORMAT_OF = {"fp32": "fp32", "int8": "q8", "int4": "q4_1"}  # int4 on the CPU is Q4_1-style too


def build_layer_offload(model, ffn_layers: list, settings, budget_bytes: int, kv_capacity_tokens: int, raw: dict):
    """The executor for ``--layer-offload``: (HybridExecutor, n_gpu_layers). Dense (every neuron computed)."""
    from tandem.core.errors import TandemError
    from .gpu_tier import GpuTier
    from .hybrid import HybridExecutor
    cfg = model.cfg
    if cfg.is_moe:
        raise TandemError("--layer-offload supports dense models only (MoE models: use a plan or --expert-slots)")
    tier_format, kv_dtype = TIER_FORMAT_OF[settings.weight_format], torch.float16
    n_gpu = gpu_layer_count(cfg, budget_bytes, tier_format, kv_dtype, kv_capacity_tokens)
    tier = GpuTier.create(budget_bytes, settings.gpu_device, threads=settings.threads)
    from dataclasses import replace
    settings = replace(settings, tier_format=tier_format, sparse=False)
    hot = [torch.arange(cfg.intermediate_size) if i < n_gpu else None for i in range(cfg.num_layers)]
    executor = HybridExecutor.build(cfg, ffn_layers, tier, settings, gpu_neurons=hot,
                                    head_weight=model.lm_head.weight, raw=raw)
    offload_layers(model, executor, tier, n_gpu, tier_format, kv_dtype, kv_capacity_tokens, raw)
    return executor, n_gpu
