"""The prepared-step cache (online/engine_cache.py): an engine loaded from it generates what the
engine built from the checkpoint generates, its step's logits are bit-identical to the fused step's,
stale and corrupt files are rebuilt, and plain generation on it never imports torch."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from online import Engine
from online.execution.native_step import ArrayKVCache

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [3, 17, 99, 4, 8, 61, 23, 5, 42, 7]


@pytest.fixture(scope="module")
def cpu_plan(tiny_model_dir, tmp_path_factory):
    from helpers_plans import tiny_plan
    folder, _ = tiny_model_dir("llama")
    plan_dir = tiny_plan(folder, tmp_path_factory.mktemp("step-cache"), "rtx4090", 0)  # all-CPU: the fused step
    return folder, plan_dir


def _cache_files(plan_dir: Path) -> list[Path]:
    return sorted((plan_dir / "step-cache").glob("*.safetensors"))


def test_cached_engine_generates_what_the_built_engine_generates(cpu_plan):
    folder, plan_dir = cpu_plan
    reference = Engine.load(str(folder), plan=plan_dir, step_cache=False)
    assert reference.decode_path == "fused" and not reference.runs_on_cached_step
    first = Engine.load(str(folder), plan=plan_dir)  # writes the cache, then runs on it
    assert first.runs_on_cached_step and len(_cache_files(plan_dir)) == 1
    cached = Engine.load(str(folder), plan=plan_dir)
    assert cached.runs_on_cached_step and cached._model is None  # nothing built from the checkpoint
    want = reference.generate(PROMPT, max_new_tokens=20, ignore_eos=True)
    for engine in (first, cached):
        got = engine.generate(PROMPT, max_new_tokens=20, ignore_eos=True)
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        assert got.stats["ffn_sparsity"] == want.stats["ffn_sparsity"]
        assert got.stats["weight_bytes_per_token"] == want.stats["weight_bytes_per_token"]
    assert cached._model is None
    assert set(want.stats) == set(cached.generate(PROMPT, max_new_tokens=2).stats)


def test_cached_step_logits_are_bit_identical_to_the_fused_step(cpu_plan):
    """A long prompt prefills through the cached step in 64-token pieces: equal to single fused steps."""
    folder, plan_dir = cpu_plan
    reference = Engine.load(str(folder), plan=plan_dir, step_cache=False)
    cached = Engine.load(str(folder), plan=plan_dir)
    ids = [int(t) for t in torch.randint(0, cached.config.vocab_size, (100,), generator=torch.Generator().manual_seed(1))]
    want = reference.step_logits(ids).numpy()  # [100, vocab], one fused step per token
    cfg = cached.config
    cache = ArrayKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 128)
    step = cached._native_step
    np.testing.assert_array_equal(step.prefill_logits(ids[:99], 0, cache), want[98])
    np.testing.assert_array_equal(step(ids[99], 99, cache), want[99])


def test_stale_cache_is_rebuilt(cpu_plan, tmp_path):
    folder, plan_dir = cpu_plan
    plan_copy = tmp_path / plan_dir.name
    shutil.copytree(plan_dir, plan_copy)
    shutil.copytree(plan_dir.parent / "profile", tmp_path / "profile")
    assert Engine.load(str(folder), plan=plan_copy)._model is None  # the copied cache is valid here too
    plan_json = plan_copy / "plan.json"
    plan_json.write_text(json.dumps(json.loads(plan_json.read_text()), indent=1))  # same plan, other bytes
    rebuilt = Engine.load(str(folder), plan=plan_copy)
    assert rebuilt._model is not None and rebuilt.runs_on_cached_step  # built from the checkpoint, cache rewritten
    assert Engine.load(str(folder), plan=plan_copy)._model is None
    other = Engine.load(str(folder), plan=plan_copy, down_format="fp32")  # other packing: its own file
    assert other._model is not None and len(_cache_files(plan_copy)) == 2


@pytest.mark.parametrize("damage", ["truncate", "description", "garbage"])
def test_corrupt_cache_is_rebuilt_with_a_warning(cpu_plan, tmp_path, capsys, damage):
    folder, plan_dir = cpu_plan
    plan_copy = tmp_path / plan_dir.name
    shutil.copytree(plan_dir, plan_copy)
    shutil.copytree(plan_dir.parent / "profile", tmp_path / "profile")
    path = _cache_files(plan_copy)[0]
    data = bytearray(path.read_bytes())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "description":
        at = data.index(b'\\"rows\\": ') + len(b'\\"rows\\": ')
        data[at] = ord("9") if data[at] != ord("9") else ord("8")  # still valid JSON, wrong geometry
    else:
        data[:64] = b"\xff" * 64
    path.write_bytes(bytes(data))
    engine = Engine.load(str(folder), plan=plan_copy)
    assert "step cache unusable, rebuilding it" in capsys.readouterr().err
    assert engine.runs_on_cached_step and engine._model is not None
    assert Engine.load(str(folder), plan=plan_copy)._model is None  # the rewritten file is good


def test_plain_generate_on_the_cache_does_not_import_torch(cpu_plan):
    folder, plan_dir = cpu_plan
    Engine.load(str(folder), plan=plan_dir)  # the cache exists
    code = (f"import sys\nfrom online import Engine\ne = Engine.load({str(folder)!r}, plan={str(plan_dir)!r})\n"
            f"r = e.generate({PROMPT!r}, max_new_tokens=5, ignore_eos=True)\n"
            "print(len(r.token_ids), e.runs_on_cached_step, 'torch' in sys.modules, 'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["5", "True", "False", "False"]


def test_module_graph_is_built_on_demand(cpu_plan):
    folder, plan_dir = cpu_plan
    engine = Engine.load(str(folder), plan=plan_dir)
    assert engine._model is None
    plain = engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True)
    logits = engine.logits(PROMPT)  # needs the torch model: built now
    assert engine._model is not None and logits.shape == (len(PROMPT), engine.config.vocab_size)
    engine.compiled_decode = engine.compiled_decode  # a step set from outside: requests run on it
    assert not engine.runs_on_cached_step
    assert engine.generate(PROMPT, max_new_tokens=8, ignore_eos=True).token_ids == plain.token_ids


def test_smollm2_chat_on_the_cache_matches_the_torch_path(smollm2_path, tmp_path):
    plan_src = ROOT / "profiles" / "SmolLM2-135M-Instruct.Q4_1"
    if not (plan_src / "plan-probed-0").is_dir():
        pytest.skip("no SmolLM2 plan in profiles/")
    shutil.copytree(plan_src / "plan-probed-0", tmp_path / "plan", ignore=shutil.ignore_patterns("step-cache"))
    shutil.copytree(plan_src / "profile", tmp_path / "profile")
    engine = Engine.load(str(smollm2_path), plan=tmp_path / "plan", threads=2)  # builds, writes, runs on the cache
    assert engine.runs_on_cached_step and engine._model is not None
    from tandem.core.loading.tokenizer_state import tokenizer_from_bytes, tokenizer_to_bytes
    tok = tokenizer_from_bytes(tokenizer_to_bytes(engine.tokenizer))
    chat = [{"role": "user", "content": "Hi! Tell me about Paris, its river and ümlauts 🙂"}]
    assert tok.encode_chat(chat) == engine.tokenizer.encode_chat(chat)
    assert tok.eos_token_ids == engine.tokenizer.eos_token_ids and tok.decode(range(400)) == engine.tokenizer.decode(range(400))
    cached = engine.generate(chat, max_new_tokens=16)
    engine.compiled_decode = engine.compiled_decode  # back onto the torch path (FusedDecodeStep)
    torch_path = engine.generate(chat, max_new_tokens=16)
    assert cached.text == torch_path.text and cached.token_ids == torch_path.token_ids


def test_the_shared_folder_evicts_the_least_recently_used_beyond_its_cap(tmp_path, monkeypatch):
    """Caches without a plan folder share one folder; past TANDEM_STEP_CACHE_BYTES the oldest files
    go (never the one just written), so loading many models cannot fill the disk."""
    import os
    from online.engine_cache import evict_shared
    monkeypatch.setenv("TANDEM_STEP_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TANDEM_STEP_CACHE_BYTES", "2500")
    files = []
    for i in range(5):  # 1000 bytes each, modified at t = 100 * i (file 4 is the newest)
        p = tmp_path / f"step-{i:016x}.safetensors"
        p.write_bytes(b"x" * 1000)
        os.utime(p, (100 * i, 100 * i))
        files.append(p)
    os.utime(files[0], (1000, 1000))  # file 0 was just read: the newest now
    removed = evict_shared(files[3])
    assert sorted(removed) == sorted([files[1], files[2]])
    assert [p.exists() for p in files] == [True, False, False, True, True]
    assert evict_shared(files[3]) == []  # under the cap now
    monkeypatch.setenv("TANDEM_STEP_CACHE_BYTES", "0")
    assert evict_shared(files[3]) and [p.exists() for p in files] == [False, False, False, True, False]



def test_interleaved_weights_must_hold_their_padded_last_group():
    """An interleaved (eight-row) weight is read a whole group of eight rows at a time: a cache whose array
    ends at rows * row_bytes (not the padded group) or whose width is not whole blocks is refused."""
    from types import SimpleNamespace

    from online.execution.native_step import _check_weight
    from online.execution.step_cache import StepCacheError
    from online.kernels.quantize import KIND_I4H, KIND_I4X8

    d = {"data": {"array": "w"}, "rows": 0, "row_bytes": 0}
    w = SimpleNamespace(kind=KIND_I4X8, rows=21, cols=64, row_bytes=40, scale_stride=0)
    _check_weight(w, d, {"w": np.zeros(24 * 40, np.uint8)})  # three whole groups
    with pytest.raises(StepCacheError, match="outside"):
        _check_weight(w, d, {"w": np.zeros(21 * 40, np.uint8)})
    _check_weight(SimpleNamespace(**{**vars(w), "kind": KIND_I4H}), d, {"w": np.zeros(21 * 40, np.uint8)})  # in place
    with pytest.raises(StepCacheError, match="whole blocks"):
        _check_weight(SimpleNamespace(**{**vars(w), "cols": 16}), d, {"w": np.zeros(24 * 40, np.uint8)})
