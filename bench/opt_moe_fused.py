"""Decode tok/s of the fused C step against the module path on random OPT and Mixtral / Qwen2-MoE models.

Random transformers models of a mid-size shape (random weights: speed only), packed as a plan would
(int8 or int4), decoded token by token after a short prefill. The two paths run interleaved in one
process, ``--rounds`` times, and each round's ratio is reported with the medians (a busy machine slows
neighbouring runs alike, so the ratio holds better than either speed). Bytes read per token: the
packed weights each token reads (attention, the head, the FFN rows: every row of a dense layer, the
top-k experts' and the shared expert's rows of a MoE layer).

    python -m bench.opt_moe_fused --kinds opt mixtral qwen2_moe --tokens 32 --rounds 3 --threads 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

SHAPES = {  # random transformers configs (vocab kept small: the layers are what is compared)
    "opt": lambda tf: tf.OPTForCausalLM(tf.OPTConfig(
        vocab_size=8192, hidden_size=768, num_hidden_layers=6, num_attention_heads=12, ffn_dim=3072,
        word_embed_proj_dim=768, max_position_embeddings=512)),
    "mixtral": lambda tf: tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=1536, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=512)),
    "qwen2_moe": lambda tf: tf.Qwen2MoeForCausalLM(tf.Qwen2MoeConfig(
        vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
        intermediate_size=1536, moe_intermediate_size=768, shared_expert_intermediate_size=1536, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=512)),
}


def _nbytes(w) -> int:
    return int(getattr(w, "nbytes", 0))


def bytes_per_token(engine) -> int:
    """Packed weight bytes one decode token reads (dense FFN: every row)."""
    ex, cfg, total = engine.executor, engine.config, 0
    for block in engine.model.layers:
        attn = block.self_attn
        total += _nbytes(attn.qkv_proj.linear.weight) + _nbytes(attn.o_proj.linear.weight)
    total += ex.head.nbytes
    for i, split in enumerate(ex.splits):
        if split is not None:
            total += split.cpu.nbytes
            continue
        rt = ex.experts
        per_expert = rt.packed[i][0].nbytes if rt is not None else ex.float_moe[i].experts[0].nbytes
        moe = rt.moe[i] if rt is not None else ex.float_moe[i]
        total += cfg.num_experts_per_tok * per_expert + moe.router.numel() * 4
        total += moe.shared_expert.nbytes if moe.shared_expert is not None else 0
    return total


def decode_tok_s(engine, prompt: list[int], n_tokens: int) -> float:
    from tandem.core.generate import decode_one_token, prefill
    from tandem.core.kv_cache import KVCache
    cache = KVCache(engine.config, len(prompt) + n_tokens + 1)
    prefill(engine.model, engine.executor, cache, prompt)
    tok, start = prompt[-1], time.perf_counter()
    with torch.inference_mode():
        for i in range(n_tokens):
            logits = decode_one_token(engine.model, engine.executor, cache, tok, len(prompt) + i, engine.compiled_decode)
            tok = int(logits.argmax())
    return n_tokens / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kinds", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    ap.add_argument("--format", default="int8", choices=["int8", "int4"])
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import transformers as tf
    from online.engine import Engine
    torch.manual_seed(0)
    prompt = list(range(1, 17))
    for kind in args.kinds:
        with tempfile.TemporaryDirectory() as folder:
            SHAPES[kind](tf).save_pretrained(folder)
            moe = {"expert_slots": 0} if kind != "opt" else {}  # MoE: packed experts in an ExpertRuntime, as a plan's
            engine = Engine.load(folder, weight_format=args.format, sparse=False, threads=args.threads, **moe)
        assert engine.decode_path == "fused", engine.decode_path_reason
        fused_step = engine.compiled_decode
        fused, modules = [], []
        for _ in range(args.rounds):  # interleaved A/B
            engine.compiled_decode = fused_step
            fused.append(decode_tok_s(engine, prompt, args.tokens))
            engine.compiled_decode = None
            modules.append(decode_tok_s(engine, prompt, args.tokens))
        row = {"kind": kind, "format": args.format, "threads": args.threads, "tokens": args.tokens,
               "fused_tok_s": round(statistics.median(fused), 1), "modules_tok_s": round(statistics.median(modules), 1),
               "ratios": [round(a / b, 2) for a, b in zip(fused, modules)],
               "bytes_per_token": bytes_per_token(engine)}
        print("BENCH_JSON " + json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
