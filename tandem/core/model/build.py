"""Build the decoder on the meta device and assign checkpoint tensors without copying them."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from tandem.core.errors import TandemError
from tandem.core.ffn.weights import FFNWeights, MoELayerWeights, extract_ffn_weights
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
    with torch.device("meta"), _no_random_init():
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


_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_",
                   "xavier_normal_", "trunc_normal_", "ones_", "zeros_", "constant_")


@contextmanager
def _no_random_init() -> Iterator[None]:
    """Skip ``reset_parameters``' random init while the meta model is built (every parameter is then
    replaced by the checkpoint's). On meta tensors ``normal_`` runs a Python reference decorated to
    disable dynamo, which imports ``torch._dynamo``: ~1.1 s of every cold start, for nothing."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, _keep)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def _keep(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor
