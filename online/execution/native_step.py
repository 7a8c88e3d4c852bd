"""The fused C decode step rebuilt from its cache file (online/execution/step_cache.py), without torch.

The same C calls as FusedDecodeStep (``tdm_decode`` for one token, ``tdm_decode_batch`` for a
prompt in pieces of at most step_calls.MAX_BATCH_TOKENS tokens: bit-identical to single steps), on the same
packed arrays, read in place from the mapped cache file; logits and the KV cache are numpy arrays.
This is what a plain ``tandem generate --plan`` runs: no torch, no GGUF dequantization, no packing.

Example::

    description, arrays = read_cache(path)
    step = NativeStep.from_cache(description, arrays, threads=2)
    cache = ArrayKVCache(n_layers, n_kv, head_dim, capacity_tokens=256)
    logits = step.prefill_logits(prompt_ids, 0, cache)        # [vocab] float32
    logits = step(token_id, len(prompt_ids), cache)           # [vocab] float32
"""
from __future__ import annotations

import ctypes
import os

import numpy as np

from tandem.core.errors import TandemError
from tandem.core.huge_pages import huge_page_zeros

from ..kernels.native import load_native
from ..kernels.native.step_calls import StepCalls
from ..kernels.native.structs import TdmLayer, TdmModel, TdmPredictor, addr
from ..kernels.quantize import KIND_I4X8, KIND_I8X8
from .step_cache import RUNTIME_POINTERS, StepCacheError


class ArrayKVCache:
    """One sequence's keys/values, float16 (or float32) [L, KV, C, hd] numpy arrays (the KVCache layout)."""

    def __init__(self, n_layers: int, n_kv: int, head_dim: int, capacity_tokens: int, dtype=np.float16) -> None:
        self.capacity_tokens = capacity_tokens
        self.keys = huge_page_zeros((n_layers, n_kv, capacity_tokens, head_dim), dtype)  # [L, KV, C, hd]
        self.values = huge_page_zeros(self.keys.shape, dtype)  # (2 MiB pages: tandem/core/huge_pages.py)

    @property
    def block_tokens(self) -> int:
        return self.capacity_tokens


def default_threads() -> int:
    """NUMBA_NUM_THREADS / OMP_NUM_THREADS when set, else the CPU count (what the kernels clamp to)."""
    for name in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS"):
        if os.environ.get(name, "").isdigit() and int(os.environ[name]) > 0:
            return int(os.environ[name])
    return os.cpu_count() or 1


class NativeStep:
    """The whole-model C step over cached arrays; ``ffn_neurons_total``/``ffn_neurons_active`` count
    FFN rows as the executor's counters do."""

    def __init__(self, desc: TdmModel, layers, keep: list, native, vocab_size: int) -> None:
        self._desc, self._layers, self._keep, self.native = desc, layers, keep, native
        self.vocab_size = vocab_size
        self.ffn_neurons_total = self.ffn_neurons_active = 0
        self._calls = StepCalls(desc, layers, native)
        self._bound: ArrayKVCache | None = None

    @classmethod
    def from_cache(cls, description: dict, arrays: dict[str, np.ndarray], threads: int, vocab_size: int) -> "NativeStep":
        native = load_native()
        keep: list = []
        threads = max(1, int(threads))
        try:
            desc = _build(TdmModel, description, arrays, keep, threads, native)
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise StepCacheError(f"the cached step description does not fit this code ({type(exc).__name__}: {exc})") from None
        desc.threads = threads
        _check_model(desc, arrays, description)
        return cls(desc, keep[0], keep + [arrays], native, vocab_size)  # the descriptors point into ``arrays``

    def _bind(self, cache: ArrayKVCache) -> None:
        self._calls.bind(cache.keys, cache.values, cache.capacity_tokens)
        self._bound = cache

    def _check(self, token_ids: list[int], start: int, cache: ArrayKVCache) -> None:
        end = start + len(token_ids)
        if not token_ids or start < 0 or end > min(cache.capacity_tokens, self._desc.rope_positions):
            raise TandemError(f"positions {start}..{end - 1} are outside the KV cache ({cache.capacity_tokens} tokens)")
        if any(not 0 <= t < self.vocab_size for t in token_ids):
            raise TandemError(f"a token id is outside the vocabulary ({self.vocab_size})")

    def __call__(self, token_id: int, pos: int, cache: ArrayKVCache) -> np.ndarray:
        """Logits [vocab] for ``token_id`` at ``pos``; writes its keys/values into ``cache``."""
        self._check([token_id], pos, cache)
        if self._bound is not cache:
            self._bind(cache)
        logits = np.empty(self._desc.vocab, dtype=np.float32)
        active = self._calls.decode(token_id, pos, logits.ctypes.data)
        self.ffn_neurons_total += self._desc.n_layers * self._desc.n_ff
        self.ffn_neurons_active += int(active)
        return logits

    def prefill_logits(self, token_ids: list[int], start_pos: int, cache: ArrayKVCache) -> np.ndarray:
        """Logits [vocab] of the last of ``token_ids`` at ``start_pos..``; every KV row written."""
        token_ids = [int(t) for t in token_ids]
        self._check(token_ids, start_pos, cache)
        if self._bound is not cache:
            self._bind(cache)
        logits = np.empty(self._desc.vocab, dtype=np.float32)
        n = len(token_ids)
        tables = np.zeros((n, 1), dtype=np.int32)  # [T, 1]: the cache is one block
        want = [False] * (n - 1) + [True]
        active = self._calls.decode_batches(token_ids, range(start_pos, start_pos + n), tables, cache.capacity_tokens,
                                            cache.capacity_tokens, want, logits.ctypes.data)
        self.ffn_neurons_total += self._desc.n_layers * self._desc.n_ff * n
        self.ffn_neurons_active += active
        return logits


def _build(s_type, d: dict, arrays: dict, keep: list, threads: int, native):
    """The ctypes struct ``d`` describes (step_cache.describe_step's walk, run backwards)."""
    s = s_type()
    runtime = RUNTIME_POINTERS.get(s_type.__name__, ())
    for field, ctype in s_type._fields_:
        value = d[field]
        if ctype is ctypes.c_void_p:
            if field not in runtime and value["array"] is not None:
                setattr(s, field, addr(arrays[value["array"]]))
        elif isinstance(ctype, type) and issubclass(ctype, ctypes.Structure):
            setattr(s, field, _build(ctype, value, arrays, keep, threads, native))
            _check_weight(getattr(s, field), value, arrays)
        elif hasattr(ctype, "_type_") and isinstance(ctype._type_, type) and issubclass(ctype._type_, ctypes.Structure):
            if value is None:
                continue
            items = [_build(ctype._type_, v, arrays, keep, threads, native) for v in value]
            block = (ctype._type_ * len(items))(*items)  # the layers, a MoE layer's experts, or one struct
            keep.insert(0, block)
            setattr(s, field, block)
        else:
            setattr(s, field, value)
    if s_type is TdmPredictor:
        _predictor_runtime(s, keep, threads, native)
    return s


def _predictor_runtime(pred: TdmPredictor, keep: list, threads: int, native) -> None:
    """A predictor's per-process scratch and per-thread counters (as fused_predict.build_predictor)."""
    z = np.zeros(pred.rank, dtype=np.float32)
    scratch = np.zeros(int(native.lib.tdm_pred_scratch_bytes(pred.rank, threads)), dtype=np.uint8)
    predicted, computed = np.zeros(threads, dtype=np.int64), np.zeros(threads, dtype=np.int64)
    pred.z, pred.scratch, pred.predicted, pred.computed = addr(z), addr(scratch), addr(predicted), addr(computed)
    keep += [z, scratch, predicted, computed]


def _check_weight(w, d: dict, arrays: dict) -> None:
    """A weight descriptor's rows must lie inside its arrays (a corrupt file must not make C read past them)."""
    if not all(k in d for k in ("data", "rows", "row_bytes")):
        return
    data = d["data"]["array"]
    if data is None and w.rows == 0:
        return  # an unused weight (a MoE layer's dense gate/up/down)
    rows = w.rows
    if w.kind in (KIND_I4X8, KIND_I8X8):  # interleaved eight rows at a time: the last group is read whole
        if w.cols < 32 or w.cols % 32:
            raise StepCacheError("a cached interleaved weight's width is not whole blocks of 32")
        rows = -(-rows // 8) * 8
    if data is None or w.rows < 0 or w.row_bytes < 0 or arrays[data].nbytes < rows * w.row_bytes:
        raise StepCacheError("a cached weight's rows lie outside its array")
    scale = d.get("scale", {}).get("array")
    if scale is not None and arrays[scale].size < w.rows * max(int(w.scale_stride), 1):
        raise StepCacheError("a cached weight's scales lie outside their array")


def _check_model(desc: TdmModel, arrays: dict, d: dict) -> None:
    def size(name: str) -> int:
        ref = d[name]["array"]
        return 0 if ref is None else arrays[ref].size
    if (size("embed") < desc.vocab * desc.d or size("final_norm") < desc.d
            or desc.head.rows != desc.vocab or desc.head.cols != desc.d):
        raise StepCacheError("the cached model's embeddings or output layer do not match its sizes")
