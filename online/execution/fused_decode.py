"""The compiled decode step: one C call per token for the whole model (online/kernels/native/decode.c).

The module graph (``DecoderModel`` + ``HybridExecutor``) dispatches ~30 small ops per layer; at
batch 1 on two cores that overhead was half the token time. For plans whose FFNs run entirely on
the CPU (the ``cpu-only`` plan, or a hybrid executor without a plan) this step reads the very same
packed weights, norms, rope tables and KV cache and does attention, the sparse FFN (gate/up in
full, then only the down rows with |h| above the layer's threshold) and the output layer in one
parallel region. Activations are quantized to int8 per 32 values for the dot products (llama.cpp's
scheme); the modular path stays the reference and the prefill path.

Layers with a predictor score their neurons first and read only the predicted gate/up/down rows
(predict.h); ReLU-family layers skip the up rows their gate zeroes. Anything it does not cover
(GPU-tier neurons or experts, float32 attention weights) makes ``FusedDecodeStep.build`` raise ``FusedDecodeUnavailable`` with the reason; the
engine then decodes through the modules.

``step_many`` (T tokens of one sequence: speculative verification) and ``step_batch`` (tokens of
several sequences over a paged KV pool: continuous batching) run T tokens in one C call
(``tdm_decode_batch``, batch.h): every weight row is read once for all T, and each token's logits,
KV rows and FFN counts are bit-identical to the single-token step.

Example::

    step = FusedDecodeStep.build(model, executor)      # model: DecoderModel, executor: HybridExecutor
    logits = step(token_id, pos, cache)                 # [vocab] float32, cache updated at pos
    many = step.step_many([t0, t1, t2], pos + 1, cache) # [3, vocab], rows pos+1..pos+3 written
"""
from __future__ import annotations

import copy
import ctypes
import math
import weakref

import numpy as np
import torch

from tandem.core.errors import TandemError

from ..kernels.cpu_kernels import clamp_threads
from ..kernels.quantize import ACT_IDS
from ..kernels.native import NativeUnavailable, load_native
from ..kernels.native.step_calls import StepCalls
from ..kernels.native.arena import WeightArena
from ..kernels.native.structs import TdmLayer, TdmModel, WeightRef, addr, describe, interleave, pair_rows
from tandem.core.kv_cache import KVCache
from .fused_arch import MoeRef, build_moe, check_moe, count_experts, expert_width, layer_arrays, model_fields
from .fused_predict import PredictorRef, build_predictor
from .multi_token import int_list, kv_arrays, kv_key, pack_tables, step_batch_by_token
from .quantized_linear import describe_qkv


DEFAULT_RESIDUAL_RATIO = 2.0


class FusedDecodeUnavailable(TandemError):
    """This model/executor combination has no fused decode step (the message says why)."""


def _np(t: torch.Tensor | None) -> np.ndarray | None:
    if t is None:
        return None
    if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
        raise FusedDecodeUnavailable("fused decode needs contiguous float32 CPU tensors")
    return t.detach().numpy()


def _bias(b) -> np.ndarray | None:
    if b is None:
        return None
    b = np.asarray(b, dtype=np.float32)
    return b if b.size else None


def dense_rows(cfg, split, refs: dict) -> list[str]:
    """The layer's matrices the fused step reads only by whole row ranges (dot_rows): attention's,
    a dense down, and gate / up unless predicted rows (predict.h) or a ReLU-family gate cut (up rows
    where the gate passes) gather them. These can take the interleaved layout (structs.interleave).
    A gated ReLU-family layer keeps its up in place whatever its threshold: a threshold >= 0 turns the
    gate cut on, and ``with_thresholds`` (the sparse drafter) may set one on a layer built without."""
    names = [k for k in ("qkv", "q", "k", "v", "o", "down") if k in refs]
    if split is not None and split.predictor is None and "up" in refs:
        if cfg.mlp_gated:  # a plain FFN's gate descriptor is its up (never read): no second copy
            names.append("gate")
        if not (cfg.mlp_gated and cfg.hidden_act in ("relu", "fatrelu", "drelu")):
            names.append("up")
    return names


def _check_model(model, executor) -> None:
    cfg = model.cfg
    why = None
    if not executor.packed:  # the executor contract (tandem/core/ffn/contract.py)
        why = "the dense float32 executor (it is the reference)"
    elif cfg.num_heads % cfg.num_kv_heads:
        why = "head counts that do not group"
    elif cfg.rope_local_theta and model.rope_local_cos is None:
        why = "windowed layers without their rope table"
    if why is not None:
        raise FusedDecodeUnavailable(f"no fused decode for {why}")
    check_moe(model, executor, FusedDecodeUnavailable)  # MoE layers: experts in RAM (fused_arch.py)
    for i, split in enumerate(executor.splits):
        if split is None and cfg.is_moe_layer(i):
            continue
        if split is None or split.cpu is None or split.gpu is not None:
            raise FusedDecodeUnavailable(f"no fused decode: layer {i} has FFN neurons on the GPU tier")
        if split.predictor is not None and getattr(split.predictor, "module", None) is None:
            raise FusedDecodeUnavailable(f"no fused decode: layer {i}'s predictor is not an MLP scorer")
        if split.cpu.gate_bias.size:
            raise FusedDecodeUnavailable("no fused decode for FFN biases on the gate")
    for i, block in enumerate(model.layers):
        attn = block.self_attn
        if getattr(attn, "on_tier", False):
            raise FusedDecodeUnavailable(f"no fused decode: layer {i} attention is on the GPU tier")
        if attn.qkv_proj is None or not hasattr(attn.o_proj, "linear"):
            raise FusedDecodeUnavailable(f"no fused decode: layer {i} attention is not packed (float32 plan)")
    if getattr(executor, "head", None) is None:
        raise FusedDecodeUnavailable("no fused decode: the output layer is not packed")
    if getattr(model.embed_tokens, "on_tier", False):
        raise FusedDecodeUnavailable("no fused decode: the embeddings are on the GPU tier")


def _gemma_arrays(model, block) -> dict:
    """Qwen3 / Gemma 3 per-layer arrays of TdmLayer (q/k head norms, sandwich norms, the local
    rope table); absent entries stay NULL in C (the Llama layout)."""
    attn, out = block.self_attn, {}
    if hasattr(attn, "q_norm"):
        out.update(q_norm=_np(attn.q_norm.weight), k_norm=_np(attn.k_norm.weight))  # [hd]
    if model.cfg.sandwich_norms:
        out.update(attn_out_norm=_np(block.attn_output_norm.weight), ffn_out_norm=_np(block.ffn_output_norm.weight))
    if attn.local_rope:
        out.update(rope_cos=_np(model.rope_local_cos), rope_sin=_np(model.rope_local_sin))  # [P, hd]
    return out


class FusedDecodeStep:
    """A callable decode step over a packed CPU-only model; ``residual_ratio`` sets which activation
    blocks get a second int8 pass (see decode.c's quantize_q8: 0 every block, < 0 none)."""
    _draft = False  # with_thresholds' clones (a drafter's steps) leave the expert runtime's counts alone

    def __init__(self, model, executor, native, layers: list, keep: list,
                 residual_ratio: float = DEFAULT_RESIDUAL_RATIO) -> None:
        self.model, self.executor, self.native = model, executor, native
        self.residual_ratio = residual_ratio
        self.cfg = model.cfg
        self._layers = (TdmLayer * len(layers))(*layers)
        self._keep = keep  # arrays the descriptors point into
        self._bound_cache = None  # weakref to the KVCache the layers point into (an old cache can be freed)
        self._kv_key = None  # (addresses, shape, strides) of the KV tensors the layers point into
        self._desc = self._describe_model()
        self._calls = StepCalls(self._desc, self._layers, native)  # KV pointers, scratch, the C calls

    @classmethod
    def build(cls, model, executor, residual_ratio: float = DEFAULT_RESIDUAL_RATIO,
              require_simd: bool = True, predictor_format: str = "int8") -> "FusedDecodeStep":
        """``require_simd``: refuse a library built without AVX2/FMA/F16C (its portable scalar code
        decodes slower than the module path). ``predictor_format``: int8 (default) or fp32
        scorer weights for layers with a predictor."""
        _check_model(model, executor)
        try:
            native = load_native()
        except NativeUnavailable as exc:
            raise FusedDecodeUnavailable(str(exc)) from None
        if require_simd and not native.has_avx2:
            raise FusedDecodeUnavailable("no fused decode: this CPU or compiler has no AVX2/FMA/F16C "
                                         "(the portable C code is slower than the module path)")
        try:
            return cls(model, executor, native, *cls._describe_layers(model, executor, native, predictor_format),
                       residual_ratio)
        except FusedDecodeUnavailable:
            raise
        except TandemError as exc:  # a shape or format the kernels do not read
            raise FusedDecodeUnavailable(f"no fused decode: {exc}") from None

    @staticmethod
    def _describe_layers(model, executor, native, predictor_format: str = "int8") -> tuple[list, list]:
        layers, keep = [], []
        arena = WeightArena()  # the step's own copies (interleaved rows, paired gate / up) on huge pages
        keep.append(arena)
        threads = clamp_threads(executor.settings.threads)
        for i, block in enumerate(model.layers):
            attn, split = block.self_attn, executor.splits[i]
            refs, qkv_bias, o_bias = {}, None, None  # attention on the GPU tier: the GPU step's FFN-only calls
            if not getattr(attn, "on_tier", False):
                qkv, qkv_bias = describe_qkv(attn.qkv_proj, i)  # one stacked weight, or q / k / v apart
                refs, o_bias = dict(qkv, o=describe(attn.o_proj.linear.weight)), _bias(attn.o_proj.linear.bias)
            arrays = dict(attn_norm=_np(block.input_layernorm.weight), ffn_norm=_np(block.post_attention_layernorm.weight),
                          qkv_bias=qkv_bias, o_bias=o_bias, **_gemma_arrays(model, block), **layer_arrays(block, split))
            cpu_ffn = split is not None and split.cpu is not None  # else all hot (GPU step: attention-only calls)
            if cpu_ffn:  # a dense layer (MoE layers: fused_arch.build_moe)
                ffn = split.cpu
                refs.update(up=describe(ffn.up), gate=describe(ffn.gate if ffn.gate is not None else ffn.up))
                dense = getattr(ffn, "down", None)  # [d, n_ff] GGUF blocks read dense in place (decode.c dense_down)
                refs["down" if dense is not None else "down_t"] = (describe(dense) if dense is not None
                                                                   else describe(ffn.down_t, dot_input=False))
                arrays["down_bias"] = _np(split.down_bias) if split.down_bias is not None else _bias(ffn.down_bias)
            for name in dense_rows(model.cfg, split, refs):  # read by whole row ranges: eight rows interleaved
                refs[name] = interleave(refs[name], native.lib, arena)
            if cpu_ffn and not model.cfg.mlp_gated:
                refs["gate"] = refs["up"]  # a plain FFN's (never read) gate is its up: one copy in the step cache
            layer = TdmLayer(threshold=float(split.threshold) if split is not None else -1.0,
                             window=int(attn.sliding_window), n_ff=ffn.n_neurons if cpu_ffn else 0,
                             **{k: r.desc for k, r in refs.items()}, **{k: addr(a) for k, a in arrays.items()})
            if split is None:
                moe = build_moe(model.cfg, executor, i)
                layer.moe, layer.n_ff = ctypes.pointer(moe.desc), expert_width(moe)
                keep.append(moe)
            elif split.predictor is not None:  # predict.h: only the predicted rows are read
                pred = build_predictor(split.predictor, threads, native.lib, predictor_format)
                pair = pair_rows(refs["gate"], refs["up"], arena) if model.cfg.mlp_gated else None
                if pair is not None:  # a predicted neuron's gate and up rows in one contiguous read
                    pred.desc.gate_up = pair.desc
                    keep.append(pair)
                layer.pred = ctypes.pointer(pred.desc)
                keep.append(pred)
            layers.append(layer)
            keep += list(refs.values()) + [a for a in arrays.values() if a is not None]
        return layers, keep

    def _describe_model(self) -> TdmModel:
        """The model descriptor; layers carry their own windows (``window`` 0 here when they differ)."""
        cfg, model, ex = self.cfg, self.model, self.executor
        arena = next(k for k in self._keep if isinstance(k, WeightArena))
        head: WeightRef = interleave(describe(ex.head.weight), self.native.lib, arena)
        embed, final_norm = _np(model.embed_tokens.weight), _np(model.norm.weight)
        cos, sin = _np(model.rope_cos), _np(model.rope_sin)
        opt, opt_keep, positions = model_fields(model)  # LayerNorm, learned positions (fused_arch.py)
        self._keep += [head, embed, final_norm, cos, sin] + opt_keep
        widths = [self._layers[i].n_ff for i in range(cfg.num_layers)]
        moe = [k.neurons for k in self._keep if isinstance(k, MoeRef)]  # MoE layers' neurons per token
        self._neurons_per_token = sum(w for i, w in enumerate(widths) if not self._layers[i].moe) + sum(moe)
        return TdmModel(
            n_layers=cfg.num_layers, d=cfg.hidden_size, n_heads=cfg.num_heads, n_kv=cfg.num_kv_heads,
            head_dim=cfg.head_dim, n_ff=max(widths), vocab=head.desc.rows, capacity=0,
            window=0 if cfg.layer_windows else cfg.sliding_window, act=ACT_IDS[cfg.hidden_act], gated=int(cfg.mlp_gated),
            threads=clamp_threads(ex.settings.threads), norm_eps=cfg.norm_eps, act_alpha=cfg.act_threshold,
            attn_scale=cfg.softmax_scale, embed_scale=cfg.embed_scale, logit_softcap=cfg.final_logit_softcap,
            residual_ratio=self.residual_ratio, embed=addr(embed), final_norm=addr(final_norm),
            rope_cos=addr(cos), rope_sin=addr(sin), rope_positions=cos.shape[0] if cos is not None else positions,
            head=head.desc, layers=self._layers, work=None, **opt)

    def _bind(self, cache: KVCache) -> None:
        """Point the layers at this cache's buffers and size the scratch for its capacity."""
        self._calls.bind(*kv_arrays(cache.keys, cache.values), cache.capacity_tokens)  # [L, KV, C, hd] each
        self._bound_cache = weakref.ref(cache)
        self._kv_key = kv_key(cache.keys, cache.values)

    def __call__(self, token_id: int, pos: int, cache: KVCache) -> torch.Tensor:
        """Logits [vocab] for ``token_id`` at ``pos``; writes its keys/values into ``cache``."""
        if not 0 <= pos < min(cache.capacity_tokens, self._desc.rope_positions):
            raise TandemError(f"position {pos} is outside the KV cache ({cache.capacity_tokens} tokens)")
        if not 0 <= token_id < self.cfg.vocab_size:
            raise TandemError(f"token id {token_id} is outside the vocabulary ({self.cfg.vocab_size})")
        if self._bound_cache is None or self._bound_cache() is not cache:
            self._bind(cache)
        # numpy's allocation: a fresh 1 MB torch.empty page-faults on every token (60-370 us for Gemma's 262k logits)
        logits = torch.from_numpy(np.empty(self._desc.vocab, dtype=np.float32))  # [vocab]
        self._count(1, self._calls.decode(token_id, pos, logits.data_ptr()))
        return logits

    def _count(self, n_tokens: int, active: int) -> None:  # FFN neurons; experts run (fused_arch), not a drafter's
        self.executor.counters.ffn_neurons_total += self._neurons_per_token * n_tokens
        self.executor.counters.ffn_neurons_active += int(active)
        count_experts(self.executor, 0 if self._draft else n_tokens)

    def step_many(self, token_ids, start_pos: int, cache: KVCache) -> torch.Tensor:
        """Logits [T, vocab] for ``token_ids`` at positions ``start_pos..start_pos+T-1`` of one sequence
        (speculative verification): bit-identical to T calls of the single-token step, KV included.
        One C call (batch.h) reads every weight row once for all T tokens.

        Example::

            logits = step.step_many([t0, t1, t2], pos, cache)   # [3, vocab]; cache rows pos..pos+2 written
        """
        token_ids, start_pos, end = self._sequence_span(token_ids, start_pos, cache, "step_many")
        if not self._native_multi_token():
            return torch.stack([self(t, start_pos + i, cache) for i, t in enumerate(token_ids)])
        tables = np.zeros((len(token_ids), 1), dtype=np.int32)  # [T, 1]: the cache is one block
        return self._run_batch(token_ids, list(range(start_pos, end)), tables, cache.capacity_tokens,
                               cache.keys, cache.values, [True] * len(token_ids))

    def step_batch(self, token_ids, positions, tables, pool, logits_for=None) -> torch.Tensor:
        """Several tokens of several sequences in one step (continuous batching, chunked prefill).

        ``pool``: anything with ``keys``/``values`` float16 or float32 [L, KV, n_blocks * block_tokens, hd] and
        ``block_tokens`` (a KVCache is one block, table ``[0]``); ``tables[i]``: int32 block ids of
        token i's sequence; ``positions[i]``: its position. Tokens of one sequence come in position
        order; token i sees its sequence's rows ``0..positions[i]`` (earlier tokens of the same call
        included). ``logits_for[i]``: whether token i's logits are wanted (default all; the output
        layer runs only for those). Returns [sum(logits_for), vocab] in token order; each row and
        every KV entry is bit-identical to the single-token step on a contiguous cache holding the
        same sequence. One C call (batch.h) per 64 tokens.

        Example::

            out = step.step_batch([5, 9, 11], [7, 0, 1], [table_a, table_b, table_b], pool, [True, False, True])
        """
        token_ids = int_list(token_ids, "token_ids")
        positions = int_list(positions, "positions")
        n = len(token_ids)
        if n == 0 or not (len(positions) == len(tables) == n):
            raise TandemError("step_batch needs one position and one block table per token (and >= 1 token)")
        want = [True] * n if logits_for is None else [bool(w) for w in logits_for]
        if len(want) != n:
            raise TandemError(f"logits_for has {len(want)} entries for {n} tokens")
        block_tokens = int(pool.block_tokens)
        tables = pack_tables(tables, positions, block_tokens, pool.keys.shape[2] if pool.keys.dim() == 4 else 0)
        if not self._native_multi_token():
            return step_batch_by_token(self, token_ids, positions, tables, pool, want)
        return self._run_batch(token_ids, positions, tables, block_tokens, pool.keys, pool.values, want)

    @property
    def prefills_natively(self) -> bool:
        """Whether ``prefill_logits`` is one C call (not token by token through a subclass's step)."""
        return self._native_multi_token()

    def prefill_logits(self, token_ids, start_pos: int, cache: KVCache) -> torch.Tensor:
        """Logits [vocab] of the last of ``token_ids`` (a prompt at ``start_pos..``), every KV row written:
        ``step_many`` with the output layer run for the last token only.

        Example::

            logits = step.prefill_logits(prompt_ids, 0, cache)   # [vocab]
        """
        token_ids, start_pos, end = self._sequence_span(token_ids, start_pos, cache, "prefill")
        want = [False] * (len(token_ids) - 1) + [True]
        return self.step_batch(token_ids, list(range(start_pos, end)), [[0]] * len(token_ids), cache, want)[0]

    def _sequence_span(self, token_ids, start_pos: int, cache: KVCache, caller: str) -> tuple[list[int], int, int]:
        """Checked (token ids, first position, end position) of consecutive tokens of one sequence."""
        token_ids = int_list(token_ids, "token_ids")
        if not token_ids:
            raise TandemError(f"{caller} needs at least one token")
        start_pos = int(start_pos)
        end = start_pos + len(token_ids)
        if start_pos < 0 or end > min(cache.capacity_tokens, self._desc.rope_positions):
            raise TandemError(f"positions {start_pos}..{end - 1} are outside the KV cache ({cache.capacity_tokens} tokens)")
        return token_ids, start_pos, end

    def _native_multi_token(self) -> bool:
        """False for subclasses with their own single-token step (LayerOffloadStep runs some layers
        outside C): their multi-token calls go token by token through that step."""
        return type(self).__call__ is FusedDecodeStep.__call__

    def _run_batch(self, token_ids: list, positions: list, tables: np.ndarray, block_tokens: int,
                   keys: torch.Tensor, values: torch.Tensor, want: list) -> torch.Tensor:
        """tdm_decode_batch over chunks of MAX_BATCH_TOKENS tokens (step_calls.py; validated inputs)."""
        cfg = self.cfg
        for t in token_ids:
            if not 0 <= t < cfg.vocab_size:
                raise TandemError(f"token id {t} is outside the vocabulary ({cfg.vocab_size})")
        for p in positions:
            if not 0 <= p < self._desc.rope_positions:
                raise TandemError(f"position {p} is past the model's {self._desc.rope_positions} rope positions")
        expected = (cfg.num_layers, cfg.num_kv_heads)
        if tuple(keys.shape[:2]) != expected or keys.shape != values.shape or keys.shape[3] != cfg.head_dim:
            raise TandemError(f"KV pool shape {tuple(keys.shape)} does not fit this model "
                              f"({cfg.num_layers} layers, {cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim})")
        if self._kv_key != kv_key(keys, values):  # point the layers at this pool (unless they already do)
            self._calls.point_layers(*kv_arrays(keys, values))  # [L, KV, rows, hd] each
            self._kv_key = kv_key(keys, values)
            self._bound_cache = None  # the single-token step rebinds its cache next time
        out = torch.empty(sum(want), self._desc.vocab, dtype=torch.float32)  # [sum(want), vocab]
        ptr = out.data_ptr() if out.numel() else None
        self._count(len(token_ids), self._calls.decode_batches(token_ids, positions, tables, block_tokens,
                                                               keys.shape[2], want, ptr))
        return out

    def predictor_rows(self) -> tuple[int, int]:
        """(rows predicted active, up rows computed) summed over predictor layers and calls so far."""
        refs = [k for k in self._keep if isinstance(k, PredictorRef)]
        return int(sum(int(r.predicted.sum()) for r in refs)), int(sum(int(r.computed.sum()) for r in refs))

    def thresholds_cut_reads(self) -> bool:
        """Whether a looser FFN threshold makes a step read fewer bytes: only where down rows are added
        one by one for the neurons that pass it (a dense GGUF down, and gate / up, are read whole)."""
        return any(not layer.moe and not layer.down.data for layer in self._layers)

    def with_thresholds(self, thresholds) -> "FusedDecodeStep":
        """The same packed weights, KV layout and predictors at other per-layer FFN thresholds (the speculative
        sparse drafter); its own scratch and neuron counters (not the executor's, nor its expert runtime's).

        Example::

            draft_step = step.with_thresholds([0.05] * n_layers)   # looser: reads fewer down rows
        """
        values = [float(t) for t in thresholds]
        if len(values) != self.cfg.num_layers or not all(math.isfinite(v) and v >= 0 for v in values):
            raise TandemError(f"need {self.cfg.num_layers} finite thresholds >= 0")
        clone = copy.copy(self)
        layers = [TdmLayer.from_buffer_copy(self._layers[i]) for i in range(self.cfg.num_layers)]
        for layer, value in zip(layers, values):
            layer.threshold = value
        clone._layers = (TdmLayer * len(layers))(*layers)
        clone._desc = TdmModel.from_buffer_copy(self._desc)
        clone._desc.layers = clone._layers
        clone._calls = StepCalls(clone._desc, clone._layers, self.native)  # its own scratch
        clone._bound_cache = None
        clone.executor = copy.copy(self.executor)
        clone.executor.counters, clone._draft = type(self.executor.counters)(), True
        return clone
