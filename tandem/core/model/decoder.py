"""The decoder model: embeddings, attention blocks, norms and output head.

FFN and MoE blocks are NOT part of this module tree: each block calls ``executor.forward(layer, x)``
so dense, sparse, hybrid or expert-cached execution plugs in behind the same model definition.

Example::

    model = build_model(checkpoint)                 # tandem.core.model.build
    cache = KVCache(model.cfg, capacity_tokens=256)
    logits = model(torch.tensor([1, 2, 3]), start_pos=0, cache=cache, executor=executor)  # [1, vocab]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelConfig
from ..kv_cache import KVCache
from .rope import apply_rope, rope_tables


class Norm(nn.Module):
    def __init__(self, cfg: ModelConfig, size: int = 0) -> None:
        super().__init__()
        size = size or cfg.hidden_size
        self.kind, self.eps = cfg.norm, cfg.norm_eps
        self.weight = nn.Parameter(torch.empty(size), requires_grad=False)
        if cfg.norm == "layer":
            self.bias = nn.Parameter(torch.empty(size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "layer":
            return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)
        return F.rms_norm(x, x.shape[-1:], self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.use_rope = cfg.position == "rope"
        self.sliding_window = cfg.window_of(layer)
        self.local_rope = cfg.uses_local_rope(layer)
        self.scale = cfg.softmax_scale
        if cfg.qk_norm:
            self.q_norm, self.k_norm = Norm(cfg, cfg.head_dim), Norm(cfg, cfg.head_dim)
        q_out, kv_out = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_out, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_out, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(q_out, cfg.hidden_size, bias=cfg.attention_out_bias)
        self.qkv_proj: nn.Module | None = None  # a fused q/k/v projection swapped in by quantization
        self.qkv_split = (q_out, kv_out, kv_out)

    def forward(self, x: torch.Tensor, layer: int, start_pos: int, cache: KVCache,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n_tokens = x.shape[0]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(self.qkv_split, dim=-1)  # [T, q_out], [T, kv_out], [T, kv_out]
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.reshape(n_tokens, self.n_heads, self.head_dim)  # [T, H, hd]
        k = k.reshape(n_tokens, self.n_kv_heads, self.head_dim)  # [T, KV, hd]
        v = v.reshape(n_tokens, self.n_kv_heads, self.head_dim)  # [T, KV, hd]
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)  # per-head RMSNorm over hd
        if self.use_rope:
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        keys, values = cache.write(layer, start_pos, k, v)  # [KV, S, hd]
        mask, causal = self._mask(n_tokens, start_pos, keys.shape[1])
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys[None], values[None],
                                             attn_mask=mask, is_causal=causal, enable_gqa=True,
                                             scale=self.scale)  # [1, H, T, hd]
        return self.o_proj(out[0].transpose(0, 1).reshape(n_tokens, -1))  # [T, d]

    def _mask(self, n_tokens: int, start_pos: int, n_keys: int) -> tuple[torch.Tensor | None, bool]:
        window = self.sliding_window
        if window == 0 or n_keys <= window:
            if n_tokens == 1:
                return None, False
            if start_pos == 0:
                return None, True
        query_pos = torch.arange(start_pos, start_pos + n_tokens)[:, None]  # [T, 1]
        key_pos = torch.arange(n_keys)[None, :]  # [1, S]
        allowed = key_pos <= query_pos
        if window:
            allowed &= (query_pos - key_pos) < window
        return allowed, False


class DecoderBlock(nn.Module):
    """``post_attention_layernorm`` is always the FFN's input norm; Gemma's extra output norms are
    ``attn_output_norm`` / ``ffn_output_norm`` (HF: post_attention / post_feedforward_layernorm)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0) -> None:
        super().__init__()
        self.input_layernorm = Norm(cfg)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = Norm(cfg)
        if cfg.sandwich_norms:
            self.attn_output_norm, self.ffn_output_norm = Norm(cfg), Norm(cfg)


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        if cfg.position == "learned":
            self.embed_positions = nn.Embedding(cfg.max_context + cfg.position_offset, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderBlock(cfg, i) for i in range(cfg.num_layers))
        self.norm = Norm(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rope_cos: torch.Tensor | None = None
        self.rope_sin: torch.Tensor | None = None
        self.rope_local_cos: torch.Tensor | None = None  # windowed layers' tables (Gemma 3)
        self.rope_local_sin: torch.Tensor | None = None

    def init_rope(self) -> None:
        if self.cfg.position == "rope":
            self.rope_cos, self.rope_sin = rope_tables(self.cfg, self.cfg.max_context)  # [P, hd]
            if self.cfg.rope_local_theta > 0:
                self.rope_local_cos, self.rope_local_sin = rope_tables(self.cfg, self.cfg.max_context, local=True)

    def embed(self, token_ids: torch.Tensor, start_pos: int) -> torch.Tensor:
        x = self.embed_tokens(token_ids)  # [T, d]
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        if self.cfg.position == "learned":
            offset = start_pos + self.cfg.position_offset
            x = x + self.embed_positions.weight[offset: offset + token_ids.shape[0]]
        return x

    def forward_layers(self, x: torch.Tensor, start_pos: int, cache: KVCache, executor, first: int,
                       last: int) -> torch.Tensor:
        """The residual stream x [T, d] at positions start_pos.. through layers [first, last)."""
        n_tokens = x.shape[0]
        tables = {}
        for local, (cos_t, sin_t) in ((False, (self.rope_cos, self.rope_sin)),
                                      (True, (self.rope_local_cos, self.rope_local_sin))):
            if cos_t is not None:
                tables[local] = (cos_t[start_pos: start_pos + n_tokens], sin_t[start_pos: start_pos + n_tokens])  # [T, hd]
        for layer in range(first, last):
            block = self.layers[layer]
            cos, sin = tables.get(block.self_attn.local_rope, (None, None))
            h = block.self_attn(block.input_layernorm(x), layer, start_pos, cache, cos, sin)  # [T, d]
            x = x + (block.attn_output_norm(h) if self.cfg.sandwich_norms else h)
            h = executor.forward(layer, block.post_attention_layernorm(x))  # [T, d]
            x = x + (block.ffn_output_norm(h) if self.cfg.sandwich_norms else h)
        return x

    def forward(self, token_ids: torch.Tensor, start_pos: int, cache: KVCache, executor,
                all_logits: bool = False) -> torch.Tensor:
        """token_ids [T] at positions start_pos.. -> logits [T or 1, vocab] (float32)."""
        x = self.embed(token_ids, start_pos)  # [T, d]
        x = self.forward_layers(x, start_pos, cache, executor, 0, len(self.layers))
        x = self.norm(x if all_logits else x[-1:])  # [T or 1, d]
        logits = executor.output_logits(x, self.lm_head.weight)  # [T or 1, vocab]
        cap = self.cfg.final_logit_softcap
        return torch.tanh(logits / cap) * cap if cap else logits
