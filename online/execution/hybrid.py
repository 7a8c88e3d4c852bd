"""HybridExecutor: plan-driven FFN execution split between the GPU tier and sparse CPU kernels.

Per dense FFN layer the plan names hot neurons; their gate/up rows and down columns are copied,
compacted, onto the GPU tier (charged against its byte budget) and computed there densely. The
remaining (cold) neurons stay on the CPU in a packed format and are computed sparsely:
- ReLU-family layers: exact zeros are skipped (|h| > 0),
- layers with a useful predictor: only the predicted-active gate/up rows are computed,
- other (SwiGLU) layers: gate and up in full, then only the down rows whose |h| passes the
  profile's threshold (the exact path).
The two partial outputs are added. MoE layers run through an attached ``online.experts.ExpertRuntime``
(expert cache on the GPU tier, prefetch, CPU compute of misses), else the dense expert path.

Example::

    executor = HybridExecutor.build(cfg, ffn_layers, tier, settings, gpu_neurons=[...], thresholds=[...])
    y = executor.forward(layer, x)
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..config import ModelConfig
from ..kernels.ffn import QuantizedFFN, QuantizedLinear
from .activations import activate, gated_hidden
from .dense import DenseExecutor
from .gpu_tier import GpuTier
from .tier_format import TIER_FORMATS, TierMatrix
from .quantized_linear import EXACT_GGUF_TYPES
from .weights import FFNWeights, MoELayerWeights

WEIGHT_FORMATS = ("fp32", "int8", "int4")
DOWN_FORMATS = ("fp32", "fp16", "int8b", "int8", "int4")  # int8b / int4: Q8_0 / Q4_1 rows (f16 scales)
PREDICTOR_MAX_TOKENS = 4  # longer batches (prefill) activate nearly every neuron: exact path there


@dataclass(frozen=True)
class ExecutionSettings:
    """How the online stage executes. ``sparse=False`` computes every neuron (exact)."""
    weight_format: str = "int8"
    # The down projection is kept transposed (rows = neurons) for the sparse axpy form. GGUF blocks
    # run along the other axis, so packing it means re-quantizing. Measured on SmolLM2 (512 held-out
    # tokens, next-token agreement with dense): fp32 1.000, int8b (per-32 scales) 0.957, per-row
    # int8 0.879. fp16 holds the GGUF Q4 values to 2^-11 relative (agreement as fp32 to within
    # noise) at half fp32's bytes: the largest stream of the sparse decode step.
    down_format: str = "fp16"
    sparse: bool = True
    threads: int = 2
    gpu_device: str | None = None  # None: CUDA when present, else the CPU
    tier_format: str = "fp32"  # how hot rows are stored on the GPU tier (a plan sets its own: fp16/q8/q4)

    def __post_init__(self) -> None:
        from tandem.errors import TandemError
        if self.weight_format not in WEIGHT_FORMATS:
            raise TandemError(f"unknown weight format {self.weight_format!r} (choose from {', '.join(WEIGHT_FORMATS)})")
        if self.down_format not in DOWN_FORMATS:
            raise TandemError(f"unknown down-projection format {self.down_format!r} (choose from {', '.join(DOWN_FORMATS)})")
        if self.threads < 1:
            raise TandemError(f"threads must be >= 1, got {self.threads}")
        if self.tier_format not in TIER_FORMATS:
            raise TandemError(f"unknown GPU-tier format {self.tier_format!r} (choose from {', '.join(TIER_FORMATS)})")


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

    @property
    def nbytes(self) -> int:
        mats = (self.up, self.down_t, self.gate)
        vecs = (self.index, self.up_bias, self.gate_bias)
        return (sum(m.nbytes for m in mats if m is not None)
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


class HybridExecutor(DenseExecutor):
    def __init__(self, cfg: ModelConfig, layers: list, splits: list[LayerSplit | None], tier: GpuTier,
                 settings: ExecutionSettings, head: QuantizedLinear | None) -> None:
        super().__init__(cfg, layers)
        self.splits = splits
        self.tier = tier
        self.settings = settings
        self.head = head
        self.counters = ExecutionCounters()
        self.experts = None  # online.experts.ExpertRuntime for MoE layers (attach_experts)
        self.tier_head = None  # TierMatrix: the output layer on the GPU tier (tier_units.place_plan_units)

    def attach_experts(self, runtime) -> None:
        """Run MoE layers through ``runtime``; it holds the (packed) experts, so the float ones go."""
        self.experts = runtime
        for i in runtime.moe:
            self.layers[i] = runtime.moe[i]

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def build(cls, cfg: ModelConfig, ffn_layers: list, tier: GpuTier, settings: ExecutionSettings,
              gpu_neurons: list[torch.Tensor | None] | None = None, thresholds: list[float] | None = None,
              predictors: list | None = None, head_weight: torch.Tensor | None = None,
              raw: dict | None = None) -> "HybridExecutor":
        """Split every dense FFN layer; float FFN weights are released once packed."""
        splits: list[LayerSplit | None] = []
        layers = list(ffn_layers)
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
            layers[i] = None  # the packed copies are the weights now
        head = None
        if head_weight is not None:
            head = _pack_head(head_weight, settings, (raw or {}).get("lm_head.weight")
                              or ((raw or {}).get("model.embed_tokens.weight") if cfg.tie_word_embeddings else None))
        return cls(cfg, layers, splits, tier, settings, head)

    # --- execution ---------------------------------------------------------------------------
    def forward(self, layer: int, x: torch.Tensor) -> torch.Tensor:
        split = self.splits[layer]
        if split is None and self.experts is not None:
            cfg = self.cfg  # selected experts are computed densely: all their neurons count as active
            n = x.shape[0] * (cfg.num_experts_per_tok * cfg.moe_intermediate_size + cfg.shared_expert_intermediate_size)
            self.counters.ffn_neurons_total += n
            self.counters.ffn_neurons_active += n
            return self.experts.forward(layer, x)
        if split is None:
            return self.moe_forward(layer, x)
        start = time.perf_counter()
        n_tokens = x.shape[0]
        y = handle = None
        if split.gpu is not None:  # launched first; on CUDA it runs while the CPU computes the cold part
            handle = self.tier.fetch_async(self._gpu_forward(split.gpu, x))
        if split.cpu is not None:
            y = self._cpu_forward(split, x)
        if handle is not None:
            y_gpu = self.tier.wait(handle)  # the layer's one exchange back
            y = y_gpu if y is None else y + y_gpu
        if split.down_bias is not None:
            y = y + split.down_bias
        self.counters.ffn_neurons_total += n_tokens * self._n_neurons(split)
        self.counters.ffn_s += time.perf_counter() - start
        return y

    def _n_neurons(self, split: LayerSplit) -> int:
        return split.cpu_neurons.numel() + (split.gpu.neurons.numel() if split.gpu is not None else 0)

    def _gpu_forward(self, part: GpuPart, x: torch.Tensor) -> torch.Tensor:
        x_tier = self.tier.send(x)
        cfg = self.cfg
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

    def _cpu_forward(self, split: LayerSplit, x: torch.Tensor) -> torch.Tensor:
        if split.predictor is not None and x.shape[0] <= PREDICTOR_MAX_TOKENS:
            t0 = time.perf_counter()
            active_global = split.predictor(x)  # [n] int64 neuron ids predicted active
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
                total += self.layers[i].nbytes
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


def _split_layer(cfg: ModelConfig, layer: int, w: FFNWeights, hot: torch.Tensor, threshold: float,
                 predictor, tier: GpuTier, settings: ExecutionSettings, raw: dict) -> LayerSplit:
    n_ff = w.n_neurons
    hot = hot.to(torch.long).sort().values
    cold_mask = torch.ones(n_ff, dtype=torch.bool)
    cold_mask[hot] = False
    cold = torch.nonzero(cold_mask).flatten()
    gpu = None
    if hot.numel():
        fmt, prefix = settings.tier_format, f"layers.{layer}"

        def put(name: str, t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else tier.allocate(f"{prefix}.{name}", t.float().contiguous())
        gpu = GpuPart(
            neurons=hot, index=tier.allocate(f"{prefix}.hot_index", hot.clone()),
            up=TierMatrix.pack(w.up[hot], fmt, tier, f"{prefix}.hot_up"),
            down_t=TierMatrix.pack(w.down[:, hot].t(), fmt, tier, f"{prefix}.hot_down"),
            gate=None if w.gate is None else TierMatrix.pack(w.gate[hot], fmt, tier, f"{prefix}.hot_gate"),
            up_bias=put("hot_up_bias", None if w.up_bias is None else w.up_bias[hot]),
            gate_bias=put("hot_gate_bias", None if w.gate_bias is None else w.gate_bias[hot]))
    cpu = None
    if cold.numel():
        kw = dict(act=cfg.hidden_act, act_threshold=cfg.act_threshold, threads=settings.threads)
        prefix = f"model.layers.{layer}.mlp"
        up_raw, gate_raw, down_raw = (raw.get(f"{prefix}.{n}_proj.weight") for n in ("up", "gate", "down"))
        all_cold = cold.numel() == n_ff
        if (all_cold and settings.weight_format == "int4" and up_raw is not None and down_raw is not None
                and up_raw.qtype in EXACT_GGUF_TYPES["int4"] and w.up_bias is None and w.gate_bias is None
                and (gate_raw is None or gate_raw.qtype in EXACT_GGUF_TYPES["int4"])):
            cpu = QuantizedFFN.from_gguf(up_raw, down_raw, gate_raw, down_fmt=settings.down_format, **kw)
        else:
            cpu = QuantizedFFN.from_float(
                up=w.up[cold], down=w.down[:, cold], gate=None if w.gate is None else w.gate[cold],
                fmt=settings.weight_format, down_fmt=None if settings.weight_format == "fp32" else settings.down_format,
                up_bias=None if w.up_bias is None else w.up_bias[cold].numpy(),
                gate_bias=None if w.gate_bias is None else w.gate_bias[cold].numpy(), **kw)
    cold_local = torch.full((n_ff,), -1, dtype=torch.long)
    cold_local[cold] = torch.arange(cold.numel())
    return LayerSplit(gpu=gpu, cpu=cpu, cpu_neurons=cold, threshold=threshold,
                      down_bias=w.down_bias, predictor=predictor if cpu is not None else None, cold_local=cold_local)


def _pack_head(weight: torch.Tensor, settings: ExecutionSettings, raw_blocks) -> QuantizedLinear:
    """The output layer, packed: GGUF Q8_0 blocks are used exactly for int8 and int4 plans."""
    if raw_blocks is not None and settings.weight_format != "fp32" and raw_blocks.qtype == "Q8_0":
        return QuantizedLinear.from_gguf(raw_blocks, threads=settings.threads)
    return QuantizedLinear.from_float(weight, fmt=settings.weight_format, threads=settings.threads)
