"""CLI subcommands of the online stage: ``tandem generate`` and ``tandem perplexity``."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tandem.core.errors import TandemError

from .engine_args import EngineArgs, add_engine_arguments


def add_parsers(sub) -> None:
    gen = sub.add_parser("generate", help="generate text from a prompt")
    source = gen.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="prompt text")
    source.add_argument("--prompt-ids", help="comma-separated token ids, e.g. 1,2,3")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt as one user message (chat template)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past end-of-sequence tokens")
    fmt = gen.add_mutually_exclusive_group()
    fmt.add_argument("--json-schema", metavar="FILE", help="constrain the output to JSON valid for this JSON-schema file")
    fmt.add_argument("--json-object", action="store_true", help="constrain the output to a JSON object")
    gen.add_argument("--logprobs", type=int, default=None, metavar="N",
                     help="with --json: each token's log-probability and its N most likely alternatives (0..20)")
    add_engine_arguments(gen)
    add_speculation_arguments(gen)
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.set_defaults(handler=run_generate)

    ppl = sub.add_parser("perplexity", help="sliding-window perplexity of a text file")
    ppl.add_argument("--text-file", required=True)
    ppl.add_argument("--window", type=int, default=None,
                     help="tokens per window (default 512, or the context less one where that is shorter)")
    ppl.add_argument("--stride", type=int, default=None,
                     help="tokens between window starts (default half the window; at most the window)")
    ppl.add_argument("--decode-steps", action="store_true",
                     help="score token by token through the decode path generation uses (fused step included)")
    add_engine_arguments(ppl)
    add_speculation_arguments(ppl)
    ppl.add_argument("--json", action="store_true")
    ppl.set_defaults(handler=run_perplexity)


def add_speculation_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculate", default=None, metavar="{off,lookup,sparse,auto}",
                   help="exact speculative decoding: draft with prompt lookup, with the model's own weights at "
                        "looser FFN thresholds (sparse; needs --plan), or auto (a drafter only where it pays); "
                        "the output is what plain decoding gives (default off)")
    p.add_argument("--draft-tokens", type=int, default=None, metavar="K",
                   help="most tokens drafted per verify step (default 5; k adapts below it); perplexity: "
                        "tokens scored per multi-token step")


def speculation_config(args):
    from online.speculative import SpeculationConfig
    return SpeculationConfig.parse(args.speculate, args.draft_tokens)


def check_speculation_runs(engine, spec) -> str:
    """'' where the engine can verify drafted tokens, else why not: a mode asked for by name (lookup, sparse) that
    cannot run is an error, as in ``tandem serve``; ``auto`` falls back to plain decoding and says why."""
    if not spec.enabled:
        return ""
    from online.speculative.setup import verifier_step
    try:
        verifier_step(engine)
    except TandemError as exc:
        if spec.mode in ("lookup", "sparse"):
            raise TandemError(f"--speculate {spec.mode}: {exc}") from None
        return str(exc)
    return ""


def load_engine(args):
    """The engine the command's engine flags (online.engine_args.add_engine_arguments) describe."""
    from online import Engine
    return Engine.from_args(EngineArgs.from_namespace(args))


def parse_prompt_ids(text: str) -> list[int]:
    if not text.strip():
        raise TandemError("--prompt-ids is empty")
    try:
        return [int(x) for x in text.split(",")]  # an empty item ("1,,2", "1,2,") is an error too
    except ValueError:
        raise TandemError(f"--prompt-ids must be comma-separated integers, got {text!r}") from None


def run_generate(args) -> int:
    if args.prompt is not None and not args.prompt:
        raise TandemError("prompt is empty")
    if args.prompt_ids is not None and args.chat:
        raise TandemError("--chat needs --prompt text, not --prompt-ids")
    prompt_ids = parse_prompt_ids(args.prompt_ids) if args.prompt_ids is not None else None
    from tandem.core.sampling_params import SamplingParams
    SamplingParams(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   top_p=args.top_p, seed=args.seed, stop=tuple(args.stop or ()))  # validate before loading
    grammar = cli_grammar(args)
    if args.logprobs is not None and not args.json:
        raise TandemError("--logprobs needs --json (the log-probabilities are printed in the JSON object)")
    if args.logprobs is not None and not 0 <= args.logprobs <= 20:
        raise TandemError(f"--logprobs must be between 0 and 20, got {args.logprobs}")
    spec = speculation_config(args)
    engine = load_engine(args)
    check_speculation_runs(engine, spec)
    prompt = prompt_ids if prompt_ids is not None else (
        [{"role": "user", "content": args.prompt}] if args.chat else args.prompt)
    kwargs = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                  top_p=args.top_p, seed=args.seed, stop=args.stop, ignore_eos=args.ignore_eos, grammar=grammar,
                  speculate=spec.mode, draft_tokens=spec.draft_tokens if spec.enabled else None)
    if args.json:
        if args.logprobs is not None:
            kwargs.update(logprobs=True, top_logprobs=args.logprobs)
        result = engine.generate(prompt, **kwargs)
        out = {"text": result.text, "token_ids": result.token_ids, "finish_reason": result.finish_reason,
               "model": engine.model_id, **result.stats}
        if args.logprobs is not None:
            out["logprobs"] = [{"token_id": c.token_id, "logprob": c.logprob, "top_logprobs": [list(t) for t in c.top_logprobs]}
                               for c in result.choices]
        print(json.dumps(out))
        return 0
    stream = engine.stream(prompt, **kwargs)
    for piece in stream:
        sys.stdout.write(piece)
        sys.stdout.flush()
    result = stream.result
    if engine.tokenizer is None:
        sys.stdout.write(",".join(map(str, result.token_ids)))
    s = result.stats
    sys.stdout.write("\n")
    sys.stderr.write(f"[{s['prompt_tokens']} prompt tokens, {s['generated_tokens']} generated, "
                     f"ttft {s['ttft_s'] * 1000:.0f} ms, prefill {s['prefill_tokens_per_s']:.1f} tok/s, "
                     f"decode {s['decode_tokens_per_s']:.1f} tok/s, finish: {result.finish_reason}]\n")
    if spec.enabled:
        sys.stderr.write(f"[speculate {s['speculate']}: acceptance {s['acceptance_rate']:.2f}, "
                         f"{s['tokens_per_verify_step']:.2f} tokens per verify step, draft time "
                         f"{s['draft_time_share']:.0%}{'; ' + s['speculate_reason'] if 'speculate_reason' in s else ''}]\n")
    return 0


def cli_grammar(args):
    """The --json-schema / --json-object constraint (online.constrain.Grammar), or None."""
    if args.json_schema is None and not args.json_object:
        return None
    from online.constrain import Grammar
    if args.json_object:
        return Grammar.json_object()
    try:
        schema = json.loads(Path(args.json_schema).read_text(encoding="utf-8"))
    except OSError as exc:
        raise TandemError(f"cannot read --json-schema {args.json_schema}: {exc.strerror}") from None
    except ValueError as exc:
        raise TandemError(f"--json-schema {args.json_schema} is not valid JSON: {exc}") from None
    return Grammar.json_schema(schema)


def run_perplexity(args) -> int:
    path = Path(args.text_file)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise TandemError(f"text file not found: {path}") from None
    except (UnicodeDecodeError, OSError) as e:
        raise TandemError(f"cannot read {path}: {e}") from None
    if (args.window is not None and args.window < 2) or (args.stride is not None and args.stride < 1):
        raise TandemError("--window must be >= 2 and --stride >= 1")
    if args.window is not None and args.stride is not None and args.stride > args.window:
        raise TandemError(f"--stride ({args.stride}) must not exceed --window ({args.window})")
    spec = speculation_config(args)
    engine = load_engine(args)
    if args.window is not None and args.window > engine.max_context - 1:
        raise TandemError(f"--window ({args.window}) must be below the context of {engine.max_context} tokens "
                          "(a window's last token needs a position after it)")
    window = args.window if args.window is not None else min(512, engine.max_context - 1)
    stride = args.stride if args.stride is not None else max(window // 2, 1)
    if stride > window:
        raise TandemError(f"--stride ({stride}) must not exceed the window ({window} tokens)")
    ids = engine.encode_prompt_for_scoring(text)
    reason = check_speculation_runs(engine, spec)
    tokens_per_step = spec.draft_tokens if spec.enabled and not reason else 1  # the text is known: K a step
    ppl, scored = engine.perplexity(ids, window_tokens=window, stride_tokens=stride,
                                    decode_steps=args.decode_steps or spec.enabled, tokens_per_step=tokens_per_step)
    if args.json:
        out = {"perplexity": ppl, "tokens": scored, "model": engine.model_id,
               "decode_path": engine.decode_path if args.decode_steps or spec.enabled else "prefill"}
        if spec.enabled:
            out.update(speculate=spec.mode if not reason else "off", tokens_per_step=tokens_per_step)
            out.update({"speculate_reason": reason} if reason else {})
        print(json.dumps(out))
    else:
        print(f"perplexity {ppl:.4f} over {scored} tokens")
        if reason:
            sys.stderr.write(f"[speculate off: {reason}]\n")
    return 0
