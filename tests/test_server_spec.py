"""Speculation inside the batching loop (``serve --speculate``): greedy output with speculation equals
the output without it and the single-token step (alone, under concurrent load, across max_tokens,
stop strings and EOS), drafted positions never leak blocks or poison the prefix cache, logprobs
requests decode token by token, and /health + /metrics say what runs."""
from __future__ import annotations

import random

import httpx
import pytest
import torch

from online import Engine
from online.server import create_app
from online.server.batch_config import BatchConfig
from online.speculative import SpeculationConfig
from test_batching import serve, single_step_greedy, tiny_dir  # noqa: F401 (tiny_dir: a fixture used here)
from test_server import LiveServer, metric


@pytest.fixture(scope="module")
def engine(tiny_dir):
    engine = Engine.load(str(tiny_dir), weight_format="int4")
    assert engine.decode_path == "fused", engine.decode_path_reason
    engine._draft_step = engine.compiled_decode.with_thresholds([0.04, 0.04])  # a profile's draft thresholds
    return engine


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts with repeated n-grams (so prompt lookup finds drafts), mixed lengths."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        motif = [rng.randrange(3, 300) for _ in range(rng.choice([3, 5, 8]))]
        out.append([rng.randrange(3, 300) for _ in range(rng.choice([1, 6]))] + motif * rng.choice([2, 4]))
    return out


def with_spec(engine, mode: str | None, draft_tokens: int = 4):
    engine.default_speculation = None if mode is None else SpeculationConfig(mode, draft_tokens, adapt=False)


def check_blocks(sched) -> None:
    """After every iteration a sequence holds blocks for its tokens only (drafted positions freed)."""
    original = sched.loop.iteration

    def iteration():
        n = original()
        for seq in sched.loop.sequences:
            if seq.allocated:
                assert len(seq.table) <= sched.pool.blocks_for(len(seq.tokens)), (len(seq.table), len(seq.tokens))
        return n
    sched.loop.iteration = iteration


def keep_eos(sched) -> None:
    """serve() asks for ignore_eos; honour EOS instead."""
    check_blocks(sched)
    submit = sched.submit
    sched.submit = lambda prompt, max_tokens, sampling, *a, **kw: submit(prompt, max_tokens,
                                                                         {**sampling, "ignore_eos": False}, *a, **kw)


def run(engine, mode, specs, batch, draft_tokens=4, spy=check_blocks):
    with_spec(engine, mode, draft_tokens)
    try:
        return serve(engine, specs, batch, spy=spy)
    finally:
        with_spec(engine, None)


@pytest.mark.parametrize("mode,draft_tokens", [("lookup", 1), ("lookup", 4), ("sparse", 3), ("auto", 5)])
def test_greedy_with_speculation_equals_without_alone_and_under_load(engine, mode, draft_tokens):
    batch = BatchConfig(block_tokens=4, prefill_chunk_tokens=32, prefill="step", spec_max_seqs=8)
    specs = [{"prompt": p, "max_tokens": [1, 2, 5, 9, 14, 20][i % 6]} for i, p in enumerate(repetitive_prompts(6))]
    off, _, _ = run(engine, None, specs, batch)
    loaded, sched, metrics = run(engine, mode, specs, batch, draft_tokens)
    counters = sched.loop.spec.counters
    assert counters.verify_steps > 0 and counters.accepted > 0  # drafts were verified and some kept
    for spec, a, b in zip(specs, off, loaded):
        ref = single_step_greedy(engine, spec["prompt"], spec["max_tokens"])[0]  # independent reference
        assert a.token_ids == ref and b.token_ids == ref and b.text == a.text
        assert b.finish_reason == a.finish_reason == "length"
    alone, sched1, _ = run(engine, mode, [specs[-1]], batch, draft_tokens)
    assert alone[0].token_ids == off[-1].token_ids and sched1.loop.spec.counters.verify_steps > 0


def test_speculation_only_while_few_run_and_modules_prefill(engine):
    """Default threshold 2: under load (6 at once) steps are plain until the batch thins out; the
    module prefill path (prefix blocks from prompt chunks only) gives the same tokens."""
    batch = BatchConfig(block_tokens=4, prefill_chunk_tokens=16)
    specs = [{"prompt": p, "max_tokens": 18} for p in repetitive_prompts(6, seed=3)]
    off, _, _ = run(engine, None, specs, batch)
    on, sched, _ = run(engine, "lookup", specs, batch)
    assert [r.token_ids for r in on] == [r.token_ids for r in off]
    assert sched.loop.spec.counters.verify_steps > 0


def test_stop_strings_and_eos_inside_an_accepted_run(engine):
    batch = BatchConfig(block_tokens=4, prefill_chunk_tokens=32, spec_max_seqs=4)
    base = [{"prompt": p, "max_tokens": 16} for p in repetitive_prompts(4, seed=7)]
    plain, _, _ = run(engine, None, base, batch)
    specs = [{**s, "stop": [r.text[5:7]]} if len(r.text) > 8 else s for s, r in zip(base, plain)]
    assert sum("stop" in s for s in specs) >= 2
    off, _, _ = run(engine, None, specs, batch)
    on, _, _ = run(engine, "lookup", specs, batch)
    for a, b in zip(off, on):
        assert (b.text, b.token_ids, b.finish_reason) == (a.text, a.token_ids, a.finish_reason)
    # EOS: make a token the model emits mid-answer an end-of-sequence token
    eos_token = plain[0].token_ids[6]
    saved = engine.eos_token_ids
    engine.eos_token_ids = saved | {eos_token}
    try:
        off_eos, _, _ = run(engine, None, base, batch, spy=keep_eos)
        on_eos, _, _ = run(engine, "lookup", base, batch, spy=keep_eos)
    finally:
        engine.eos_token_ids = saved
    assert any(r.finish_reason == "stop" for r in off_eos)
    for a, b in zip(off_eos, on_eos):
        assert (b.token_ids, b.finish_reason) == (a.token_ids, a.finish_reason)


def test_rejected_drafts_never_enter_the_prefix_cache(engine):
    """prefill="step" registers blocks over generated tokens: a follow-up whose prompt is the first
    answer's whole text reuses them and still equals the single-token step from scratch."""
    batch = BatchConfig(block_tokens=4, prefill_chunk_tokens=32, prefill="step")
    prompt = repetitive_prompts(1, seed=5)[0]
    first = {"prompt": prompt, "max_tokens": 24}
    with_spec(engine, "lookup", 6)
    try:
        results, sched, _ = serve(engine, [first, {"prompt": None, "max_tokens": 10, "after": 0}], batch,
                                  spy=lambda s: _follow_up(s, prompt))
    finally:
        with_spec(engine, None)
    follow_prompt = prompt + results[0].token_ids
    assert sched.loop.spec.counters.drafted > sched.loop.spec.counters.accepted  # some drafts were rejected
    assert sched.pool.counters.hits_tokens >= 4 * (len(follow_prompt) // 4 - 2)  # the answer's blocks were reused
    assert results[1].token_ids == single_step_greedy(engine, follow_prompt, 10)[0]


def _follow_up(sched, prompt):
    """Make the second request's prompt the first one's prompt + its answer (known only once it is done)."""
    check_blocks(sched)
    submit = sched.submit

    def patched(p, *args, **kwargs):
        if p is None:
            p = prompt + sched._last_answer
        return submit(p, *args, **kwargs)
    on_finish = sched._on_finish

    def finished(seq):
        sched._last_answer = list(seq.decoder.generated)
        on_finish(seq)
    sched.submit, sched._on_finish = patched, finished
    sched.loop.on_finish = finished


@pytest.mark.parametrize("mode", ["lookup", "sparse"])
def test_sampling_under_speculation_completes_and_frees_blocks(engine, mode, monkeypatch):
    seeds = iter(range(3, 100))  # requests without a seed draw one from torch.seed(): pinned, so the drafts are too
    monkeypatch.setattr(torch, "seed", lambda: next(seeds))
    batch = BatchConfig(block_tokens=4, prefill_chunk_tokens=32)
    specs = [{"prompt": p, "max_tokens": 12, "temperature": 0.3} for p in repetitive_prompts(2, seed=9)]
    results, sched, _ = run(engine, mode, specs, batch)  # serve() checks the pool is empty afterwards
    assert all(len(r.token_ids) == 12 for r in results) and sched.loop.spec.counters.verify_steps > 0


def test_a_seeded_sampled_request_gives_its_text_whatever_else_runs(engine):
    """Drafting depends on how many sequences run (spec_max_seqs) and draws random numbers differently, so a
    seeded request's text used to depend on the load. Seeded sampled requests now decode token by token: with
    speculation, alone and beside greedy requests that draft, the text equals the one served without
    speculation (the reference)."""
    batch = BatchConfig(block_tokens=4, prefill_chunk_tokens=32, spec_max_seqs=2)
    prompts = repetitive_prompts(3, seed=11)
    seeded = {"prompt": prompts[0], "max_tokens": 16, "temperature": 0.3, "seed": 5}
    want, _, _ = run(engine, None, [seeded], batch)
    alone, sched, _ = run(engine, "lookup", [seeded], batch)
    assert alone[0].token_ids == want[0].token_ids and sched.loop.spec.counters.verify_steps == 0
    greedy = [{"prompt": p, "max_tokens": 24} for p in prompts[1:]]
    loaded, sched, _ = run(engine, "lookup", [greedy[0], seeded, greedy[1]], batch)
    assert loaded[1].token_ids == want[0].token_ids and sched.loop.spec.counters.verify_steps > 0  # others drafted


def test_health_metrics_and_logprobs_requests_decode_token_by_token(engine):
    with_spec(engine, "lookup")
    try:
        app = create_app(engine, batch=BatchConfig(block_tokens=4))
    finally:
        with_spec(engine, None)
    prompt = "one two three one two three one two three one two"
    with LiveServer(app) as srv:
        health = httpx.get(srv.url + "/health").json()["batching"]["speculation"]
        assert health["mode"] == "lookup" and "at most 2 run" in health["reason"]
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        r = httpx.post(srv.url + "/v1/completions", json={**body, "logprobs": 2}, timeout=60)
        assert r.status_code == 200
        assert app.state.scheduler.loop.spec.counters.verify_steps == 0  # logprobs: no drafts
        plain = httpx.post(srv.url + "/v1/completions", json=body, timeout=60).json()
        assert plain["choices"][0]["text"] == r.json()["choices"][0]["text"]
        text = httpx.get(srv.url + "/metrics").text
        assert metric(text, "tandem_spec_verify_steps_total") == app.state.scheduler.loop.spec.counters.verify_steps > 0
    off = create_app(engine, batch=BatchConfig(block_tokens=4))
    assert off.state.scheduler.describe()["speculation"]["mode"] == "off"


def test_spec_max_seqs_flag_and_off_on_the_module_path(tiny_dir):
    import argparse

    from online.server.cli import add_serve_parser, batch_config
    from tandem.core.errors import TandemError
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    base = ["serve", "--model", "m"]
    assert batch_config(parser.parse_args(base + ["--spec-max-seqs", "3"])).spec_max_seqs == 3
    assert batch_config(parser.parse_args(base)).spec_max_seqs == 2
    with pytest.raises(TandemError):
        batch_config(parser.parse_args(base + ["--spec-max-seqs", "0"]))
    dense = Engine.load(str(tiny_dir))  # float32: the module path, no fused batched step
    dense.default_speculation = SpeculationConfig("lookup")
    described = create_app(dense, batch=BatchConfig(block_tokens=4)).state.scheduler.describe()["speculation"]
    assert described["mode"] == "off" and "module path" in described["reason"]
