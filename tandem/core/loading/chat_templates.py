"""Built-in chat templates for GGUF files that ship without ``tokenizer.chat_template``.

Example::

    builtin_template({"general.architecture": "gemma3"}, tokens)   # GEMMA_TEMPLATE when the turn tokens exist
"""
from __future__ import annotations

from typing import Any, Mapping

# Gemma's turn format (as llama.cpp falls back to when a Gemma GGUF carries no template): a system
# message is folded into the first user turn, the assistant speaks as "model".
GEMMA_TEMPLATE = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\n\n' %}"
    "{% set loop_messages = messages[1:] %}{% else %}{% set first = '' %}{% set loop_messages = messages %}{% endif %}"
    "{% for message in loop_messages %}<start_of_turn>{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{{ (first if loop.first else '') + message['content'] | trim }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def builtin_template(fields: Mapping[str, Any], tokens: list[str]) -> str | None:
    """A known chat format for GGUFs that ship without ``tokenizer.chat_template`` (Gemma)."""
    arch = str(fields.get("general.architecture", ""))
    if arch.startswith("gemma") and "<start_of_turn>" in tokens and "<end_of_turn>" in tokens:
        return GEMMA_TEMPLATE
    return None
