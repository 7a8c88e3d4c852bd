"""Stage bench/gpu_sparse.sh's folder for the GPU machine (no network, 64 MiB a run): a synthetic ReLU-sparse
model's profile, predictors and GPU plans made here, and what synthesizing the model there needs.

``python -m bench.gpu_sparse_stage --shape llama-1b --sparsity 0.9 --out .dev/b2`` prepares the model under
``--models-dir`` (bench.synthetic.prepare: synth, profile, train-predictors; ~12 min for llama-1b on 2 cores)
unless it is there, then writes into ``--out``:

- ``plans/plan-<fraction>``: `tandem plan --hardware <preset> --predictors ...` at bench.gpu_bench's budgets
  (fraction 0: no GPU budget, the predictors on the CPU alone), without their CPU step caches;
- ``profile/``, ``predictors/`` (or ``--predictors-out`` when they would push a run past 64 MiB),
  ``model.sha256`` (what the machine's synth is compared with);
- ``tokenizer.gguf``: the tokenizer model's metadata with no tensors (synth reads only its fields; the
  model written from it is byte-identical here), and the gguf wheel;
- ``stage.json``: the model's and predictors' paths here (``python -m bench.gpu_ab --stage DIR`` runs the A/B
  on this machine: `make bench-gpu SPARSE=llama-350m`).

Then ``bash bench/gpu_sparse.sh`` there (see its header; STAGE/PREDICTORS when split).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

from tandem.core.artifacts import atomic_write_bytes, atomic_write_json

RUN_LIMIT_BYTES = 60 << 20  # what one run may carry, less the tracked tree
FRACTIONS = (0.0, 0.1, 0.25, 0.5, 1.0)


def tokenizer_only_gguf(src: Path, dst: Path) -> None:
    """``src``'s header and metadata with a tensor count of 0 (a valid GGUF without tensors), atomically."""
    from gguf import GGUFReader
    reader = GGUFReader(str(src))
    end = max(f.offset + sum(p.nbytes for p in f.parts) for f in reader.fields.values())  # metadata's end
    with open(src, "rb") as f:
        head = f.read(end)
    magic, version, _, n_kv = struct.unpack("<IIQQ", head[:24])
    data = struct.pack("<IIQQ", magic, version, 0, n_kv) + head[24:]
    data += b"\0" * (-len(data) % 32)
    atomic_write_bytes(dst, data)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llama-350m")
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--models-dir", default="bench/synthetic-models")
    p.add_argument("--hardware", default="h100",
                   help="preset or probe JSON the plans are made for; auto: this machine probed when it has CUDA")
    p.add_argument("--fractions", default=",".join(f"{f:g}" for f in FRACTIONS))
    p.add_argument("--out", default=".dev/sparse")
    p.add_argument("--predictors-out", default=None, help="where the predictors go when they need a run of their own")
    p.add_argument("--no-wheel", action="store_true", help="leave out the gguf wheel (a run on this machine)")
    p.add_argument("--profile-tokens", type=int, default=2048, help="tokens the profile runs (a new model only)")
    p.add_argument("--predictor-tokens", type=int, default=4096, help="tokens the predictors train on (a new model only)")
    p.add_argument("--tokenizer", default="smollm2",
                   help="GGUF whose tokenizer synth embeds (the GPU machine, with no network: a staged tokenizer.gguf)")
    args = p.parse_args(argv)
    from bench.gpu_bench import make_plan_dir, model_bytes, plan_budget
    from bench.synthetic import prepare
    from tandem.core.loading.resolve import resolve_model_path
    tokenizer = resolve_model_path(args.tokenizer)
    gguf, work = prepare(args.shape, args.sparsity, Path(args.models_dir), str(tokenizer), quality=False,
                         profile_tokens=args.profile_tokens, predictor_tokens=args.predictor_tokens)
    request = json.loads(gguf.with_name(gguf.name + ".synth.json").read_text())["request"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.hardware == "auto":
        import torch
        from bench.gpu_bench import probed_hardware
        args.hardware = probed_hardware(out) if torch.cuda.is_available() else "h100"
    total, reserve = model_bytes(str(gguf), work / "profile", args.hardware, "auto")
    plan_names = {f"plan-{float(x):g}": float(x) for x in args.fractions.split(",")}
    for name, f in plan_names.items():
        plan_dir = make_plan_dir(str(gguf), work / "profile", args.hardware, plan_budget(f, total, reserve),
                                 out / "plans" / name, predictors=str(work / "predictors"))
        shutil.rmtree(plan_dir / "step-cache", ignore_errors=True)  # the machine builds its own (GiBs here)
    for name in ("profile", "predictors"):
        shutil.rmtree(out / name, ignore_errors=True)
    for stale in (out / "plans").glob("plan-*"):  # plans of other fractions would travel too
        if stale.name not in plan_names:
            shutil.rmtree(stale)
    shutil.copytree(work / "profile", out / "profile")
    if tokenizer.resolve() != (out / "tokenizer.gguf").resolve():
        tokenizer_only_gguf(tokenizer, out / "tokenizer.gguf")
    atomic_write_bytes(out / "model.sha256", (sha256(gguf) + "\n").encode())
    if not args.no_wheel and not list(out.glob("gguf-*.whl")):
        from importlib.metadata import version
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(out),
                        f"gguf=={version('gguf')}"], check=True)
    pred_dst = out / "predictors"
    if folder_bytes(out) + folder_bytes(work / "predictors") > RUN_LIMIT_BYTES:
        pred_dst = Path(args.predictors_out or str(out) + "-predictors") / "predictors"
        shutil.rmtree(pred_dst, ignore_errors=True)
    shutil.copytree(work / "predictors", pred_dst)
    stage = {"model": str(gguf), "predictors": str(pred_dst), "hardware": args.hardware, "request": request}
    atomic_write_json(out / "stage.json", stage)  # bench.gpu_ab --stage reads it (the model's path on this machine)
    print(f"staged {out} ({folder_bytes(out) >> 20} MiB); synth there: --shape {request['shape']} --sparsity "
          f"{request['sparsity']} --hot-share {request['hot_share']}")
    if folder_bytes(pred_dst) > RUN_LIMIT_BYTES:
        print(f"warning: the predictors alone are {folder_bytes(pred_dst) >> 20} MiB: more than a run carries (64 MiB "
              f"with the tracked tree); split predictors.safetensors by hand", file=sys.stderr)
    if pred_dst.parent != out:
        print(f"the predictors ({folder_bytes(pred_dst) >> 20} MiB) travel alone: first run carries {pred_dst.parent} "
              f"and copies it to /tmp; the second (within 30 s) carries {out} with PREDICTORS=/tmp/.../predictors")
    print(f"then: STAGE={out} SHAPE={request['shape']} SPARSITY={request['sparsity']} HOT_SHARE={request['hot_share']} "
          f"bash bench/gpu_sparse.sh")
    return 0


if __name__ == "__main__":
    sys.exit(main())
