"""Hugging Face folders: ``config.json`` + ``*.safetensors`` (single or sharded) -> Checkpoint."""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tandem.core.errors import TandemError
from .checkpoint import Checkpoint
from .hf_config import config_from_hf

OPT_RENAMES = [
    (r"^(model\.)?decoder\.embed_tokens\.", "model.embed_tokens."),
    (r"^(model\.)?decoder\.embed_positions\.", "model.embed_positions."),
    (r"^(model\.)?decoder\.final_layer_norm\.", "model.norm."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.self_attn\.out_proj\.", r"model.layers.\2.self_attn.o_proj."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.self_attn_layer_norm\.", r"model.layers.\2.input_layernorm."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.final_layer_norm\.", r"model.layers.\2.post_attention_layernorm."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.fc1\.", r"model.layers.\2.mlp.up_proj."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.fc2\.", r"model.layers.\2.mlp.down_proj."),
    (r"^(model\.)?decoder\.layers\.(\d+)\.self_attn\.", r"model.layers.\2.self_attn."),
]
MOE_RENAMES = [
    (r"\.block_sparse_moe\.gate\.weight$", ".mlp.router.weight"),
    (r"\.block_sparse_moe\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
    (r"\.block_sparse_moe\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
    (r"\.block_sparse_moe\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj."),
    (r"\.mlp\.gate\.weight$", ".mlp.router.weight"),
]


GEMMA3_RENAMES = [  # HF's post_attention_layernorm norms the attention output; ours is the FFN input norm
    (r"^(model\.)?language_model\.", "model."),
    (r"\.post_attention_layernorm\.", ".attn_output_norm."),
    (r"\.pre_feedforward_layernorm\.", ".post_attention_layernorm."),
    (r"\.post_feedforward_layernorm\.", ".ffn_output_norm."),
]


def canonical_name(name: str, arch: str) -> str:
    rules = (OPT_RENAMES if arch == "opt" else MOE_RENAMES if arch in ("mixtral", "qwen2_moe")
             else GEMMA3_RENAMES if arch == "gemma3" else [])
    for pattern, repl in rules:
        name = re.sub(pattern, repl, name)
    return name


def _split_fused_experts(tensors: dict[str, torch.Tensor]) -> None:
    """Fused layout (``experts.gate_up_proj`` [E, 2F, d], ``experts.down_proj`` [E, d, F]) -> per expert."""
    for name in [n for n in tensors if n.endswith(".mlp.experts.gate_up_proj")]:
        prefix = name[: -len("gate_up_proj")]
        gate_up = tensors.pop(name)  # [E, 2F, d]
        down = tensors.pop(prefix + "down_proj", None)  # [E, d, F]
        if down is None:
            raise TandemError(f"checkpoint has {name} but no {prefix}down_proj")
        n_ff = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            tensors[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :n_ff]
            tensors[f"{prefix}{e}.up_proj.weight"] = gate_up[e, n_ff:]
            tensors[f"{prefix}{e}.down_proj.weight"] = down[e]


def _shard_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as e:
            raise TandemError(f"corrupted {index}: {e}") from None
        files = sorted({folder / f for f in weight_map.values()})
    else:
        files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise TandemError(f"no .safetensors weights in {folder}")
    for f in files:
        if not f.is_file():
            raise TandemError(f"missing weight shard {f}")
    return files


def load_hf_folder(folder: str | Path) -> Checkpoint:
    folder = Path(folder)
    config_path = folder / "config.json"
    try:
        raw = json.loads(config_path.read_text())
    except FileNotFoundError:
        raise TandemError(f"{folder} has no config.json") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise TandemError(f"corrupted {config_path}: {e}") from None
    if not isinstance(raw, dict):
        raise TandemError(f"corrupted {config_path}: not a JSON object")
    cfg = config_from_hf(raw)
    tensors: dict[str, torch.Tensor] = {}
    for shard in _shard_files(folder):
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    tensors[canonical_name(name, cfg.arch)] = f.get_tensor(name).to(torch.float32)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise TandemError(f"corrupted safetensors file {shard}: {str(e).splitlines()[0]}") from None
    _split_fused_experts(tensors)
    if cfg.arch == "gemma3":  # Gemma's RMSNorm scales by (1 + w): keep the effective weight
        for name in [n for n in tensors if n.endswith("norm.weight")]:
            tensors[name] = tensors[name] + 1.0
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    tokenizer = None
    if (folder / "tokenizer.json").is_file():
        from .tokenizer import Tokenizer
        tokenizer = Tokenizer.from_hf_folder(folder)
    return Checkpoint(config=cfg, tensors=tensors, source_path=folder.resolve(),
                      model_id=folder.resolve().name, tokenizer=tokenizer,
                      quant_types={k: "F32" for k in tensors})
