"""logprobs, response_format (JSON / JSON schema through llguidance) and tools, from choose_token to the
openai client.

References: log-softmax of the logits computed independently (float64 formula; ``Engine.step_logits``,
the decode path generation uses), the ``jsonschema`` validator, Python's ``json`` parser, a separately
loaded engine fed the documented tool-prompt convention, and the official ``openai`` client's parsing.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import httpx
import jsonschema
import pytest
import torch
from pydantic import BaseModel, Field

from online import Engine
from tandem.core.generate import decode_one_token, prefill
from online.constrain import (Grammar, GrammarConstraint, ToolSpec, parse_tool_calls, render_tool_messages,
                              tool_call_grammar)
from online.constrain.grammar import build_grammar_tokenizer
from tandem.core.sampling import DecodeOptions, SamplingParams, choose_token, make_generator
from online.server import create_app
from online.server.batch_config import BatchConfig
from online.server.app import chat_prompt
from online.server.responses import may_be_tool_call
from online.server.schemas import ChatCompletionRequest, parse_request
from tandem.core.errors import TandemError
from helpers_tiny import build_tiny_chat_model
from test_server import LiveServer, sse_payloads

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city for some days",
    "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome", "Oslo"]},
                                                    "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}}, "required": ["zone"],
    "additionalProperties": False}}}
SCHEMAS = [
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": -5, "maximum": 50},
                                      "color": {"enum": ["red", "green", "blue"]}},
     "required": ["ok", "n", "color"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 6},
                                               "minItems": 1, "maxItems": 3},
                                      "code": {"type": "string", "pattern": "^[a-z]{2,5}$"}},
     "required": ["tags", "code"], "additionalProperties": False},
    {"type": "object", "properties": {"item": {"anyOf": [{"type": "null"}, {"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 999}}, "required": ["id"], "additionalProperties": False}]},
        "note": {"type": "string", "maxLength": 4}}, "required": ["item"], "additionalProperties": False},
]


class Point(BaseModel):
    x: int = Field(ge=0, le=9)
    y: int = Field(ge=0, le=9)


class Shape(BaseModel):
    color: Literal["red", "blue"]
    points: list[Point] = Field(max_length=3)
    closed: bool


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_chat_model(tmp_path_factory.mktemp("tiny-oai"), max_position_embeddings=2048)


@pytest.fixture(scope="module")
def ref_engine(tiny_dir) -> Engine:
    return Engine.load(str(tiny_dir))


@pytest.fixture(scope="module")
def srv(tiny_dir):
    with LiveServer(create_app(Engine.load(str(tiny_dir)))) as server:
        yield server


# --- choose_token --------------------------------------------------------------------------------------
class AllowSet:
    """A constraint state allowing a fixed token set (records what it was advanced by)."""

    def __init__(self, allowed: list[int]):
        self.allowed_ids, self.seen = allowed, []

    def allowed(self, vocab_size: int) -> torch.Tensor:
        mask = torch.zeros(vocab_size, dtype=torch.bool)
        mask[self.allowed_ids] = True
        return mask

    def advance(self, token_id: int) -> None:
        self.seen.append(token_id)

    def ends(self, token_id: int) -> bool:
        return False


def test_choose_token_logprobs_are_log_softmax_of_raw_logits():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(500, generator=gen) * 4  # [vocab]
    ref = logits.double() - torch.logsumexp(logits.double(), 0)  # independent float64 log-softmax
    for params in (SamplingParams(), SamplingParams(temperature=0.3, top_k=20, seed=1)):
        choice = choose_token(logits, params, make_generator(params), DecodeOptions(logprobs=True, top_logprobs=7))
        assert abs(choice.logprob - float(ref[choice.token_id])) < 1e-5  # raw logits: temperature does not change it
        ids = [t for t, _ in choice.top_logprobs]
        assert ids == torch.argsort(ref, descending=True)[:7].tolist()
        assert all(abs(lp - float(ref[t])) < 1e-5 for t, lp in choice.top_logprobs)
    assert choose_token(logits, SamplingParams(), make_generator(SamplingParams())).logprob is None
    with pytest.raises(TandemError):
        DecodeOptions(logprobs=True, top_logprobs=21)
    with pytest.raises(TandemError):
        DecodeOptions(top_logprobs=2)


def test_choose_token_constraint_masks_greedy_and_sampling():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(1))  # [vocab]
    allowed = torch.randperm(300, generator=torch.Generator().manual_seed(2))[:9].tolist()
    best_allowed = max(allowed, key=lambda t: float(logits[t]))
    state = AllowSet(allowed)
    choice = choose_token(logits, SamplingParams(), make_generator(SamplingParams()), DecodeOptions(logprobs=True), state)
    assert choice.token_id == best_allowed and state.seen == [best_allowed]
    assert abs(choice.logprob - float(torch.log_softmax(logits.double(), 0)[best_allowed])) < 1e-5
    params = SamplingParams(temperature=1.5, top_p=0.9, seed=3)
    generator = make_generator(params)
    drawn = {choose_token(logits, params, generator, None, AllowSet(allowed)).token_id for _ in range(200)}
    assert drawn <= set(allowed) and len(drawn) > 1


# --- engine ------------------------------------------------------------------------------------------
def test_engine_logprobs_match_the_decode_path_logits(ref_engine):
    prompt = ref_engine.encode_prompt("Once upon a time")
    out = ref_engine.generate(prompt, max_new_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=4)
    assert len(out.choices) == len(out.token_ids) == 12
    ref = torch.log_softmax(ref_engine.step_logits(prompt + out.token_ids).double(), -1)  # [T, vocab]
    for i, (token, choice) in enumerate(zip(out.token_ids, out.choices)):
        row = ref[len(prompt) - 1 + i]
        assert choice.token_id == token == choice.top_logprobs[0][0] == int(row.argmax())  # greedy
        assert abs(choice.logprob - float(row[token])) < 1e-4
        lps = [lp for _, lp in choice.top_logprobs]
        assert lps == sorted(lps, reverse=True) and len(lps) == 4
        assert all(abs(lp - float(row[t])) < 1e-4 for t, lp in choice.top_logprobs)


def test_json_schema_outputs_validate_on_the_tiny_model(ref_engine):
    for schema in SCHEMAS:
        grammar = Grammar.json_schema(schema)
        for seed in (0, 1):
            out = ref_engine.generate([{"role": "user", "content": "json please"}], max_new_tokens=400,
                                      temperature=1.0, seed=seed, grammar=grammar)
            assert out.finish_reason == "stop", out.text
            jsonschema.validate(json.loads(out.text), schema)
    out = ref_engine.generate("{", max_new_tokens=400, temperature=0.7, seed=5, grammar=Grammar.json_object())
    assert out.finish_reason == "length" or isinstance(json.loads(out.text), dict)


def random_walk(tokenizer, grammar: Grammar, seed: int, max_steps: int = 400) -> str:
    """Text of a walk choosing uniformly among the tokens the grammar allows, decoded by our tokenizer."""
    state = GrammarConstraint(build_grammar_tokenizer(tokenizer, tokenizer.vocab_size, list(tokenizer.eos_token_ids)),
                              grammar)()
    gen, ids = torch.Generator().manual_seed(seed), []
    for _ in range(max_steps):
        allowed = state.allowed(tokenizer.vocab_size).nonzero().flatten()  # [n_allowed]
        token = int(allowed[torch.randint(len(allowed), (1,), generator=gen)])
        state.advance(token)
        if state.ends(token):
            return tokenizer.decode(ids)
        ids.append(token)
    raise AssertionError(f"the grammar did not complete in {max_steps} tokens: {tokenizer.decode(ids)!r}")


def test_grammar_bridge_agrees_with_our_tokenizers(ref_engine, tmp_path):
    """llguidance's view of the vocabulary (built from the tokenizers JSON) decodes as ours does: walks
    through the allowed tokens of byte-level BPE and SentencePiece (byte fallback) GGUF vocabularies
    give text that parses and validates."""
    from tandem.core.loading.tokenizer import Tokenizer
    from test_tokenizer import read_gguf, write_sentencepiece_gguf
    write_sentencepiece_gguf(tmp_path / "sp.gguf")
    sentencepiece = Tokenizer.from_gguf_metadata(read_gguf(tmp_path / "sp.gguf")[1])
    for tokenizer in (ref_engine.tokenizer, sentencepiece):
        first = GrammarConstraint(build_grammar_tokenizer(tokenizer, tokenizer.vocab_size, [2]),
                                  Grammar.json_object())().allowed(tokenizer.vocab_size)
        assert first.any() and all(tokenizer.decode([int(t)]).startswith("{") for t in first.nonzero().flatten())
        for schema in SCHEMAS:
            for seed in range(3):
                jsonschema.validate(json.loads(random_walk(tokenizer, Grammar.json_schema(schema), seed)), schema)


def test_unsupported_schema_features_are_named():
    for schema, word in (({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not"),
                         ({"type": "array", "uniqueItems": True}, "uniqueItems"),
                         ({"type": "strang"}, "strang")):
        with pytest.raises(TandemError, match=word):
            Grammar.json_schema(schema)


@pytest.mark.slow
def test_smollm2_json_schema_and_json_object(smollm2_path):
    engine = Engine.load(str(smollm2_path), weight_format="int4", sparse=False)
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                               "country": {"type": "string", "maxLength": 20},
                                               "population_millions": {"type": "integer", "minimum": 0, "maximum": 100}},
              "required": ["city", "country", "population_millions"], "additionalProperties": False}
    out = engine.generate([{"role": "user", "content": "Describe Paris as JSON."}], max_new_tokens=48,
                          grammar=Grammar.json_schema(schema), logprobs=True)
    assert out.finish_reason == "stop", out.text
    jsonschema.validate(json.loads(out.text), schema)
    ids = engine.encode_prompt([{"role": "user", "content": "Describe Paris as JSON."}])
    ref = torch.log_softmax(generation_logits(engine, ids, out.token_ids).double(), -1)  # [T, vocab]
    for i, choice in enumerate(out.choices):
        assert abs(choice.logprob - float(ref[i, choice.token_id])) < 1e-4
    out = engine.generate([{"role": "user", "content": "Give the name and age of a famous scientist as a JSON object."}],
                          max_new_tokens=40, grammar=Grammar.json_object())
    assert out.finish_reason == "stop" and isinstance(json.loads(out.text), dict), out.text


def generation_logits(engine: Engine, prompt_ids: list[int], token_ids: list[int]) -> torch.Tensor:
    """[len(token_ids), vocab]: the logits each generated token was chosen from, recomputed as generation
    does (prefill and one decode step per token, through the fused step on a packed engine)."""
    cache = engine.new_kv_cache(len(prompt_ids) + len(token_ids))
    rows = [prefill(engine.model, engine.executor, cache, prompt_ids, compiled=engine.compiled_decode)]
    for pos, token in enumerate(token_ids[:-1], start=len(prompt_ids)):
        rows.append(decode_one_token(engine.model, engine.executor, cache, token, pos, engine.compiled_decode))
    return torch.stack(rows).float()


def test_generate_cli_json_schema_and_logprobs(tiny_dir, ref_engine, tmp_path, capsys):
    from tandem.cli import main
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(SCHEMAS[0]))
    code = main(["generate", "--model", str(tiny_dir), "--prompt", "hi", "--max-new-tokens", "300", "--json",
                 "--json-schema", str(schema_file), "--logprobs", "2"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["finish_reason"] == "stop"
    jsonschema.validate(json.loads(out["text"]), SCHEMAS[0])
    ref = ref_engine.generate("hi", max_new_tokens=300, grammar=Grammar.json_schema(SCHEMAS[0]), logprobs=True, top_logprobs=2)
    assert out["text"] == ref.text and [x["logprob"] for x in out["logprobs"]] == [c.logprob for c in ref.choices]
    (tmp_path / "bad.json").write_text('{"type": "object", "not": {}}')
    for argv, fragment in ((["--json-schema", str(tmp_path / "bad.json")], "not"),
                           (["--json-schema", str(tmp_path / "missing.json")], "cannot read"),
                           (["--json", "--logprobs", "99"], "--logprobs"), (["--logprobs", "2"], "--json")):
        code = main(["generate", "--model", str(tiny_dir), "--prompt", "hi", *argv])
        err = capsys.readouterr().err.strip()
        assert code == 2 and "\n" not in err and fragment in err and "Traceback" not in err, err


# --- tools ---------------------------------------------------------------------------------------------
def test_tool_call_parsing_and_grammar(ref_engine):
    tools = [ToolSpec.from_openai(WEATHER), ToolSpec.from_openai(CLOCK)]
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    assert parse_tool_calls(text, tools) == [("get_weather", '{"city": "Oslo", "days": 2}')]
    assert parse_tool_calls(text + "\n" + text.replace("Oslo", "Rome"), tools)[1][1] == '{"city": "Rome", "days": 2}'
    assert parse_tool_calls('{"name": "get_time", "parameters": {"zone": "UTC"}}', tools) == [("get_time", '{"zone": "UTC"}')]
    for not_a_call in ("The weather is fine.", '<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>',
                       '<tool_call>{"name": "get_time", "arguments": {"zone"'):
        assert parse_tool_calls(not_a_call, tools) == []
    for name in (None, "get_time"):
        for seed in (0, 1):
            out = ref_engine.generate("call", max_new_tokens=300, temperature=1.0, seed=seed,
                                      grammar=tool_call_grammar(tools, name))
            calls = parse_tool_calls(out.text, tools)
            assert out.finish_reason == "stop" and len(calls) == 1, out.text
            spec = next(t for t in tools if t.name == calls[0][0])
            assert name in (None, spec.name)
            jsonschema.validate(json.loads(calls[0][1]), spec.parameters)
    with pytest.raises(TandemError, match="not among"):
        tool_call_grammar(tools, "nope")
    assert may_be_tool_call("") and may_be_tool_call("  <tool_") and may_be_tool_call('{"na')
    assert not may_be_tool_call("The") and not may_be_tool_call("<b>")


def test_openai_client_tool_calls_round_trip(srv, ref_engine):
    client = srv.client()
    question = [{"role": "user", "content": "What is the weather in Paris?"}]
    chat = client.chat.completions.create(model=ref_engine.model_id, messages=question, tools=[WEATHER, CLOCK],
                                          tool_choice="required", max_tokens=300, temperature=0)
    choice = chat.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.type == "function" and call.id and call.function.name in ("get_weather", "get_time")
    params = (WEATHER if call.function.name == "get_weather" else CLOCK)["function"]["parameters"]
    jsonschema.validate(json.loads(call.function.arguments), params)

    # the follow-up with the tool's result: rendered by the documented convention, answered like the engine
    follow = question + [choice.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": '{"temperature_c": 21}'}]
    answer = client.chat.completions.create(model=ref_engine.model_id, messages=follow, tools=[WEATHER, CLOCK],
                                            max_tokens=8, temperature=0)
    rendered = render_tool_messages(
        question + [{"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
                    {"role": "tool", "content": '{"temperature_c": 21}'}],
        [ToolSpec.from_openai(WEATHER), ToolSpec.from_openai(CLOCK)])
    assert "<tool_response>" in rendered[-1]["content"] and "<tools>" in rendered[0]["content"]
    ref = ref_engine.generate(rendered, max_new_tokens=8)
    assert answer.choices[0].message.content == ref.text and answer.choices[0].message.tool_calls is None
    # the same with stream: true (tool_choice auto): content arrives as it is generated, once it cannot be a call
    chunks = list(client.chat.completions.create(model=ref_engine.model_id, messages=follow, tools=[WEATHER, CLOCK],
                                                 max_tokens=8, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason

    # a named function, streamed: the name first, then the arguments in pieces; finish_reason tool_calls
    chunks = list(client.chat.completions.create(
        model=ref_engine.model_id, messages=question, tools=[WEATHER, CLOCK], max_tokens=300, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}}, stream=True))
    deltas = [d for c in chunks if c.choices and c.choices[0].delta.tool_calls for d in c.choices[0].delta.tool_calls]
    assert deltas[0].function.name == "get_time" and deltas[0].id and deltas[0].index == 0
    assert {d.index for d in deltas} == {0} and len(deltas) > 2  # streamed in pieces
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), CLOCK["function"]["parameters"])
    whole = client.chat.completions.create(
        model=ref_engine.model_id, messages=question, tools=[WEATHER, CLOCK], max_tokens=300, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert json.loads(arguments) == json.loads(whole.choices[0].message.tool_calls[0].function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # tool_choice none: the tools are not rendered, the answer is the plain chat's
    plain = client.chat.completions.create(model=ref_engine.model_id, messages=question, tools=[WEATHER],
                                           tool_choice="none", max_tokens=6, temperature=0)
    assert plain.choices[0].message.content == ref_engine.generate(question, max_new_tokens=6).text


def test_auto_tool_choice_parses_a_call_the_model_writes():
    """tool_choice auto: a call the model writes by itself (here: a canned text) becomes message.tool_calls,
    in a full reply and in a stream (held back while it can still be a call); other text stays content."""
    import asyncio
    from types import SimpleNamespace
    from online.server.responses import Reply
    tools = (ToolSpec.from_openai(WEATHER), ToolSpec.from_openai(CLOCK))
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'

    def result(text):
        return SimpleNamespace(text=text, token_ids=[0] * 3, prompt_tokens=5, finish_reason="stop", choices=[])

    def streamed(text, pieces):
        reply = Reply("chatcmpl-x", "m", chat=True, tools=tools)
        job = SimpleNamespace(events=asyncio.Queue(), deadline_s=float("inf"), cancel=lambda *a: None)

        async def run():
            for piece in pieces[1:]:
                job.events.put_nowait(("piece", (piece, [])))
            job.events.put_nowait(("done", result(text)))
            return [e async for e in reply.events(job, ("piece", (pieces[0], [])), False, 60)]
        return [json.loads(e[6:]) for e in asyncio.run(run()) if e.startswith("data: {")]

    full = Reply("chatcmpl-x", "m", chat=True, tools=tools).full(result("ok " + call))
    message = full["choices"][0]["message"]
    assert full["choices"][0]["finish_reason"] == "tool_calls" and message["content"] == "ok"
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert Reply("c", "m", chat=True, tools=tools).full(result("Hello"))["choices"][0]["message"]["content"] == "Hello"

    events = streamed(call, [call[:5], call[5:20], call[20:]])
    deltas = [e["choices"][0]["delta"] for e in events]
    assert [d.get("content") for d in deltas[1:]] == [None, None] and deltas[1]["tool_calls"][0]["function"]["name"] == "get_time"
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
    events = streamed("ok " + call, ["ok ", "<tool", call[5:]])
    assert events[1]["choices"][0]["delta"]["content"] == "ok " and "tool_calls" in events[2]["choices"][0]["delta"]
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls" and len(events) == 4
    events = streamed("a <b> c", ["a <", "b> c"])  # a '<' that is not a call: held only while it might be
    assert [e["choices"][0]["delta"].get("content") for e in events[1:-1]] == ["a ", "<b> c"]
    events = streamed("Hello there", ["Hel", "lo", " there"])
    assert [e["choices"][0]["delta"].get("content") for e in events[1:-1]] == ["Hel", "lo", " there"]
    assert events[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_call_cut_by_max_tokens_reads_the_same_streamed_and_whole():
    """max_tokens ending inside a call's arguments: the full reply and the stream both give the call with the
    arguments generated so far and finish_reason "length" (the full reply once put the raw <tool_call> text
    in content, while the stream sent the call)."""
    import asyncio
    from types import SimpleNamespace
    from online.server.responses import Reply
    tools = (ToolSpec.from_openai(WEATHER), ToolSpec.from_openai(CLOCK))
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    result = SimpleNamespace(text=text, token_ids=[0] * 9, prompt_tokens=5, finish_reason="length", choices=[])
    full = Reply("c", "m", chat=True, tools=tools).full(result)["choices"][0]
    assert full["finish_reason"] == "length" and full["message"]["content"] is None
    assert [c["function"] for c in full["message"]["tool_calls"]] == [
        {"name": "get_weather", "arguments": '{"city": "Par'}]
    job = SimpleNamespace(events=asyncio.Queue(), deadline_s=float("inf"), cancel=lambda *a: None)

    async def run():
        for piece in (text[20:40], text[40:]):
            job.events.put_nowait(("piece", (piece, [])))
        job.events.put_nowait(("done", result))
        return [e async for e in Reply("c", "m", chat=True, tools=tools).events(job, ("piece", (text[:20], [])),
                                                                               False, 60)]
    events = [json.loads(e[6:]) for e in asyncio.run(run()) if e.startswith("data: {")]
    deltas = [d for e in events for d in e["choices"][0]["delta"].get("tool_calls", [])]
    assert [d["function"]["name"] for d in deltas if "id" in d] == ["get_weather"]
    assert "".join(d["function"]["arguments"] for d in deltas) == full["message"]["tool_calls"][0]["function"]["arguments"]
    assert not any(e["choices"][0]["delta"].get("content") for e in events)
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_tool_call_arguments_stream_in_pieces_that_join_to_the_parsed_call():
    """Fed a character at a time, a stream names each call once and then sends argument fragments whose
    concatenation parses to what parse_tool_calls (the whole-text reference) finds; parallel calls get
    their own index, parallel_tool_calls false keeps the first; text that is no call sends nothing."""
    from online.server.tool_stream import ToolCallStream, scan_tool_calls
    tools = [ToolSpec.from_openai(WEATHER), ToolSpec.from_openai(CLOCK)]
    known = {t.name for t in tools}
    text = ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris \\"Lutetia\\" {x}", "days": [1, 2]}}'
            '\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    reference = parse_tool_calls(text, tools)
    assert [name for name, _ in reference] == ["get_weather", "get_time"]
    for max_calls in (None, 1):
        stream = ToolCallStream(known, max_calls)
        updates = [stream.update(text[:i]) for i in range(1, len(text) + 1)]
        deltas = [d for update in updates for d in update]
        starts = [d for d in deltas if "id" in d]
        assert [(d["index"], d["function"]["name"]) for d in starts] == list(enumerate(
            name for name, _ in reference[:max_calls]))
        for i, (_, args) in enumerate(reference[:max_calls]):
            pieces = [d["function"]["arguments"] for d in deltas if d["index"] == i]
            assert len(pieces) > 5 and json.loads("".join(pieces)) == json.loads(args)
        # the whole text at once, or a call's name and arguments in one look: one entry per call in a delta
        # (two entries of one index lost the first fragment for clients that key them by index)
        for update in [*updates, ToolCallStream(known, max_calls).update(text)]:
            assert len({d["index"] for d in update}) == len(update)
        whole = ToolCallStream(known, max_calls).update(text)
        assert [json.loads(d["function"]["arguments"]) for d in whole] == [
            json.loads(args) for _, args in reference[:max_calls]]
    for prefix in range(len(text)):  # a scan of a prefix never claims a call complete too early
        assert all(not done or json.loads(args) for _, args, done in scan_tool_calls(text[:prefix], known))
    assert ToolCallStream(known, None).update('{"name": "get_time", "arguments": {"zone"')[0]["function"]["name"] == "get_time"
    assert ToolCallStream(known, None).update('{"name": "nope", "arguments": {"a": 1}}') == []
    assert ToolCallStream(known, None).update("The weather is {sunny}") == []


def test_chat_template_with_tools_renders_them_itself(ref_engine):
    tokenizer = ref_engine.tokenizer
    saved = tokenizer.chat_template, tokenizer._template
    try:
        tokenizer.chat_template = ("{% if tools %}TOOLS:{{ tools | map(attribute='function') | map(attribute='name') "
                                   "| join(',') }}\n{% endif %}" + saved[0])
        tokenizer._template = None
        assert tokenizer.supports_tools
        req = parse_request(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}],
                                                    "tools": [WEATHER, CLOCK]})
        ids = chat_prompt(ref_engine, req)
        assert tokenizer.decode(ids, skip_special_tokens=False).startswith("TOOLS:get_weather,get_time\n")
    finally:
        tokenizer.chat_template, tokenizer._template = saved


def test_logprobs_over_http_chat_completions_and_stream(srv, ref_engine):
    client = srv.client()
    question = [{"role": "user", "content": "hi"}]
    ref = ref_engine.generate(question, max_new_tokens=8, logprobs=True, top_logprobs=3)
    chat = client.chat.completions.create(model=ref_engine.model_id, messages=question, max_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=3)
    items = chat.choices[0].logprobs.content
    assert [it.logprob for it in items] == [c.logprob for c in ref.choices]
    assert b"".join(bytes(it.bytes) for it in items).decode() == chat.choices[0].message.content == ref.text
    for it, c in zip(items, ref.choices):
        assert [t.logprob for t in it.top_logprobs] == [lp for _, lp in c.top_logprobs]
        assert it.top_logprobs[0].token == it.token  # greedy: the chosen token is the most likely
    chunks = list(client.chat.completions.create(model=ref_engine.model_id, messages=question, max_tokens=8,
                                                 temperature=0, logprobs=True, top_logprobs=3, stream=True))
    streamed = [it for c in chunks if c.choices and c.choices[0].logprobs for it in c.choices[0].logprobs.content]
    assert [it.model_dump() for it in streamed] == [it.model_dump() for it in items]

    ref = ref_engine.generate("Once upon a time", max_new_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=2)
    comp = client.completions.create(model=ref_engine.model_id, prompt="Once upon a time", max_tokens=6,
                                     temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    lp = comp.choices[0].logprobs
    assert lp.token_logprobs == [c.logprob for c in ref.choices] and len(lp.tokens) == 6
    assert lp.text_offset == [len(ref_engine.tokenizer.decode(ref.token_ids[:i]).replace("\ufffd", "")) for i in range(6)]
    assert all(len(top) <= 2 and max(top.values()) >= logprob for top, logprob in zip(lp.top_logprobs, lp.token_logprobs))
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        events = sse_payloads(http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 6,
                                                                  "temperature": 0, "logprobs": 0, "stream": True,
                                                                  "ignore_eos": True}))
    streamed = [x for e in events[:-1] if e["choices"] and e["choices"][0]["logprobs"]
                for x in e["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == lp.token_logprobs


def test_response_format_over_http(srv, ref_engine):
    client = srv.client()
    schema = SCHEMAS[0]
    chat = client.chat.completions.create(
        model=ref_engine.model_id, messages=[{"role": "user", "content": "json"}], max_tokens=300, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "r", "schema": schema, "strict": True}})
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), schema)
    # the client's structured-output helper: a pydantic model's strict schema ($defs, enums, bounds) parses back
    parse = getattr(client.chat.completions, "parse", None) or client.beta.chat.completions.parse
    parsed = parse(model=ref_engine.model_id, messages=[{"role": "user", "content": "a shape"}], response_format=Shape,
                   max_tokens=400, temperature=0.9, seed=4).choices[0].message.parsed
    assert isinstance(parsed, Shape) and len(parsed.points) <= 3

    comp = client.completions.create(model=ref_engine.model_id, prompt="Data:", max_tokens=300, temperature=0,
                                     extra_body={"response_format": {"type": "json_schema",
                                                                     "json_schema": {"name": "r", "schema": SCHEMAS[2]}}})
    assert comp.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(comp.choices[0].text), SCHEMAS[2])
    text = client.chat.completions.create(model=ref_engine.model_id, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, temperature=0, response_format={"type": "text"})
    assert text.choices[0].message.content == ref_engine.generate([{"role": "user", "content": "hi"}], max_new_tokens=5).text


def test_unsupported_openai_features_get_clear_400s(srv):
    not_schema = {"type": "object", "properties": {"a": {"not": {"type": "string"}}}}
    cases = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": not_schema}}}, "not"),
        ({"response_format": {"type": "yaml"}}, "yaml"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": "x"}}}, "json_schema"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "nope"),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, "sometimes"),
        ({"tool_choice": "required"}, "needs tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "a b"),
        ({"tools": [WEATHER, WEATHER]}, "unique"),
        ({"tools": [{"type": "retrieval"}]}, "function"),
        ({"tools": [WEATHER], "response_format": {"type": "json_object"}}, "together"),
        ({"top_logprobs": 3}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "20"),
        ({"logprobs": 3}, "logprobs"),
        ({"functions": [{"name": "f"}]}, "tools"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
    ]
    with httpx.Client(base_url=srv.url, timeout=60) as http:
        for fields, word in cases:
            resp = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                           "max_tokens": 2, **fields})
            assert resp.status_code == 400, (fields, resp.text)
            message = resp.json()["error"]["message"]
            assert word in message and "\n" not in message, (fields, message)
        resp = http.post("/v1/completions", json={"prompt": "hi", "logprobs": 21})
        assert resp.status_code == 400 and "logprobs" in resp.json()["error"]["message"]
        assert http.get("/health").json()["status"] == "ok"


# --- with the batching scheduler ---------------------------------------------------------------------
def test_n_choices_with_logprobs_and_a_json_schema_request_batched_beside_a_stream(tiny_dir):
    """n=2 with logprobs: each choice's text and logprobs equal Engine.generate with that choice's seed
    (seed + index); a json_schema request admitted while another stream decodes (one step_batch serves
    both: /metrics' batch-size histogram sees a batch above 1) validates and equals the request alone."""
    from test_server import metric
    engine_kw = {"weight_format": "int4"}
    ref = Engine.load(str(tiny_dir), **engine_kw)
    question = [{"role": "user", "content": "hi"}]
    batch = BatchConfig()  # step prefill: the reference, Engine.generate, prefills short prompts through the step too
    with LiveServer(create_app(Engine.load(str(tiny_dir), **engine_kw), batch=batch)) as srv:
        client = srv.client()
        chat = client.chat.completions.create(model=ref.model_id, messages=question, max_tokens=10, n=2,
                                              temperature=0.9, seed=11, logprobs=True, top_logprobs=2)
        for i, choice in enumerate(chat.choices):
            want = ref.generate(question, max_new_tokens=10, temperature=0.9, seed=11 + i, logprobs=True,
                                top_logprobs=2)
            assert choice.index == i and choice.message.content == want.text
            items = choice.logprobs.content
            assert [it.logprob for it in items] == [c.logprob for c in want.choices]
            assert [[t.logprob for t in it.top_logprobs] for it in items] == \
                   [[lp for _, lp in c.top_logprobs] for c in want.choices]
        streamed: dict[int, list[float]] = {0: [], 1: []}
        for chunk in client.chat.completions.create(model=ref.model_id, messages=question, max_tokens=10, n=2,
                                                    temperature=0.9, seed=11, logprobs=True, top_logprobs=2,
                                                    stream=True):
            for c in chunk.choices:
                streamed[c.index] += [it.logprob for it in (c.logprobs.content if c.logprobs else [])]
        assert streamed == {i: [it.logprob for it in c.logprobs.content] for i, c in enumerate(chat.choices)}

        schema = SCHEMAS[1]
        fmt = {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}}
        alone = ref.generate(question, max_new_tokens=300, grammar=Grammar.json_schema(schema))
        before = httpx.get(srv.url + "/metrics").text
        with httpx.Client(base_url=srv.url, timeout=120) as http:
            body = {"prompt": "Once upon a time", "max_tokens": 1500, "temperature": 0, "stream": True,
                    "ignore_eos": True}
            with http.stream("POST", "/v1/completions", json=body) as resp:
                lines = resp.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))  # the stream is decoding
                answer = http.post("/v1/chat/completions", json={"messages": question, "max_tokens": 300,
                                                                  "temperature": 0, "response_format": fmt}).json()
        after = httpx.get(srv.url + "/metrics").text
        content = answer["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(content), schema)
        assert content == alone.text and answer["choices"][0]["finish_reason"] == "stop"
        delta = lambda name, **kw: metric(after, name, **kw) - metric(before, name, **kw)  # noqa: E731
        assert delta("tandem_batch_size_bucket", le="1") < delta("tandem_batch_size_count")  # batched
