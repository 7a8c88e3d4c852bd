"""CLI: ``tandem synth --shape NAME --out DIR`` (a synthetic-weights GGUF of a real model shape)."""
from __future__ import annotations

import sys
import time

from tandem.core.errors import TandemError


def add_parsers(sub) -> None:
    from .shapes import SHAPES

    p = sub.add_parser("synth", help="write a synthetic-weights, ReLU-sparse GGUF of a named model shape")
    p.add_argument("--shape", required=True, help=f"model shape ({', '.join(SHAPES)})")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--sparsity", type=float, default=0.9, help="mean FFN sparsity (default 0.9)")
    p.add_argument("--hot-fraction", type=float, default=0.26, help="hot neuron fraction (default 0.26)")
    p.add_argument("--hot-share", type=float, default=0.8,
                   help="share of activations on the hot neurons (default 0.8, PowerInfer's OPT figure)")
    p.add_argument("--gate-rank", type=int, default=48, help="rank of the predictable part of the gates (default 48)")
    p.add_argument("--gate-noise", type=float, default=0.1, help="full-rank gate noise relative to it (default 0.1)")
    p.add_argument("--qtype", default="Q4_0", help="Q4_0 (default) or Q4_1 blocks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer-from", default="smollm2", help="GGUF (or alias) whose tokenizer to embed (default smollm2)")
    p.add_argument("--quiet", action="store_true", help="no per-layer progress lines")
    p.set_defaults(handler=run_synth)


def run_synth(args) -> int:
    from tandem.core.loading.resolve import resolve_model_path

    from .build import SynthSpec, synthesize
    from .shapes import get_shape

    spec = SynthSpec(get_shape(args.shape), sparsity=args.sparsity, hot_fraction=args.hot_fraction,
                     hot_share=args.hot_share, gate_rank=args.gate_rank, gate_noise=args.gate_noise,
                     qtype=args.qtype.upper(), seed=args.seed)
    tok = resolve_model_path(args.tokenizer_from)
    vocab_guess = 49152
    gib = spec.shape.params(vocab_guess) * (20 if spec.qtype == "Q4_1" else 18) / 32 / 2**30
    print(f"synthetic weights: writing {spec.shape.name} ({spec.shape.note}), ~{gib:.2f} GiB of {spec.qtype}, "
          f"requested sparsity {spec.sparsity:.0%}, {spec.hot_fraction:.0%} of neurons carry {spec.hot_share:.0%}",
          flush=True)
    start = time.perf_counter()
    progress = None if args.quiet else (lambda line: print(f"  {line}", file=sys.stderr, flush=True))
    result = synthesize(spec, args.out, tok, progress=progress)
    s = result.stats["summary"]
    print(f"synthetic weights: wrote {result.path} in {time.perf_counter() - start:.1f} s")
    print(f"synthetic weights: realised sparsity {s['sparsity']:.1%} (layers {s['sparsity_min']:.1%}-"
          f"{s['sparsity_max']:.1%}; requested {s['requested_sparsity']:.1%}), hot share {s['hot_share']:.1%} "
          f"(requested {s['requested_hot_share']:.1%}), SiLU vs ReLU output gap <= {s['silu_relu_gap_max']:.2%}; "
          f"measured on {s['measured_on']}")
    if not s["within_tolerance"]:
        print(f"synthetic weights: WARNING realised statistics are outside the tolerances {s['tolerances']}")
    return 0
