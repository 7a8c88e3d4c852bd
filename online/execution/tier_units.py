"""The plan's non-FFN GPU units on the tier: a layer's attention with its KV cache, the output layer,
the embeddings. Each is a module swapped into the model, stored in the tier format and charged to the
tier under the plan's kinds (``attention_and_kv``, ``output_head``, ``embeddings``).

The model keeps calling its modules; these move their input to the tier, compute there and hand the
result back to the host (one exchange each way per unit).

Example::

    place_plan_units(model, executor, tier, attention_on_gpu=[True, False], output_head_on_gpu=True,
                     embeddings_on_gpu=False, tier_format="q4", kv_dtype=torch.float16, kv_capacity_tokens=2048)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.core.errors import TandemError

from tandem.core.model.decoder import Attention
from tandem.core.model.rope import apply_rope
from tandem.core.tier_format import TierMatrix

KV_DTYPES = {4.0: torch.float32, 2.0: torch.float16}


def kv_dtype_for(kv_bytes_per_element: float) -> torch.dtype:
    """The KV element type the plan budgets (fp32 or fp16; other sizes are stored as fp16)."""
    return KV_DTYPES.get(float(kv_bytes_per_element), torch.float16)


class TierAttention(nn.Module):
    """One layer's attention on the tier: packed q/k/v/o, its own KV cache there (``kv_capacity_tokens``)."""
    on_tier = True

    def __init__(self, attn, layer: int, tier, fmt: str, kv_dtype: torch.dtype, kv_capacity_tokens: int) -> None:
        super().__init__()
        self.tier, self.layer = tier, layer
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.use_rope, self.sliding_window = attn.use_rope, attn.sliding_window
        self.local_rope, self.scale = attn.local_rope, attn.scale  # Gemma 3: per-layer rope table, own scale
        if hasattr(attn, "q_norm"):  # Qwen3 / Gemma 3 per-head norms (a few hundred bytes, not planned)
            self.q_norm, self.k_norm = attn.q_norm.to(tier.device), attn.k_norm.to(tier.device)
        prefix = f"layers.{layer}.attention"
        qkv_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])  # [q + 2 kv, d]
        self.qkv = TierMatrix.pack(qkv_w, fmt, tier, f"{prefix}.qkv")
        self.o = TierMatrix.pack(attn.o_proj.weight, fmt, tier, f"{prefix}.o")
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        self.qkv_bias = None if biases[0] is None else tier.allocate(f"{prefix}.qkv_bias", torch.cat(biases).float())
        ob = attn.o_proj.bias
        self.o_bias = None if ob is None else tier.allocate(f"{prefix}.o_bias", ob.detach().float())
        shape = (self.n_kv_heads, kv_capacity_tokens, self.head_dim)
        self.keys = tier.allocate(f"layers.{layer}.kv_keys", torch.zeros(shape, dtype=kv_dtype))  # [KV, C, hd]
        self.values = tier.allocate(f"layers.{layer}.kv_values", torch.zeros(shape, dtype=kv_dtype))
        self.capacity_tokens = kv_capacity_tokens

    def _mask(self, n_tokens: int, start_pos: int, n_keys: int):
        return Attention._mask(self, n_tokens, start_pos, n_keys)  # reads only self.sliding_window

    @property
    def nbytes(self) -> int:
        """Weight bytes read per token (the KV cache is not counted)."""
        bias = sum(b.numel() * 4 for b in (self.qkv_bias, self.o_bias) if b is not None)
        return self.qkv.nbytes + self.o.nbytes + bias

    def forward(self, x: torch.Tensor, layer: int, start_pos: int, cache, cos, sin) -> torch.Tensor:
        n_tokens, end = x.shape[0], start_pos + x.shape[0]
        if end > self.capacity_tokens:
            raise TandemError(f"context of {end} tokens exceeds the {self.capacity_tokens}-token KV cache the plan "
                              f"put on the GPU tier (plan again with a larger --context)")
        dev = self.tier.device
        qkv = self.qkv.linear(self.tier.send(x), self.qkv_bias)  # [T, q + 2 kv]
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
        return self.tier.fetch(y)


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
                     embeddings_on_gpu: bool, tier_format: str, kv_dtype: torch.dtype, kv_capacity_tokens: int) -> None:
    """Swap the plan's GPU units into ``model`` / ``executor`` (call before packing the CPU attention)."""
    cfg = model.cfg
    for i, on_gpu in enumerate(attention_on_gpu):
        if on_gpu:
            block = model.layers[i]
            block.self_attn = TierAttention(block.self_attn, i, tier, tier_format, kv_dtype, kv_capacity_tokens)
    head = None
    if output_head_on_gpu:
        head = TierMatrix.pack(model.lm_head.weight, tier_format, tier, "output_head")
        executor.tier_head = head
        executor.head = None  # the packed CPU copy is not needed
    if cfg.tie_word_embeddings and head is not None:
        model.embed_tokens = TierEmbedding(head, tier)  # one shared table (the plan counts it once)
    elif embeddings_on_gpu and not cfg.tie_word_embeddings:
        model.embed_tokens = TierEmbedding(TierMatrix.pack(model.embed_tokens.weight, tier_format, tier, "embeddings"), tier)
