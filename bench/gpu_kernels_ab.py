"""The GPU step's matvec kernels on a loaded model with every layer on the GPU: each distinct matvec of a decode
token (recorded from the step itself: its own matrices and buffers) swept over launch shapes
(``bench.gpu_kernel_rates``), then whole decode steps timed under the default launches, the candidate word reads
and the best launch per matrix found here: three engines interleaved in rounds, their greedy tokens compared.

``python -m bench.gpu_kernels_ab --model M.gguf [--rounds 7 --tokens 64 --threads 8 --out FILE]`` (CUDA only).
"""
from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter

from bench.gpu_bench import PROMPT, context_tokens
from bench.gpu_kernel_rates import HEADER, mat_bytes, matvec_configs, matvec_t_configs, rate_line, sweep, word_launches


def step_layers(engine):
    """The engine's ``GpuLayers`` (its decode program on the tier)."""
    step = engine._compiled_decode
    layers = getattr(step, "layers", None) or getattr(step, "gpu_layers", None)
    if layers is None:
        raise SystemExit(f"error: the decode step ({engine.decode_path}) runs no program on the GPU")
    return layers


def set_launches(engine, matvec_launch, matvec_t_launch) -> None:
    layers = step_layers(engine)
    layers.ctx.ops.matvec_launch, layers.ctx.ops.matvec_t_launch = matvec_launch, matvec_t_launch
    layers.runner.graphs = None  # run eagerly and captured again at the next token


def record_calls(engine) -> tuple[dict, Counter]:
    """{key: (x, w, y, kwargs)} of one decode token's matvec / matvec_t calls and {key: calls a token}."""
    import torch
    layers = step_layers(engine)
    ops = layers.ctx.ops
    calls, counts = {}, Counter()

    def recording(kind, original):
        def call(x, w, y, **kwargs):
            if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
                w2 = kwargs.get("w2")
                key = (kind, w.rows, w.cols, w.fmt, None if w2 is None else w2.fmt, kwargs.get("norm") is not None)
                counts[key] += 1
                calls.setdefault(key, (x, w, y, kwargs))
            return original(x, w, y, **kwargs)
        return call
    ops.matvec, ops.matvec_t = recording("matvec", ops.matvec), recording("matvec_t", ops.matvec_t)
    layers.runner.graphs = None
    try:
        engine.generate(PROMPT, max_new_tokens=2, ignore_eos=True)
    finally:
        del ops.matvec, ops.matvec_t
    return calls, counts


def concrete_launch(kind: str, launch, rows: int, cols: int):
    """The launch object a sweep's key stands for: "default" and "words" are policies, resolved for this matrix."""
    from online.gpu.ops import default_matvec_launch, default_matvec_t_launch
    if launch == "default":
        return (default_matvec_launch if kind == "matvec" else default_matvec_t_launch)(rows, cols)
    if launch == "words":
        return word_launches()[0 if kind == "matvec" else 1](rows, cols)
    return launch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print("error: bench.gpu_kernels_ab needs CUDA (and Triton)", file=sys.stderr)
        return 2
    from online import Engine
    context = context_tokens(args.model)

    def load():
        return Engine.load(args.model, layer_offload=True, gpu_budget_bytes=1 << 37, threads=args.threads,
                           context_length=context)
    engines = {"default": load(), "words": load(), "tuned": load()}
    calls, counts = record_calls(engines["tuned"])
    lines = [f"# Whole-GPU decode of {args.model} on {torch.cuda.get_device_name(0)}", "",
             "Each distinct matvec of a token (calls a token in brackets):", "", *HEADER]
    best, per_token = {}, Counter()
    for key, (x, w, y, kwargs) in calls.items():
        kind = key[0]
        seconds = sweep(kind, x, w, y, kwargs, matvec_configs() if kind == "matvec" else matvec_t_configs())
        w2 = kwargs.get("w2")
        line, launch = rate_line(f"{kind} {w.rows}x{w.cols} {w.fmt}{' + ' + w2.fmt if w2 is not None else ''} "
                                 f"(x{counts[key]})", mat_bytes(w) + (mat_bytes(w2) if w2 is not None else 0), seconds)
        lines.append(line)
        print(line, flush=True)
        for name, chosen in (("default", "default"), ("words", "words"), ("tuned", launch)):
            per_token[name] += counts[key] * seconds.get(chosen, float("nan"))
        best.setdefault((kind, w.rows, w.cols), concrete_launch(kind, launch, w.rows, w.cols))
    lines += ["", "Matvec kernel time a token, summed from the sweep (us): " +
              ", ".join(f"{k} {v * 1e6:.0f}" for k, v in per_token.items())]
    if args.out:  # the sweep survives a timeout in the whole-step part
        from tandem.core.artifacts import atomic_write_bytes
        atomic_write_bytes(args.out, ("\n".join(lines) + "\n").encode())
    set_launches(engines["words"], *word_launches())
    set_launches(engines["tuned"],
                 lambda r, c: best.get(("matvec", r, c)) or concrete_launch("matvec", "default", r, c),
                 lambda r, c: best.get(("matvec_t", r, c)) or concrete_launch("matvec_t", "default", r, c))
    names = list(engines)
    for engine in engines.values():  # compile, capture
        engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    rates: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            out = engines[n].generate(PROMPT, max_new_tokens=args.tokens, ignore_eos=True)
            rates[n].append(out.stats["decode_tokens_per_s"])
    reference = engines["default"].generate(PROMPT, max_new_tokens=16, ignore_eos=True).token_ids
    same = [engines[n].generate(PROMPT, max_new_tokens=16, ignore_eos=True).token_ids == reference
            for n in ("words", "tuned")]
    lines += ["", f"Whole decode steps ({args.rounds} rounds of {args.tokens} tokens, {args.threads} threads; "
              f"decode path {engines['default'].decode_path}, {step_layers(engines['default']).launches_per_token} "
              f"launches a token), median tok/s:", ""]
    for n in names:
        ratios = sorted(a / b for a, b in zip(rates[n], rates["default"]))
        lines.append(f"- {n}: {statistics.median(rates[n]):.1f} tok/s ({1e3 / statistics.median(rates[n]):.3f} ms a "
                     f"token); / default per round: median {statistics.median(ratios):.3f}, range {ratios[0]:.3f}-"
                     f"{ratios[-1]:.3f}")
    lines.append(f"- greedy tokens equal the default's (16 tokens): words {same[0]}, tuned {same[1]} (word reads sum "
                 f"Q4_0 as (sum q x - 8 sum x) d, the byte reads as sum (q - 8) d x: last bits may differ)")
    print("\n".join(lines[-len(names) - 2:]))
    if args.out:
        from tandem.core.artifacts import atomic_write_bytes
        atomic_write_bytes(args.out, ("\n".join(lines) + "\n").encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
