"""Function tools: prompt rendering, the tool-call grammar, and parsing calls out of the model's text.

The tool-call format is the Hermes/Qwen convention, which many small instruct models were trained on::

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

Rendering: a chat template that takes ``tools`` (it mentions the variable) renders them itself;
otherwise (SmolLM2's and most plain ChatML templates) this module's documented convention applies:

- a system message lists the tools as JSON inside ``<tools></tools>`` and asks for the format above
  (merged before the first system message's text, or inserted as the first message);
- an assistant message's ``tool_calls`` become that text, one ``<tool_call>`` block per call;
- a ``role: tool`` message becomes a user turn ``<tool_response>\\n{content}\\n</tool_response>``
  (templates often reject unknown roles).

Example::

    tools = [ToolSpec.from_openai(t) for t in request_tools]
    messages = render_tool_messages(messages, tools)
    grammar = tool_call_grammar(tools)                       # for tool_choice "required"
    calls = parse_tool_calls(text, tools)                    # [(name, arguments_json)] or []
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from tandem.core.errors import TandemError
from .grammar import JSON_OPTIONS, Grammar

TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
CALL_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
SYSTEM_PREAMBLE = (
    "You may call one or more functions to assist with the user query. The functions are listed as JSON "
    "within <tools></tools>:\n<tools>\n{tools}\n</tools>\n"
    "To call a function, reply with a JSON object holding its name and arguments within "
    "<tool_call></tool_call> tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n"
    "</tool_call>")


TOOL_FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})


@dataclass(frozen=True)
class ToolSpec:
    """One function tool: name, description and its JSON-schema parameters (validated for the grammar)."""
    name: str
    description: str
    parameters_json: str  # the parameters schema, serialized (keeps the dataclass hashable)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not TOOL_NAME.match(self.name):
            raise TandemError(f"tool name {self.name!r} must be 1-64 letters, digits, '_' or '-'")
        Grammar.json_schema(self.parameters)  # raises naming the unsupported schema feature

    @property
    def parameters(self) -> dict[str, Any]:
        return json.loads(self.parameters_json)

    @classmethod
    def from_openai(cls, tool: Any) -> "ToolSpec":
        """From ``{"type": "function", "function": {"name", "description", "parameters"}}``."""
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise TandemError('each tool must be {"type": "function", "function": {...}}')
        fn = tool["function"]
        unknown = sorted(set(tool) - {"type", "function"}) or sorted(set(fn) - TOOL_FUNCTION_FIELDS)
        if unknown:
            raise TandemError(f"tool {fn.get('name')!r}: unsupported fields {unknown} "
                              f"(a function takes {', '.join(sorted(TOOL_FUNCTION_FIELDS))})")
        params = fn.get("parameters", EMPTY_PARAMETERS)
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            raise TandemError(f"tool {fn.get('name')!r}: parameters must be a JSON schema of type \"object\" "
                              "(the arguments are one JSON object)")
        if not isinstance(fn.get("strict", False), (bool, type(None))):
            raise TandemError(f"tool {fn.get('name')!r}: strict must be a boolean")
        description = fn.get("description", "")
        if not isinstance(description, str):
            raise TandemError(f"tool {fn.get('name')!r}: description must be a string")
        return cls(fn.get("name"), description, json.dumps(params))

    def openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


def call_text(name: str, arguments: Any) -> str:
    """One call in the convention's format (``arguments``: a dict, or its JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def render_tool_messages(messages: list[dict[str, Any]], tools: list[ToolSpec]) -> list[dict[str, str]]:
    """Plain role/content messages for a template without tool support (see the module docstring)."""
    out: list[dict[str, str]] = []
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], c["function"]["arguments"]) for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + calls})
        else:
            out.append({"role": m["role"], "content": content})
    if tools:
        preamble = SYSTEM_PREAMBLE.format(tools="\n".join(json.dumps(t.openai(), ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out


def native_tool_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages for a template that renders tools itself (transformers' convention: arguments as objects)."""
    out = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            calls = []
            for c in m["tool_calls"]:
                args = c["function"]["arguments"]
                try:
                    args = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    pass
                calls.append({"id": c.get("id"), "type": "function",
                              "function": {"name": c["function"]["name"], "arguments": args}})
            m["tool_calls"] = calls
        out.append(m)
    return out


def tool_call_grammar(tools: list[ToolSpec], name: str | None = None) -> Grammar:
    """Exactly one call of ``name`` (or of any of ``tools``) with arguments valid for its schema."""
    chosen = [t for t in tools if name is None or t.name == name]
    if not chosen:
        raise TandemError(f"tool_choice names {name!r}, which is not among the tools")
    options = [{"type": "object", "properties": {"name": {"const": t.name}, "arguments": t.parameters},
                "required": ["name", "arguments"], "additionalProperties": False} for t in chosen]
    schema = options[0] if len(options) == 1 else {"anyOf": options}
    schema = {**schema, "x-guidance": JSON_OPTIONS}  # compact JSON, as for response_format
    return Grammar.lark('start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json ' + json.dumps(schema) + "\n")


def parse_tool_calls(text: str, tools: list[ToolSpec]) -> list[tuple[str, str]]:
    """``[(name, arguments_json)]`` for each well-formed call of a known tool in ``text``; ``[]`` when
    the text holds none (it is then ordinary content). A bare JSON object with ``name`` and
    ``arguments`` (or ``parameters``) counts as a call too."""
    known = {t.name for t in tools}
    blocks = CALL_BLOCK.findall(text) if "<tool_call>" in text else [text.strip()]
    calls = []
    for block in blocks:
        try:
            obj = json.loads(block)
        except ValueError:
            continue
        if not isinstance(obj, dict) or obj.get("name") not in known:
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                continue
        if isinstance(args, dict):
            calls.append((obj["name"], json.dumps(args, ensure_ascii=False)))
    return calls
