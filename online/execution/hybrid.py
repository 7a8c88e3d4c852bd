"""HybridExecutor: plan-driven FFN execution split between the GPU tier and sparse CPU kernels.

Per dense FFN layer the plan names hot neurons; their gate/up rows and down columns are copied,
compacted, onto the GPU tier (charged against its byte budget) and computed there densely. The
remaining (cold) neurons stay on the CPU in a packed format and are computed sparsely:
- ReLU-family layers: exact zeros are skipped (|h| > 0),
- layers with a useful predictor: only the predicted-active gate/up rows are computed,
- other (SwiGLU) layers: gate and up in full, then only the down rows whose |h| passes the
  profile's threshold (the exact path).
The two partial outputs are added. MoE layers run through an attached ``online.experts.ExpertRuntime``
(expert cache on the GPU tier, prefetch, CPU compute of misses), else their GGUF blocks or float experts.

Example::

    executor = HybridExecutor.build(cfg, ffn_layers, tier, settings, gpu_neurons=[...], thresholds=[...])
    y = executor.forward(layer, x)
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.core.config import ModelConfig
from tandem.core.errors import TandemError
from ..kernels.ffn import QuantizedFFN, QuantizedLinear
from tandem.core.ffn.activations import activate, gated_hidden
from tandem.core.ffn.dense import moe_forward
from ..engine_args import DOWN_FORMATS, WEIGHT_FORMATS
from .gpu_tier import GpuTier
from tandem.core.tier_format import TIER_FORMATS
from .tier_matrix import TierMatrix
from .tier_units import tier_ffn_kernel
from .quantized_linear import EXACT_GGUF_TYPES, dense_down_wanted, predicted_active_share
from tandem.core.ffn.weights import FFNWeights, MoELayerWeights

PREDICTOR_MAX_TOKENS = 4  # longer batches (prefill) activate nearly every neuron: exact path there


@dataclass(frozen=True)
class ExecutionSettings:
    """How the online stage executes. ``sparse=False`` computes every neuron (exact)."""
    weight_format: str = "int8"
    # The down projection transposed (rows = neurons, the sparse axpy form) is re-quantized: GGUF blocks run along
    # the other axis. SmolLM2, 512 held-out tokens, agreement with dense: fp32 1.000, int8b 0.957, per-row int8
    # 0.879; fp16 holds the Q4 values to 2^-11 (as fp32 within noise) at half fp32's bytes.
    down_format: str = "fp16"
    sparse: bool = True
    threads: int = 2
    gpu_device: str | None = None  # None: CUDA when present, else the CPU
    tier_format: str = "fp32"  # how hot rows are stored on the GPU tier (a plan sets its own: fp16/q8/q4)
    tier_formats: tuple[tuple[str, str], ...] = ()  # per tensor role (a plan's ``tensor_formats``); others: tier_format

    def __post_init__(self) -> None:
        if self.weight_format not in WEIGHT_FORMATS:
            raise TandemError(f"unknown weight format {self.weight_format!r} (choose from {', '.join(WEIGHT_FORMATS)})")
        if self.down_format not in DOWN_FORMATS:
            raise TandemError(f"unknown down-projection format {self.down_format!r} (choose from {', '.join(DOWN_FORMATS)})")
        if self.threads < 1:
            raise TandemError(f"threads must be >= 1, got {self.threads}")
        if self.tier_format not in TIER_FORMATS:
            raise TandemError(f"unknown GPU-tier format {self.tier_format!r} (choose from {', '.join(TIER_FORMATS)})")
        if any(fmt not in TIER_FORMATS for _, fmt in self.tier_formats):  # keys: placement.settings checks them
            raise TandemError(f"unknown GPU-tier format in {dict(self.tier_formats)} (choose from {', '.join(TIER_FORMATS)})")

    def tier_format_of(self, role: str, layer: int | None = None) -> str:
        """The tier format of a tensor role (``ffn_up``, ``attn_q``, ``output``, ...; see placement.settings),
        in ``layer`` (a plan may give single layers their own)."""
        from tandem.core.tier_format import format_lookup
        return format_lookup(self.tier_formats, role, layer, self.tier_format)


@dataclass
class GpuPart:
    """The hot rows of one FFN layer, compacted on the tier in the tier format (no down bias: added once)."""
    neurons: torch.Tensor  # [n_hot] int64 (CPU), original neuron ids
    index: torch.Tensor  # [n_hot] int64 on the tier: compact row -> neuron id (the map the plan budgets)
    up: TierMatrix  # [n_hot, d]
    down_t: TierMatrix  # [n_hot, d]: down columns as rows, blocks along d
    gate: TierMatrix | None = None  # [n_hot, d]
    up_bias: torch.Tensor | None = None  # [n_hot] float32 on the tier
    gate_bias: torch.Tensor | None = None  # [n_hot]
    kernel_ffn: object = None  # CPU tier: online.kernels QuantizedFFN over the same codes (tier_ffn_kernel)

    @property
    def nbytes(self) -> int:
        vecs = (self.index, self.up_bias, self.gate_bias)
        return (sum(m.nbytes for m in (self.up, self.down_t, self.gate) if m is not None)
                + sum(t.numel() * t.element_size() for t in vecs if t is not None))


@dataclass
class LayerSplit:
    gpu: GpuPart | None
    cpu: QuantizedFFN | None
    cpu_neurons: torch.Tensor  # [n_cold] int64
    threshold: float  # |h| threshold for the CPU exact path (0: skip exact zeros only)
    down_bias: torch.Tensor | None = None  # [d], added once
    predictor: object | None = None  # callable x [T, d] -> neuron ids predicted active
    cold_local: torch.Tensor | None = None  # [n_ff] int64: neuron id -> index in the CPU part, -1 if hot


@dataclass
class ExecutionCounters:
    ffn_neurons_total: int = 0
    ffn_neurons_active: int = 0
    bytes_moved: int = 0
    predictor_s: float = 0.0
    ffn_s: float = 0.0

    def snapshot(self) -> dict:
        return dict(self.__dict__)


class HybridExecutor:
    """Packed, split FFN execution (the executor contract, tandem.core.ffn.contract.Executor). Dense layers are
    ``splits``; MoE layers run through an attached ExpertRuntime, else ``block_moe`` (experts in a GGUF file's
    blocks, online/experts/block_experts.py) or float from ``float_moe``."""

    packed = True

    def __init__(self, cfg: ModelConfig, float_moe: dict[int, MoELayerWeights], splits: list[LayerSplit | None],
                 tier: GpuTier, settings: ExecutionSettings, head: QuantizedLinear | None) -> None:
        self.cfg, self.splits, self.tier, self.settings, self.head = cfg, splits, tier, settings, head
        self.float_moe = float_moe  # layer -> float MoE weights (until an ExpertRuntime takes them)
        self.counters = ExecutionCounters()
        self.experts = None  # online.experts.ExpertRuntime for MoE layers (attach_experts)
        self.block_moe: dict = {}  # layer -> BlockExperts (float_moe's experts as the file's blocks)
        self.tier_head = None  # TierMatrix: the output layer on the GPU tier (tier_units.place_plan_units)
        # layer -> (hot FFN output, tier predictor's mask), fetched in the layer's tier-attention exchange
        self.pending_hot: dict[int, tuple] = {}

    def attach_experts(self, runtime) -> None:
        """Run MoE layers through ``runtime``; it holds the (packed) experts, so the float ones go."""
        self.experts = runtime
        for i in runtime.moe:
            self.float_moe.pop(i, None)
            self.block_moe.pop(i, None)

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: ModelConfig, ffn_layers: list, tier: GpuTier, settings: ExecutionSettings,
              gpu_neurons: list[torch.Tensor | None] | None = None, thresholds: list[float] | None = None,
              predictors: list | None = None, head_weight: torch.Tensor | None = None,
              raw: dict | None = None, pack_experts: bool = True) -> "HybridExecutor":
        """Split every dense FFN layer; float FFN weights are released once packed. ``pack_experts``: MoE layers
        get their experts packed (block_moe), unless an ExpertRuntime will take them (False)."""
        splits: list[LayerSplit | None] = []
        float_moe = {i: w for i, w in enumerate(ffn_layers) if isinstance(w, MoELayerWeights)}
        for i, w in enumerate(ffn_layers):
            if isinstance(w, MoELayerWeights):
                splits.append(None)
                continue
            hot = gpu_neurons[i] if gpu_neurons is not None and gpu_neurons[i] is not None else torch.zeros(0, dtype=torch.long)
            threshold = float(thresholds[i]) if thresholds is not None and settings.sparse else -1.0
            if threshold < 0 and settings.sparse and cfg.ffn_is_relu_sparse:
                threshold = 0.0
            predictor = predictors[i] if predictors is not None and settings.sparse else None
            splits.append(_split_layer(cfg, i, w, hot, threshold, predictor, tier, settings, raw or {}))
        head = None
        if head_weight is not None:
            head = _pack_head(head_weight, settings, (raw or {}).get("lm_head.weight")
                              or ((raw or {}).get("model.embed_tokens.weight") if cfg.tie_word_embeddings else None))
        from ..experts.block_experts import block_moe_layers
        executor = cls(cfg, float_moe, splits, tier, settings, head)
        executor.block_moe = block_moe_layers(cfg, float_moe, raw, settings) if pack_experts else {}
        return executor

    # --- execution ---------------------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        split = self.splits[layer]
        if split is None:  # a MoE layer: its selected experts are computed densely, all their neurons count active
            cfg = self.cfg
            n = x.shape[0] * (cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size)
            self.counters.ffn_neurons_total += n
            self.counters.ffn_neurons_active += n
            if self.experts is not None:
                return self.experts.forward(layer, x)
            blocks = self.block_moe.get(layer)
            return blocks.forward(x) if blocks is not None else moe_forward(self.cfg, self.float_moe[layer], x)
        start = time.perf_counter()
        n_tokens = x.shape[0]
        y = handle = None
        pending = self.pending_hot.pop(layer, None)  # computed in the layer's tier-attention exchange
        if pending is not None and pending[0] is not None and pending[0].shape != x.shape:
            raise TandemError(f"internal error: layer {layer}'s hot FFN output does not match its input")
        if pending is None and self.has_tier_ffn(layer, n_tokens):  # launched first: on CUDA it runs while the CPU computes
            handle = self.tier.fetch_async(self.tier_outputs(layer, self.tier.send(x)))
            if self._tier_mask_wanted(split, n_tokens):  # the CPU part needs the predicted rows first
                pending, handle = self.unpack_tier_outputs(layer, self.tier.wait(handle), n_tokens), None
        y_gpu, mask = pending if pending is not None else (None, None)
        if split.cpu is not None:
            y = self._cpu_forward(split, x, mask)
        if handle is not None:
            y_gpu, _ = self.unpack_tier_outputs(layer, self.tier.wait(handle), n_tokens)  # the layer's one exchange
        if y_gpu is not None:
            y = y_gpu if y is None else y + y_gpu
        if split.down_bias is not None:
            y = y + split.down_bias
        self.counters.ffn_neurons_total += n_tokens * self._n_neurons(split)
        self.counters.ffn_s += time.perf_counter() - start
        return y

    def _n_neurons(self, split: LayerSplit) -> int:
        return split.cpu_neurons.numel() + (split.gpu.neurons.numel() if split.gpu is not None else 0)

    def _gpu_forward(self, part: GpuPart, x: torch.Tensor) -> torch.Tensor:
        return self.hot_on_tier(part, self.tier.send(x))

    # --- what a layer's FFN computes on the tier, fetched as one buffer ------------------------
    def has_tier_ffn(self, layer: int, n_tokens: int) -> bool:
        """Whether the layer's FFN computes anything on the tier for ``n_tokens`` tokens."""
        split = self.splits[layer] if layer < len(self.splits) else None
        return split is not None and (split.gpu is not None or self._tier_mask_wanted(split, n_tokens))

    @staticmethod
    def _tier_mask_wanted(split: LayerSplit, n_tokens: int) -> bool:
        return _tier_predictor(split) is not None and split.cpu is not None and n_tokens <= PREDICTOR_MAX_TOKENS

    def tier_outputs(self, layer: int, x_tier: torch.Tensor) -> torch.Tensor:
        """From the FFN input on the tier: the hot rows' output ``[T * d]`` then the tier predictor's mask
        ``[n_ff]`` (as 0/1 floats; decode only), concatenated: one buffer to fetch."""
        split, parts = self.splits[layer], []
        if split.gpu is not None:
            parts.append(self.hot_on_tier(split.gpu, x_tier).reshape(-1))
        if self._tier_mask_wanted(split, x_tier.shape[0]):
            parts.append(split.predictor.mask_on_tier(x_tier).to(x_tier.dtype))
        return torch.cat(parts) if len(parts) > 1 else parts[0]

    def unpack_tier_outputs(self, layer: int, flat: torch.Tensor, n_tokens: int) -> tuple:
        """(hot output ``[T, d]`` or None, predicted-active mask ``[n_ff]`` bool or None) from ``tier_outputs``."""
        split, d = self.splits[layer], self.cfg.hidden_size
        y = flat[:n_tokens * d].reshape(n_tokens, d) if split.gpu is not None else None
        rest = flat[n_tokens * d:] if split.gpu is not None else flat
        return y, (rest > 0.5 if rest.numel() else None)

    def hot_on_tier(self, part: GpuPart, x_tier: torch.Tensor) -> torch.Tensor:
        """The hot rows on input already on the tier: ``[T, d]`` there (no exchange)."""
        cfg, x = self.cfg, x_tier
        if part.kernel_ffn is not None and x_tier.dtype == torch.float32:  # CPU tier: the CPU kernels, same codes
            self.counters.ffn_neurons_active += x.shape[0] * part.neurons.numel()
            return part.kernel_ffn.forward_dense(x_tier.contiguous())
        up = part.up.linear(x_tier, part.up_bias)  # [T, n_hot]
        if part.gate is None:
            h = activate(cfg.hidden_act, up, cfg.act_threshold)
        else:
            h = gated_hidden(cfg.hidden_act, part.gate.linear(x_tier, part.gate_bias), up, cfg.act_threshold)
        y = h @ part.down_t.dequantize()  # [T, n_hot] @ [n_hot, d] -> [T, d]
        self.counters.ffn_neurons_active += h.shape[0] * h.shape[1]
        if self.tier.is_cuda:
            self.counters.bytes_moved += x.numel() * x.element_size() + y.numel() * y.element_size()
        return y  # [T, d] on the tier

    def _cpu_forward(self, split: LayerSplit, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        if split.predictor is not None and x.shape[0] <= PREDICTOR_MAX_TOKENS:
            t0 = time.perf_counter()
            # [n] int64 neuron ids predicted active (a tier predictor's came with the layer's exchange)
            active_global = mask.nonzero().flatten() if mask is not None else split.predictor(x)
            local = split.cold_local[active_global]
            local = local[local >= 0].numpy()  # [n_cold_active] indices into the CPU part
            self.counters.predictor_s += time.perf_counter() - t0
            y, active = split.cpu.forward_numpy(x.detach().float().contiguous().numpy(),
                                                max(split.threshold, -1.0), local)
            self.counters.ffn_neurons_active += int(active) if split.threshold >= 0 else x.shape[0] * local.size
            return torch.from_numpy(y)
        if split.threshold < 0:  # sparsity off
            self.counters.ffn_neurons_active += x.shape[0] * split.cpu.n_neurons
            return split.cpu.forward_dense(x)
        y, active = split.cpu.forward_sparse(x, split.threshold)
        self.counters.ffn_neurons_active += active
        return y

    def output_logits(self, x: torch.Tensor, lm_head_weight: torch.Tensor) -> torch.Tensor:
        if self.tier_head is not None:
            return self.tier.fetch(self.tier_head.linear(self.tier.send(x)))  # [T, vocab]
        if self.head is None:
            return F.linear(x, lm_head_weight)
        return self.head.forward(x)

    @property
    def ffn_nbytes(self) -> int:
        total = self.experts.nbytes if self.experts is not None else 0
        for i, split in enumerate(self.splits):
            if split is None and self.experts is not None:
                continue
            if split is None:
                total += (self.block_moe.get(i) or self.float_moe[i]).nbytes
                continue
            if split.cpu is not None:
                total += split.cpu.nbytes
            if split.gpu is not None:
                total += split.gpu.nbytes
        return total

    @property
    def head_nbytes(self) -> int | None:
        if self.tier_head is not None:
            return self.tier_head.nbytes
        return None if self.head is None else self.head.nbytes

    def counters_snapshot(self) -> dict:
        """Cumulative counters; the tier's prefixed ``tier.``, the expert cache's ``experts.``."""
        snapshot = self.counters.snapshot()
        snapshot.update({f"tier.{k}": v for k, v in self.tier.link_counters().items()})
        if self.experts is not None:
            snapshot.update({f"experts.{k}": v for k, v in self.experts.counters().items()})
        return snapshot

    def run_stats(self, delta: dict, steps: int, forward_steps: int, elapsed_s: float) -> dict:
        """ffn_sparsity, bytes moved per token, predictor time share, weight format, tier exchanges per
        forward step and the expert cache's figures, from the counters' change over one generation."""
        stats = {"ffn_sparsity": round(1.0 - delta["ffn_neurons_active"] / max(delta["ffn_neurons_total"], 1), 4)}
        bytes_moved = delta["bytes_moved"]
        if self.experts is not None:
            expert_stats = self.experts.stats({k[8:]: v for k, v in delta.items() if k.startswith("experts.")}, steps)
            bytes_moved += expert_stats.pop("expert_bytes_moved")
            stats.update(expert_stats)
        stats["bytes_moved_per_token"] = int(bytes_moved / max(steps, 1))
        stats["predictor_time_share"] = round(delta["predictor_s"] / max(elapsed_s, 1e-9), 4)
        stats["weight_format"] = self.settings.weight_format
        if "tier.tier_syncs" in delta:
            stats["tier_calls_per_token"] = round(delta["tier.tier_calls"] / forward_steps, 3)
            stats["tier_syncs_per_token"] = round(delta["tier.tier_syncs"] / forward_steps, 3)
            stats["link_bytes_per_token"] = int(delta["tier.link_bytes"] / forward_steps)
            stats["gpu_launches_per_token"] = round(delta.get("tier.launches", 0) / forward_steps, 1)
            stats["graph_replays_per_token"] = round(delta.get("tier.graph_replays", 0) / forward_steps, 2)
        return stats


def _split_layer(cfg: ModelConfig, layer: int, w: FFNWeights, hot: torch.Tensor, threshold: float,
                 predictor, tier: GpuTier, settings: ExecutionSettings, raw: dict) -> LayerSplit:
    n_ff = w.n_neurons
    hot = hot.to(torch.long).sort().values
    cold_mask = torch.ones(n_ff, dtype=torch.bool)
    cold_mask[hot] = False
    cold = torch.nonzero(cold_mask).flatten()
    gpu = None
    if hot.numel():
        prefix = f"layers.{layer}"

        def fmt(role: str) -> str:
            return settings.tier_format_of(role, layer)

        def put(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else tier.allocate(f"{prefix}.{name}", t.float().contiguous())

        def rows(name: str, role: str, float_rows: torch.Tensor) -> TierMatrix:  # GGUF rows as they are, if any
            blocks = raw.get(f"model.layers.{layer}.mlp.{name}_proj.weight")
            if blocks is not None:
                return TierMatrix.from_raw(blocks, fmt(role), tier, f"{prefix}.hot_{name}", rows=hot)
            return TierMatrix.pack(float_rows[hot], fmt(role), tier, f"{prefix}.hot_{name}")
        gpu = GpuPart(
            neurons=hot, index=tier.allocate(f"{prefix}.hot_index", hot.clone()),
            up=rows("up", "ffn_up", w.up),
            down_t=TierMatrix.pack(w.down[:, hot].t(), fmt("ffn_down"), tier, f"{prefix}.hot_down"),  # blocks along d
            gate=None if w.gate is None else rows("gate", "ffn_gate", w.gate),
            up_bias=put("hot_up_bias", None if w.up_bias is None else w.up_bias[hot]),
            gate_bias=put("hot_gate_bias", None if w.gate_bias is None else w.gate_bias[hot]))
        gpu.kernel_ffn = tier_ffn_kernel(cfg, gpu, tier)
    cpu = None
    if cold.numel():
        kw = dict(act=cfg.hidden_act, act_threshold=cfg.act_threshold, threads=settings.threads)
        prefix = f"model.layers.{layer}.mlp"
        up_raw, gate_raw, down_raw = (raw.get(f"{prefix}.{n}_proj.weight") for n in ("up", "gate", "down"))
        all_cold = cold.numel() == n_ff
        exact = EXACT_GGUF_TYPES.get(settings.weight_format, ())  # int4 / int8: the GGUF kinds kept as they are
        if (all_cold and settings.weight_format in ("int4", "int8") and up_raw is not None and down_raw is not None
                and up_raw.qtype in exact and w.up_bias is None and w.gate_bias is None
                and (gate_raw is None or gate_raw.qtype in exact)):
            cpu = QuantizedFFN.from_gguf(up_raw, down_raw, gate_raw, down_fmt=settings.down_format,
                                         dense_down=dense_down_wanted(cfg.hidden_act, down_raw, settings.down_format,
                                                                      predicted_active_share(predictor)), **kw)
        else:
            cpu = QuantizedFFN.from_float(
                up=w.up[cold], down=w.down[:, cold], gate=None if w.gate is None else w.gate[cold],
                fmt=settings.weight_format, down_fmt=None if settings.weight_format == "fp32" else settings.down_format,
                up_bias=None if w.up_bias is None else w.up_bias[cold].numpy(),
                gate_bias=None if w.gate_bias is None else w.gate_bias[cold].numpy(), **kw)
    if cpu is not None and getattr(cpu, "down", None) is not None and predictor is None:
        threshold = -1.0  # a dense down reads every row anyway: every neuron then costs no bytes and no quality
    cold_local = torch.full((n_ff,), -1, dtype=torch.long)
    cold_local[cold] = torch.arange(cold.numel())
    return LayerSplit(gpu=gpu, cpu=cpu, cpu_neurons=cold, threshold=threshold,
                      down_bias=w.down_bias, predictor=predictor if cpu is not None else None, cold_local=cold_local)


def _tier_predictor(split: LayerSplit):
    """The split's predictor when it runs on the tier (``tier_units.TierPredictor``), else None."""
    return split.predictor if getattr(split.predictor, "on_tier", False) else None


def _pack_head(weight: torch.Tensor, settings: ExecutionSettings, raw_blocks) -> QuantizedLinear:
    """The output layer, packed: its GGUF blocks as they are wherever the kernels read that kind, for int8 and int4
    (a Q4_0 head quantized again cost up to 1.2 in a logit); other kinds are quantized in ``weight_format``."""
    readable = {qtype for kinds in EXACT_GGUF_TYPES.values() for qtype in kinds}
    if raw_blocks is not None and settings.weight_format != "fp32" and raw_blocks.qtype in readable:
        return QuantizedLinear.from_gguf(raw_blocks, threads=settings.threads)
    return QuantizedLinear.from_float(weight, fmt=settings.weight_format, threads=settings.threads)
