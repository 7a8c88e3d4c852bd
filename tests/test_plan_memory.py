"""`tandem plan` lets go of the checkpoint it planned from.

pulp keeps the exception of each optional solver whose library is missing, and with it the traceback of its
first import: every frame then on the stack stayed alive, locals included. pipeline.plan imports pulp lazily
while it holds the float32 checkpoint, so the checkpoint lived to the end of the process and the plan's quality
measurement loaded two more models beside it (a 3B model ran out of 24 GB). Run in a fresh interpreter, where
pulp's first import happens inside plan().
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from synth import SynthSpec, get_shape, synthesize

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"

CHECK = """
import gc, sys, weakref
from tandem import pipeline
import tandem.core.loading as loading
assert "pulp" not in sys.modules, "pulp was imported before plan()"
held = []
real = loading.load_checkpoint
def load_checkpoint(model, **kw):
    ckpt = real(model, **kw)
    held.append(weakref.ref(ckpt))
    return ckpt
loading.load_checkpoint = load_checkpoint
model, profile, out = sys.argv[1:4]
pipeline.plan(model, profile, "cpu-only", out=out)
assert "pulp" in sys.modules
gc.collect()
print("alive" if held and held[0]() is not None else ("dead" if held else "not loaded"))
"""


@pytest.mark.skipif(not TOKENIZER.exists(), reason="SmolLM2's GGUF (the synthetic model's tokenizer) is not fetched")
def test_plan_releases_the_checkpoint(tmp_path):
    res = synthesize(SynthSpec(get_shape("tiny"), sparsity=0.9, sample_seqs=4), tmp_path, str(TOKENIZER))
    gguf = res.path
    profile = tmp_path / "profile"
    subprocess.run([sys.executable, "-m", "tandem.cli", "profile", "--model", str(gguf), "--tokens", "256",
                    "--no-progress", "--out", str(profile)], cwd=REPO, check=True, capture_output=True)
    proc = subprocess.run([sys.executable, "-c", CHECK, str(gguf), str(profile), str(tmp_path / "plan")], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == "dead"
