"""Request bodies of the OpenAI-compatible API, validated with pydantic.

What reaches the engine is an allowlist: the typed fields below, OpenAI's sampling and output
parameters, and vLLM's documented sampling extensions (top_k, min_p, ...). Fields that steer
the engine itself (its prefix-cache salt, KV transfer, chat template, structured-output backend,
scheduling priority, extension arguments) are the platform's to set: a request carrying one is
refused with a 400 that names it, as is any field neither OpenAI nor vLLM defines (OpenAI's own
"Unrecognized request argument supplied"). A few OpenAI fields that mean nothing to a
self-hosted engine (store, metadata, service_tier, ...) are accepted and not forwarded, so
clients written for OpenAI work unchanged.
"""

from __future__ import annotations

from typing import Any, Literal

import orjson
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from serving.engine.tokens import render_chat_prompt
from serving.gateway.errors import ApiError


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow")
    include_usage: bool = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content")
    @classmethod
    def parts_have_a_type_and_text_parts_text(
        cls, value: str | list[dict[str, Any]] | None
    ) -> str | list[dict[str, Any]] | None:
        # The engine refuses these itself, but then the replica has spent the request; the
        # client's mistake is found here, before admission.
        if isinstance(value, list):
            for part in value:
                if not isinstance(part.get("type"), str):
                    raise ValueError("each content part needs a string 'type'")
                if part["type"] == "text" and not isinstance(part.get("text"), str):
                    raise ValueError("a text content part needs a string 'text'")
        return value

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(
            str(part.get("text", "")) for part in self.content if part.get("type") == "text"
        )


# Forwarded to the engine as sent: OpenAI's parameters beyond the typed ones, and vLLM's
# sampling extensions (vllm/entrypoints/openai/*/protocol.py, "extra sampling params").
FORWARDED_FIELDS: frozenset[str] = frozenset({
    "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "top_logprobs",
    "response_format", "tools", "tool_choice", "parallel_tool_calls", "echo", "suffix",
    "top_k", "min_p", "repetition_penalty", "length_penalty", "min_tokens", "stop_token_ids",
    "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "include_stop_str_in_output", "prompt_logprobs", "bad_words", "allowed_token_ids",
    "add_generation_prompt", "continue_final_message", "truncate_prompt_tokens",
})  # fmt: skip
# Several sequences per request: refused with their own message (see `only_allowed_fields`).
MULTI_CHOICE_FIELDS: frozenset[str] = frozenset({"best_of", "use_beam_search"})
# OpenAI fields a self-hosted engine has no use for: accepted, never forwarded.
IGNORED_FIELDS: frozenset[str] = frozenset(
    {"store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier"}
)
# The engine's own controls: the gateway sets some of them (cache_salt from the tenant, the
# KV transfer of disaggregated serving); a tenant steers none of them.
ENGINE_INTERNAL_FIELDS: frozenset[str] = frozenset({
    "cache_salt", "kv_transfer_params", "chat_template", "chat_template_kwargs", "vllm_xargs",
    "structured_outputs", "guided_json", "guided_regex", "guided_choice", "guided_grammar",
    "guided_decoding_backend", "guided_whitespace_pattern", "structural_tag", "priority",
    "request_id", "mm_processor_kwargs", "return_tokens_as_token_ids", "return_token_ids",
    "prompt_embeds", "add_special_tokens", "documents", "media_io_kwargs", "logits_processors",
})  # fmt: skip


ACCEPTED_EXTRA_FIELDS = FORWARDED_FIELDS | IGNORED_FIELDS | MULTI_CHOICE_FIELDS


class RefusedField(ValueError):
    """A body field that the gateway refuses, with the field's name for `param`."""

    def __init__(self, field: str, message: str, code: str) -> None:
        super().__init__(message)
        self.field = field
        self.code = code


def _out_of_int64(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    if isinstance(value, int):
        return not -(2**63) <= value < 2**63
    if isinstance(value, dict):
        return any(_out_of_int64(item) for item in value.values())
    if isinstance(value, list | tuple):
        return any(_out_of_int64(item) for item in value)
    if isinstance(value, BaseModel):
        return any(_out_of_int64(item) for _, item in value)
    return False


class _GenerationRequest(BaseModel):
    # NaN and infinities are no sampling parameter: refused as such, not as out of range.
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(default=None, max_length=256)
    n: int = 1

    @field_validator("n")
    @classmethod
    def only_one_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported (one choice a request); send separate requests")
        return value

    @model_validator(mode="after")
    def only_allowed_fields(self) -> _GenerationRequest:
        extra = self.model_extra or {}
        if (extra.get("best_of") or 1) != 1 or extra.get("use_beam_search"):
            raise ValueError("best_of and beam search are not supported; send separate requests")
        for name in extra:
            if name in ENGINE_INTERNAL_FIELDS:
                raise RefusedField(
                    name, f"'{name}' is set by the platform, not by requests", "forbidden_parameter"
                )
            if name not in ACCEPTED_EXTRA_FIELDS:
                raise RefusedField(
                    name, f"Unrecognized request argument supplied: {name}", "unknown_parameter"
                )
        return self

    @model_validator(mode="after")
    def integers_fit_64_bits(self) -> _GenerationRequest:
        """The body travels on as JSON that no engine reads past 64-bit integers."""
        for name, value in [*self, *(self.model_extra or {}).items()]:
            if _out_of_int64(value):
                message = f"'{name}' holds an integer beyond the 64-bit range"
                raise RefusedField(name, message, "invalid_value")
        return self

    def engine_fields(self) -> dict[str, Any]:
        """The body as the engine may see it: typed fields and forwarded extras, no nulls."""
        return self.model_dump(
            exclude_none=True,
            exclude={"stream_options", "n", *MULTI_CHOICE_FIELDS, *IGNORED_FIELDS},
        )

    @field_validator("stop")
    @classmethod
    def at_most_four_stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 4:
            raise ValueError("at most 4 stop sequences are allowed")
        return value

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def prompt_texts(self) -> list[str]:
        """Every text of the request the model reads, for the guardrails: each message's
        text parts and `name`, an assistant message's tool calls (function name and
        arguments), and the tool definitions (name, description, parameters as JSON) and
        the function `tool_choice` names. The chat template renders all of them into the
        prompt, so a pattern blocked in a message is blocked in any of them."""
        texts: list[str] = []
        for message in self.messages:
            texts.append(message.text())
            if message.name:
                texts.append(message.name)
            texts.extend(_tool_call_texts((message.model_extra or {}).get("tool_calls")))
        extra = self.model_extra or {}
        texts.extend(_tool_texts(extra.get("tools")))
        choice = extra.get("tool_choice")
        if isinstance(choice, dict):
            texts.extend(_function_texts(choice.get("function"), ("name",)))
        return [text for text in texts if text]

    def prompt_text(self) -> str:
        return render_chat_prompt([(message.role, message.text()) for message in self.messages])


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str]

    @field_validator("prompt", mode="before")
    @classmethod
    def prompt_as_text(cls, value: Any) -> Any:
        # The guardrails, the prefix index and the token estimate read the prompt's text.
        if isinstance(value, list) and any(
            isinstance(item, int | list) and not isinstance(item, bool) for item in value
        ):
            raise ValueError("prompts of token ids are not accepted; send the prompt as text")
        return value

    @field_validator("prompt")
    @classmethod
    def one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("exactly one prompt per request is supported")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_texts(self) -> list[str]:
        """The prompt, and the suffix the engine reads after it (for the guardrails)."""
        texts = [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)
        suffix = (self.model_extra or {}).get("suffix")
        return [*texts, suffix] if isinstance(suffix, str) and suffix else texts

    def prompt_text(self) -> str:
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


def _as_text(value: Any) -> str:
    """A string as it is; anything else (a parameters schema, arguments sent as an object)
    as its JSON."""
    if isinstance(value, str):
        return value
    if value is None:
        return ""
    return orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode()


def _function_texts(function: Any, fields: tuple[str, ...]) -> list[str]:
    if not isinstance(function, dict):
        return []
    return [_as_text(function.get(name)) for name in fields]


def _tool_texts(tools: Any) -> list[str]:
    """The texts of `tools` (OpenAI's `[{"type": "function", "function": {...}}]`)."""
    if not isinstance(tools, list):
        return []
    texts: list[str] = []
    for tool in tools:
        if isinstance(tool, dict):
            function = tool.get("function")
            texts.extend(_function_texts(function, ("name", "description", "parameters")))
    return texts


def _tool_call_texts(calls: Any) -> list[str]:
    """The texts of an assistant message's `tool_calls` (function name and arguments)."""
    if not isinstance(calls, list):
        return []
    texts: list[str] = []
    for call in calls:
        if isinstance(call, dict):
            texts.extend(_function_texts(call.get("function"), ("name", "arguments")))
    return texts


GenerationRequest = ChatCompletionRequest | CompletionRequest

UNION_TAGS = {"str", "int", "float", "bool", "list[str]", "list[dict[str,any]]", "none"}


def parse_body(kind: type[_GenerationRequest], raw: bytes) -> Any:
    """Validate a JSON body, turning pydantic's first complaint into OpenAI's 400."""
    if not raw:
        raise ApiError(400, "The request body is empty; send a JSON object.")
    try:
        return kind.model_validate_json(raw)
    except ValidationError as error:
        first = error.errors()[0]
        refused = first.get("ctx", {}).get("error")
        if isinstance(refused, RefusedField):
            raise ApiError(400, f"{refused}.", param=refused.field, code=refused.code) from None
        if first["type"] == "model_type" and not first["loc"]:
            raise ApiError(400, "The request body must be a JSON object.") from None
        # Drop pydantic's union-member tags ("str", "list[str]") from the parameter path.
        if first["type"] == "json_invalid":
            raise ApiError(400, "The request body is not valid JSON.") from None
        param = (
            ".".join(str(part) for part in first["loc"] if str(part).lower() not in UNION_TAGS)
            or None
        )
        message = first["msg"].removeprefix("Value error, ")
        if first["type"] in ("model_type", "dict_type"):
            message = "expected a JSON object"  # not pydantic's name for the class
        if param is None:
            message = f"{message}."
        elif first["type"] == "missing":
            message = f"Missing required parameter: '{param}'."
        else:
            message = f"Invalid value for '{param}': {message}."
        raise ApiError(400, message, param=param, code="invalid_value") from None
