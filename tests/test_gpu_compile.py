"""The GPU step's Triton kernels compiled for a real GPU (sm_90: H100 / H200) by Triton's own NVIDIA backend, on any
machine (``online/gpu/compile_check.py``, in a process of its own so that no interpreted kernels are in the way).
Triton's interpreter (tests/test_gpu_kernels.py) runs kernels as Python and misses what only the compiler checks: the
word and packed reads returned early from a constexpr branch, which the compiler type-checks past, and did not
compile for a GPU until that was mended."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest


def _has_nvidia_backend() -> bool:
    """Looked up on disk, not imported: importing Triton in this process would settle its interpreter setting before
    tests/test_gpu_kernels.py asks for the interpreter (its kernels would then not run on CPU tensors)."""
    spec = importlib.util.find_spec("triton")
    return spec is not None and any(os.path.isdir(os.path.join(p, "backends", "nvidia"))
                                    for p in spec.submodule_search_locations or ())


pytestmark = pytest.mark.skipif(not _has_nvidia_backend(), reason="Triton with its NVIDIA backend is not installed")


@pytest.fixture(scope="module")
def compiled() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "online.gpu.compile_check", "--arch", "90"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    return {r["variant"]: r for r in map(json.loads, run.stdout.splitlines())}


def test_every_matvec_read_compiles_for_sm90(compiled):
    """32-bit words (Q4 pair, Q8_0 alone with the column loop rolled), whole Q4 bytes, a byte per weight (a mixed
    pair), and the three down-row kernels."""
    from online.gpu.compile_check import DOWN_VARIANTS, MATVEC_VARIANTS
    assert len(compiled) == len(MATVEC_VARIANTS) + len(DOWN_VARIANTS)
    failed = {name: r["error"] for name, r in compiled.items() if not r["ok"]}
    assert not failed, failed


def test_word_reads_come_in_16_byte_loads_at_16_rows_by_512_columns(compiled):
    """The candidate word launch for tall matrices: each thread's words arrive as ld.global.v4.b32; the byte reads of
    the default launch have no 16-byte loads."""
    words = compiled["matvec q4+q4 words 16x512 C=512"]["loads"]
    assert words.get("ld.global.v4.b32", 0) > 0, words
    assert not any(".v4" in op for op in compiled["matvec q4+q8 bytes 8x128 C=256"]["loads"])
