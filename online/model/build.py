"""Build the decoder on the meta device and assign checkpoint tensors without copying them."""
from __future__ import annotations

import torch

from tandem.errors import TandemError
from ..execution.weights import FFNWeights, MoELayerWeights, extract_ffn_weights
from ..loading.checkpoint import Checkpoint
from .decoder import DecoderModel


def build_model(ckpt: Checkpoint) -> tuple[DecoderModel, list[FFNWeights | MoELayerWeights]]:
    """Returns the attention/embedding model and the per-layer FFN weights for an executor.

    Example::

        model, ffn_layers = build_model(load_checkpoint("smollm2"))
        executor = DenseExecutor(model.cfg, ffn_layers)

    Consumes ``ckpt.tensors`` (the dict is emptied: weights now belong to the model and executor).
    """
    cfg = ckpt.config
    tensors = ckpt.tensors
    ffn_layers = extract_ffn_weights(cfg, tensors)
    if cfg.tie_word_embeddings:
        if "model.embed_tokens.weight" not in tensors:
            raise TandemError("checkpoint is missing tensor model.embed_tokens.weight")
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    with torch.device("meta"):
        model = DecoderModel(cfg)
    state = {("lm_head.weight" if k == "lm_head.weight" else k.removeprefix("model.")): v for k, v in tensors.items()}
    expected = set(model.state_dict().keys())
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing:
        raise TandemError(f"checkpoint is missing tensor(s): {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        raise TandemError(f"checkpoint has unexpected tensor(s) for {cfg.arch}: {', '.join(unexpected[:5])}")
    for name, param in model.state_dict().items():
        if tuple(state[name].shape) != tuple(param.shape):
            raise TandemError(f"tensor {name} has shape {tuple(state[name].shape)}, config expects {tuple(param.shape)}")
    model.load_state_dict(state, assign=True, strict=True)
    for p in model.parameters():
        p.requires_grad_(False)
    model.init_rope()
    model.eval()
    tensors.clear()
    return model, ffn_layers
