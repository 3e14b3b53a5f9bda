"""Errors in OpenAI's shape: {"error": {"message", "type", "param", "code"}}.

The `type` values follow OpenAI's so its client raises the matching exception class: the
client picks the class from the HTTP status (401 AuthenticationError, 403
PermissionDeniedError, 404 NotFoundError, 400 BadRequestError, 429 RateLimitError, ...).
"""

from __future__ import annotations

from typing import Any

import orjson

TYPE_BY_STATUS = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    502: "server_error",
    503: "service_unavailable_error",
    504: "server_error",
}


class ApiError(Exception):
    """A refusal the client should see, with its status, OpenAI error fields and headers."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        code: str | None = None,
        param: str | None = None,
        error_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.error_type = error_type or TYPE_BY_STATUS.get(status, "invalid_request_error")
        self.headers = headers or {}

    def payload(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def body(self) -> bytes:
        return orjson.dumps(self.payload())


def replica_failed() -> ApiError:
    """A replica failed before the first token and no other could take the request."""
    return ApiError(
        502,
        "The model replica failed; please retry.",
        code="upstream_error",
        error_type="server_error",
    )


def invalid_api_key() -> ApiError:
    return ApiError(
        401,
        "Incorrect API key provided. Create a key in the portal and send it as "
        "'Authorization: Bearer <key>'.",
        code="invalid_api_key",
    )
