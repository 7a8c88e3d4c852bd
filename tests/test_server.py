"""The OpenAI-compatible server, end to end: a real uvicorn server on a free loopback port, a real Engine.

References: ``Engine.generate`` on a separately loaded engine (same greedy text), transformers' own greedy
generation of the same tiny model, the ``openai`` client's parsing of our responses, and the counts of the
requests these tests send (metrics, cancellations, rejections).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn

from online import Engine
from online.server import create_app
from online.server.batch_config import BatchConfig
from online.server.cli import add_serve_parser, run_serve
from tandem.core.errors import TandemError
from helpers_tiny import build_tiny_chat_model

REPO_ROOT = Path(__file__).resolve().parents[1]
CHAT = [{"role": "system", "content": "be brief."}, {"role": "user", "content": "What is the capital of France?"}]
PROMPTS = ["Once upon a time", "Hello, how are you", "The quick brown fox", "Numbers: 1 2 3",
           "Servers answer requests", "What is the capital", "Über café", "system user assistant"]


class LiveServer:
    """uvicorn serving ``app`` in a background thread on 127.0.0.1:<free port>."""

    def __init__(self, app):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.app = app
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "LiveServer":
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert time.monotonic() < deadline and self.thread.is_alive(), "server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(20)
        self.sock.close()

    def client(self, api_key: str = "unused", **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60, **kwargs)

    def http(self, **kwargs) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=60, **kwargs)


def metric(text: str, name: str, **labels: str) -> float:
    """One sample from Prometheus text (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    pattern = re.escape(name) + (re.escape("{" + want + "}") if want else "") + r" (\S+)$"
    for line in text.splitlines():
        m = re.match(pattern, line)
        if m:
            return float(m.group(1))
    return 0.0


def sse_payloads(response: httpx.Response) -> list:
    """The ``data:`` payloads of a server-sent event stream, ``[DONE]`` kept as a string."""
    out = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def wait_idle(srv: LiveServer, timeout_s: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        health = httpx.get(srv.url + "/health", timeout=5).json()
        if health["queue_depth"] == 0 and health["running"] == 0:
            return health
        assert time.monotonic() < deadline, f"server still busy: {health}"
        time.sleep(0.02)


# --- fixtures ----------------------------------------------------------------------------------
LONG_TOKENS = 600  # a generation this long takes ~1 s on the tiny model: time enough to observe it running


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"), max_position_embeddings=1024)


@pytest.fixture(scope="module")
def ref_engine(tiny_dir) -> Engine:
    """A separately loaded engine: the reference the server's answers must match."""
    return Engine.load(str(tiny_dir))


@pytest.fixture(scope="module")
def srv(tiny_dir):
    with LiveServer(create_app(Engine.load(str(tiny_dir)), max_queue=64)) as server:
        yield server


@pytest.fixture(scope="module")
def keyed_srv(tiny_dir):
    with LiveServer(create_app(Engine.load(str(tiny_dir)), api_key="s3cret", max_queue=1,
                               batch=BatchConfig(max_batch_seqs=1))) as server:
        yield server


@pytest.fixture(scope="module")
def long_prompts(ref_engine) -> dict:
    """A text prompt and a chat whose greedy continuations run LONG_TOKENS tokens without hitting EOS."""
    found = {}
    for prompt in PROMPTS:
        for kind, p in (("prompt", prompt), ("messages", [{"role": "user", "content": prompt}])):
            if kind not in found and ref_engine.generate(p, max_new_tokens=LONG_TOKENS).finish_reason == "length":
                found[kind] = p
        if len(found) == 2:
            return found
    pytest.fail("no prompt makes the tiny model generate LONG_TOKENS tokens")


# --- the openai client: chat, completion, streaming, greedy text ----------------------------------
def test_openai_client_chat_and_completion_match_engine_generate(srv, ref_engine):
    client = srv.client()
    ref = ref_engine.generate(CHAT, max_new_tokens=12, temperature=0.0)
    chat = client.chat.completions.create(model=ref_engine.model_id, messages=CHAT, max_tokens=12, temperature=0)
    assert chat.object == "chat.completion" and chat.id.startswith("chatcmpl-")
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].message.content == ref.text
    assert chat.choices[0].finish_reason == ref.finish_reason
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (ref.prompt_tokens, len(ref.token_ids))
    assert chat.usage.total_tokens == ref.prompt_tokens + len(ref.token_ids)

    ref = ref_engine.generate(PROMPTS[0], max_new_tokens=10, temperature=0.0)
    comp = client.completions.create(model=ref_engine.model_id, prompt=PROMPTS[0], max_tokens=10, temperature=0)
    assert comp.object == "text_completion"
    assert comp.choices[0].text == ref.text and comp.choices[0].finish_reason == ref.finish_reason
    assert comp.usage.completion_tokens == len(ref.token_ids)

    # the extension field top_k and max_completion_tokens reach the engine
    ref = ref_engine.generate(CHAT, max_new_tokens=6, temperature=0.8, top_k=5, seed=7)
    chat = client.chat.completions.create(model=ref_engine.model_id, messages=CHAT, max_completion_tokens=6,
                                          temperature=0.8, seed=7, extra_body={"top_k": 5})
    assert chat.choices[0].message.content == ref.text


def test_openai_client_streaming_matches_engine_generate(srv, ref_engine):
    client = srv.client()
    ref = ref_engine.generate(CHAT, max_new_tokens=16, temperature=0.0)
    chunks = list(client.chat.completions.create(model=ref_engine.model_id, messages=CHAT, max_tokens=16,
                                                 temperature=0, stream=True, stream_options={"include_usage": True}))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == ref.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [ref.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)

    ref = ref_engine.generate(PROMPTS[2], max_new_tokens=9, temperature=0.0, stop=[" "])
    chunks = list(client.completions.create(model=ref_engine.model_id, prompt=[PROMPTS[2]], max_tokens=9,
                                            temperature=0, stop=" ", stream=True))
    assert "".join(c.choices[0].text for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason

    with srv.http() as http, http.stream("POST", "/v1/completions",
                                         json={"prompt": PROMPTS[2], "max_tokens": 3, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        assert sse_payloads(resp)[-1] == "[DONE]"


def test_greedy_text_matches_transformers(srv, tiny_dir, ref_engine):
    """Independent reference: transformers' greedy generation of the same checkpoint and tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False,
                             eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"), pad_token_id=0)
    expected = tok.decode(out[0, len(ids):], skip_special_tokens=True)
    chat = srv.client().chat.completions.create(model=ref_engine.model_id, messages=CHAT, max_tokens=12,
                                                temperature=0)
    assert chat.choices[0].message.content == expected
    assert chat.usage.prompt_tokens == len(ids)


def test_models_and_health(srv, ref_engine):
    models = srv.client().models.list()
    assert [m.id for m in models.data] == [ref_engine.model_id]
    assert srv.client().models.retrieve(ref_engine.model_id).id == ref_engine.model_id
    health = httpx.get(srv.url + "/health").json()
    assert health["status"] == "ok" and health["model"] == ref_engine.model_id


# --- load: 16 concurrent clients x 4 streaming requests ----------------------------------------------
def test_load_16_clients_x_4_streaming_requests(srv, ref_engine):
    max_tokens = 8
    expected_chat = {p: ref_engine.generate([{"role": "user", "content": p}], max_new_tokens=max_tokens).text
                     for p in PROMPTS}
    expected_text = {p: ref_engine.generate(p, max_new_tokens=max_tokens).text for p in PROMPTS}

    def client_session(i: int) -> list[tuple[str, str, str]]:
        client = srv.client()
        out = []
        for j in range(4):
            prompt = PROMPTS[(i + j) % len(PROMPTS)]
            if (i + j) % 2 == 0:
                stream = client.chat.completions.create(model=ref_engine.model_id, max_tokens=max_tokens,
                                                        messages=[{"role": "user", "content": prompt}],
                                                        temperature=0, stream=True)
                got = "".join(c.choices[0].delta.content or "" for c in stream)
                out.append(("chat", prompt, got))
            else:
                stream = client.completions.create(model=ref_engine.model_id, prompt=prompt,
                                                   max_tokens=max_tokens, temperature=0, stream=True)
                out.append(("text", prompt, "".join(c.choices[0].text for c in stream)))
        return out

    before = httpx.get(srv.url + "/metrics").text
    start_s = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        results = [r for fut in [pool.submit(client_session, i) for i in range(16)] for r in fut.result(timeout=120)]
    elapsed_s = time.monotonic() - start_s
    assert len(results) == 64
    for kind, prompt, got in results:
        assert got == (expected_chat if kind == "chat" else expected_text)[prompt], (kind, prompt)
    after = httpx.get(srv.url + "/metrics").text
    done = sum(metric(after, "tandem_requests_total", endpoint=e, status="200") -
               metric(before, "tandem_requests_total", endpoint=e, status="200")
               for e in ("/v1/chat/completions", "/v1/completions"))
    assert done == 64
    assert elapsed_s < 90
    wait_idle(srv)


# --- bad requests ---------------------------------------------------------------------------------
def _chat(**fields) -> bytes:
    return json.dumps({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}).encode()


def _bad_cases(model_id: str, max_context: int) -> list[tuple[str, str, bytes, int]]:
    msg = [{"role": "user", "content": "hi"}]
    return [
        ("malformed json", "/v1/chat/completions", b'{"messages": [', 400),
        ("trailing garbage", "/v1/chat/completions", _chat() + b"}", 400),
        ("empty body", "/v1/chat/completions", b"", 400),
        ("json array", "/v1/chat/completions", b"[1, 2]", 400),
        ("json string", "/v1/completions", b'"hello"', 400),
        ("non-utf8", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\xff\xfe\xc3"}]}', 400),
        ("latin-1 body", "/v1/completions", '{"prompt": "caf\u00e9"}'.encode("latin-1"), 400),
        ("lone surrogate", "/v1/completions", b'{"prompt": "\\ud800abc"}', 400),
        ("NaN", "/v1/chat/completions", _chat()[:-1] + b', "temperature": NaN}', 400),
        ("deep nesting", "/v1/chat/completions", b"[" * 200_000, 400),
        ("missing messages", "/v1/chat/completions", b'{"model": "m"}', 400),
        ("missing prompt", "/v1/completions", b'{"max_tokens": 3}', 400),
        ("empty messages", "/v1/chat/completions", json.dumps({"messages": []}).encode(), 400),
        ("messages not a list", "/v1/chat/completions", json.dumps({"messages": "hi"}).encode(), 400),
        ("message not an object", "/v1/chat/completions", json.dumps({"messages": ["hi"]}).encode(), 400),
        ("bad role", "/v1/chat/completions", json.dumps({"messages": [{"role": "god", "content": "x"}]}).encode(), 400),
        ("missing role", "/v1/chat/completions", json.dumps({"messages": [{"content": "x"}]}).encode(), 400),
        ("content is a number", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": 5}]}).encode(), 400),
        ("image content", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://x"}}]}]}).encode(), 400),
        ("max_tokens string", "/v1/chat/completions", _chat(max_tokens="10"), 400),
        ("max_tokens float", "/v1/chat/completions", _chat(max_tokens=2.5), 400),
        ("max_tokens bool", "/v1/chat/completions", _chat(max_tokens=True), 400),
        ("max_tokens zero", "/v1/chat/completions", _chat(max_tokens=0), 400),
        ("max_tokens negative", "/v1/chat/completions", _chat(max_tokens=-5), 400),
        ("max_tokens huge", "/v1/chat/completions", _chat(max_tokens=10**12), 400),
        ("max_tokens beyond context", "/v1/completions", json.dumps({"prompt": "hi", "max_tokens": max_context + 1}).encode(), 400),
        ("prompt + max_tokens beyond context", "/v1/completions",
         json.dumps({"prompt": "hi " * 40, "max_tokens": max_context - 5}).encode(), 400),
        ("prompt longer than context", "/v1/completions", json.dumps({"prompt": "hello " * (4 * max_context)}).encode(), 400),
        ("temperature string", "/v1/chat/completions", _chat(temperature="hot"), 400),
        ("temperature negative", "/v1/chat/completions", _chat(temperature=-0.5), 400),
        ("top_p zero", "/v1/chat/completions", _chat(top_p=0), 400),
        ("top_p above one", "/v1/chat/completions", _chat(top_p=1.5), 400),
        ("top_k negative", "/v1/chat/completions", _chat(top_k=-3), 400),
        ("seed negative", "/v1/chat/completions", _chat(seed=-1), 400),
        ("seed huge", "/v1/chat/completions", _chat(seed=2**70), 400),
        ("stop not strings", "/v1/chat/completions", _chat(stop=[1, 2]), 400),
        ("stop empty string", "/v1/chat/completions", _chat(stop=[""]), 400),
        ("stream not bool", "/v1/chat/completions", _chat(stream="yes"), 400),
        ("n = 0", "/v1/chat/completions", _chat(n=0), 400),
        ("n = 17", "/v1/chat/completions", _chat(n=17), 400),
        ("model not a string", "/v1/chat/completions", _chat(model=3), 400),
        ("unknown model", "/v1/chat/completions", _chat(model="gpt-17"), 404),
        ("unknown model (completions)", "/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode(), 404),
        ("prompt empty", "/v1/completions", json.dumps({"prompt": ""}).encode(), 400),
        ("prompt batch of two", "/v1/completions", json.dumps({"prompt": ["a", "b"]}).encode(), 400),
        ("prompt is a number", "/v1/completions", json.dumps({"prompt": 42}).encode(), 400),
        ("token id out of range", "/v1/completions", json.dumps({"prompt": [1, 2, 10**9]}).encode(), 400),
        ("10 MB body", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "' + b"a" * (10 << 20) + b'"}]}', 413),
        ("n = 3.5 while streaming", "/v1/chat/completions", _chat(model=model_id, stream=True, n=3.5), 400),
        # fields OpenAI does not know, or knows with another type: never silently dropped
        ("unknown field", "/v1/chat/completions", _chat(foo="bar"), 400),
        ("misspelt field", "/v1/completions", json.dumps({"prompt": "x", "max_tokenz": 1}).encode(), 400),
        ("user not a string", "/v1/chat/completions", _chat(user=5), 400),
        ("store true", "/v1/chat/completions", _chat(store=True), 400),
        ("stream_options without stream", "/v1/chat/completions", _chat(stream_options={"include_usage": True}), 400),
        ("unknown stream_options", "/v1/chat/completions", _chat(stream=True, stream_options={"x": 1}), 400),
        ("audio output", "/v1/chat/completions", _chat(modalities=["text", "audio"]), 400),
        ("reasoning effort", "/v1/chat/completions", _chat(reasoning_effort="low"), 400),
        ("another server's min_p", "/v1/chat/completions", _chat(min_p=0.1), 400),
        ("store on completions", "/v1/completions", json.dumps({"prompt": "x", "store": False}).encode(), 400),
        ("stop string too long", "/v1/chat/completions", _chat(stop=["z" * 1001]), 400),
        ("message name not a string", "/v1/chat/completions",
         json.dumps({"messages": [{"role": "user", "content": "x", "name": 5}]}).encode(), 400),
        ("unknown message field", "/v1/chat/completions",
         json.dumps({"messages": [{"role": "user", "content": "x", "mood": "sad"}]}).encode(), 400),
        ("user message without content", "/v1/chat/completions", json.dumps({"messages": [{"role": "user"}]}).encode(), 400),
        ("tool message without tool_call_id", "/v1/chat/completions",
         json.dumps({"messages": [{"role": "tool", "content": "1"}]}).encode(), 400),
        ("tool call without arguments", "/v1/chat/completions", json.dumps({"messages": msg + [
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f"}}]}]}).encode(), 400),
        ("tool parameters not an object schema", "/v1/chat/completions", _chat(tools=[
            {"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], tool_choice="required"), 400),
        ("tool strict not a boolean", "/v1/chat/completions",
         _chat(tools=[{"type": "function", "function": {"name": "f", "strict": "yes"}}]), 400),
        ("tool_choice a number", "/v1/chat/completions", _chat(tool_choice=5), 400),
        ("json_schema without a name", "/v1/chat/completions",
         _chat(response_format={"type": "json_schema", "json_schema": {}}), 400),
        ("json_schema unknown field", "/v1/chat/completions", _chat(response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "extra": 1}}), 400),
        # lone surrogates anywhere in the body (each of these once stopped the generation worker for good)
        ("surrogate in a tool description", "/v1/chat/completions",
         _chat()[:-1] + b', "tools": [{"type": "function", "function": {"name": "f", "description": "\\ud800"}}]}', 400),
        ("surrogate in tool call arguments", "/v1/chat/completions", json.dumps({"messages": msg + [
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "f", "arguments": "@"}}]},
            {"role": "tool", "tool_call_id": "c", "content": "1"}]}).encode().replace(b'"@"', b'"\\udc00"'), 400),
        ("surrogate in a stop string", "/v1/chat/completions", _chat()[:-1] + b', "stop": "\\ud800"}', 400),
    ]


def test_bad_request_corpus(srv, ref_engine):
    cases = _bad_cases(ref_engine.model_id, ref_engine.max_context)
    with srv.http() as http:
        for name, path, body, status in cases:
            resp = http.post(path, content=body, headers={"content-type": "application/json"})
            assert resp.status_code == status, (name, resp.status_code, resp.text[:300])
            error = resp.json()["error"]
            assert set(error) == {"message", "type", "param", "code"}, name
            assert isinstance(error["message"], str) and error["message"] and "\n" not in error["message"], name
        # a 10 MB body without Content-Length (chunked), wrong methods, unknown routes
        resp = http.post("/v1/completions", content=(b"x" * 65536 for _ in range(160)))
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "request_too_large"
        assert http.get("/v1/chat/completions").status_code == 405
        assert http.get("/v2/nothing").json()["error"]["code"] == "not_found"
        slash = http.post("/v1/chat/completions/", content=_chat())  # a JSON 404, not a bodiless redirect
        assert slash.status_code == 404 and slash.json()["error"]["code"] == "not_found"
        assert http.head("/health").status_code == 200
        # the unknown-model error names the model parameter, OpenAI-style
        error = http.post("/v1/chat/completions", content=_chat(model="gpt-17")).json()["error"]
        assert error["code"] == "model_not_found" and error["param"] == "model"
        assert http.post("/v1/chat/completions", content=_chat(max_tokens=-5)).json()["error"]["param"] == "max_tokens"
        # never a 5xx; the server still serves
        text = http.get("/metrics").text
        assert not re.search(r'tandem_requests_total\{[^}]*status="5\d\d"\}', text)
        assert http.get("/health").json()["status"] == "ok"
        ok = http.post("/v1/chat/completions", content=_chat(temperature=0))
        assert ok.status_code == 200
        ref = ref_engine.generate([{"role": "user", "content": "hi"}], max_new_tokens=2)
        assert ok.json()["choices"][0]["message"]["content"] == ref.text
        # OpenAI's bookkeeping fields and an assistant turn echoed back whole are accepted, and change nothing
        echoed = {"role": "assistant", "content": "x", "refusal": None, "annotations": [], "audio": None,
                  "function_call": None, "reasoning_content": "thought", "name": "bot"}
        body = json.dumps({"messages": [{"role": "user", "content": "hi"}, echoed, {"role": "user", "content": "hi"}],
                           "max_tokens": 2, "temperature": 0, "user": "u1", "metadata": {"k": "v"}, "store": False,
                           "safety_identifier": "s", "prompt_cache_key": "p", "reasoning_effort": None}).encode()
        same = http.post("/v1/chat/completions", content=body)
        plain = {**json.loads(body), "messages": [{"role": "user", "content": "hi"},
                                                  {"role": "assistant", "content": "x"},
                                                  {"role": "user", "content": "hi"}]}
        plain = {k: v for k, v in plain.items() if k in ("messages", "max_tokens", "temperature")}
        assert same.status_code == 200
        assert same.json()["choices"][0]["message"] == http.post("/v1/chat/completions", json=plain).json()["choices"][0]["message"]


# --- disconnects ----------------------------------------------------------------------------------
def test_disconnect_storm_frees_the_engine(srv, ref_engine, long_prompts):
    """Clients that hang up after the first chunk must not hold the engine for their whole max_tokens."""
    n_clients = 24
    wait_idle(srv)
    before = httpx.get(srv.url + "/metrics").text

    def hang_up_after_first_chunk(i: int) -> bool:
        kind = ("prompt", "messages")[i % 2]
        body = {kind: long_prompts[kind], "max_tokens": LONG_TOKENS, "stream": True, "temperature": 0}
        path = "/v1/completions" if kind == "prompt" else "/v1/chat/completions"
        with httpx.Client(base_url=srv.url, timeout=60) as http, http.stream("POST", path, json=body) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    return resp.status_code == 200
        return False

    with ThreadPoolExecutor(n_clients) as pool:
        assert all(pool.map(hang_up_after_first_chunk, range(n_clients), timeout=120))
    t0 = time.monotonic()
    assert httpx.get(srv.url + "/health", timeout=5).json()["status"] == "ok"
    wait_idle(srv, timeout_s=10)
    ref = ref_engine.generate(PROMPTS[3], max_new_tokens=5)
    resp = httpx.post(srv.url + "/v1/completions", json={"prompt": PROMPTS[3], "max_tokens": 5, "temperature": 0},
                      timeout=30)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == ref.text
    assert time.monotonic() - t0 < 10
    after = httpx.get(srv.url + "/metrics").text
    # every storm request was stopped early, none ran to the end; their KV blocks are all back
    assert metric(after, "tandem_cancelled_total") - metric(before, "tandem_cancelled_total") == n_clients
    srv.app.state.scheduler.pool.check_empty()
    assert metric(after, "tandem_generations_total") - metric(before, "tandem_generations_total") == 1


def test_non_streaming_client_that_gives_up_frees_the_engine(srv, long_prompts):
    wait_idle(srv)
    before = httpx.get(srv.url + "/metrics").text
    body = {"prompt": long_prompts["prompt"], "max_tokens": LONG_TOKENS, "temperature": 0}
    for _ in range(3):
        with pytest.raises(httpx.TimeoutException):
            httpx.post(srv.url + "/v1/completions", json=body, timeout=httpx.Timeout(10.0, read=0.1))
    wait_idle(srv, timeout_s=10)
    after = httpx.get(srv.url + "/metrics").text
    assert metric(after, "tandem_cancelled_total") - metric(before, "tandem_cancelled_total") == 3
    assert metric(after, "tandem_generations_total") == metric(before, "tandem_generations_total")


# --- api key, queue limit, timeout ------------------------------------------------------------------
def test_api_key_required(keyed_srv, ref_engine):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}, {"Authorization": "Basic s3cret"}):
        resp = httpx.post(keyed_srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, headers=headers)
        assert resp.status_code == 401, headers
        assert resp.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(keyed_srv.url + "/v1/models").status_code == 401
    with pytest.raises(openai.AuthenticationError):
        keyed_srv.client(api_key="wrong").models.list()
    ref = ref_engine.generate("hi", max_new_tokens=3)
    got = keyed_srv.client(api_key="s3cret").completions.create(model=ref_engine.model_id, prompt="hi",
                                                                max_tokens=3, temperature=0)
    assert got.choices[0].text == ref.text
    assert httpx.get(keyed_srv.url + "/health").status_code == 200  # health and metrics stay open for probes


def test_queue_full_gets_429(keyed_srv, ref_engine, long_prompts):
    """max_queue=1 and a batch of one: one request running, one waiting; the next gets 429 at once."""
    auth = {"Authorization": "Bearer s3cret"}
    long_body = {"prompt": long_prompts["prompt"], "max_tokens": LONG_TOKENS, "stream": True, "temperature": 0}
    probe, waiter_http = keyed_srv.http(headers=auth), keyed_srv.http(headers=auth)
    with keyed_srv.http(headers=auth) as http, http.stream("POST", "/v1/completions", json=long_body) as running:
        lines = running.iter_lines()  # keep the iterator: dropping it would close the connection
        next(lines)  # the long generation is on the engine now
        queued: list[httpx.Response] = []
        waiter = threading.Thread(target=lambda: queued.append(
            waiter_http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3, "temperature": 0})))
        waiter.start()
        deadline = time.monotonic() + 10
        while probe.get("/health").json()["queue_depth"] < 1:
            assert time.monotonic() < deadline
            time.sleep(0.002)
        rejected = probe.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        assert rejected.status_code == 429
        assert rejected.json()["error"]["code"] == "rate_limit_exceeded"
        assert rejected.headers["retry-after"] == "1"
        assert probe.get("/health").json()["running"] == 1  # the long generation was still running
    waiter.join(30)  # closing the stream above frees the engine for the queued request
    assert queued and queued[0].status_code == 200
    assert queued[0].json()["choices"][0]["text"] == ref_engine.generate("hi", max_new_tokens=3).text
    assert metric(probe.get("/metrics").text, "tandem_rejected_total") == 1
    probe.close()
    waiter_http.close()


def test_request_timeout(tiny_dir):
    with LiveServer(create_app(Engine.load(str(tiny_dir)), request_timeout_s=0.02)) as server:
        body = {"prompt": PROMPTS[0], "max_tokens": 200, "ignore_eos": True}  # long enough to time out
        resp = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "timeout"
        with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as resp:
            events = sse_payloads(resp)
        assert resp.status_code in (200, 504)
        if resp.status_code == 200:  # the stream started, then ended with an error event
            assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "timeout"
        wait_idle(server)
        assert metric(httpx.get(server.url + "/metrics").text, "tandem_timeouts_total") == 2


# --- metrics ------------------------------------------------------------------------------------------
def test_metrics_count_requests_and_tokens(srv):
    wait_idle(srv)
    before = httpx.get(srv.url + "/metrics").text
    usages = []
    for prompt in PROMPTS[:2]:
        resp = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                          json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 4})
        usages.append(resp.json()["usage"])
    httpx.post(srv.url + "/v1/chat/completions", content=b"{")
    resp = httpx.get(srv.url + "/metrics")
    assert resp.headers["content-type"].startswith("text/plain")
    after = resp.text
    delta = lambda name, **labels: metric(after, name, **labels) - metric(before, name, **labels)  # noqa: E731
    assert delta("tandem_requests_total", endpoint="/v1/chat/completions", status="200") == 2
    assert delta("tandem_requests_total", endpoint="/v1/chat/completions", status="400") == 1
    assert delta("tandem_generated_tokens_total") == sum(u["completion_tokens"] for u in usages)
    assert delta("tandem_prompt_tokens_total") == sum(u["prompt_tokens"] for u in usages)
    assert delta("tandem_request_duration_seconds_count", endpoint="/v1/chat/completions") == 3
    assert metric(after, "tandem_queue_depth") == 0
    for name in ("tandem_time_to_first_token_seconds_count", "tandem_decode_tokens_per_second"):
        assert name in after
    assert "# TYPE tandem_requests_total counter" in after


# --- the CLI entry point ------------------------------------------------------------------------------
LAUNCH = """
import argparse, sys
from online.server.batch_config import BatchConfig
from online.server.cli import add_serve_parser, run_serve
from tandem.core.errors import TandemError
parser = argparse.ArgumentParser(); sub = parser.add_subparsers(dest="command", required=True)
add_serve_parser(sub)
args = parser.parse_args(sys.argv[1:])
try:
    sys.exit(args.func(args))
except TandemError as exc:
    print(f"error: {exc}", file=sys.stderr); sys.exit(2)
"""


def test_serve_command_binds_loopback_and_rejects_a_busy_port(tiny_dir, ref_engine):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmd = [sys.executable, "-c", LAUNCH, "serve", "--model", str(tiny_dir), "--port", str(port),
           "--api-key", "k", "--max-queue", "4", "--threads", "1", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.poll() else ""
            time.sleep(0.1)
        listening = [c for c in __import__("psutil").Process(proc.pid).net_connections() if c.status == "LISTEN"]
        assert [c.laddr.ip for c in listening] == ["127.0.0.1"]
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/completions", headers={"Authorization": "Bearer k"},
                          json={"prompt": "hi", "max_tokens": 3, "temperature": 0}, timeout=30)
        assert resp.json()["choices"][0]["text"] == ref_engine.generate("hi", max_new_tokens=3).text
        # a tool call round trip through the openai client against `tandem serve`
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="k", max_retries=0, timeout=60)
        tool = {"type": "function", "function": {"name": "pick", "parameters": {
            "type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "required": ["n"], "additionalProperties": False}}}
        question = [{"role": "user", "content": "pick"}]
        chat = client.chat.completions.create(model=ref_engine.model_id, messages=question, tools=[tool],
                                              tool_choice="required", max_tokens=120, temperature=0)
        call = chat.choices[0].message.tool_calls[0]
        assert chat.choices[0].finish_reason == "tool_calls" and call.function.name == "pick"
        assert 0 <= json.loads(call.function.arguments)["n"] <= 9
        follow = question + [chat.choices[0].message.model_dump(exclude_none=True),
                             {"role": "tool", "tool_call_id": call.id, "content": "7"}]
        answer = client.chat.completions.create(model=ref_engine.model_id, messages=follow, tools=[tool],
                                                max_tokens=3, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")
        # a second server on the same port: a one-line TandemError before any model is loaded
        parser = argparse.ArgumentParser()
        add_serve_parser(parser.add_subparsers(dest="command"))
        args = parser.parse_args(cmd[3:])
        with pytest.raises(TandemError, match=rf"^cannot listen on 127\.0\.0\.1:{port}: "):
            run_serve(args)
        for bad in (["--port", "70000"], ["--max-queue", "0"], ["--request-timeout", "-1"], ["--api-key", " "],
                    ["--served-model-name", " "], ["--spec-max-seqs", "3"], ["--max-batch", "0"],
                    ["--prefill-chunk-tokens", "17"]):
            with pytest.raises(TandemError, match="^--"):  # the flag named, before the busy port is even tried
                run_serve(parser.parse_args(cmd[3:] + bad))
    finally:
        proc.terminate()  # SIGTERM: a graceful stop, exit code 0
        proc.wait(20)
    assert proc.returncode == 0, proc.stderr.read()[-500:]


def test_a_kv_budget_past_free_memory_is_refused(ref_engine):
    """An explicit --kv-budget larger than the memory free now: a one-line error, not the OOM killer."""
    import psutil
    too_big = int(psutil.virtual_memory().available * 1.5)
    with pytest.raises(TandemError, match="--kv-budget"):
        BatchConfig(kv_budget_bytes=too_big).make_pool(ref_engine)
    assert BatchConfig(kv_budget_bytes=64 << 20).make_pool(ref_engine).nbytes <= 64 << 20


# --- the real default model ---------------------------------------------------------------------------
@pytest.mark.slow
def test_smollm2_chat_over_http_matches_engine(smollm2_path):
    question = [{"role": "user", "content": "What is the capital of France?"}]
    ref = Engine.load(str(smollm2_path)).generate(question, max_new_tokens=24, temperature=0.0)
    engine = Engine.load("smollm2")
    with LiveServer(create_app(engine)) as server:
        client = server.client()
        chat = client.chat.completions.create(model=engine.model_id, messages=question, max_tokens=24, temperature=0)
        assert chat.choices[0].message.content == ref.text
        streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
            model=engine.model_id, messages=question, max_tokens=24, temperature=0, stream=True))
        assert streamed == ref.text
    assert "Paris" in ref.text


def test_a_request_that_fails_fails_alone(tiny_dir, ref_engine, long_prompts, monkeypatch):
    """An unexpected error while starting a request, or while sampling one sequence of the batch, answers
    that request with a 500 and nothing else: the stream running beside it finishes with its served-alone
    text, and the worker keeps serving (it once died on a tokenizer error, and one sampler's error failed
    every running stream)."""
    import online.server.batch_loop as batch_loop
    from tandem.core import sampling
    engine = Engine.load(str(tiny_dir))
    encode = engine.encode_prompt

    def encode_or_fail(prompt):
        if prompt == "fail to start":
            raise RuntimeError("tokenizer broke")
        return encode(prompt)

    def choose_or_fail(logits, params, *rest):
        if params.temperature == 0.125:
            raise RuntimeError("sampler broke")
        return sampling.choose_token(logits, params, *rest)

    monkeypatch.setattr(engine, "encode_prompt", encode_or_fail)
    monkeypatch.setattr(batch_loop, "choose_token", choose_or_fail)
    prompt, max_tokens = long_prompts["prompt"], LONG_TOKENS
    expected = ref_engine.generate(prompt, max_new_tokens=max_tokens).text
    with LiveServer(create_app(engine)) as server, server.http() as http:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
        with http.stream("POST", "/v1/completions", json=body) as running:
            lines = running.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            started = http.post("/v1/completions", json={"prompt": "fail to start", "max_tokens": 4})
            sampled = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0.125})
            rest = [line for line in lines if line.startswith("data: ")]
        text = "".join(json.loads(line[6:])["choices"][0]["text"] for line in [first] + rest[:-1])
        assert rest[-1] == "data: [DONE]" and text == expected
        for failed in (started, sampled):
            assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
        assert http.get("/health").json()["status"] == "ok"
        again = http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "temperature": 0})
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == ref_engine.generate("hi", max_new_tokens=4).text
