"""The batching server over HTTP: 64 clients x 4 requests with random disconnects (nothing lost or
mixed, the KV pool back to empty), ``n`` > 1 through the openai client, prefix reuse reported as
``cached_tokens``, batching metrics and flags."""
from __future__ import annotations

import argparse
import json
import random
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from online import Engine
from online.server import create_app
from online.server.batch_config import BatchConfig
from online.server.cli import add_serve_parser, batch_config
from tandem.core.errors import TandemError
from helpers_tiny import build_tiny_chat_model
from test_server import PROMPTS, LiveServer, metric, sse_payloads, wait_idle

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-serve-batch"), max_position_embeddings=1024)


@pytest.fixture(scope="module")
def ref_engine(tiny_dir):
    return Engine.load(str(tiny_dir))


def test_64_clients_x_4_requests_with_random_disconnects(tiny_dir):
    """The fused step_batch path (the module path's storm is in test_server.py). Reference:
    Engine.generate of a separately loaded engine (the prompts fit in one prefill chunk, so the server's
    module prefill + batched decode steps are the same arithmetic as generate's)."""
    max_tokens, weight_format = 6, "int4"
    ref_engine = Engine.load(str(tiny_dir), weight_format=weight_format)
    expected = {p: ref_engine.generate(p, max_new_tokens=max_tokens, ignore_eos=True).text for p in PROMPTS}
    engine = Engine.load(str(tiny_dir), weight_format=weight_format)
    assert engine.decode_path == "fused"
    app = create_app(engine, max_queue=256, batch=BatchConfig(block_tokens=4, prefill="step"))  # as generate (the fused step)
    with LiveServer(app) as srv:
        before = httpx.get(srv.url + "/metrics").text

        def client(i: int) -> list[tuple[str, str, bool]]:
            rng, out = random.Random(i), []
            with httpx.Client(base_url=srv.url, timeout=60) as http:
                for j in range(4):
                    prompt = PROMPTS[(i + j) % len(PROMPTS)]
                    hang_up = rng.randint(1, 4) if rng.random() < 0.3 else None
                    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                            "ignore_eos": True}
                    text, lines = "", 0
                    with http.stream("POST", "/v1/completions", json=body) as resp:
                        assert resp.status_code == 200
                        for line in resp.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            lines += 1
                            text += json.loads(line[6:])["choices"][0]["text"]
                            if lines == hang_up:
                                break
                    out.append((prompt, text, lines == hang_up))
            return out

        with ThreadPoolExecutor(64) as pool:
            results = [r for f in [pool.submit(client, i) for i in range(64)] for r in f.result(timeout=300)]
        wait_idle(srv, timeout_s=30)
        after = httpx.get(srv.url + "/metrics").text
        scheduler = app.state.scheduler
        assert scheduler.pool.n_used == 0  # every block back: nothing leaked
        scheduler.pool.check_empty()
    assert len(results) == 256 and any(h for _, _, h in results)
    for prompt, text, hung_up in results:
        if hung_up:
            assert expected[prompt].startswith(text)  # a prefix of its own answer, never another's
        else:
            assert text == expected[prompt]
    delta = lambda name: metric(after, name) - metric(before, name)  # noqa: E731
    assert delta("tandem_generations_total") + delta("tandem_cancelled_total") == 256
    assert delta("tandem_generations_total") >= sum(not h for _, _, h in results)
    assert metric(after, "tandem_batch_size_bucket", le="1") < metric(after, "tandem_batch_size_count")  # batched
    assert metric(after, "tandem_inter_token_latency_seconds_count") > 0
    assert metric(after, "tandem_kv_pool_blocks_used") == 0 < metric(after, "tandem_kv_pool_blocks_total")


def test_n_choices_through_the_openai_client(tiny_dir, ref_engine):
    with LiveServer(create_app(Engine.load(str(tiny_dir)))) as srv:
        client = srv.client()
        chat = client.chat.completions.create(model=ref_engine.model_id, messages=CHAT, max_tokens=8, n=3,
                                              temperature=0.9, seed=5)
        refs = [ref_engine.generate(CHAT, max_new_tokens=8, temperature=0.9, seed=5 + i) for i in range(3)]
        assert [c.index for c in chat.choices] == [0, 1, 2]
        assert [c.message.content for c in chat.choices] == [r.text for r in refs]
        assert chat.usage.completion_tokens == sum(len(r.token_ids) for r in refs)
        assert chat.usage.prompt_tokens == refs[0].prompt_tokens
        texts = {0: "", 1: ""}
        for chunk in client.completions.create(model=ref_engine.model_id, prompt=PROMPTS[0], max_tokens=6, n=2,
                                               temperature=0.9, seed=8, stream=True):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
        assert [texts[0], texts[1]] == [ref_engine.generate(PROMPTS[0], max_new_tokens=6, temperature=0.9,
                                                            seed=8 + i).text for i in range(2)]
        health = wait_idle(srv)["batching"]  # the dense model has no fused step: /health says so
        assert health["path"] == "modules" and "module path" in health["note"] and health["kv_blocks_used"] == 0
        assert health["kv_cache_type"] == "f32"  # module decoding keeps float32 keys and values


def test_prefix_reuse_is_reported_and_changes_nothing(tiny_dir):
    engine = Engine.load(str(tiny_dir), weight_format="int4")
    system = {"role": "system", "content": " ".join(PROMPTS) * 2}
    app = create_app(engine, batch=BatchConfig(block_tokens=8, prefill_chunk_tokens=16))
    with LiveServer(app) as srv, srv.http() as http:
        health = http.get("/health").json()["batching"]
        assert health["path"] == "fused" and health["prefix_caching"] is True
        assert health["kv_cache_type"] == "f16"  # float16 where the C step decodes: half the pool bytes per token
        cfg = engine.config  # keys and values, two bytes each, of every layer's KV heads per token
        assert health["kv_pool_bytes"] == health["kv_pool_blocks"] * health["kv_block_tokens"] * (
            cfg.num_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2)
        bodies = [{"messages": [system, {"role": "user", "content": q}], "max_tokens": 6, "temperature": 0}
                  for q in ("Hello", "Numbers: 1 2 3", "Numbers: 1 2 3")]
        answers = [http.post("/v1/chat/completions", json=b).json() for b in bodies]
        cached = [a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers]
        assert cached[0] == 0 and cached[2] >= cached[1] > 0
        # step prefill (the default) reuses whole blocks (8 tokens); module prefill whole chunks (16)
        assert all(c % 8 == 0 and c < a["usage"]["prompt_tokens"] for c, a in zip(cached, answers))
        assert answers[2]["choices"][0]["message"]["content"] == answers[1]["choices"][0]["message"]["content"]
        assert metric(http.get("/metrics").text, "tandem_prefix_cache_hit_tokens_total") == cached[1] + cached[2]
        # streamed usage carries the same field
        with http.stream("POST", "/v1/chat/completions", json={**bodies[1], "stream": True,
                                                               "stream_options": {"include_usage": True}}) as resp:
            usage = [p for p in sse_payloads(resp) if isinstance(p, dict) and p.get("usage")][0]["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == cached[2]


def test_serve_batching_flags():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(dest="command"))
    base = ["serve", "--model", "m"]
    config = batch_config(parser.parse_args(base + ["--kv-budget", "64MiB", "--schedule", "mlfq",
                                                    "--prefill-chunk-tokens", "32", "--max-batch", "4"]))
    assert (config.kv_budget_bytes, config.schedule, config.prefill_chunk_tokens, config.max_batch_seqs) == \
        (64 << 20, "mlfq", 32, 4)
    for bad in (["--kv-budget", "lots"], ["--kv-budget", "0"], ["--prefill-chunk-tokens", "0"], ["--max-batch", "-1"]):
        with pytest.raises(TandemError):
            batch_config(parser.parse_args(base + bad))
