"""Request models of the OpenAI-compatible API, with strict validation.

Every field is type-checked without coercion (``"5"`` is not an int). A failed check becomes an
:class:`ApiError` (HTTP 400, OpenAI error body) through :func:`parse_request`.

Example::

    req = parse_request(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    req.chat_messages()  # [{"role": "user", "content": "hi"}]
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from online.server.features import parse_tool_choice, parse_tools, response_format_grammar
from online.server.messages import ChatMessage

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1000  # each: searched at every token
MAX_CHOICES = 16  # n
MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20  # top_logprobs (chat) / logprobs (completions) upper bound, as OpenAI
# Fields OpenAI's API (or another server's extension of it) has and this server does not implement: a 400 naming
# the field when set (null means unset); any other unknown field is "unrecognized", as OpenAI answers it
UNSUPPORTED_FIELDS = ("reasoning_effort", "verbosity", "prediction", "web_search_options", "audio",
                      "min_p", "repetition_penalty", "typical_p", "top_a", "mirostat", "chat_template_kwargs",
                      "guided_json", "guided_regex", "guided_choice", "grammar", "json_schema")


class ApiError(Exception):
    """An error answered as ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The path (``messages.0.tool_calls.0.function.arguments``) of the first string in a decoded JSON value,
    key or value, holding a lone surrogate (a ``\\ud800`` escape: valid JSON, not Unicode; the tokenizer and
    every encoder fail on it), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "body"
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        where = f"{path}.{key}" if path else str(key)
        found = lone_surrogate_at(key, where) if isinstance(key, str) else None
        found = found or lone_surrogate_at(item, where)
        if found:
            return found
    return None


class _SamplingRequest(BaseModel):
    """Fields shared by chat and text completions. A field this server does not know is a 400, as OpenAI
    answers it ("unrecognized request argument"), never silently dropped."""

    model_config = ConfigDict(strict=True, extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1)  # extension; -1 or 0 = disabled
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    ignore_eos: bool = False  # extension (as vLLM): keep generating past end-of-sequence
    stop: Any = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None
    user: str | None = None  # an end-user id (OpenAI uses it to monitor abuse): no effect on the output

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, bias: dict[str, Any] | None) -> None:
        if bias:
            raise ValueError("logit_bias is not supported")
        return None

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: Any) -> list[str] | None:
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise ValueError("stop must be a string or a list of strings")
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"at most {MAX_STOP_STRINGS} stop strings are supported")
        if any(s == "" for s in stops):
            raise ValueError("stop strings must not be empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"stop strings are at most {MAX_STOP_CHARS} characters long")
        return stops or None

    @field_validator("n")
    @classmethod
    def _n(cls, n: int) -> int:
        if not 1 <= n <= MAX_CHOICES:
            raise ValueError(f"n must be between 1 and {MAX_CHOICES}")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, value: float | None) -> None:
        if value not in (None, 0.0):
            raise ValueError("presence and frequency penalties are not supported")
        return None

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, options: dict[str, Any] | None, info: Any) -> dict[str, Any] | None:
        if options is None:
            return None
        if not info.data.get("stream"):
            raise ValueError("stream_options is only allowed when stream is true")
        unknown = sorted(set(options) - {"include_usage"})
        if unknown:
            raise ValueError(f"unsupported stream_options {unknown} (supported: include_usage)")
        if not isinstance(options.get("include_usage", False), bool):
            raise ValueError("stream_options.include_usage must be a boolean")
        return options

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.get("include_usage"))

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling(self) -> dict[str, Any]:
        """Keyword arguments for ``Engine.stream`` (besides prompt and max_new_tokens)."""
        return {
            "temperature": 1.0 if self.temperature is None else float(self.temperature),
            "top_k": max(self.top_k or 0, 0),
            "top_p": 1.0 if self.top_p is None else float(self.top_p),
            "seed": self.seed,
            "stop": self.stop,
            "ignore_eos": self.ignore_eos,
            **self.decode_extras(),
        }

    def decode_extras(self) -> dict[str, Any]:
        """``logprobs`` / ``top_logprobs`` / ``grammar`` keyword arguments for ``Engine.stream`` (only those set)."""
        return {}


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    modalities: list[str] | None = None
    functions: Any = None
    function_call: Any = None
    # OpenAI's bookkeeping fields, accepted without effect on the output: ids for abuse monitoring and cache
    # routing (every prompt's prefix is cached here anyway), tags for stored completions (stored nowhere)
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    @field_validator("modalities")
    @classmethod
    def _modalities(cls, modalities: list[str] | None) -> None:
        if modalities not in (None, ["text"]):
            raise ValueError('only text output is supported (modalities: ["text"])')
        return None

    @field_validator("store")
    @classmethod
    def _store(cls, store: bool | None) -> None:
        if store:
            raise ValueError("storing completions (store: true) is not supported")
        return None

    @field_validator("service_tier")
    @classmethod
    def _service_tier(cls, tier: str | None) -> None:
        if tier not in (None, "auto", "default"):
            raise ValueError(f"service_tier {tier!r} is not supported (this server has one tier: auto, default)")
        return None

    @field_validator("functions", "function_call")
    @classmethod
    def _legacy_functions(cls, value: Any) -> None:
        if value is not None:
            raise ValueError("the deprecated functions/function_call API is not supported; use tools and tool_choice")
        return None

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, value: int | None, info: Any) -> int | None:
        if value and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return value

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, fmt: dict[str, Any] | None) -> Any:
        return None if fmt is None else response_format_grammar(fmt)

    @field_validator("tools")
    @classmethod
    def _tools(cls, tools: list[Any] | None) -> Any:
        return None if not tools else parse_tools(tools)

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice(cls, choice: Any, info: Any) -> Any:
        return parse_tool_choice(choice, info.data.get("tools"))

    @model_validator(mode="after")
    def _format_or_tools(self) -> "ChatCompletionRequest":
        if self.response_format is not None and self.tool_mode()[0] != "none":
            raise ValueError("response_format json_object/json_schema together with tools is not supported; "
                             "use tool_choice \"none\" or drop response_format")
        return self

    def tool_mode(self) -> tuple[str, str | None]:
        """(``"none" | "auto" | "required"``, the forced tool's name or None)."""
        if not self.tools or self.tool_choice == "none":
            return "none", None
        if self.tool_choice is None:
            return "auto", None
        if isinstance(self.tool_choice, tuple):
            return "required", self.tool_choice[1]
        return self.tool_choice, None

    def decode_extras(self) -> dict[str, Any]:
        from online.constrain import tool_call_grammar
        extras: dict[str, Any] = {}
        if self.logprobs:
            extras.update(logprobs=True, top_logprobs=self.top_logprobs or 0)
        mode, name = self.tool_mode()
        if mode == "required":
            extras["grammar"] = tool_call_grammar(list(self.tools), name)
        elif self.response_format is not None:
            extras["grammar"] = self.response_format
        return extras

    @field_validator("messages")
    @classmethod
    def _messages(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages must contain at least one message")
        return messages

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def chat_messages(self) -> list[dict[str, Any]]:
        messages = [{"role": m.role, "content": m.content} for m in self.messages]
        if not any(m.role == "tool" or m.tool_calls for m in self.messages):
            return messages
        for out, m in zip(messages, self.messages):
            if m.tool_calls:
                out["tool_calls"] = m.tool_calls
            if m.tool_call_id is not None:
                out["tool_call_id"] = m.tool_call_id
        return messages


class CompletionRequest(_SamplingRequest):
    prompt: Any
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    response_format: dict[str, Any] | None = None  # extension (as vLLM): constrained text completions

    @field_validator("response_format")
    @classmethod
    def _response_format(cls, fmt: dict[str, Any] | None) -> Any:
        return None if fmt is None else response_format_grammar(fmt)

    def decode_extras(self) -> dict[str, Any]:
        extras: dict[str, Any] = {} if self.logprobs is None else {"logprobs": True, "top_logprobs": self.logprobs}
        if self.response_format is not None:
            extras["grammar"] = self.response_format
        return extras
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            return prompt
        if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
            return prompt  # token ids, range-checked by the engine
        raise ValueError("prompt must be a non-empty string, a list of one string, or a list of token ids")

    @field_validator("echo")
    @classmethod
    def _echo(cls, echo: bool) -> bool:
        if echo:
            raise ValueError("echo is not supported")
        return echo

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, best_of: int | None) -> None:
        if best_of not in (None, 1):
            raise ValueError("only best_of=1 is supported")
        return None

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, suffix: str | None) -> None:
        if suffix:
            raise ValueError("suffix is not supported")
        return None


def parse_request(model: type[BaseModel], payload: Any) -> Any:
    """Validate a decoded JSON payload; raise :class:`ApiError` (400) naming the first bad field."""
    if not isinstance(payload, dict):
        raise ApiError(400, "the request body must be a JSON object")
    bad = lone_surrogate_at(payload)
    if bad is not None:
        raise ApiError(400, f"{bad}: not valid Unicode (a lone surrogate escape)", param=bad)
    unsupported = next((k for k in UNSUPPORTED_FIELDS if payload.get(k) is not None), None)
    if unsupported is not None:
        raise ApiError(400, f"{unsupported}: not supported by this server", param=unsupported)
    payload = {k: v for k, v in payload.items() if k not in UNSUPPORTED_FIELDS}  # the ones left are null: unset
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        err = exc.errors(include_url=False)[0]
        loc = [str(p) for p in err.get("loc", ())]
        param = ".".join(loc) or None
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        if err.get("type") == "missing":
            msg = "field required"
        if err.get("type") == "extra_forbidden":
            raise ApiError(400, f"unrecognized request argument supplied: {param}", param=param) from None
        raise ApiError(400, f"{param}: {msg}" if param else msg, param=param) from None
