"""Request bodies of the OpenAI-compatible API, validated with pydantic.

Known fields are type-checked; unknown fields are passed through to the engine untouched,
as vLLM accepts its own sampling extensions (top_k, min_p, ...).
"""

from __future__ import annotations

from typing import Any, Literal

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

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(
            str(part.get("text", "")) for part in self.content if part.get("type") == "text"
        )


class _GenerationRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
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
            raise ValueError("n greater than 1 is not supported; send separate requests")
        return value

    @model_validator(mode="after")
    def no_hidden_multiple_choices(self) -> _GenerationRequest:
        # vLLM extensions pass through, but not ones that generate several sequences.
        extra = self.model_extra or {}
        if (extra.get("best_of") or 1) != 1 or extra.get("use_beam_search"):
            raise ValueError("best_of and beam search are not supported; send separate requests")
        return self

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
        return [message.text() for message in self.messages]

    def prompt_text(self) -> str:
        return render_chat_prompt([(message.role, message.text()) for message in self.messages])


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str]

    @field_validator("prompt")
    @classmethod
    def one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError("exactly one prompt per request is supported")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def prompt_texts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)

    def prompt_text(self) -> str:
        return self.prompt_texts()[0]


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
        if first["type"] == "model_type":
            raise ApiError(400, "The request body must be a JSON object.") from None
        # Drop pydantic's union-member tags ("str", "list[str]") from the parameter path.
        if first["type"] == "json_invalid":
            raise ApiError(400, "The request body is not valid JSON.") from None
        param = (
            ".".join(str(part) for part in first["loc"] if str(part).lower() not in UNION_TAGS)
            or None
        )
        message = first["msg"].removeprefix("Value error, ")
        if param is None:
            message = f"{message}."
        elif first["type"] == "missing":
            message = f"Missing required parameter: '{param}'."
        else:
            message = f"Invalid value for '{param}': {message}."
        raise ApiError(400, message, param=param, code="invalid_value") from None
