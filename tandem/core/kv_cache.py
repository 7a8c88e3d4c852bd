"""Preallocated KV cache: one [n_kv_heads, capacity, head_dim] buffer pair per layer.

Layout shared with the paged pool (online/kv_pool.py): a pool's keys/values are
[n_layers, n_kv, n_blocks * block_tokens, head_dim]; a sequence's position p lives at row
``table[p // block_tokens] * block_tokens + p % block_tokens``. A KVCache is the one-block case
(``block_tokens == capacity_tokens``, table ``[0]``), so the fused step reads both the same way.
"""
from __future__ import annotations

import torch

from .config import ModelConfig
from .huge_pages import huge_page_tensor


class KVCache:
    """Fixed-capacity key/value storage for one sequence.

    Example::

        cache = KVCache(cfg, capacity_tokens=512)
        k_all, v_all = cache.write(layer=0, start=0, k=k, v=v)  # views over positions [0, start+T)
    """

    def __init__(self, cfg: ModelConfig, capacity_tokens: int, device: str | torch.device = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.capacity_tokens = capacity_tokens
        shape = (cfg.num_layers, cfg.num_kv_heads, capacity_tokens, cfg.head_dim)
        def zeros() -> torch.Tensor:  # [L, KV, C, hd]; on the host on 2 MiB pages: a step reads scattered runs
            if torch.device(device).type == "cpu":
                return huge_page_tensor(shape, dtype)
            return torch.zeros(shape, device=device, dtype=dtype)
        self.keys, self.values = zeros(), zeros()  # [L, KV, C, hd] each

    @property
    def block_tokens(self) -> int:
        """Tokens per block: the whole cache is one block (see the module docstring)."""
        return self.capacity_tokens

    @property
    def nbytes(self) -> int:
        return 2 * self.keys.numel() * self.keys.element_size()

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [T, KV, hd] at positions start.. and return all keys/values so far [KV, S, hd], in k's
        dtype (a float16 cache is widened for the caller's attention)."""
        end = start + k.shape[0]
        self.keys[layer, :, start:end] = k.transpose(0, 1)
        self.values[layer, :, start:end] = v.transpose(0, 1)
        return self.keys[layer, :, :end].to(k.dtype), self.values[layer, :, :end].to(v.dtype)
