"""Errors in OpenAI's shape on the OpenAI routes: `{"error": {"message", "type", "param", "code"}}`.

OpenAI clients read the reason from `error.message` (the `openai` package puts it in `str(e)`)
and the field at fault from `error.param`; FastAPI's `{"detail": ...}` shows them only a status
code. Every refusal on a `/v1` path but nnsight's (`/v1/nnsight/...`, whose clients read
`detail`) is answered this way, whoever refuses it: the key and the limits (`limits.Guard`),
validation, the routes, an unexpected exception.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import HTTPException
from starlette.responses import JSONResponse

NNSIGHT_PREFIX = "/v1/nnsight/"

# OpenAI's `type` for each status; `code` where OpenAI has one.
ERROR_TYPES = {401: "authentication_error", 429: "rate_limit_error"}
ERROR_CODES = {
    401: "invalid_api_key",
    408: "timeout",
    413: "request_too_large",
    429: "rate_limit_exceeded",
    503: "service_unavailable",
    504: "timeout",
}


class OpenAIError(HTTPException):
    """An HTTP error with the request field it is about (`param`) and OpenAI's `code`, if any."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(status_code=status_code, detail=message, headers=headers)
        self.param = param
        self.code = code


def is_openai_path(path: str) -> bool:
    """Whether a path's errors take OpenAI's shape: `/v1/...`, but not nnsight's routes."""
    return path.startswith("/v1/") and not path.startswith(NNSIGHT_PREFIX)


def error_body(status_code: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object for a status (its `type` from the status, as OpenAI's API answers)."""
    kind = ERROR_TYPES.get(status_code, "server_error" if status_code >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code or ERROR_CODES.get(status_code)}}


def error_response(
    path: str,
    status_code: int,
    message: str,
    headers: dict[str, str] | None = None,
    param: str | None = None,
    code: str | None = None,
) -> JSONResponse:
    """The refusal of a request to `path`: OpenAI's shape on the OpenAI routes, `{"detail": ...}` elsewhere."""
    if is_openai_path(path):
        return JSONResponse(error_body(status_code, message, param, code), status_code=status_code, headers=headers)
    return JSONResponse({"detail": message}, status_code=status_code, headers=headers)


def http_error_response(path: str, error: HTTPException) -> JSONResponse:
    """`error_response` for a raised HTTPException (an `OpenAIError` brings its param and code)."""
    return error_response(
        path,
        error.status_code,
        str(error.detail),
        headers=error.headers,
        param=getattr(error, "param", None),
        code=getattr(error, "code", None),
    )


def stream_error_event(error: BaseException) -> str:
    """The SSE event that ends a stream which cannot finish (the `openai` client raises it as an `APIError`)."""
    if isinstance(error, HTTPException):
        body = error_body(error.status_code, str(error.detail), getattr(error, "param", None))
    else:
        body = error_body(500, f"{type(error).__name__}: {error}")
    return f"data: {json.dumps(body)}\n\n"
