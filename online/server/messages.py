"""One chat message of a request: the fields OpenAI's API has, typed and checked strictly (a field it does not
have is an error, as for the request itself: see online/server/schemas.py).

Example::

    ChatMessage.model_validate({"role": "user", "content": [{"type": "text", "text": "hi"}]}).content  # "hi"
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

ROLES = ("system", "developer", "user", "assistant", "tool")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    role: str
    content: Any = Field(default=None, validate_default=True)
    name: str | None = None  # the participant's name: OpenAI's templates and ours do not render it
    tool_calls: list[dict[str, Any]] | None = None  # assistant turns that called tools
    tool_call_id: str | None = Field(default=None, validate_default=True)  # role "tool": the call it answers
    # what an assistant message carries back when a client returns it into the history: not rendered (as the
    # other servers do; a reasoning model's reasoning_content too), audio and the legacy function_call only empty
    refusal: str | None = None
    annotations: list[Any] | None = None
    reasoning_content: str | None = None
    audio: None = None
    function_call: None = None

    @field_validator("tool_calls")
    @classmethod
    def _tool_calls(cls, calls: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
        for call in calls or ():
            fn = call.get("function")
            if call.get("type", "function") != "function" or not isinstance(fn, dict) \
                    or not isinstance(fn.get("name"), str) or not isinstance(fn.get("arguments"), (str, dict)):
                raise ValueError('each tool call must be {"id", "type": "function", "function": {"name", "arguments"}} '
                                 "(arguments: a JSON string)")
        return calls or None

    @field_validator("role")
    @classmethod
    def _role(cls, role: str) -> str:
        if role not in ROLES:
            raise ValueError(f"unsupported role {role!r} (supported: {', '.join(ROLES)})")
        return "system" if role == "developer" else role

    @field_validator("content")
    @classmethod
    def _content(cls, content: Any, info: Any) -> str:
        if content is None:  # an assistant turn may carry tool calls alone
            role = info.data.get("role")
            if role not in (None, "assistant"):  # (None: the role itself was wrong, and says so first)
                raise ValueError(f"required for role {role!r}")
            return ""
        if isinstance(content, str):
            return content
        if isinstance(content, list):  # [{"type": "text", "text": "..."}, ...]
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError("only text content parts ({\"type\": \"text\", \"text\": ...}) are supported")
                texts.append(part["text"])
            return "\n".join(texts)
        raise ValueError("content must be a string or a list of text parts")

    @field_validator("tool_call_id")
    @classmethod
    def _tool_call_id(cls, call_id: str | None, info: Any) -> str | None:
        if call_id is None and info.data.get("role") == "tool":
            raise ValueError("required for role 'tool' (the id of the call this result answers)")
        return call_id
