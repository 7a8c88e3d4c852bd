"""CLI commands: ``tandem plan``, ``tandem show-plan``, ``tandem probe``.

``add_parsers(subparsers)`` registers them; each parser's default ``handler`` takes the parsed
arguments and returns an exit code (TandemError propagates to the main CLI, which prints it).

Example::

    tandem plan --model smollm2 --profile profiles/M/profile --hardware rtx4090 --gpu-budget 64MiB
    tandem show-plan profiles/M/plan-rtx4090-64MiB --plot split.png
    tandem probe --out this-machine.json
"""
from __future__ import annotations

import argparse
import io
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tandem.core.artifacts import atomic_write_bytes, check_file_out
from tandem.core.errors import ArtifactError, TandemError

from .budget import format_bytes
from .hardware import PRESETS
from .settings import WEIGHT_FORMATS

if TYPE_CHECKING:  # the plan module loads torch: only the commands that read or write a plan import it
    from .plan import Plan


def add_parsers(subparsers: Any) -> None:
    plan = subparsers.add_parser("plan", help="decide what lives on the GPU (ILP over the modeled decode time)")
    plan.add_argument("--model", required=True, help="model name, GGUF file or Hugging Face folder")
    plan.add_argument("--profile", required=True, help="profile directory from `tandem profile`")
    plan.add_argument("--predictors", help="predictor directory from `tandem train-predictors` (default: exact path)")
    plan.add_argument("--hardware", required=True, help=f"preset ({', '.join(PRESETS)}) or a JSON file from `tandem probe`")
    plan.add_argument("--gpu-budget", help="GPU memory the plan may use, e.g. 2GiB, 512MiB, 0 (default: 90%% of the GPU)")
    plan.add_argument("--out", help="plan directory (default: profiles/<model-id>/plan-<hardware>-<budget>/)")
    plan.add_argument("--replan", action="store_true", help="plan again even if a plan exists at --out")
    plan.add_argument("--time-limit", type=float, default=30.0, help="ILP time limit in seconds (default 30)")
    plan.add_argument("--weight-format", default="auto",
                      help=f"weights' format on the GPU/CPU tiers: auto (from the checkpoint), {', '.join(WEIGHT_FORMATS)}, or bytes per weight")
    plan.add_argument("--context", type=int, help="KV cache context in tokens (default: min(model context, 2048))")
    plan.add_argument("--neurons-per-chunk", type=int, default=64)
    plan.add_argument("--min-gpu-neurons", type=int, default=128, help="a layer puts at least this many neurons on the GPU, or none")
    plan.add_argument("--no-quality", action="store_true",
                      help="skip measuring held-out perplexity / greedy agreement through the plan's runtime")
    plan.add_argument("--quality-tokens", type=int, default=None,
                      help="held-out tokens for the quality measurement (default 256; a reused plan measured on "
                           "another number is measured again)")
    plan.add_argument("--gpu-device", choices=("cuda", "cpu"), default=None,
                      help="where the quality measurement runs the GPU tier (default: cuda when present)")
    plan.set_defaults(handler=cmd_plan)

    show = subparsers.add_parser("show-plan", help="summarise a plan (modeled times, GPU bytes, per-layer split)")
    show.add_argument("plan_dir", help="plan directory")
    show.add_argument("--plot", help="write the per-layer split as a PNG")
    show.add_argument("--calibration", help="fused-step calibration from `tandem probe --fused FILE`: also print "
                                            "the calibrated modeled tok/s (cpu-only plans)")
    show.add_argument("--measure", metavar="MODEL", help="also decode with the plan on MODEL and print measured tok/s")
    show.add_argument("--predictors", help="predictor directory for --measure (default: beside the plan)")
    show.add_argument("--threads", type=int, help="CPU threads for --measure")
    show.set_defaults(handler=cmd_show_plan)

    probe = subparsers.add_parser("probe", help="measure this machine's bandwidths and matmul rates")
    probe.add_argument("--out", help="write the hardware profile JSON here (default: print it)")
    probe.add_argument("--threads", type=int, help="CPU threads (default: all cores)")
    probe.add_argument("--name", default="probed", help="profile name (default: probed)")
    probe.add_argument("--fused", metavar="FILE", help="also time the fused decode step (fixed costs per call and "
                                                      "layer, bandwidth share per weight format) and write them here")
    probe.set_defaults(handler=cmd_probe)


def cmd_plan(args: argparse.Namespace) -> int:
    from tandem import pipeline
    quality = not args.no_quality
    if quality and args.quality_tokens is not None:
        pipeline.check_quality_tokens(args.quality_tokens)  # before planning: no plan left without its quality
    result = pipeline.plan(args.model, args.profile, args.hardware, gpu_budget=args.gpu_budget,
                           predictors_dir=args.predictors, out=args.out, replan=args.replan,
                           time_limit_s=args.time_limit, weight_format=args.weight_format,
                           context_tokens=args.context, neurons_per_chunk=args.neurons_per_chunk,
                           min_gpu_neurons=args.min_gpu_neurons, quality=quality)
    if result.reused:
        print(f"reusing the plan in {result.path} (same model, profile, predictors, hardware, budget and settings)",
              flush=True)
    if quality:  # a new plan, or a reused one without the measurement this run asks for (interrupted, --no-quality)
        pipeline.ensure_quality(result, args.model, args.profile, args.predictors, tokens=args.quality_tokens,
                                gpu_device=args.gpu_device, log=lambda line: print(line, flush=True))
    # the first `generate --plan` starts from it
    pipeline.warm_step_cache(args.model, result.path, args.profile, args.predictors)
    if not result.reused:
        print(f"plan written to {result.path}")
    print(_headline(result.plan))
    print(_quality_line(result.plan.quality) if result.plan.quality else format_not_measured(result.plan))
    return 0


def format_not_measured(plan: Plan) -> str:
    from .quality import not_measured_line  # torch: not at the CLI's start
    return not_measured_line(plan)


def _quality_line(q: dict) -> str:
    return (f"quality (measured, {q['held_out_tokens']} held-out tokens): perplexity {q['perplexity']:.4f} vs dense "
            f"{q['dense_perplexity']:.4f} ({q['perplexity_increase']:+.2%}), greedy agreement {q['greedy_agreement']:.1%}")


def _headline(plan: Plan) -> str:
    solver, modeled = plan.solver, plan.modeled
    gap = "unknown" if solver.get("gap_rel") is None else f"{100 * solver['gap_rel']:.2f}%"
    if solver.get("gap_rel") is not None and solver["status"] == "optimal":
        gap = f"<= {gap}"
    better = solver.get("improvement_over_greedy")
    versus = "" if better is None else f"; {100 * better:.1f}% faster than greedy (modeled)"
    return (f"solver: {solver['status']}, gap {gap}, kept {solver['chosen']}{versus}\n"
            f"GPU: {format_bytes(plan.gpu_bytes)} of {format_bytes(plan.gpu_budget_bytes)} used; "
            f"modeled {modeled['tokens_per_s']:.2f} tok/s vs llama.cpp-style layer offload {modeled['layer_offload_tokens_per_s']:.2f} "
            f"(modeled {modeled['speedup_vs_layer_offload']:.2f}x)")


def format_plan_summary(plan: Plan) -> str:
    """The `show-plan` text: fingerprints, solver, GPU bytes by kind, per-layer split, modeled tokens/s."""
    modeled, cfg = plan.modeled, plan.model_config
    lines = [f"model {plan.model_id} (fingerprint {plan.model_fingerprint}), profile {plan.profile_fingerprint}, "
             f"predictors {plan.predictors_fingerprint}",
             f"hardware {plan.hardware.name} (fingerprint {plan.hardware.fingerprint}), GPU budget "
             f"{format_bytes(plan.gpu_budget_bytes)} ({plan.gpu_budget_bytes} bytes), "
             f"{plan.settings.bytes_per_weight:g} bytes/weight, context {plan.settings.context_tokens}",
             f"chunks of {plan.solver['neurons_per_chunk']} neurons"
             + (" (coarsened for the model's size)" if plan.solver.get("chunks_coarsened") else "")
             + f", solved in {plan.solver['solve_time_s']:.1f}s",
             _headline(plan),
             _quality_line(plan.quality) if plan.quality else format_not_measured(plan),
             "tier formats: " + (", ".join(f"{role} {fmt}" for role, fmt in plan.settings.tensor_formats)
                                 if plan.settings.tensor_formats else f"every tensor {plan.settings.format_of('ffn_up')}"),
             "", "GPU bytes by kind:"]
    for kind, num_bytes in plan.gpu_bytes_by_kind.items():
        if num_bytes:
            lines.append(f"  {kind:<18} {format_bytes(num_bytes):>10}")
    lines += [f"  {'total':<18} {format_bytes(plan.gpu_bytes):>10}", "",
              "per layer (times modeled, microseconds per token):",
              "  layer  attn  gpu neurons   act. on GPU   attn_us  ffn_gpu_us  ffn_cpu_us  sync_us  total_us"]
    width = cfg.get("intermediate_size", 0)
    for layer in plan.layers:
        neurons = (f"{layer['experts_pinned']}p+{layer['expert_cache_slots']}s exp" if layer["is_moe"]
                   else f"{layer['gpu_neurons']}/{width}")
        lines.append(f"  {layer['index']:>5}  {'GPU' if layer['attention_on_gpu'] else 'CPU':>4}  {neurons:>11}"
                     f"  {100 * layer['gpu_activation_share']:>11.1f}%  {1e6 * layer['attention_s']:>8.1f}"
                     f"  {1e6 * layer['ffn_gpu_s']:>10.1f}  {1e6 * layer['ffn_cpu_s']:>10.1f}"
                     f"  {1e6 * layer['sync_s']:>7.1f}  {1e6 * layer['total_s']:>8.1f}")
    lines += ["", f"output head on {'GPU' if plan.output_head_on_gpu else 'CPU'}: {1e3 * modeled['output_head_s']:.3f} ms (modeled)", "",
              "tokens/s (modeled, batch 1 decode):"]
    offload_label = f"llama.cpp-style layer offload ({modeled['layer_offload_gpu_layers']} layers on GPU)"
    for label, value in (("this plan", modeled["tokens_per_s"]), (offload_label, modeled["layer_offload_tokens_per_s"]),
                         ("all-CPU, dense", modeled["all_cpu_dense_tokens_per_s"]),
                         ("all-CPU, sparse (this engine)", modeled["all_cpu_sparse_tokens_per_s"])):
        lines.append(f"  {label:<48} {value:10.2f}")
    return "\n".join(lines)


def plot_plan(plan: Plan, out_path: str | Path) -> Path:
    """Per-layer modeled time split (attention, FFN on GPU vs CPU, sync) and GPU activation share."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    index = [layer["index"] for layer in plan.layers]
    us = lambda key: [1e6 * layer[key] for layer in plan.layers]  # noqa: E731
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 0.25 * len(index)), 7), sharex=True)
    width = 0.4
    top.bar([i - width / 2 for i in index], us("ffn_gpu_s"), width, label="FFN on GPU", color="tab:green")
    top.bar([i + width / 2 for i in index], us("ffn_cpu_s"), width, label="FFN on CPU", color="tab:blue")
    top.plot(index, us("attention_s"), "k.", label="attention")
    top.plot(index, us("sync_s"), "r_", label="sync")
    top.set_ylabel("modeled µs per token")
    top.set_title(f"{plan.model_id} on {plan.hardware.name}, budget {format_bytes(plan.gpu_budget_bytes)} (modeled)")
    top.legend(fontsize=8, loc="upper right", framealpha=0.9)
    bottom.bar(index, [100 * layer["gpu_activation_share"] for layer in plan.layers], color="tab:green")
    bottom.set_ylabel("activation mass on GPU (%)")
    bottom.set_xlabel("layer")
    bottom.set_ylim(0, 100)
    fig.tight_layout()
    out_path = check_plot_out(out_path)
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=110)
    finally:
        plt.close(fig)
    try:
        atomic_write_bytes(out_path, png.getvalue())
    except OSError as e:
        raise TandemError(f"cannot write plot {out_path}: {e.strerror or e}") from None
    return out_path


def check_plot_out(out_path: str | Path) -> Path:
    """The --plot path, checked before any work: a .png file that can be written."""
    out_path = Path(out_path)
    if out_path.suffix.lower() != ".png":
        raise TandemError(f"--plot writes a PNG image: name a .png file, got {out_path}")
    return check_file_out(out_path)


def cmd_show_plan(args: argparse.Namespace) -> int:
    from .plan import read_plan
    for flag, value in (("--predictors", args.predictors), ("--threads", args.threads)):
        if value is not None and not args.measure:
            raise TandemError(f"{flag} is for --measure (the decode it times): add --measure MODEL or leave it out")
    if args.plot:
        check_plot_out(args.plot)
    plan = read_plan(args.plan_dir)
    try:  # a field of the wrong type in a plan older than the content checksum (tandem/core/artifacts.py)
        summary = format_plan_summary(plan)
    except (TypeError, ValueError, KeyError, AttributeError, IndexError) as e:
        raise ArtifactError(f"plan metadata in {args.plan_dir} is malformed ({e}); make the plan again") from None
    print(f"plan {args.plan_dir}")
    print(summary)
    if args.plot:
        print(f"plot written to {plot_plan(plan, args.plot)}")
    if args.calibration or args.measure:
        from online.plan_measure import measure_plan_tokens_per_s  # the runtime: only with --measure
        from .plan_check import print_modeled_and_measured
        print_modeled_and_measured(plan, args, measure_plan_tokens_per_s)
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from tandem import pipeline
    from tandem.core.cpus import max_threads
    if args.threads is not None and args.threads > max_threads():  # as engines: the plan runs on these threads
        raise TandemError(f"--threads must be at most {max_threads()} (8 per CPU this process may use), "
                          f"got {args.threads}")
    if args.fused and args.out and Path(args.fused).absolute() == Path(args.out).absolute():
        raise TandemError("--fused and --out name the same file: the calibration would replace the hardware profile")
    if args.fused:
        check_file_out(args.fused)  # before the probe's minute, not after it
    hardware = pipeline.probe(args.out, threads=args.threads, name=args.name)
    if args.out:
        print(f"hardware profile written to {args.out} (use it with --hardware {args.out})")
    print(json.dumps(hardware.to_dict(), indent=2))
    if args.fused:
        from online.plan_measure import measure_fused_calibration  # the runtime: only with --fused
        from .fused_calibration import save_calibration
        from .step_reads import WHOLE_ACCESSES
        cal = measure_fused_calibration(threads=hardware.cpu_threads)
        save_calibration(cal, args.fused)
        for t in cal.terms:
            print(f"fused step {t.weight_format}: {1e6 * t.call_s:.0f} us per call, {1e6 * t.layer_s:.1f} us per layer")
        print(f"fused step: {1e6 * cal.pass_s:.2f} us per matrix pass beyond its bytes")
        print("cache speedup on a working set read again: "
              + ", ".join(f"{size >> 20} MB {speedup:.2f}x" for size, speedup in cal.residency))
        print(f"row kernels, share of {cal.read_bandwidth_bytes_per_s / 1e9:.1f} GB/s per packed format and access: "
              + ", ".join(f"{r.kind} {r.access}{_rate_note(r, WHOLE_ACCESSES)} {r.share:.0%}" for r in cal.rates))
        print("what a row costs beyond its bytes (ns, rows of the probe's width against narrower ones): "
              + ", ".join(f"{r.kind} {r.access}{_rate_note(r, WHOLE_ACCESSES)} {1e9 * r.row_s:.1f}"
                          for r in cal.rates if r.row_s > 0))
        print(f"fused-step calibration written to {args.fused} (use it with show-plan --calibration)")
    return 0


def _rate_note(rate, whole_accesses) -> str:
    """How much a probe pass read: nothing for whole matrices, the row share, or an attention pass's group size."""
    if rate.access in whole_accesses:
        return ""
    if rate.access == "attend":
        return f" ({round(1 / rate.fraction)} query heads per KV head)"
    return f" ({rate.fraction:.0%} of rows)"
