"""The plan's non-FFN GPU units on the tier: a layer's attention with its KV cache, the output layer,
the embeddings. Each is a module swapped into the model, stored in the tier format and charged to the
tier under the plan's kinds (``attention_and_kv``, ``output_head``, ``embeddings``).

The model keeps calling its modules; these move their input to the tier, compute there and hand the
result back to the host (one exchange each way per unit). A layer whose attention and hot FFN rows are
both on the tier makes ONE exchange: the attention sends the residual stream (tapped at the block's
input norm), and the tier runs norm, attention, residual, FFN norm and the hot rows in one go, fetching
the attention output and the hot FFN output together; the executor adds the CPU's cold part to it.

Example::

    place_plan_units(model, executor, tier, attention_on_gpu=[True, False], output_head_on_gpu=True,
                     embeddings_on_gpu=False, tier_format="q4", kv_dtype=torch.float16, kv_capacity_tokens=2048)
    # per tensor role (a plan's tensor_formats), GGUF blocks kept where the role's format is their type:
    place_plan_units(..., tier_format=settings.tier_format_of, raw=ckpt.raw)
"""
from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from tandem.core.errors import TandemError

from tandem.core.model.decoder import Attention
from tandem.core.model.rope import apply_rope
from .tier_matrix import TierMatrix

_ATTENTION_ROLES = (("q_proj", "attn_q"), ("k_proj", "attn_k"), ("v_proj", "attn_v"), ("o_proj", "attn_o"))

KV_DTYPES = {4.0: torch.float32, 2.0: torch.float16}


def tier_ffn_kernel(cfg, part, tier):
    """On a CPU tier: the hot rows as a QuantizedFFN over the tier's own codes (no copy of the weights, no
    dequantization per call), or None (CUDA tier, or a layout the kernels do not read)."""
    if tier.is_cuda:
        return None
    mats = [part.up.kernel_weight(), part.down_t.kernel_weight()]
    gate = part.gate.kernel_weight() if part.gate is not None else None
    if any(m is None for m in mats) or (part.gate is not None and gate is None):
        return None
    from ..kernels.ffn import QuantizedFFN
    vec = lambda t: None if t is None else t.numpy()  # noqa: E731
    return QuantizedFFN(mats[0], mats[1], gate, act=cfg.hidden_act, act_threshold=cfg.act_threshold,
                        up_bias=vec(part.up_bias), gate_bias=vec(part.gate_bias), threads=tier.threads)


def _role_format(tier_format) -> object:
    """A (role, layer) -> format function from a format (every tensor) or such a function
    (``ExecutionSettings.tier_format_of``)."""
    return tier_format if callable(tier_format) else (lambda role, layer=None: tier_format)


def tier_matrix(float_weight: torch.Tensor, raw_blocks, fmt: str, tier, name: str) -> TierMatrix:
    """A matrix in ``fmt`` on the tier: from its GGUF blocks when there are any (kept as they are where ``fmt``
    is their type), else packed from the float weights."""
    if raw_blocks is not None and tuple(raw_blocks.shape) == tuple(float_weight.shape):
        return TierMatrix.from_raw(raw_blocks, fmt, tier, name)
    return TierMatrix.pack(float_weight, fmt, tier, name)


def kv_dtype_for(kv_bytes_per_element: float) -> torch.dtype:
    """The KV element type the plan budgets (fp32 or fp16; other sizes are stored as fp16)."""
    return KV_DTYPES.get(float(kv_bytes_per_element), torch.float16)


class TierAttention(nn.Module):
    """One layer's attention on the tier: packed q/k/v/o, its own KV cache there (``kv_capacity_tokens``)."""
    on_tier = True

    def __init__(self, attn, layer: int, tier, fmt, kv_dtype: torch.dtype, kv_capacity_tokens: int,
                 raw: dict | None = None) -> None:
        super().__init__()
        self.tier, self.layer = tier, layer
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.use_rope, self.sliding_window = attn.use_rope, attn.sliding_window
        self.local_rope, self.scale = attn.local_rope, attn.scale  # Gemma 3: per-layer rope table, own scale
        if hasattr(attn, "q_norm"):  # Qwen3 / Gemma 3 per-head norms (a few hundred bytes, not planned)
            self.q_norm, self.k_norm = attn.q_norm.to(tier.device), attn.k_norm.to(tier.device)
        prefix, role_format, raw = f"layers.{layer}.attention", _role_format(fmt), raw or {}
        mats = {name: tier_matrix(getattr(attn, name).weight, raw.get(f"model.layers.{layer}.self_attn.{name}.weight"),
                                  role_format(role, layer), tier, f"{prefix}.{name[0]}")
                for name, role in _ATTENTION_ROLES}  # each in its role's format
        self.qkv_parts = [mats["q_proj"], mats["k_proj"], mats["v_proj"]]  # [q, d], [kv, d], [kv, d]
        self.o = mats["o_proj"]
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        self.qkv_bias = None if biases[0] is None else tier.allocate(f"{prefix}.qkv_bias", torch.cat(biases).float())
        ob = attn.o_proj.bias
        self.o_bias = None if ob is None else tier.allocate(f"{prefix}.o_bias", ob.detach().float())
        shape = (self.n_kv_heads, kv_capacity_tokens, self.head_dim)
        self.keys = tier.allocate(f"layers.{layer}.kv_keys", torch.zeros(shape, dtype=kv_dtype))  # [KV, C, hd]
        self.values = tier.allocate(f"layers.{layer}.kv_values", torch.zeros(shape, dtype=kv_dtype))
        self.capacity_tokens = kv_capacity_tokens

    def fuse_ffn(self, block, executor) -> None:
        """Run what the layer's FFN computes on the tier (hot rows, a tier predictor: ``executor.tier_outputs``)
        in this unit's exchange: the residual stream is tapped where the block's input norm reads it; the
        norms run on the tier (copies on CUDA)."""
        on_tier = (lambda m: m) if not self.tier.is_cuda else (lambda m: copy.deepcopy(m).to(self.tier.device))
        self._norms = (on_tier(block.input_layernorm), on_tier(block.post_attention_layernorm),
                       on_tier(block.attn_output_norm) if hasattr(block, "attn_output_norm") else None)
        self._executor, self._residual = executor, None
        block.input_layernorm.register_forward_pre_hook(self._tap)

    def _tap(self, module, args) -> None:
        self._residual = args[0]  # x [T, d], the residual stream this layer's attention input is norm(x) of

    def _mask(self, n_tokens: int, start_pos: int, n_keys: int):
        return Attention._mask(self, n_tokens, start_pos, n_keys)  # reads only self.sliding_window

    @property
    def nbytes(self) -> int:
        """Weight bytes read per token (the KV cache is not counted)."""
        bias = sum(b.numel() * 4 for b in (self.qkv_bias, self.o_bias) if b is not None)
        return sum(m.nbytes for m in self.qkv_parts) + self.o.nbytes + bias

    def forward(self, x: torch.Tensor, layer: int, start_pos: int, cache, cos, sin) -> torch.Tensor:
        n_tokens, end = x.shape[0], start_pos + x.shape[0]
        if end > self.capacity_tokens:
            raise TandemError(f"context of {end} tokens exceeds the {self.capacity_tokens}-token KV cache the plan "
                              f"put on the GPU tier (plan again with a larger --context)")
        dev = self.tier.device
        residual, self._residual = getattr(self, "_residual", None), None
        fused = residual is not None and residual.shape == x.shape and self._executor.has_tier_ffn(self.layer, n_tokens)
        if fused:  # send the residual stream; the tier takes its norm itself
            residual_tier = self.tier.send(residual)
            x_tier = self._norms[0](residual_tier)
        else:
            x_tier = self.tier.send(x)
        qkv = torch.cat([m.linear(x_tier) for m in self.qkv_parts], dim=-1)  # [T, q + 2 kv]
        if self.qkv_bias is not None:
            qkv = qkv + self.qkv_bias
        q_dim, kv_dim = self.n_heads * self.head_dim, self.n_kv_heads * self.head_dim
        q = qkv[:, :q_dim].reshape(n_tokens, self.n_heads, self.head_dim)  # [T, H, hd]
        k = qkv[:, q_dim:q_dim + kv_dim].reshape(n_tokens, self.n_kv_heads, self.head_dim)  # [T, KV, hd]
        v = qkv[:, q_dim + kv_dim:].reshape(n_tokens, self.n_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)  # per-head RMSNorm over hd
        if self.use_rope:
            cos, sin = cos.to(dev, non_blocking=True), sin.to(dev, non_blocking=True)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        self.keys[:, start_pos:end] = k.transpose(0, 1).to(self.keys.dtype)
        self.values[:, start_pos:end] = v.transpose(0, 1).to(self.values.dtype)
        keys, values = self.keys[:, :end].float(), self.values[:, :end].float()  # [KV, S, hd]
        mask, causal = self._mask(n_tokens, start_pos, end)
        if mask is not None:
            mask = mask.to(dev)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                             attn_mask=mask, is_causal=causal, enable_gqa=True,
                                             scale=self.scale)  # [1, H, T, hd]
        y = self.o.linear(out[0].transpose(0, 1).reshape(n_tokens, -1), self.o_bias)  # [T, d]
        if not fused:
            return self.tier.fetch(y)
        h = residual_tier + (self._norms[2](y) if self._norms[2] is not None else y)  # as the decoder adds it
        ffn = self._executor.tier_outputs(self.layer, self._norms[1](h))  # hot output [T * d], predictor mask
        both = self.tier.fetch(torch.cat([y.reshape(-1), ffn]))  # the layer's one exchange
        n = y.numel()
        self._executor.pending_hot[self.layer] = self._executor.unpack_tier_outputs(self.layer, both[n:], n_tokens)
        return both[:n].reshape(y.shape)


class TierEmbedding(nn.Module):
    """The embedding table on the tier; looks up (dequantizes) only the rows asked for."""
    on_tier = True

    def __init__(self, table: TierMatrix, tier) -> None:
        super().__init__()
        self.table, self.tier = table, tier

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        ids = self.tier.send(token_ids)
        return self.tier.fetch(self.table.take_rows(ids))  # [T, d]


def place_plan_units(model, executor, tier, *, attention_on_gpu: list[bool], output_head_on_gpu: bool,
                     embeddings_on_gpu: bool, tier_format, kv_dtype: torch.dtype, kv_capacity_tokens: int,
                     raw: dict | None = None) -> None:
    """Swap the plan's GPU units into ``model`` / ``executor`` (call before packing the CPU attention).
    ``tier_format``: one format, or role -> format (``ExecutionSettings.tier_format_of``); ``raw``: GGUF blocks."""
    cfg, fmt, raw = model.cfg, _role_format(tier_format), raw or {}
    embed_raw = raw.get("model.embed_tokens.weight")
    splits = getattr(executor, "splits", [])
    for i, on_gpu in enumerate(attention_on_gpu):
        if on_gpu:
            block = model.layers[i]
            block.self_attn = TierAttention(block.self_attn, i, tier, fmt, kv_dtype, kv_capacity_tokens, raw)
            if i < len(splits) and splits[i] is not None:
                block.self_attn.fuse_ffn(block, executor)  # one exchange for the layer (when its FFN uses the tier)
    head = None
    if output_head_on_gpu:
        head_raw = embed_raw if cfg.tie_word_embeddings else raw.get("lm_head.weight")
        head = tier_matrix(model.lm_head.weight, head_raw, fmt("output"), tier, "output_head")
        executor.tier_head = head
        executor.head = None  # the packed CPU copy is not needed
    if cfg.tie_word_embeddings and head is not None:
        model.embed_tokens = TierEmbedding(head, tier)  # one shared table (the plan counts it once)
    elif embeddings_on_gpu and not cfg.tie_word_embeddings:
        table = tier_matrix(model.embed_tokens.weight, embed_raw, fmt("embeddings"), tier, "embeddings")
        model.embed_tokens = TierEmbedding(table, tier)


class TierPredictor:
    """A layer's activation predictor (``predictors.runtime.LayerGate``) on the tier: its parameters are
    charged as ``layers.{i}.predictor.*`` (kind ``predictors``) and its scores computed there. The
    executor fetches the predicted-active mask in the layer's exchange; called alone it is one exchange."""
    on_tier = True

    def __init__(self, gate, layer: int, tier) -> None:
        module = copy.deepcopy(gate.module)
        for name, param in module.named_parameters():
            param.data = tier.allocate(f"layers.{layer}.predictor.{name}", param.detach())
        self.tier, self.layer, self._module, self.threshold = tier, layer, module, float(gate.threshold)
        # the host's scorer, kept for the fused C step's share of a GPU step: a layer's cold rows are gated on the
        # host (no mask fetched from the tier, no extra exchange); not charged to the tier
        self.host_gate = gate

    @property
    def module(self):
        """The scorer on the tier's device when that is the CPU (the fused CPU step reads it); None on CUDA, where
        the GPU step's C call scores the cold rows with ``host_gate``."""
        return None if self.tier.is_cuda else self._module

    @torch.inference_mode()
    def mask_on_tier(self, x_tier: torch.Tensor) -> torch.Tensor:
        """bool ``[n_ff]``: neurons predicted active for any token of ``x_tier`` ``[T, d]`` (on the tier)."""
        scores = self._module(x_tier.to(self._module.down.weight.dtype))  # [T, n_ff]
        return (scores >= self.threshold).any(dim=0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """int64 neuron ids predicted active (host), as ``LayerGate``."""
        return self.tier.fetch(self.mask_on_tier(self.tier.send(x))).nonzero().flatten()


def place_predictors(executor, tier, predictors: list, predictor_on_gpu: list) -> None:
    """The plan's ``predictor_on_gpu`` layers: their predictors on the tier (bytes charged as planned even
    where the layer's CPU part is empty and nothing reads them)."""
    for i, on_gpu in enumerate(predictor_on_gpu):
        if not on_gpu or predictors is None or predictors[i] is None:
            continue
        placed = TierPredictor(predictors[i], i, tier)
        split = executor.splits[i] if i < len(executor.splits) else None
        if split is not None and split.predictor is not None:
            split.predictor = placed


class TierSharedExpert:
    """A Qwen2-MoE layer's shared expert on the tier (kind ``shared_experts``): up/gate rows and the down
    projection as stored (blocks along the expert's width: GGUF blocks kept) in the plan's formats, the
    float32 gate vector beside them. One exchange per call."""
    on_tier = True

    def __init__(self, cfg, moe, layer: int, tier, fmt, raw: dict | None = None) -> None:
        w, fmt, raw = moe.shared_expert, _role_format(fmt), raw or {}
        if w.up_bias is not None or w.gate_bias is not None or w.down_bias is not None:
            raise TandemError("shared experts with biases are not placed on the GPU tier")
        prefix, source = f"layers.{layer}.shared_expert", f"model.layers.{layer}.mlp.shared_expert"

        def matrix(name: str, role: str, weight: torch.Tensor) -> TierMatrix:
            return tier_matrix(weight, raw.get(f"{source}.{name}_proj.weight"), fmt(role, layer), tier, f"{prefix}.{name}")
        self.cfg, self.tier = cfg, tier
        self.up, self.down = matrix("up", "ffn_up", w.up), matrix("down", "ffn_down", w.down)  # [F, d], [d, F]
        self.gate = None if w.gate is None else matrix("gate", "ffn_gate", w.gate)
        self.gate_vector = tier.allocate(f"{prefix}.gate_vector", moe.shared_expert_gate.detach().float())  # [1, d]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x ``[T, d]`` (host) -> the gated shared-expert output ``[T, d]`` (host), as ``dense.shared_expert_out``."""
        from tandem.core.ffn.activations import activate, gated_hidden
        cfg, x_tier = self.cfg, self.tier.send(x)
        up = self.up.linear(x_tier)  # [T, F]
        h = (activate(cfg.hidden_act, up, cfg.act_threshold) if self.gate is None
             else gated_hidden(cfg.hidden_act, self.gate.linear(x_tier), up, cfg.act_threshold))
        y = self.down.linear(h.contiguous()) * torch.sigmoid(F.linear(x_tier, self.gate_vector))  # [T, d]
        return self.tier.fetch(y)


def place_shared_experts(cfg, layer_weights: list, tier, shared_on_gpu: list, fmt, raw: dict | None = None) -> dict:
    """The plan's ``shared_expert_on_gpu`` layers: their shared experts on the tier, by layer (for
    ``ExpertRuntime.tier_shared``; placed before the expert cache takes the tier's free bytes)."""
    from tandem.core.ffn.weights import MoELayerWeights
    placed = {}
    for i, on_gpu in enumerate(shared_on_gpu):
        w = layer_weights[i] if i < len(layer_weights) else None
        if on_gpu and isinstance(w, MoELayerWeights) and w.shared_expert is not None:
            placed[i] = TierSharedExpert(cfg, w, i, tier, fmt, raw)
    return placed
