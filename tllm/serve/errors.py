"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every
failure: invalid requests (400, never FastAPI's 422), unknown routes, and internal errors."""
from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tllm.serve.protocol import ErrorInfo, ErrorResponse


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error",
          415: "invalid_request_error", 429: "rate_limit_error", 500: "server_error",
          503: "service_unavailable"}
# Union members and validator wrappers in a pydantic error location, not field names.
_NOT_A_FIELD = re.compile(r"[\[\-]|^(str|int|float|bool|list|dict)$")


class APIError(Exception):
    """An error answered to the client as it is."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(
            message=self.message, type=_TYPES.get(self.status, "invalid_request_error"),
            param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status,
                            headers=self.headers)


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def from_value_error(exc: ValueError, prompt_param: str = "prompt") -> APIError:
    """A ValueError of the engine (SamplingParams, prompt checks) as a 400 naming the field;
    the engine's `inputs` is the request's prompt_param."""
    message = str(exc).removeprefix("SamplingParams.")
    match = re.match(r"(\w+)\b", message)
    param = match.group(1) if match else None
    if param == "inputs":
        param = prompt_param
        message = f"{prompt_param}{message.removeprefix('inputs')}"
    return bad_request(message, param=param)


def from_validation_error(exc: ValidationError) -> APIError:
    """The most telling error of a pydantic validation, as a 400."""
    errors = exc.errors(include_url=False)
    if any(e["type"] == "json_invalid" for e in errors):
        return bad_request(f"the request body is not valid JSON: {errors[0]['msg']}")
    custom = [e for e in errors if e["type"] == "value_error"]
    error = (custom or errors)[0]
    loc = [str(part) for part in error["loc"] if not _NOT_A_FIELD.search(str(part))]
    message = error["msg"].removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unrecognized request argument"
    if error["type"] == "model_type" and not loc:
        message = "the request body must be a JSON object"
    param = ".".join(loc) or None
    return bad_request(f"{param}: {message}" if param else message, param=param)


def internal_error(exc: Exception) -> APIError:
    return APIError(500, f"internal server error: {type(exc).__name__}: {exc}")


def install_error_handlers(app: FastAPI) -> None:
    """Handlers for errors of requests; internal errors are answered by a middleware."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _request_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    return bad_request("; ".join(str(e.get("msg")) for e in exc.errors())).response()


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()
