"""Continuous batching in the scheduler (no HTTP): outputs under load equal the same request served
alone and an independent reference (the single-token step on a contiguous cache, or
``Engine.generate``); prefix reuse gives the cold-prefill logits; pool exhaustion preempts and every
request still completes exactly; skip-join MLFQ lets a short request pass a long one; the pool
returns to empty."""
from __future__ import annotations

import asyncio
import random

import pytest
import torch

from online import Engine
from tandem.core.generate import prefill
from online.server.batch_config import BatchConfig
from online.server.metrics import Metrics
from online.server.scheduler import Scheduler
from helpers_tiny import build_tiny_chat_model


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-batch"), max_position_embeddings=512)


@pytest.fixture(scope="module")
def fused_engine(tiny_dir):
    engine = Engine.load(str(tiny_dir), weight_format="int4")
    assert engine.decode_path == "fused", engine.decode_path_reason
    return engine


@pytest.fixture(scope="module")
def dense_engine(tiny_dir):
    return Engine.load(str(tiny_dir))


def prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of mixed lengths (1..45 tokens: several blocks and prefill chunks)."""
    rng = random.Random(seed)
    return [[rng.randrange(3, 300) for _ in range(rng.choice([1, 3, 7, 12, 20, 33, 45]))] for _ in range(n)]


def serve(engine, specs: list[dict], batch: BatchConfig, spy=None):
    """Run ``specs`` (prompt, max_tokens, delay_s, after, stop, cancel_after, n, temperature, seed) through one
    scheduler concurrently; returns ([GenerationResult | list | None per spec], scheduler, metrics)."""
    async def main():
        metrics = Metrics()
        sched = Scheduler(engine, max_queue=512, request_timeout_s=120.0, metrics=metrics, batch=batch)
        if spy is not None:
            spy(sched)
        sched.start()
        loop = asyncio.get_running_loop()

        done = [asyncio.Event() for _ in specs]

        async def one(i, spec):
            try:
                return await run_one(spec)
            finally:
                done[i].set()

        async def run_one(spec):
            await asyncio.sleep(spec.get("delay_s", 0.0))
            if "after" in spec:  # start once that spec has finished
                await done[spec["after"]].wait()
            sampling = {"temperature": spec.get("temperature", 0.0), "seed": spec.get("seed"),
                        "stop": spec.get("stop"), "top_k": 0, "top_p": 1.0, "ignore_eos": True}
            job = sched.submit(spec["prompt"], spec["max_tokens"], sampling, stream_pieces=True, loop=loop,
                               n=spec.get("n", 1))
            pieces = 0
            while True:
                kind, value = await job.events.get()
                if kind == "piece":
                    pieces += 1
                    if pieces == spec.get("cancel_after"):
                        job.cancel()
                        return None
                elif kind == "done":
                    return value
                else:
                    raise AssertionError(value.message)
        try:
            results = await asyncio.gather(*(one(i, s) for i, s in enumerate(specs)))
            for _ in range(500):
                if sched.queue_depth == 0 and sched.running == 0 and not sched.loop.sequences:
                    break
                await asyncio.sleep(0.01)
            sched.pool.check_empty()  # no leaked blocks
        finally:
            await loop.run_in_executor(None, sched.close)
        return results, sched, metrics
    return asyncio.run(main())


def single_step_greedy(engine, prompt: list[int], max_tokens: int) -> tuple[list[int], torch.Tensor]:
    """Independent reference: the single-token fused step on a contiguous cache, greedy (EOS ignored).
    Returns the tokens and the logits after the prompt."""
    cache = engine.new_kv_cache(len(prompt) + max_tokens)
    for pos, tok in enumerate(prompt):
        logits = engine.compiled_decode(tok, pos, cache)
    first_logits, out = logits.clone(), []
    for i in range(max_tokens):
        out.append(int(torch.argmax(logits)))
        if i < max_tokens - 1:
            logits = engine.compiled_decode(out[-1], len(prompt) + i, cache)
    return out, first_logits


def module_prefill_greedy(engine, prompt: list[int], max_tokens: int) -> list[int]:
    """Reference for ``prefill="modules"``: the prompt through the module graph in one chunk, then greedy
    single-token fused steps."""
    cache = engine.new_kv_cache(len(prompt) + max_tokens)
    logits, out = prefill(engine.model, engine.executor, cache, prompt), []
    for i in range(max_tokens):
        out.append(int(torch.argmax(logits)))
        if i < max_tokens - 1:
            logits = engine.compiled_decode(out[-1], len(prompt) + i, cache)
    return out


@pytest.mark.parametrize("prefill", ["step", "modules"])
def test_fused_batch_under_load_equals_references_and_served_alone(fused_engine, prefill):
    """Mixed prompt lengths, staggered arrivals (joins mid-stream), a cancellation; decode tokens of all
    running sequences share one step_batch call. References: the single-token step on a contiguous
    cache (prefill through the step) or the module graph's prefill (prompts within one chunk)."""
    batch = BatchConfig(block_tokens=4, prefill_chunk_tokens=32, prefill=prefill)
    specs = [{"prompt": p, "max_tokens": 12 + 3 * i, "delay_s": 0.004 * i} for i, p in enumerate(prompts(8))]
    specs[3]["cancel_after"] = 2
    calls = []
    results, sched, metrics = serve(fused_engine, specs, batch,
                                    spy=lambda s: _count_step_batch_calls(s, calls))
    assert sched.loop.step.path == "fused"
    assert max(len(c) for c in calls) > 1  # several sequences shared a step_batch call
    for spec, result in zip(specs, results):
        if spec.get("cancel_after"):
            assert result is None
            continue
        if prefill == "step":
            assert result.token_ids == single_step_greedy(fused_engine, spec["prompt"], spec["max_tokens"])[0]
        elif len(spec["prompt"]) <= 32:
            assert result.token_ids == module_prefill_greedy(fused_engine, spec["prompt"], spec["max_tokens"])
        alone, _, _ = serve(fused_engine, [{k: v for k, v in spec.items() if k != "delay_s"}], batch)
        assert alone[0].token_ids == result.token_ids and alone[0].text == result.text
    assert metrics.cancelled_total == 1


def _count_step_batch_calls(sched, calls: list) -> None:
    step = sched.engine.compiled_decode
    original = type(step).step_batch

    def spy(tokens, positions, tables, pool, logits_for=None):
        calls.append(list(positions))
        return original(step, tokens, positions, tables, pool, logits_for)
    sched.loop.step.engine = _EngineView(sched.engine, spy)


class _EngineView:
    """The engine with its compiled step's ``step_batch`` replaced (the spy above)."""

    def __init__(self, engine, step_batch):
        self._engine, self.compiled_decode = engine, _StepView(engine.compiled_decode, step_batch)

    def __getattr__(self, name):
        return getattr(self._engine, name)


class _StepView:
    def __init__(self, step, step_batch):
        self._step, self.step_batch = step, step_batch

    def __getattr__(self, name):
        return getattr(self._step, name)


@pytest.mark.parametrize("prefill", ["step", "modules"])
def test_prefix_reuse_gives_cold_prefill_logits(fused_engine, prefill):
    system = prompts(1, seed=5)[0] * 2  # 90 tokens shared
    a, b = system + [11, 12, 13], system + [21, 22]
    batch = BatchConfig(block_tokens=8, prefill_chunk_tokens=32, prefill=prefill)
    seen = {}

    def spy(sched):
        run = sched.loop.step.run

        def recording(items):
            out = run(items)
            for seq, logits in out.items():
                if seq.n_generated == 0:
                    seen.setdefault(tuple(seq.tokens), []).append(logits.clone())
            return out
        sched.loop.step.run = recording

    results, sched, metrics = serve(fused_engine, [{"prompt": a, "max_tokens": 3},
                                                   {"prompt": b, "max_tokens": 3, "after": 0}], batch, spy=spy)
    hit = results[1].stats["cached_tokens"]
    whole = 8 if prefill == "step" else 32  # module prefill reuses whole chunks only
    assert hit == len(system) // whole * whole and results[0].stats["cached_tokens"] == 0
    assert sched.pool.counters.hits_tokens >= hit
    cold, _, _ = serve(fused_engine, [{"prompt": b, "max_tokens": 3}], batch, spy=spy)
    assert cold[0].stats["cached_tokens"] == 0
    warm_logits, cold_logits = seen[tuple(b)]
    assert torch.equal(warm_logits, cold_logits)  # reused KV = cold prefill, bit for bit
    assert results[1].token_ids == cold[0].token_ids
    if prefill == "step":  # and both equal the single-token step on a contiguous cache
        want_tokens, want_logits = single_step_greedy(fused_engine, b, 3)
        assert torch.equal(warm_logits, want_logits) and results[1].token_ids == want_tokens


@pytest.mark.parametrize("path", ["fused-step", "fused-modules", "modules"])
def test_pool_exhaustion_preempts_and_everything_completes(path, fused_engine, dense_engine):
    engine = fused_engine if path.startswith("fused") else dense_engine
    per_token = 2 * engine.config.num_layers * engine.config.num_kv_heads * engine.config.head_dim * 4
    batch = BatchConfig(block_tokens=4, prefill_chunk_tokens=8, kv_budget_bytes=per_token * 4 * 30,  # 30 blocks
                        prefill="step" if path == "fused-step" else "modules")
    specs = [{"prompt": p, "max_tokens": 40} for p in prompts(6, seed=3)]  # ~6 x (prompt + 40) tokens > 120
    results, sched, metrics = serve(engine, specs, batch)
    assert metrics.preemptions_total > 0
    for spec, result in zip(specs, results):
        if path == "fused-step":
            assert result.token_ids == single_step_greedy(engine, spec["prompt"], spec["max_tokens"])[0]
        alone, _, _ = serve(engine, [spec], batch)
        assert result.token_ids == alone[0].token_ids


def test_modules_path_matches_engine_generate_under_load(dense_engine):
    """The fallback path (dense float32): under load == Engine.generate (prompts shorter than a chunk)."""
    batch = BatchConfig(block_tokens=4, prefill_chunk_tokens=64)
    specs = [{"prompt": p, "max_tokens": 10 + i, "delay_s": 0.003 * i} for i, p in enumerate(prompts(6, seed=9))]
    results, sched, _ = serve(dense_engine, specs, batch)
    assert sched.loop.step.path == "modules"
    for spec, result in zip(specs, results):
        ref = dense_engine.generate(spec["prompt"], max_new_tokens=spec["max_tokens"], ignore_eos=True)
        assert result.token_ids == ref.token_ids and result.text == ref.text


@pytest.mark.parametrize("path", ["modules", "fused"])
def test_stop_strings_under_load_equal_served_alone(path, dense_engine, fused_engine):
    engine = fused_engine if path == "fused" else dense_engine
    batch = BatchConfig(block_tokens=4, prefill_chunk_tokens=16)
    base = [{"prompt": p, "max_tokens": 16} for p in prompts(4, seed=11)]
    alone = [serve(engine, [s], batch)[0][0] for s in base]
    specs = [{**s, "stop": [r.text[4:6]]} if len(r.text) > 6 else s for s, r in zip(base, alone)]
    assert sum("stop" in s for s in specs) >= 2
    results, _, _ = serve(engine, specs, batch)
    for spec, result in zip(specs, results):
        ref = serve(engine, [spec], batch)[0][0]
        assert (result.text, result.finish_reason) == (ref.text, ref.finish_reason)
        if spec.get("stop"):
            assert result.finish_reason == "stop" and spec["stop"][0] not in result.text


def test_n_choices_share_the_prompt_kv_and_follow_their_seeds(fused_engine):
    batch = BatchConfig(block_tokens=4, prefill_chunk_tokens=16)
    prompt = prompts(1, seed=2)[0] + [5, 6]  # 47 tokens, not a multiple of 4: the last prompt block is copied on write
    assert len(prompt) % 4
    spec = {"prompt": prompt, "max_tokens": 8, "temperature": 0.9, "seed": 40}
    results, sched, _ = serve(fused_engine, [{**spec, "n": 3}], batch)
    choices = results[0]
    assert len(choices) == 3 and sched.pool.counters.copies >= 2
    for i, choice in enumerate(choices):  # choice i samples with seed + i, from the same prompt KV
        alone, _, _ = serve(fused_engine, [{**spec, "seed": 40 + i}], batch)
        assert choice.token_ids == alone[0].token_ids


def test_mlfq_lets_a_short_request_pass_a_long_one(dense_engine):
    finished = {}
    for schedule in ("fcfs", "mlfq"):
        order = []

        def spy(sched):
            done = sched._on_finish

            def record(seq):
                order.append(len(seq.tokens) - seq.n_prompt)
                done(seq)
            sched.loop.on_finish = record
        batch = BatchConfig(max_batch_seqs=1, schedule=schedule, prefill_chunk_tokens=16)
        specs = [{"prompt": [5, 6, 7], "max_tokens": 120}, {"prompt": [8, 9], "max_tokens": 4, "delay_s": 0.02}]
        results, _, _ = serve(dense_engine, specs, batch, spy=spy)
        finished[schedule] = order
        assert [len(r.token_ids) for r in results] == [120, 4]
    assert finished["fcfs"] == [120, 4]
    assert finished["mlfq"] == [4, 120]


def test_plan_with_attention_on_the_tier_serves_one_sequence_at_a_time(tiny_model_dir, tmp_path_factory):
    """Tier attention keeps one sequence's KV itself: the scheduler must not interleave sequences there."""
    from helpers_plans import tiny_plan
    folder, _ = tiny_model_dir("llama")
    plan_dir = tiny_plan(folder, tmp_path_factory.mktemp("tier-plan"), "rtx4090", 1.0)
    engine = Engine.load(str(folder), plan=plan_dir, gpu_device="cpu")
    assert any(getattr(m, "on_tier", False) and hasattr(m, "keys") for m in engine.model.modules())
    specs = [{"prompt": [5 + i, 17, 42, 9][: 2 + i % 3], "max_tokens": 6, "n": 1 + (i == 1)} for i in range(4)]
    results, sched, _ = serve(engine, specs, BatchConfig(max_batch_seqs=8, schedule="mlfq"))
    for spec, result in zip(specs, results):
        ref = engine.generate(spec["prompt"], max_new_tokens=6, ignore_eos=True)
        choices = result if isinstance(result, list) else [result]
        assert all(c.token_ids == ref.token_ids for c in choices)  # greedy: every choice is the same
    assert sched.batch.max_batch_seqs == 1 and sched.policy.name == "fcfs" and not sched.loop.step.prefix_caching


def test_mlfq_promotes_a_starving_sequence():
    from types import SimpleNamespace
    from online.server.policy import make_policy
    policy = make_policy("mlfq", prefill_chunk_tokens=16)
    long_prompt = SimpleNamespace(n_prompt=16 * 40, level=0, level_tokens=0, idle_steps=0)
    policy.on_arrival(long_prompt)  # skip-join: 40 chunks of prefill -> the first queue with a quantum >= 40
    assert policy.quantum(long_prompt.level) >= 40 > policy.quantum(long_prompt.level - 1)
    for _ in range(policy.starvation_steps - 1):
        policy.on_idle(long_prompt)
    assert long_prompt.level > 0
    policy.on_idle(long_prompt)
    assert long_prompt.level == 0 and long_prompt.idle_steps == 0


def test_a_request_larger_than_the_pool_is_a_clear_400(dense_engine):
    per_token = 2 * dense_engine.config.num_layers * dense_engine.config.num_kv_heads * dense_engine.config.head_dim * 4
    batch = BatchConfig(block_tokens=4, prefill_chunk_tokens=8, kv_budget_bytes=per_token * 4 * 5)  # 20 tokens
    with pytest.raises(AssertionError, match="needs more KV than the server's pool holds"):
        serve(dense_engine, [{"prompt": [5, 6, 7], "max_tokens": 30}], batch)
    results, _, _ = serve(dense_engine, [{"prompt": [5, 6, 7], "max_tokens": 17}], batch)  # 20 tokens fit
    assert len(results[0].token_ids) == 17
