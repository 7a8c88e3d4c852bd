"""Request-side parsing of the OpenAI features built on constrained decoding: ``response_format``,
``tools`` / ``tool_choice``, and the chat prompt with tools (see online.constrain).

Example::

    grammar = response_format_grammar({"type": "json_object"})      # online.constrain.Grammar
    tools = parse_tools([{"type": "function", "function": {"name": "f"}}])
    parse_tool_choice({"type": "function", "function": {"name": "f"}}, tools)  # ("function", "f")
"""
from __future__ import annotations

import re
from typing import Any

from online.constrain import Grammar, ToolSpec, native_tool_messages, render_tool_messages
from tandem.core.errors import TandemError


JSON_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for json_schema.name


def response_format_grammar(fmt: dict[str, Any]) -> Any:
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}``
    -> an online.constrain.Grammar (None for text); ValueError naming what is wrong or unsupported."""
    kind = fmt.get("type")
    try:
        if kind == "text":
            return None
        if kind == "json_object":
            return Grammar.json_object()
        if kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict) \
                    or not isinstance(spec.get("name"), str) or not JSON_SCHEMA_NAME.fullmatch(spec["name"]):
                raise ValueError('json_schema must be {"name": ..., "schema": {...}, "strict": ...} (name: up to '
                                 '64 letters, digits, _ or -)')
            unknown = sorted(set(spec) - {"name", "description", "schema", "strict"})
            if unknown:
                raise ValueError(f"unsupported json_schema fields {unknown} (supported: name, description, schema, "
                                 "strict)")
            if not isinstance(spec.get("strict", False), (bool, type(None))):
                raise ValueError("json_schema.strict must be a boolean")
            return Grammar.json_schema(spec.get("schema", {}))
    except TandemError as exc:
        raise ValueError(str(exc)) from None
    raise ValueError(f"unsupported response_format type {kind!r} (supported: text, json_object, json_schema)")


def parse_tools(tools: list[Any]) -> tuple[Any, ...]:
    """OpenAI ``tools`` -> ToolSpecs (each parameters schema checked); ValueError naming the problem."""
    try:
        specs = tuple(ToolSpec.from_openai(t) for t in tools)
    except TandemError as exc:
        raise ValueError(str(exc)) from None
    names = [t.name for t in specs]
    if len(set(names)) != len(names):
        raise ValueError("tool names must be unique")
    return specs


def parse_tool_choice(choice: Any, tools: Any) -> Any:
    """``"none" | "auto" | "required" | {"type": "function", "function": {"name"}}`` -> the string, or
    ``("function", name)``."""
    if choice is None:
        return None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ValueError(f"unsupported tool_choice {choice!r} (supported: none, auto, required, or a function)")
        if choice != "none" and not tools:
            raise ValueError(f"tool_choice {choice!r} needs tools")
        return choice
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(fn, dict) \
            or not isinstance(fn.get("name"), str):
        raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}')
    if not tools or fn["name"] not in {t.name for t in tools}:
        raise ValueError(f"tool_choice names {fn['name']!r}, which is not among the tools")
    return ("function", fn["name"])


def chat_prompt(engine: Any, req: Any) -> list[dict[str, Any]] | list[int]:
    """The prompt of a chat request: its messages, or, with tools or tool turns, the messages rendered
    for tools: token ids from the model's own template when it takes ``tools``, else the convention
    of online.constrain.tools (a system preamble, ``<tool_call>``/``<tool_response>`` text)."""
    messages = req.chat_messages()
    tools = list(req.tools or ()) if req.tool_mode()[0] != "none" else []
    if not tools and not any(m["role"] == "tool" or m.get("tool_calls") for m in messages):
        return messages
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is not None and getattr(tokenizer, "supports_tools", False):
        return tokenizer.encode_chat(native_tool_messages(messages), tools=[t.openai() for t in tools] or None)
    return render_tool_messages(messages, tools)
