"""Load a GGUF file into a Checkpoint: ModelConfig from metadata, float32 tensors in canonical names.

Tensors are decoded one at a time straight into torch tensors (no float64 or dict-of-numpy detour);
the file stays memory-mapped and ``Checkpoint.raw`` keeps each tensor's on-disk blocks for quantized
kernels. llama.cpp stores the Q/K rows of Llama-family models permuted for its RoPE layout; they
are put back in the Hugging Face rotate-half order (raw Q/K blocks too, as in-memory copies).

Example::

    ckpt = load_gguf("models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ckpt.config.num_layers                                   # 30
    ckpt.tensors["model.layers.0.self_attn.q_proj.weight"]   # float32 [576, 576]
    ckpt.raw["model.layers.0.mlp.up_proj.weight"].qtype      # "Q4_1"
"""
from __future__ import annotations

import math
import mmap
import re
import struct
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tandem.core.errors import TandemError
from ..config import ModelConfig, freeze_mapping
from .checkpoint import Checkpoint, RawQuantTensor
from .deferred import DeferredTensor, defer_wanted
from .gguf_header import GGUFHeader, read_gguf_header
from .quants import SUPPORTED_QTYPES, dequantize, qtype_name
from .tokenizer import Tokenizer

SUPPORTED_GGUF_ARCHS = ("llama", "qwen2", "qwen2moe", "qwen3", "gemma3")  # llama with experts = Mixtral
_PERMUTED_QK_ARCHS = ("llama",)  # converted through llama.cpp's LlamaModel (Q/K rows interleaved)
_LAYER_PARTS = {  # GGUF per-layer tensor stem -> canonical suffix
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "ffn_gate_inp": "mlp.router",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",  # Qwen3, Gemma 3
    "post_attention_norm": "attn_output_norm", "post_ffw_norm": "ffn_output_norm",  # Gemma 3 (stored as 1 + w)
}
_GLOBAL_PARTS = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_IGNORED = {"rope_freqs.weight"}
DECODE_SPLIT_ELEMENTS = 1 << 20  # a deferred decode uses a thread per this many elements (up to _decode_workers)
_LAYER_RE = re.compile(r"blk\.(\d+)\.([a-z_]+?)(?:\.(\d+))?\.(weight|bias)")
_READER_ERRORS = (ValueError, KeyError, IndexError, TypeError, OverflowError, struct.error, OSError,
                  MemoryError, UnicodeDecodeError, AttributeError)


def read_gguf(path: str | Path) -> tuple[GGUFHeader, dict[str, Any]]:
    """Open a GGUF (memory-mapped) -> (header with ``.tensors`` views, metadata as plain Python values)."""
    path = Path(path)
    if not path.exists():
        raise TandemError(f"model file not found: {path}")
    if not path.is_file():
        raise TandemError(f"not a file: {path}")
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise TandemError(f"{path} is not a GGUF file (bad magic {magic!r})")
    try:
        header = read_gguf_header(path)
    except _READER_ERRORS as e:
        detail = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise TandemError(f"cannot parse GGUF {path}: truncated or corrupted file ({detail})") from None
    return header, header.fields


def _decode_workers() -> int:
    """Threads that decode tensors at load: the CPUs this process may use, at most 8."""
    from tandem.core.cpus import usable_cpus
    return max(1, min(8, usable_cpus()))


def _release_pages(reader: Any, offset: int, nbytes: int) -> None:
    """Drop the decoded bytes' file pages from this process's RSS (they stay readable, from the page cache)."""
    mm = getattr(reader.data, "_mmap", None)
    if mm is None or not hasattr(mm, "madvise") or not hasattr(mmap, "MADV_DONTNEED"):
        return
    start = -(-offset // mmap.PAGESIZE) * mmap.PAGESIZE
    stop = (offset + nbytes) // mmap.PAGESIZE * mmap.PAGESIZE
    if stop > start:
        mm.madvise(mmap.MADV_DONTNEED, start, stop - start)


def load_gguf(path: str | Path, with_tokenizer: bool = True, deferred: bool | None = False) -> Checkpoint:
    """Read a GGUF checkpoint (Llama/SmolLM2/Mistral, Qwen2, Mixtral, Qwen2-MoE) into a Checkpoint.

    ``deferred``: the layers' weight matrices and the output layer stay in their blocks as DeferredTensors
    (decoded on each use; deferred.py), so the float32 model never exists whole. None: deferred when
    their float32 copy would take over 3/4 of the memory available (``deferred.defer_wanted``)."""
    path = Path(path)
    reader, fields = read_gguf(path)
    arch = fields.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHS:
        raise TandemError(f"unsupported GGUF architecture {arch!r} in {path.name} "
                          f"(supported: {', '.join(SUPPORTED_GGUF_ARCHS)}; llama with experts = Mixtral)")
    by_name = {t.name: t for t in reader.tensors}
    tokenizer = Tokenizer.from_gguf_metadata(fields) if with_tokenizer else None
    config = config_from_gguf(fields, by_name, tokenizer)
    if deferred is None:
        deferred = defer_wanted(4 * sum(math.prod(int(s) for s in t.shape.tolist()) for t in reader.tensors))
    tensors: dict[str, torch.Tensor] = {}
    raw: dict[str, RawQuantTensor] = {}
    # numpy's decoding releases the GIL: tensors decode on a few threads, each file's pages dropped once decoded
    # (a deferred tensor's pages are read when it is used)
    with ThreadPoolExecutor(max_workers=_decode_workers()) as pool:
        pending = []
        for t in reader.tensors:
            if t.name in _IGNORED:
                continue
            jobs = []
            for name, qtype, shape, data in _canonical_pieces(t, config, arch):
                if deferred and _deferrable(name, shape):
                    tensors[name] = DeferredTensor(shape, partial(decode_float32, data, qtype, shape))
                    raw[name] = RawQuantTensor(qtype=qtype, shape=shape, data=data)
                    continue
                out = torch.empty(shape, dtype=torch.float32)
                jobs.append(pool.submit(dequantize, data, qtype, shape, out.numpy()))
                if name.endswith("shared_expert_gate.weight"):
                    out = out.reshape(1, -1)  # [1, d] (a view: filled by the job above)
                    shape = tuple(out.shape)
                tensors[name] = out
                raw[name] = RawQuantTensor(qtype=qtype, shape=shape, data=data)
            if jobs:
                pending.append((t, jobs))
        for t, jobs in pending:
            for job in jobs:
                job.result()  # (re-raises a decoding error)
            _release_pages(reader, t.data_offset, t.n_bytes)
    _check_tensors(config, tensors, path)
    return Checkpoint(config=config, tensors=tensors, source_path=path.resolve(),
                      model_id=path.stem, tokenizer=tokenizer, quant_types={k: v.qtype for k, v in raw.items()},
                      raw=raw)


def _deferrable(name: str, shape: tuple[int, ...]) -> bool:
    """Weights a deferred load keeps in their blocks: every layer matrix (attention, FFN, experts) and the
    output layer. The embeddings stay decoded (a token's lookup would otherwise decode the whole table)."""
    return len(shape) == 2 and (name.startswith("model.layers.") or name == "lm_head.weight")


def decode_float32(data: np.ndarray, qtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor's blocks decoded to a new float32 tensor, the rows split over the decode threads."""
    out = np.empty(shape, dtype=np.float32)
    rows = shape[0]
    workers = min(_decode_workers(), torch.get_num_threads(), max(1, math.prod(shape) // DECODE_SPLIT_ELEMENTS))
    if workers <= 1 or len(shape) != 2:
        dequantize(data, qtype, shape, out)
        return torch.from_numpy(out)
    bounds = [rows * k // workers for k in range(workers + 1)]
    with ThreadPoolExecutor(max_workers=workers) as pool:
        jobs = [pool.submit(dequantize, data[a:b], qtype, (b - a, shape[1]), out[a:b])
                for a, b in zip(bounds, bounds[1:]) if b > a]
        for job in jobs:
            job.result()
    return torch.from_numpy(out)


def _canonical_pieces(t: Any, config: ModelConfig, arch: str):
    """Yield (canonical name, qtype, logical shape, uint8 [rows, row_bytes]) for one GGUF tensor."""
    try:
        qtype = qtype_name(t.tensor_type)
    except TandemError:
        raise TandemError(f"tensor {t.name} has unsupported type {t.tensor_type.name} "
                          f"(supported: {', '.join(SUPPORTED_QTYPES)})") from None
    shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # torch order [.., out, in]
    data = np.asarray(t.data).view(np.uint8).reshape(math.prod(shape[:-1]), -1)  # [rows, row_bytes]
    stem, _, kind = t.name.rpartition(".")
    if stem in _GLOBAL_PARTS:
        yield f"{_GLOBAL_PARTS[stem]}.{kind}", qtype, shape, data
        return
    m = _LAYER_RE.fullmatch(t.name)
    if m is None:
        raise TandemError(f"unexpected tensor {t.name} in a {arch} GGUF")
    layer, part, expert, kind = int(m[1]), m[2], m[3], m[4]
    prefix = f"model.layers.{layer}"
    if part in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):  # stacked [E, out, in]
        proj = part.split("_")[1]
        per_expert = data.reshape(shape[0], -1, data.shape[-1])  # [E, rows, row_bytes]
        for e in range(shape[0]):
            yield f"{prefix}.mlp.experts.{e}.{proj}_proj.{kind}", qtype, shape[1:], per_expert[e]
        return
    if expert is not None and part in ("ffn_gate", "ffn_up", "ffn_down"):  # older per-expert Mixtral
        yield f"{prefix}.mlp.experts.{expert}.{part[4:]}_proj.{kind}", qtype, shape, data
        return
    if part not in _LAYER_PARTS or expert is not None:
        raise TandemError(f"unexpected tensor {t.name} in a {arch} GGUF")
    if arch in _PERMUTED_QK_ARCHS and part in ("attn_q", "attn_k"):
        heads = config.num_heads if part == "attn_q" else config.num_kv_heads
        perm = rope_unpermute_index(heads, shape[0])
        if len(shape) == 1:  # bias: one row of `rows` elements
            data = data.reshape(shape[0], -1)[perm].reshape(1, -1)
        else:
            data = data[perm]  # [rows, row_bytes], in-memory copy
    yield f"{prefix}.{_LAYER_PARTS[part]}.{kind}", qtype, shape, data


def rope_unpermute_index(n_heads: int, rows: int) -> np.ndarray:
    """Row order that turns llama.cpp's interleaved Q/K rows into the HF rotate-half layout.

    Within a head, llama.cpp row ``2*i + j`` (i < head_dim/2, j in {0, 1}) is HF row ``j*head_dim/2 + i``;
    ``hf_rows = gguf_rows[index]``.
    """
    if rows % (2 * n_heads):
        raise TandemError(f"cannot split {rows} Q/K rows into {n_heads} rotary heads")
    return np.arange(rows).reshape(n_heads, rows // n_heads // 2, 2).transpose(0, 2, 1).reshape(-1)


def config_from_gguf(fields: dict[str, Any], tensors: dict[str, Any], tokenizer: Tokenizer | None) -> ModelConfig:
    """ModelConfig from GGUF metadata (+ tensor names/shapes for what metadata leaves implicit)."""
    arch = fields["general.architecture"]

    def key(name: str, default: Any = None) -> Any:
        value = fields.get(f"{arch}.{name}", default)
        if isinstance(value, list):  # per-layer arrays: only uniform ones are supported
            if len(set(value)) != 1:
                raise TandemError(f"per-layer {arch}.{name} values are not supported")
            value = value[0]
        return value

    def shape_of(name: str) -> tuple[int, ...] | None:
        t = tensors.get(name)
        return None if t is None else tuple(int(s) for s in reversed(t.shape.tolist()))

    for required in ("block_count", "embedding_length", "attention.head_count"):
        if key(required) is None:
            raise TandemError(f"GGUF metadata lacks {arch}.{required}")
    num_layers, hidden = int(key("block_count")), int(key("embedding_length"))
    num_heads = int(key("attention.head_count"))
    if num_heads <= 0 or hidden <= 0:
        raise TandemError(f"invalid GGUF metadata: attention.head_count ({num_heads}) and embedding_length "
                          f"({hidden}) must be positive")
    names = set(tensors)
    head_dim = int(key("attention.key_length", 0) or 0) or hidden // num_heads
    rotary = key("rope.dimension_count")
    if rotary is not None and int(rotary) != head_dim:
        raise TandemError(f"partial rotary embeddings ({rotary} of {head_dim} dims) are not supported")
    tokens = fields.get("tokenizer.ggml.tokens")
    embed = shape_of("token_embd.weight")
    vocab = len(tokens) if isinstance(tokens, list) else key("vocab_size") or (embed[0] if embed else 0)
    kw: dict[str, Any] = dict(
        arch="llama", vocab_size=int(vocab), hidden_size=hidden, num_layers=num_layers, num_heads=num_heads,
        num_kv_heads=int(key("attention.head_count_kv", num_heads)),
        head_dim=head_dim, max_context=int(key("context_length", 2048)),
        norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)), rope_scaling=_rope_scaling(fields, arch, tensors, key),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names, attention_out_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_up.bias" in names, intermediate_size=int(key("feed_forward_length", 0) or 0),
        sliding_window=int(key("attention.sliding_window", 0) or 0),
        pad_token_id=fields.get("tokenizer.ggml.padding_token_id"))
    if fields.get("tandem.activation"):  # ours (tandem synth): a ReLU model stored in llama's SiLU layout
        kw["hidden_act"] = str(fields["tandem.activation"])
    moe_layers = tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" in names)
    experts = int(key("expert_count", 0) or 0)
    if moe_layers and not experts:
        experts = shape_of(f"blk.{moe_layers[0]}.ffn_gate_inp.weight")[0]
    if experts or moe_layers:
        exp_shape = shape_of(f"blk.{moe_layers[0]}.ffn_up_exps.weight") if moe_layers else None
        moe_ff = int(key("expert_feed_forward_length", 0) or 0)
        moe_ff = moe_ff or (exp_shape[1] if exp_shape else kw["intermediate_size"])
        kw.update(arch="qwen2_moe" if arch == "qwen2moe" else "mixtral", num_experts=experts,
                  num_experts_per_tok=int(key("expert_used_count", 0) or 0), moe_intermediate_size=moe_ff,
                  norm_topk_prob=bool(key("expert_weights_norm", arch != "qwen2moe")),
                  moe_layers=moe_layers if 0 < len(moe_layers) < num_layers else ())
        kw["intermediate_size"] = kw["intermediate_size"] or moe_ff
        shexp = shape_of(f"blk.{moe_layers[0]}.ffn_up_shexp.weight") if moe_layers else None
        if shexp:
            kw["shared_expert_intermediate_size"] = int(key("expert_shared_feed_forward_length", 0) or 0) or shexp[0]
    if arch == "qwen3":
        kw.update(arch="qwen3", qk_norm=True)
    elif arch == "gemma3":
        kw.update(_gemma3_fields(fields, num_layers, hidden, num_heads, head_dim, kw["sliding_window"], key))
    if tokenizer is not None:
        kw.update(bos_token_id=tokenizer.bos_token_id, eos_token_ids=tokenizer.eos_token_ids)
    else:
        bos, eos = fields.get("tokenizer.ggml.bos_token_id"), fields.get("tokenizer.ggml.eos_token_id")
        kw.update(bos_token_id=bos, eos_token_ids=(eos,) if eos is not None else ())
    return ModelConfig(**kw)


def _gemma3_fields(fields: dict[str, Any], num_layers: int, hidden: int, num_heads: int, head_dim: int,
                   window: int, key: Any) -> dict[str, Any]:
    """Gemma 3 settings llama.cpp derives rather than stores: every 6th layer global (or the stored
    per-layer pattern), windowed layers on rope base 10000, the 27B's attention scale from d / heads."""
    pattern = fields.get("gemma3.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) == num_layers:
        windows = tuple(window if bool(p) else 0 for p in pattern)
    else:
        windows = tuple(0 if (i + 1) % 6 == 0 else window for i in range(num_layers))
    scale_dim = hidden / num_heads if num_layers == 62 else head_dim
    return dict(arch="gemma3", qk_norm=True, sandwich_norms=True, hidden_act="gelu_tanh",
                embed_scale=float(hidden) ** 0.5, attn_scale=float(scale_dim) ** -0.5,
                final_logit_softcap=float(key("final_logit_softcapping", 0.0) or 0.0),
                layer_windows=windows if window else (), rope_local_theta=10000.0 if window else 0.0)


def _rope_scaling(fields: dict[str, Any], arch: str, tensors: dict[str, Any], key: Any) -> tuple:
    kind = key("rope.scaling.type") or ("linear" if key("rope.scale_linear") else None)
    factor = float(key("rope.scaling.factor", 0) or key("rope.scale_linear", 0) or 0)
    if "rope_freqs.weight" in tensors:
        return freeze_mapping(_llama3_scaling(tensors["rope_freqs.weight"], key))
    if kind in (None, "none") or factor in (0.0, 1.0):
        return ()
    if kind != "linear":
        raise TandemError(f"unsupported rope scaling {kind!r} in GGUF (supported: linear, llama3)")
    return freeze_mapping({"rope_type": "linear", "factor": factor})


def _llama3_scaling(rope_freqs: Any, key: Any) -> dict[str, Any]:
    """Recover Llama-3 rope_scaling parameters from llama.cpp's ``rope_freqs`` divisors."""
    stored = np.asarray(rope_freqs.data, dtype=np.float64).reshape(-1)  # [head_dim / 2]
    dim = 2 * stored.size
    theta = float(key("rope.freq_base", 10000.0))
    freqs = theta ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    wavelen = 2 * math.pi / freqs
    for factor in (8.0, 32.0, 16.0, 4.0):
        low, high, orig = 1.0, 4.0, 8192
        smooth = np.clip((orig / wavelen - low) / (high - low), 0.0, 1.0)
        expected = 1.0 / ((1 - smooth) / factor + smooth)
        if np.allclose(stored, expected, rtol=1e-3):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": orig}
    raise TandemError("unsupported rope_freqs in GGUF (not a Llama-3 frequency scaling)")


def _check_tensors(config: ModelConfig, tensors: dict[str, torch.Tensor], path: Path) -> None:
    d, hd = config.hidden_size, config.head_dim
    expect = {"model.embed_tokens.weight": (config.vocab_size, d), "model.norm.weight": (d,)}
    if not config.tie_word_embeddings:
        expect["lm_head.weight"] = (config.vocab_size, d)
    for i in range(config.num_layers):
        p = f"model.layers.{i}"
        expect.update({f"{p}.input_layernorm.weight": (d,), f"{p}.post_attention_layernorm.weight": (d,),
                       f"{p}.self_attn.q_proj.weight": (config.num_heads * hd, d),
                       f"{p}.self_attn.k_proj.weight": (config.num_kv_heads * hd, d),
                       f"{p}.self_attn.v_proj.weight": (config.num_kv_heads * hd, d),
                       f"{p}.self_attn.o_proj.weight": (d, config.num_heads * hd)})
        if config.qk_norm:
            expect.update({f"{p}.self_attn.q_norm.weight": (hd,), f"{p}.self_attn.k_norm.weight": (hd,)})
        if config.sandwich_norms:
            expect.update({f"{p}.attn_output_norm.weight": (d,), f"{p}.ffn_output_norm.weight": (d,)})
        if config.is_moe_layer(i):
            ff = config.moe_intermediate_size
            expect[f"{p}.mlp.router.weight"] = (config.num_experts, d)
            for e in range(config.num_experts):
                q = f"{p}.mlp.experts.{e}"
                expect.update({f"{q}.gate_proj.weight": (ff, d), f"{q}.up_proj.weight": (ff, d),
                               f"{q}.down_proj.weight": (d, ff)})
        else:
            ff = config.intermediate_size
            expect.update({f"{p}.mlp.gate_proj.weight": (ff, d), f"{p}.mlp.up_proj.weight": (ff, d),
                           f"{p}.mlp.down_proj.weight": (d, ff)})
    for name, shape in expect.items():
        if name not in tensors:
            raise TandemError(f"{path.name} lacks tensor {name} needed by its {config.arch} config")
        if tuple(tensors[name].shape) != shape:
            raise TandemError(f"{path.name}: tensor {name} has shape {list(tensors[name].shape)}, "
                              f"config implies {list(shape)}")
