"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, for every
failure: invalid requests (400, never FastAPI's 422), unknown routes, and internal errors
(a generic 500 naming a request id; the exception goes to the log under that id)."""
from __future__ import annotations

import logging
import re
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from tllm.log import current_request_id
from tllm.serve.openai.protocol import ErrorInfo, ErrorResponse


logger = logging.getLogger(__name__)
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 415: "invalid_request_error",
          429: "rate_limit_error", 431: "invalid_request_error", 500: "server_error",
          503: "service_unavailable"}
# Union members and validator wrappers in a pydantic error location, not field names.
_NOT_A_FIELD = re.compile(r"[\[\-]|^(str|int|float|bool|list|dict)$")


_DESCRIPTIONS = {
    400: "Invalid request (the error names the field in `param`)",
    401: "Missing or wrong API key",
    403: "Not permitted (a lora_path outside --lora-allowed-paths)",
    404: "Unknown model or route",
    408: "The body did not arrive within --body-read-timeout",
    413: "The body is larger than --max-body-bytes",
    415: "The body is not JSON",
    431: "The request line and headers are larger than --max-header-bytes",
    429: "Too many requests are waiting (--max-queue-size)",
    500: "Internal error: a request id to find in the server's log",
    503: "The engine is not running",
    "default": "Any other error, in OpenAI's shape"}


def error_responses(*statuses: int) -> dict:
    """OpenAPI `responses` for these statuses, and "default", all with OpenAI's error body
    ("default" also keeps FastAPI from documenting a 422, never answered here)."""
    return {status: {"model": ErrorResponse, "description": _DESCRIPTIONS[status]}
            for status in (*statuses, "default")}


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
    """A ValueError of the engine (SamplingParams, PoolingParams, prompt checks) as a 400
    naming the field;
    the engine's `inputs` is the request's prompt_param."""
    message = re.sub(r"^(Sampling|Pooling)Params\.", "", str(exc))
    match = re.match(r"(\w+)\b", message)
    param = match.group(1) if match else None
    if param in ("inputs", "multi_modal_data"):   # the engine's names for the prompt
        message = f"{prompt_param}{message.removeprefix(param)}"
        param = prompt_param
    return bad_request(message, param=param)


def from_validation_error(exc: ValidationError) -> APIError:
    """The most telling error of a pydantic validation, as a 400."""
    return from_error_list(exc.errors(include_url=False))


def from_error_list(errors, is_body_loc: bool = False) -> APIError:
    """pydantic's (or FastAPI's, whose locations start with "body") error list as one 400
    naming the field."""
    if any(e["type"] == "json_invalid" for e in errors):
        json_error = next(e for e in errors if e["type"] == "json_invalid")
        detail = (json_error.get("ctx") or {}).get("error") or json_error["msg"]
        return bad_request(f"the request body is not valid JSON: {detail}")
    custom = [e for e in errors if e["type"] == "value_error"]
    error = (custom or errors)[0]
    loc = list(error.get("loc", ()))[1 if is_body_loc else 0:]
    loc = [str(part) for part in loc if not _NOT_A_FIELD.search(str(part))]
    message = str(error.get("msg", "invalid request")).removeprefix("Value error, ")
    if error["type"] == "extra_forbidden":
        message = "unrecognized request argument"
    if error["type"] in ("model_type", "model_attributes_type", "dict_type") and not loc:
        message = "the request body must be a JSON object"
    if error["type"] == "missing" and not loc:
        message = "the request body is missing: send a JSON object"
    param = ".".join(loc) or None
    return bad_request(f"{param}: {message}" if param else message, param=param)


def server_stopping() -> APIError:
    return APIError(503, "the server is shutting down", code="server_shutting_down",
                    headers={"Retry-After": "1"})


def internal_error(exc: BaseException) -> APIError:
    """A 500 that tells the client a request id and nothing of the exception; the exception
    and its traceback go to the log under that id."""
    request_id = current_request_id() or f"req-{uuid.uuid4().hex[:20]}"
    logger.error("internal error, request id %s: %s", request_id, type(exc).__name__,
                 exc_info=exc)
    return APIError(500, f"internal server error (request id {request_id}; the server's log "
                    "has the details)", code="internal_error",
                    headers={"X-Request-Id": request_id})


def install_error_handlers(app: FastAPI) -> None:
    """Handlers for errors of requests; internal errors are answered by a middleware."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _request_validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def _request_validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = list(exc.errors())
    is_body = bool(errors) and all(tuple(e.get("loc", ()))[:1] == ("body",) for e in errors)
    return from_error_list(errors, is_body_loc=is_body).response()


async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
    return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()
