"""Request ids end to end: a client's `X-Request-Id` is kept when it is sane (else one is
made), set as the logging context of everything done for the request (tllm.log.REQUEST_ID),
and returned on every response, errors included."""
from __future__ import annotations

import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tllm.log import REQUEST_ID

HEADER = b"x-request-id"
MAX_LEN = 128


def new_request_id() -> str:
    return f"req-{uuid.uuid4().hex[:20]}"


def accepted_request_id(value: bytes | None) -> str | None:
    """The client's id if it is 1-128 printable ASCII characters, no spaces (it goes into
    log lines and a response header: nothing that could forge either); else None."""
    if value is None or not 0 < len(value) <= MAX_LEN:
        return None
    if any(byte <= 0x20 or byte >= 0x7f for byte in value):
        return None
    return value.decode("ascii")


class RequestIdMiddleware:
    """Outermost middleware of a tllm app: every response carries the request's id."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k.lower() == HEADER), None)
        request_id = accepted_request_id(given) or new_request_id()
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", ())
                           if k.lower() != HEADER]     # an error's own id: the same one
                headers.append((HEADER, request_id.encode()))
                message = {**message, "headers": headers}
            await send(message)

        token = REQUEST_ID.set(request_id)
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            REQUEST_ID.reset(token)
