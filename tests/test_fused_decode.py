"""The fused C decode step against an independent torch statement of its arithmetic, the module path
and transformers; its eligibility rules, fallbacks and the native build."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from helpers_fused import matvec, quantized_activation, reference_step
from tandem.core.ffn import DenseExecutor
from online.execution.fused_decode import FusedDecodeStep, FusedDecodeUnavailable
from online.execution.gpu_tier import GpuTier
from online.execution.hybrid import ExecutionSettings, HybridExecutor
from online.execution.quantized_linear import quantize_attention
from tandem.core.generate import decode_one_token, prefill
from online.kernels import native
from online.kernels.native.structs import describe
from online.kernels.quantize import Fp32Weight, quantize
from tandem.core.kv_cache import KVCache
from tandem.core.loading.hf_loader import load_hf_folder
from tandem.core.model.build import build_model
from tandem.core.errors import TandemError

PROMPT = [5, 17, 42, 9, 77, 3, 101, 64]
RNG = np.random.default_rng(7)


def packed(folder, fmt: str = "int4", thresholds=None, down_format: str = "fp16", hot=None, threads: int = 2):
    model, ffn_layers = build_model(load_hf_folder(folder))
    settings = ExecutionSettings(weight_format=fmt, down_format=down_format, sparse=thresholds is not None,
                                 threads=threads)
    tier = GpuTier.create(1 << 30 if hot is not None else 0, "cpu")
    executor = HybridExecutor.build(model.cfg, ffn_layers, tier, settings, thresholds=thresholds, gpu_neurons=hot,
                                    head_weight=model.lm_head.weight)
    quantize_attention(model, fmt, settings.threads)
    return model, executor


def steps_match_reference(model, executor, tol: float, tokens=PROMPT) -> None:
    """Each fused step's logits equal the torch statement's (reference_step) within ``tol``, and where a
    threshold or gate cut skips neurons, the step counts the neurons the statement used (one may flip at
    the threshold)."""
    step = FusedDecodeStep.build(model, executor, residual_ratio=0.0)
    cache, ref_cache = KVCache(model.cfg, len(tokens)), KVCache(model.cfg, len(tokens))
    n_ff = model.cfg.intermediate_size
    for pos, tok in enumerate(tokens):
        before = executor.counters.ffn_neurons_active
        got = step(tok, pos, cache)
        ref, used = reference_step(model, executor, ref_cache, tok, pos, residual_ratio=0.0)
        torch.testing.assert_close(got, ref.float(), rtol=tol, atol=tol)
        if executor.settings.sparse:
            assert abs((executor.counters.ffn_neurons_active - before) - used) <= 1 and 0 < used < 2 * n_ff


def decode_all(step, model, executor, cache, tokens, start):
    return [step(t, start + i, cache) for i, t in enumerate(tokens)]


# --- row kernels ---------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["int4-g32", "int4-g64", "int8", "int8b", "fp32"])
@pytest.mark.parametrize("ratio", [-1.0, 0.0, 2.0])
def test_row_dot_matches_the_stated_rounding(fmt, ratio):
    lib = native.load_native().lib
    w = RNG.standard_normal((6, 192)).astype(np.float32)
    x = RNG.standard_normal(192).astype(np.float32)
    x[37] = 40.0  # an outlier block
    weight = {"int4-g32": lambda: quantize(w, "int4", 32), "int4-g64": lambda: quantize(w, "int4", 64),
              "int8": lambda: quantize(w, "int8"), "int8b": lambda: quantize(w, "int8b"),
              "fp32": lambda: Fp32Weight(w)}[fmt]()
    ref = (torch.from_numpy(w.astype(np.float32)) @ torch.from_numpy(x) if fmt == "fp32"
           else matvec(weight, torch.from_numpy(x), ratio))
    d = describe(weight)
    for r0, n in ((0, 6), (1, 4), (5, 1)):  # four-row kernels and their single-row tails
        got = np.zeros(n, np.float32)
        lib.tdm_dot_rows(ctypes.byref(d.desc), r0, n, x.ctypes.data, ratio, got.ctypes.data)
        torch.testing.assert_close(torch.from_numpy(got), ref[r0: r0 + n].float(), rtol=1e-5, atol=1e-4)


def test_residual_quantization_is_nearly_exact_and_plain_int8_is_not():
    x = torch.from_numpy(RNG.standard_normal(256).astype(np.float32))
    x[3] = 80.0
    err_plain = float((quantized_activation(x, -1.0) - x).abs().max())
    err_all = float((quantized_activation(x, 0.0) - x).abs().max())
    assert err_all < err_plain / 100  # ~15 bits where the residual is kept
    flagged_only = quantized_activation(x, 2.0)
    assert float((flagged_only[:32] - x[:32]).abs().max()) < err_plain / 100  # the outlier block is refined
    torch.testing.assert_close(flagged_only[32:], quantized_activation(x, -1.0)[32:])  # the others are not



@pytest.mark.parametrize("n_blocks", [1, 7, 8, 18, 48])  # the vector path quantizes 8 blocks at a time, the rest one by one
def test_activation_quantization_matches_its_statement_exactly(n_blocks):
    """quantize_q8 (codes, scales, block sums, residual blocks) against a numpy statement of it: codes
    round(x * (127 / amax)) half to even, d = amax / 127, sums in column order from 0.0, the residual
    where d > ratio * mean(d)."""
    lib = native.load_native().lib
    n = 32 * n_blocks
    x = (RNG.standard_normal(n) * RNG.uniform(0.01, 3.0, n)).astype(np.float32)
    x[5] = 60.0  # an outlier block
    x[32 * (n_blocks - 1):] *= np.float32(0.0) if n_blocks > 2 else np.float32(1.0)  # an all-zero block: d = 0
    if n_blocks > 3:  # a block of denormals: 127 / amax overflows, every code is 0 (as (int8_t)lrintf(inf) is)
        x[64:96] = (RNG.standard_normal(32) * 1e-39).astype(np.float32)
    q, r = np.zeros(n, np.int8), np.zeros(n, np.int8)
    d, dr, s = (np.zeros(n_blocks, np.float32) for _ in range(3))
    flagged = lib.tdm_quantize_q8(x.ctypes.data, n, 2.0, q.ctypes.data, r.ctypes.data, d.ctypes.data,
                                  dr.ctypes.data, s.ctypes.data)
    xb = x.reshape(n_blocks, 32)
    amax = np.abs(xb).max(axis=1)  # [nb]
    with np.errstate(over="ignore", divide="ignore"):
        inv = np.where(amax > 0, np.float32(127.0) / np.where(amax > 0, amax, 1), 0).astype(np.float32)
    inv = np.where(np.isfinite(inv), inv, np.float32(0.0))  # an overflowing scale: codes 0
    np.testing.assert_array_equal(q.reshape(n_blocks, 32), np.rint(xb * inv[:, None]).astype(np.int8))
    np.testing.assert_array_equal(d, amax / np.float32(127.0))
    sums = np.zeros(n_blocks, np.float32)
    for k in range(32):  # sequential float32 sums, column by column
        sums = sums + xb[:, k]
    np.testing.assert_array_equal(s, sums)
    mean_d = np.float32(0.0)
    for v in d:
        mean_d = np.float32(mean_d + v)
    mean_d = mean_d / np.float32(n_blocks)
    expect_flag = (d > np.float32(2.0) * mean_d) & (d > 0)
    assert flagged == int(expect_flag.sum()) and (flagged >= 1 or n_blocks == 1)
    np.testing.assert_array_equal(dr != 0, expect_flag)

# --- the step ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["llama", "llama-relu", "qwen2", "mistral", "llama-mqa"])
@pytest.mark.parametrize("fmt,kv_dtype", [("int4", torch.float32), ("int8", torch.float32), ("int4", torch.float16)])
def test_step_matches_reference_arithmetic(tiny_model_dir, kind, fmt, kv_dtype):
    """Every decode step (rope, GQA, biases, sliding window, KV writes, head) equals the torch
    statement of the same rounding; the KV cache the kernel writes equals the reference's. A float16
    cache: torch rounds the reference's keys and values on store and widens them on read."""
    folder, _ = tiny_model_dir(kind)
    model, executor = packed(folder, fmt)
    step = FusedDecodeStep.build(model, executor, residual_ratio=0.0)
    cache, ref_cache = KVCache(model.cfg, 48, dtype=kv_dtype), KVCache(model.cfg, 48, dtype=kv_dtype)
    tokens = PROMPT + [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]  # past the window (16)
    for pos, tok in enumerate(tokens):
        got = step(tok, pos, cache)
        ref, _ = reference_step(model, executor, ref_cache, tok, pos, residual_ratio=0.0)
        torch.testing.assert_close(got, ref.float(), rtol=1e-4, atol=1e-4)
    tol = 1e-4 if kv_dtype == torch.float32 else 1e-3  # float16: one ulp where the two roundings straddle
    torch.testing.assert_close(cache.keys.float(), ref_cache.keys.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(cache.values.float(), ref_cache.values.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("kind", ["llama", "mistral"])
def test_float16_kv_cache_rounds_like_numpy_and_stays_close_to_float32(tiny_model_dir, kind):
    """The same tokens through the step on a float32 and a float16 cache: layer 0's keys and values (which
    no attention output reaches) are the float32 rows rounded to nearest even (numpy's float16), bit for
    bit; the logits stay within float16's rounding of the float32 cache's (a random tiny model's logits
    are too close together for its greedy tokens to say more: the SmolLM2 test below checks those)."""
    folder, _ = tiny_model_dir(kind)
    model, executor = packed(folder, "int4")
    step = FusedDecodeStep.build(model, executor)
    full, half = KVCache(model.cfg, 48), KVCache(model.cfg, 48, dtype=torch.float16)
    tokens = PROMPT + list(range(20, 44))  # past mistral's window (16)
    for pos, tok in enumerate(tokens):
        a, b = step(tok, pos, full), step(tok, pos, half)
        torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)
    n = len(tokens)
    for name in ("keys", "values"):
        want = getattr(full, name)[0, :, :n].numpy().astype(np.float16)
        np.testing.assert_array_equal(getattr(half, name)[0, :, :n].numpy(), want)
    assert not torch.equal(half.keys[1:, :, :n].float(), full.keys[1:, :, :n])  # later layers read rounded rows


def test_smollm2_float16_kv_keeps_its_perplexity_and_greedy_tokens():
    """The real model through the fused step, f16 cache (the default) against f32: perplexity within 1% and
    the same greedy token at each of 48 steps whose choice is not a near-tie; the engine reports the type,
    and module decoding keeps f32. (On
    1,536 calibration tokens f16 moved this step's perplexity by +0.47%, as much as a 1e-4 relative noise
    on the f32 keys did: any perturbation re-draws the int8 activations' rounding; the module graph's
    perplexity moved by < 0.01% with K and V rounded to float16.)"""
    from online import Engine
    from tandem.core.loading.resolve import resolve_model_path
    try:
        resolve_model_path("smollm2")
    except Exception:
        pytest.skip("SmolLM2 is not in models/")
    half, full = (Engine.load("smollm2", threads=2, weight_format="int4", kv_cache_type=t) for t in ("f16", "f32"))
    assert (half.kv_cache_type, full.kv_cache_type) == ("f16", "f32") and half.decode_path == "fused"
    ids = half.tokenizer.encode("The old lighthouse keeper kept a notebook in which he wrote down every ship "
                                "that passed the point, the weather and the colour of the sea. " * 3)
    ppl = [e.perplexity(ids, window_tokens=256, stride_tokens=256, decode_steps=True)[0] for e in (half, full)]
    assert abs(ppl[0] / ppl[1] - 1) < 1e-2, ppl
    # Greedy tokens: both caches score the f32 cache's own greedy continuation (teacher-forced, every
    # position: logits row i predicts token i + 1), and pick its tokens wherever the f32 logits' top two are
    # more than 1.0 apart (the f16 cache moves that gap by up to ~0.85 here: nearer ones can go either way);
    # their next-token distributions stay within a mean KL of 3e-3 (measured 1.2e-3; keys cut to three mantissa
    # bits give 6.6e-3, and keep every decisive choice).
    from tandem.core.kv_cache import KVCache
    seq = ids[:40] + full.generate(ids[:40], max_new_tokens=48, ignore_eos=True).token_ids
    logits = [e.compiled_decode.step_many(seq, 0, KVCache(e.model.cfg, len(seq), dtype=d))[39:-1]  # [48, vocab]
              for e, d in ((half, torch.float16), (full, torch.float32))]
    top2 = logits[1].topk(2).values  # [48, 2]
    decisive = (top2[:, 0] - top2[:, 1]) > 1.0
    assert decisive.sum() >= 40
    assert torch.equal(logits[1].argmax(-1), torch.tensor(seq[40:]))  # the f32 step's own greedy choices
    assert torch.equal(logits[0].argmax(-1)[decisive], logits[1].argmax(-1)[decisive])
    log16, log32 = (torch.log_softmax(x.double(), -1) for x in logits)  # [48, vocab]
    assert float((log32.exp() * (log32 - log16)).sum(-1).mean()) < 3e-3
    assert Engine.load("smollm2", threads=2, weight_format="int4", fused_decode=False).kv_cache_type == "f32"


def test_step_rejects_kv_caches_it_cannot_read(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    model, executor = packed(folder, "int4")
    step = FusedDecodeStep.build(model, executor)
    with pytest.raises(TandemError, match="float16 or float32"):
        step(5, 0, KVCache(model.cfg, 8, dtype=torch.bfloat16))


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("cut", [None, 0.0])
def test_rows_split_over_any_thread_count(tmp_path, threads, cut):
    """Every FFN row is computed once whatever the thread count: 600 neurons are 19 slices of 32 (the last
    short) and 3 gate-cut slices of 256, split into contiguous runs per thread (dense rows, the ReLU gate
    cut) that may be empty; the step still equals the torch statement of its arithmetic."""
    import transformers as tf
    from conftest import TINY_COMMON

    torch.manual_seed(3)
    cfg = tf.LlamaConfig(num_key_value_heads=2, intermediate_size=600, hidden_act="relu", **TINY_COMMON)
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(tmp_path)
    model, executor = packed(tmp_path, "int4", thresholds=None if cut is None else [cut] * 2, threads=threads)
    steps_match_reference(model, executor, tol=1e-4)


def test_sparse_step_counts_the_neurons_it_uses(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    model, executor = packed(folder, "int4", thresholds=[0.02] * 2)
    steps_match_reference(model, executor, tol=1e-3)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_step_continues_a_prefill_like_the_module_path(tiny_model_dir, kind):
    """Prefill through the modules, then decode: the fused step (15-bit activations) stays within
    float noise of the module path and of transformers on the same packed weights."""
    folder, _ = tiny_model_dir(kind)
    model, executor = packed(folder, "int8")
    step = FusedDecodeStep.build(model, executor, residual_ratio=0.0)
    fused_cache, module_cache = KVCache(model.cfg, 32), KVCache(model.cfg, 32)
    prefill(model, executor, fused_cache, PROMPT)
    prefill(model, executor, module_cache, PROMPT)
    for i, tok in enumerate([3, 99, 4]):
        pos = len(PROMPT) + i
        got = decode_one_token(model, executor, fused_cache, tok, pos, step)
        ref = decode_one_token(model, executor, module_cache, tok, pos)
        torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)


def test_prompts_prefill_through_the_step_like_single_steps(tiny_model_dir):
    """A prompt, short or longer than one 64-token call, is prefilled through the fused step: its logits
    and every KV row equal feeding it token by token through the single-token step (so the module
    engine, the cached engine and speculation start from the same cache). All-logits requests go
    through the module graph."""
    folder, _ = tiny_model_dir("llama")
    model, executor = packed(folder, "int4")
    step = FusedDecodeStep.build(model, executor)
    for prompt in (PROMPT, [(7 * i + 3) % 100 for i in range(100)]):  # 100: two step calls
        n = len(prompt)
        one_call, by_token = KVCache(model.cfg, 120), KVCache(model.cfg, 120)
        got = prefill(model, executor, one_call, prompt, compiled=step)  # [vocab]
        ref = decode_all(step, model, executor, by_token, prompt, 0)[-1]
        assert torch.equal(got, ref)
        assert torch.equal(one_call.keys[:, :, :n], by_token.keys[:, :, :n])
        assert torch.equal(one_call.values[:, :, :n], by_token.values[:, :, :n])
    all_logits = prefill(model, executor, KVCache(model.cfg, 32), PROMPT, all_logits=True, compiled=step)
    via_modules = prefill(model, executor, KVCache(model.cfg, 32), PROMPT, all_logits=True)
    assert torch.equal(all_logits, via_modules)


def test_plain_int8_activations_stay_close_to_float(tiny_model_dir):
    folder, hf_model = tiny_model_dir("llama")
    model, ffn_layers = build_model(load_hf_folder(folder))
    dense = DenseExecutor(model.cfg, ffn_layers)
    ref = prefill(model, dense, KVCache(model.cfg, 32), PROMPT, all_logits=True)  # [T, vocab]
    model, executor = packed(folder, "int8")
    step = FusedDecodeStep.build(model, executor, residual_ratio=-1.0)
    cache = KVCache(model.cfg, 32)
    got = torch.stack(decode_all(step, model, executor, cache, PROMPT, 0))
    assert float((got - ref).abs().max() / ref.abs().max()) < 0.03


def test_engine_uses_the_fused_step_and_reports_it(tiny_model_dir):
    from online.engine import Engine
    folder, _ = tiny_model_dir("llama")
    fused = Engine.load(folder, weight_format="int8")
    modules = Engine.load(folder, weight_format="int8", fused_decode=False)
    assert fused.decode_path == "fused" and modules.decode_path == "modules"
    a = fused.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
    b = modules.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
    assert a.stats["decode_path"] == "fused" and b.stats["decode_path"] == "modules"
    assert len(a.token_ids) == len(b.token_ids) == 6
    assert a.stats["ffn_sparsity"] == b.stats["ffn_sparsity"] == 0.0
    # two generations with different cache capacities rebind the step to each cache
    long = fused.generate(PROMPT * 8, max_new_tokens=3, ignore_eos=True)
    again = fused.generate(PROMPT, max_new_tokens=6, ignore_eos=True)
    assert len(long.token_ids) == 3 and again.token_ids == a.token_ids
    torch.testing.assert_close(fused.step_logits(PROMPT), modules.step_logits(PROMPT), rtol=0.05, atol=0.05)


# --- eligibility and fallbacks --------------------------------------------------------------

def test_what_the_step_does_not_cover_falls_back_with_a_reason(tiny_model_dir):
    from online.engine import Engine
    folder, _ = tiny_model_dir("llama")
    assert Engine.load(folder).decode_path == "modules"  # dense float32: the reference
    fp32 = Engine.load(folder, weight_format="fp32")
    assert fp32.decode_path == "modules" and "not packed" in fp32.decode_path_reason
    model, executor = packed(folder, "int4", hot=[torch.arange(8)] * 2)
    with pytest.raises(FusedDecodeUnavailable, match="GPU tier"):
        FusedDecodeStep.build(model, executor)
    # OPT and MoE models decode fused (test_fused_opt_moe.py); experts cached on a CUDA tier do not


def test_step_rejects_positions_outside_the_cache(tiny_model_dir):
    folder, _ = tiny_model_dir("llama")
    model, executor = packed(folder)
    step = FusedDecodeStep.build(model, executor)
    cache = KVCache(model.cfg, 8)
    with pytest.raises(TandemError, match="outside the KV cache"):
        step(1, 8, cache)
    with pytest.raises(TandemError, match="vocabulary"):
        step(model.cfg.vocab_size, 0, cache)


def test_no_compiler_means_module_decoding(tiny_model_dir, tmp_path, monkeypatch):
    from online.engine import Engine
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(native.NativeUnavailable, match="no C compiler"):
        native.load_native()
    engine = Engine.load(tiny_model_dir("llama")[0], weight_format="int8")
    assert engine.decode_path == "modules" and "compiler" in engine.decode_path_reason
    assert len(engine.generate(PROMPT, max_new_tokens=3, ignore_eos=True).token_ids) == 3
    assert not list(tmp_path.rglob("*.so"))


def test_native_build_is_cached_and_written_atomically(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    first = native.load_native()
    built = sorted(p.name for p in (tmp_path / "native").iterdir())
    assert built == [first.path.name]  # no temp files left behind
    mtime = first.path.stat().st_mtime_ns
    assert native.load_native().path == first.path and first.path.stat().st_mtime_ns == mtime
    monkeypatch.setenv("TANDEM_NATIVE", "0")
    with pytest.raises(native.NativeUnavailable, match="TANDEM_NATIVE=0"):
        native.load_native()


def test_perplexity_through_the_decode_path(tiny_model_dir, tmp_path, capsys):
    import json

    from online.engine import Engine
    from tandem.cli import main as tandem_main
    folder, _ = tiny_model_dir("llama")
    engine = Engine.load(folder, weight_format="int8")
    ids = (PROMPT * 6)[:40]
    by_prefill, n = engine.perplexity(ids, window_tokens=16, stride_tokens=8)
    by_steps, m = engine.perplexity(ids, window_tokens=16, stride_tokens=8, decode_steps=True)
    assert n == m == len(ids) - 1
    assert by_steps == pytest.approx(by_prefill, rel=0.02) and by_steps != by_prefill  # int8 activations
    from helpers_tiny import build_tiny_chat_model
    chat = build_tiny_chat_model(tmp_path / "chat")
    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 6)
    rc = tandem_main(["perplexity", "--model", str(chat), "--text-file", str(text), "--weight-format", "int8",
                      "--decode-steps", "--json"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["decode_path"] == "fused"


def test_widths_the_kernels_do_not_read_fall_back(tmp_path):
    """hidden 48 (not a multiple of 32): per-row int8 works on the module path; the fused step
    declines with the reason instead of failing the load."""
    import transformers as tf

    from online.engine import Engine
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(vocab_size=96, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    tf.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    engine = Engine.load(tmp_path, weight_format="int8")
    assert engine.decode_path == "modules" and "divisible by 32" in engine.decode_path_reason
    assert len(engine.generate([1, 2, 3], max_new_tokens=4, ignore_eos=True).token_ids) == 4
    with pytest.raises(TandemError, match="int4 down-projection rows only in groups of 32"):
        describe(quantize(RNG.standard_normal((4, 64)).astype(np.float32), "int4", 64), dot_input=False)


def test_unwritable_cache_folder_falls_back_to_the_temp_dir(tmp_path, monkeypatch):
    blocked = tmp_path / "file-not-folder"
    blocked.write_text("x")  # a file where the cache folder should be: mkdir fails
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(blocked))
    monkeypatch.setattr(native.tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    folder = native._writable_native_dir()  # where load_native builds (building itself: the test above)
    assert folder == tmp_path / "tmp" / f"tandem-native-{native.os.getuid()}" and folder.is_dir()
    assert folder.stat().st_mode & 0o777 == 0o700  # a shared library is loaded from there: this user's only
