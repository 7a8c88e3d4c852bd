"""Constrained decoding: JSON / JSON-schema / tool-call grammars enforced token by token (llguidance).

Example::

    from online.constrain import Grammar
    grammar = Grammar.json_schema({"type": "object", "properties": {"x": {"type": "integer"}}})
    out = engine.generate("Reply in JSON:", grammar=grammar)   # out.text parses and validates
"""
from .grammar import Grammar, GrammarConstraint, GrammarState, grammar_tokenizer
from .tools import ToolSpec, native_tool_messages, parse_tool_calls, render_tool_messages, tool_call_grammar

__all__ = ["Grammar", "GrammarConstraint", "GrammarState", "grammar_tokenizer", "ToolSpec", "parse_tool_calls",
           "render_tool_messages", "native_tool_messages", "tool_call_grammar"]
