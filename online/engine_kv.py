"""The engine's KV caches: their element type (float16 where the C step decodes) and the cache it reuses.

Example::

    engine.kv_cache_type                  # "f16": the fused step's caches hold float16 keys and values
    cache = engine.new_kv_cache(256)      # a KVCache of that type
"""
from __future__ import annotations

import math

from tandem.core.errors import TandemError

KV_CAPACITY_ROUND_TOKENS = 256
# decode paths whose caches take kv_cache_type: the C step attends over them on the CPU (the GPU steps' CPU layers
# do too, but keep float32 until a float16 cache is measured on CUDA)
C_STEP_PATHS = ("fused", "layer-offload")


def context_capacity(cfg, context_length: int | None, model_id: str) -> int:
    """The engine's context: ``context_length`` (--context) or the model's; longer than the model's is an error (vLLM
    refuses it too; llama.cpp warns), not cut to the model's in silence."""
    if context_length is not None and context_length > cfg.max_context:
        raise TandemError(f"context length {context_length} (--context) is longer than {model_id}'s context length "
                          f"({cfg.max_context} tokens)")
    return context_length or cfg.max_context


def _is_half(cache) -> bool:
    return "float16" in str(cache.keys.dtype)


class KVCaches:
    """Mixed into Engine: needs ``args``, ``decode_path``, ``config``, ``max_context`` and ``_cache``."""

    @property
    def kv_cache_type(self) -> str:
        """The element type of this engine's KV caches: ``f16`` where the fused C step decodes
        (EngineArgs.kv_cache_type, f16 by default: attention reads half the bytes), else ``f32``."""
        wanted = self.args.kv_cache_type if self.args is not None else "f16"
        return wanted if self.decode_path in C_STEP_PATHS else "f32"

    def new_kv_cache(self, capacity_tokens: int):
        """A fresh torch KVCache of ``capacity_tokens`` in this engine's kv_cache_type (what its own
        requests decode on).

        Example::

            cache = engine.new_kv_cache(256)
            logits = engine.compiled_decode(token_id, 0, cache)
        """
        from tandem.core.kv_cache import KVCache
        from .kv_pool import kv_dtype
        return KVCache(self.config, capacity_tokens, dtype=kv_dtype(self.kv_cache_type))

    def _kv_cache(self, n_tokens: int, arrays: bool = False):
        """A KVCache (torch, the module graph) or with ``arrays`` an ArrayKVCache (the cached step) of
        at least ``n_tokens`` rows in kv_cache_type, reused while it is big enough and of that kind."""
        needed = min(self.max_context, math.ceil(n_tokens / KV_CAPACITY_ROUND_TOKENS) * KV_CAPACITY_ROUND_TOKENS)
        from .execution.native_step import ArrayKVCache
        half = self.kv_cache_type == "f16"
        if (self._cache is None or self._cache.capacity_tokens < needed
                or isinstance(self._cache, ArrayKVCache) != arrays or _is_half(self._cache) != half):
            self._cache = None
            cfg = self.config
            if arrays:
                import numpy as np
                self._cache = ArrayKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, needed,
                                           dtype=np.float16 if half else np.float32)
            else:
                self._cache = self.new_kv_cache(needed)
        self._kv_epoch += 1  # a stream still holding the cache sees it change hands (Engine._pieces)
        return self._cache
