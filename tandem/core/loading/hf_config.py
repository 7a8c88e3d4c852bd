"""Hugging Face ``config.json`` -> ModelConfig for the supported model types."""
from __future__ import annotations

from typing import Any

from tandem.core.errors import TandemError
from ..config import ModelConfig, freeze_mapping

LLAMA_LIKE = {"llama", "mistral", "qwen2", "smollm", "smollm2"}
SUPPORTED = sorted(LLAMA_LIKE | {"opt", "mixtral", "qwen2_moe", "qwen3", "gemma3_text"})
ACT_ALIASES = {"swish": "silu", "silu": "silu", "relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh",
               "gelu_pytorch_tanh": "gelu_tanh", "fatrelu": "fatrelu", "drelu": "drelu", "relu2": None}


def _eos_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    return tuple(value) if isinstance(value, list) else (int(value),)


def _rope(raw: dict[str, Any]) -> tuple[float, tuple]:
    params = dict(raw.get("rope_parameters") or {})
    if isinstance(params.get("full_attention"), dict):  # per layer type (Gemma 3): the global layers'
        params = dict(params["full_attention"])
    theta = float(params.pop("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling = dict(raw.get("rope_scaling") or {}) or params
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = {}
    return theta, freeze_mapping(scaling)


def _activation(raw: dict[str, Any]) -> tuple[str, float]:
    name = raw.get("hidden_activation") or raw.get("hidden_act", raw.get("activation_function", "silu"))
    act = ACT_ALIASES.get(name)
    if act is None:
        raise TandemError(f"unsupported activation {name!r} in config.json")
    threshold = float(raw.get("hidden_act_param", raw.get("fatrelu_threshold", 0.0)) or 0.0)
    return act, threshold


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    model_type = raw.get("model_type")
    if model_type not in SUPPORTED:
        raise TandemError(f"unsupported model_type {model_type!r} (supported: {', '.join(SUPPORTED)})")
    try:
        return _build(model_type, raw)
    except KeyError as e:
        raise TandemError(f"config.json lacks required key {e}") from None
    except (TypeError, ValueError) as e:
        raise TandemError(f"config.json has an invalid value: {e}") from None


def _build(model_type: str, raw: dict[str, Any]) -> ModelConfig:
    common = dict(vocab_size=int(raw["vocab_size"]), hidden_size=int(raw["hidden_size"]),
                  num_layers=int(raw["num_hidden_layers"]), num_heads=int(raw["num_attention_heads"]),
                  max_context=int(raw.get("max_position_embeddings", 2048)),
                  bos_token_id=raw.get("bos_token_id"), eos_token_ids=_eos_ids(raw.get("eos_token_id")),
                  pad_token_id=raw.get("pad_token_id"))
    if model_type == "opt":
        if not raw.get("do_layer_norm_before", True):
            raise TandemError("OPT models with post-layer-norm (do_layer_norm_before=false, OPT-350m) are not supported")
        if raw.get("word_embed_proj_dim", raw["hidden_size"]) != raw["hidden_size"]:
            raise TandemError("OPT models with word_embed_proj_dim != hidden_size are not supported")
        act, threshold = _activation(raw)
        bias = bool(raw.get("enable_bias", True))
        return ModelConfig(arch="opt", intermediate_size=int(raw["ffn_dim"]), num_kv_heads=common["num_heads"],
                           norm="layer", norm_eps=1e-5, position="learned", position_offset=2,
                           tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
                           attention_bias=bias, attention_out_bias=bias, mlp_gated=False, mlp_bias=bias,
                           hidden_act=act, act_threshold=threshold, **common)
    theta, scaling = _rope(raw)
    act, threshold = _activation(raw)
    llama_common = dict(common, num_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
                        head_dim=int(raw.get("head_dim") or 0), norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                        rope_theta=theta, rope_scaling=scaling, hidden_act=act, act_threshold=threshold,
                        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)))
    sliding = raw.get("sliding_window") or 0
    if model_type in ("qwen2", "qwen2_moe") and not raw.get("use_sliding_window", False):
        sliding = 0
    if model_type == "qwen3":
        return ModelConfig(arch="qwen3", intermediate_size=int(raw["intermediate_size"]), qk_norm=True,
                           attention_bias=bool(raw.get("attention_bias", False)),
                           attention_out_bias=bool(raw.get("attention_bias", False)),
                           sliding_window=int(sliding) if raw.get("use_sliding_window") else 0, **llama_common)
    if model_type == "gemma3_text":
        return _gemma3(raw, llama_common)
    if model_type == "mixtral":
        return ModelConfig(arch="mixtral", intermediate_size=int(raw["intermediate_size"]),
                           num_experts=int(raw["num_local_experts"]), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                           moe_intermediate_size=int(raw["intermediate_size"]), norm_topk_prob=True,
                           sliding_window=int(sliding), **llama_common)
    if model_type == "qwen2_moe":
        mlp_only = set(raw.get("mlp_only_layers") or [])
        step = int(raw.get("decoder_sparse_step", 1) or 1)
        moe_layers = tuple(i for i in range(common["num_layers"])
                           if i not in mlp_only and (i + 1) % step == 0)
        return ModelConfig(arch="qwen2_moe", intermediate_size=int(raw["intermediate_size"]),
                           num_experts=int(raw["num_experts"]), num_experts_per_tok=int(raw["num_experts_per_tok"]),
                           moe_intermediate_size=int(raw["moe_intermediate_size"]),
                           shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size", 0)),
                           norm_topk_prob=bool(raw.get("norm_topk_prob", False)), moe_layers=moe_layers,
                           attention_bias=bool(raw.get("qkv_bias", True)), sliding_window=int(sliding),
                           **llama_common)
    return ModelConfig(arch="llama", intermediate_size=int(raw["intermediate_size"]),
                       attention_bias=bool(raw.get("attention_bias", model_type == "qwen2")),
                       attention_out_bias=bool(raw.get("attention_bias", False)) and model_type != "qwen2",
                       mlp_bias=bool(raw.get("mlp_bias", False)), sliding_window=int(sliding), **llama_common)


def _gemma3(raw: dict[str, Any], llama_common: dict[str, Any]) -> ModelConfig:
    n_layers = llama_common["num_layers"]
    types = raw.get("layer_types")
    if not types:
        pattern = int(raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", 6)) or 6)
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(n_layers)]
    window = int(raw.get("sliding_window") or 0)
    windows = tuple(window if t == "sliding_attention" else 0 for t in types)
    params = raw.get("rope_parameters") or {}
    local = params.get("sliding_attention") if isinstance(params.get("sliding_attention"), dict) else {}
    if local and local.get("rope_type", "default") != "default":
        raise TandemError(f"unsupported rope scaling {local} on Gemma 3 sliding layers")
    local_theta = float(local.get("rope_theta", raw.get("rope_local_base_freq", 10000.0)))
    softcap = raw.get("final_logit_softcapping") or 0.0
    if raw.get("attn_logit_softcapping"):
        raise TandemError("attention logit softcapping (Gemma 2) is not supported")
    common = dict(llama_common, tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)))
    return ModelConfig(arch="gemma3", intermediate_size=int(raw["intermediate_size"]),
                       attention_bias=bool(raw.get("attention_bias", False)), qk_norm=True, sandwich_norms=True,
                       embed_scale=float(common["hidden_size"]) ** 0.5,
                       attn_scale=float(raw.get("query_pre_attn_scalar") or common["head_dim"]) ** -0.5,
                       final_logit_softcap=float(softcap), layer_windows=windows, sliding_window=window,
                       rope_local_theta=local_theta, **common)
