"""Grammar libraries side by side: per-step token-mask time on SmolLM2's 49,152-token vocabulary.

Each library installed in this environment (llguidance is a dependency; xgrammar and outlines-core are
measured when installed, e.g. in a scratch venv) follows the same 4-property JSON-schema answer token
by token, timing the allowed-token mask before each step. Medians over ``--runs`` full passes.
``--decode N``: also SmolLM2's decode tok/s (packed int4, fused step) without and with a JSON-schema
constraint and logprobs, alternating in one process, N tokens per run.

Example::

    python -m bench.grammar_mask --runs 5 --decode 48
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
          "tags": {"type": "array", "items": {"type": "string"}}, "ok": {"type": "boolean"}},
          "required": ["name", "age", "tags", "ok"], "additionalProperties": False}
ANSWER = {"name": "Ada Lovelace", "age": 36, "tags": ["math", "poetry", "engines"], "ok": True}


def bench_llguidance(tok, vocab_size, ids, eos):
    import llguidance
    from online.constrain.grammar import JSON_OPTIONS
    start = time.perf_counter()
    ll_tok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=vocab_size, eos_token=eos)
    setup_s = time.perf_counter() - start
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults=JSON_OPTIONS)

    def run():
        t0 = time.perf_counter()
        matcher = llguidance.LLMatcher(ll_tok, grammar)
        compile_s, steps = time.perf_counter() - t0, []
        for token in ids + [eos]:
            t = time.perf_counter()
            matcher.compute_bitmask()
            steps.append(time.perf_counter() - t)
            assert matcher.consume_token(token), matcher.get_error()
        return compile_s, steps
    return setup_s, run


def bench_xgrammar(tok, vocab_size, ids, eos):
    import transformers
    import xgrammar
    start = time.perf_counter()
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tok.backend)
    compiler = xgrammar.GrammarCompiler(xgrammar.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size,
                                                                                stop_token_ids=[eos]), max_threads=1)
    setup_s = time.perf_counter() - start
    bitmask = xgrammar.allocate_token_bitmask(1, vocab_size)

    def run():
        t0 = time.perf_counter()
        compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, separators=(", ", ": "))
        matcher = xgrammar.GrammarMatcher(compiled)
        compile_s, steps = time.perf_counter() - t0, []
        for token in ids + [eos]:
            t = time.perf_counter()
            matcher.fill_next_token_bitmask(bitmask)
            steps.append(time.perf_counter() - t)
            assert matcher.accept_token(token)
        compiler.clear_cache()
        return compile_s, steps
    return setup_s, run


def bench_outlines_core(tok, vocab_size, ids, eos):
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema
    from tandem.core.loading.tokenizer import byte_alphabet
    start = time.perf_counter()
    to_byte = {c: b for b, c in byte_alphabet().items()}
    by_bytes: dict[bytes, list[int]] = {}
    for text, i in tok.backend.get_vocab(with_added_tokens=True).items():
        if i in tok.eos_token_ids or text.startswith("<|") or not set(text) <= to_byte.keys():
            continue
        by_bytes.setdefault(bytes(to_byte[c] for c in text), []).append(i)
    vocab = Vocabulary(eos, by_bytes)
    setup_s = time.perf_counter() - start
    regex = build_regex_from_schema(json.dumps(SCHEMA), r"[ ]?")

    def run():
        t0 = time.perf_counter()
        guide = Guide(Index(regex, vocab))
        compile_s, steps = time.perf_counter() - t0, []
        for token in ids + [eos]:
            t = time.perf_counter()
            guide.get_tokens()
            steps.append(time.perf_counter() - t)
            if token != eos:
                guide.advance(token)
        return compile_s, steps
    return setup_s, run


LIBRARIES = {"llguidance": bench_llguidance, "xgrammar": bench_xgrammar, "outlines_core": bench_outlines_core}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--decode", type=int, default=0, metavar="TOKENS", help="also time constrained decoding")
    args = parser.parse_args(argv)
    from tandem.core.loading import load_checkpoint
    ckpt = load_checkpoint(args.model)
    tok, vocab_size = ckpt.tokenizer, ckpt.config.vocab_size
    ids = tok.encode(json.dumps(ANSWER), add_special_tokens=False)
    eos = tok.eos_token_ids[0]
    print(f"{args.model}: vocabulary {vocab_size}, answer {len(ids)} tokens + EOS, {args.runs} runs")
    print("| library | tokenizer setup ms | grammar compile ms (median) | mask us/step median | first-step mask us (median) | mask us/step max |")
    print("|---|---|---|---|---|---|")
    for name, bench in LIBRARIES.items():
        if importlib.util.find_spec(name) is None:
            print(f"| {name} | not installed | | | | |")
            continue
        setup_s, run = bench(tok, vocab_size, ids, eos)
        results = [run() for _ in range(args.runs)]
        steps = [s for _, run_steps in results for s in run_steps]
        print(f"| {name} | {setup_s * 1e3:.0f} | {statistics.median(c for c, _ in results) * 1e3:.1f} | "
              f"{statistics.median(steps) * 1e6:.0f} | {statistics.median(r[1][0] for r in results) * 1e6:.0f} | "
              f"{max(steps) * 1e6:.0f} |")
    if args.decode:
        bench_decode(args.model, args.decode, args.runs)
    return 0


def bench_decode(model: str, tokens: int, runs: int) -> None:
    """Decode tok/s of plain, logprobs and JSON-constrained generation, alternating, medians of ``runs``."""
    from online import Engine
    from online.constrain import Grammar
    engine = Engine.load(model, weight_format="int4", sparse=False)
    numbers = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 1000}
    modes = {"plain": {"ignore_eos": True}, "logprobs (top 5)": {"ignore_eos": True, "logprobs": True, "top_logprobs": 5},
             "json schema (array of integers)": {"grammar": Grammar.json_schema(numbers)}}
    prompt = [{"role": "user", "content": "List one thousand numbers as a JSON array."}]
    engine.generate(prompt, max_new_tokens=4, grammar=Grammar.json_object())  # warm-up (and the grammar tokenizer)
    rates: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(runs):
        for name, kwargs in modes.items():
            out = engine.generate(prompt, max_new_tokens=tokens, **kwargs)
            assert len(out.token_ids) == tokens, (name, out.text)
            rates[name].append(out.stats["decode_tokens_per_s"])
    print(f"\n{model} ({engine.decode_path} decode), {tokens} tokens per run, {runs} runs alternating")
    print("| mode | decode tok/s median [min-max] |\n|---|---|")
    for name, values in rates.items():
        print(f"| {name} | {statistics.median(values):.1f} [{min(values):.1f}-{max(values):.1f}] |")


if __name__ == "__main__":
    raise SystemExit(main())
