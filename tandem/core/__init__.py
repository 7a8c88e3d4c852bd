"""The ground floor every stage stands on; it imports nothing else of ours.

- ``config``: ModelConfig; ``loading``: GGUF / Hugging Face checkpoints, the GGUF header reader, quant
  decoders, tokenizer and chat templates; ``model``: the reference decoder; ``kv_cache``, ``sampling`` and
  ``generate`` (prefill and the token loop over the reference model);
- ``ffn``: FFN / MoE weights, activations and DenseExecutor (the exact math every executor matches);
  ``tier_format``: the byte layouts of the weight tiers;
- ``errors`` (TandemError), ``artifacts`` (atomic writes), ``roofline``.

Floors (tests/test_import_direction.py): entry points (CLIs, tandem.pipeline) -> online -> placement ->
predictors -> offline, synth -> tandem.core.

Example::

    from tandem.core.loading import load_checkpoint
    from tandem.core.model.build import build_model
    ckpt = load_checkpoint("smollm2")
"""
