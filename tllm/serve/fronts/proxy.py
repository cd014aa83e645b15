"""Forwarding OpenAI requests to other tllm servers, for the fronts that sit before them (the
disaggregated front, the router): an upstream server with its load and liveness, a JSON call,
and a relay of a (streamed) response back to the client. A server that cannot be reached,
or dies mid-request, is a 503 (or, once a stream has begun, an error event), never a hang:
connections time out after CONNECT_TIMEOUT_S and a dead peer's socket closes at once."""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import Any, AsyncIterator, Awaitable, Iterator, TypeVar

import httpx
from fastapi import APIRouter, FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from tllm import __version__
from tllm.log import REQUEST_ID
from tllm.serve.context import SSE_DONE, sse
from tllm.serve.http.auth import install_api_key_guard
from tllm.serve.http.errors import APIError, bad_request, install_error_handlers, server_stopping
from tllm.serve.http.limits import HttpLimits, install_request_limits
from tllm.serve.http.request_ids import RequestIdMiddleware

logger = logging.getLogger(__name__)
CONNECT_TIMEOUT_S = 2.0
DOWN_FOR_S = 2.0        # a server that failed is passed over this long while others are up
T = TypeVar("T")
TEXT_ROUTES = ("/v1/completions", "/v1/chat/completions")   # what a front forwards
# Routes a front forwards whole to one server (the pooling and token routes: one step
# each, nothing kept on the server afterwards).
WHOLE_ROUTES = ("/v1/embeddings", "/v1/score", "/v1/rerank", "/v2/rerank", "/classify",
                "/v1/classify", "/tokenize", "/detokenize")


def normalize_url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else f"http://{url}"


async def _pass_request_id(request: httpx.Request) -> None:
    """The client's request id (RequestIdMiddleware's) goes on to the server behind the
    front, so one id names the request in every log on its way."""
    request_id = REQUEST_ID.get()
    if request_id is not None:
        request.headers["X-Request-Id"] = request_id


class Upstream:
    """One server behind a front: its client, requests in flight, and when it last failed."""

    def __init__(self, url: str, api_key: str | None = None) -> None:
        self.url = normalize_url(url)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(
            base_url=self.url, headers=headers,
            timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT_S),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            event_hooks={"request": [_pass_request_id]})
        self.num_in_flight = 0
        self.num_requests = 0
        self.num_failures = 0
        self.down_until = 0.0

    @property
    def is_up(self) -> bool:
        return time.monotonic() >= self.down_until

    def mark_down(self, exc: Exception) -> None:
        self.num_failures += 1
        self.down_until = time.monotonic() + DOWN_FOR_S
        logger.warning("upstream %s failed: %s", self.url, exc)

    def unavailable(self, exc: Exception | None = None) -> APIError:
        if exc is not None:
            self.mark_down(exc)
        return APIError(503, f"the server {self.url} is unavailable"
                        + (f": {type(exc).__name__}" if exc is not None else ""),
                        code="upstream_unavailable", headers={"Retry-After": "1"})

    async def get_json(self, path: str, timeout_s: float = 5.0) -> Any:
        try:
            response = await self.client.get(path, timeout=timeout_s)
        except httpx.HTTPError as exc:
            raise self.unavailable(exc) from exc
        if response.status_code != 200:
            raise APIError(503, f"{self.url}{path} answered {response.status_code}",
                           code="upstream_unavailable")
        return response.json()

    async def post_json(self, path: str, body: dict) -> httpx.Response:
        """The whole (non-streamed) response; 503 if the server cannot be reached."""
        self.num_requests += 1
        self.num_in_flight += 1
        try:
            return await self.client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise self.unavailable(exc) from exc
        finally:
            self.num_in_flight -= 1

    async def aclose(self) -> None:
        await self.client.aclose()


async def relay_whole(request: Request, servers: list[Upstream], turn: int, path: str,
                      drain: RelayDrain) -> Response:
    """A request of WHOLE_ROUTES, relayed as it is to the least loaded of the servers."""
    with drain.admit():
        body = await read_json_body(request)
        return await relay(request, pick_least_loaded(servers, turn), path, body, drain)


def pick_least_loaded(servers: list[Upstream], turn: int) -> Upstream:
    """The live server with the fewest requests in flight (ties: in turn)."""
    live = [s for s in servers if s.is_up] or servers
    n = len(live)
    return min((live[(turn + i) % n] for i in range(n)), key=lambda s: s.num_in_flight)


async def read_json_body(request: Request) -> dict:
    try:
        body = json.loads(await request.body())
    except (ValueError, UnicodeDecodeError) as exc:
        raise bad_request(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("the body must be a JSON object")
    return body


def front_app(title: str, handle, handle_whole, drain: RelayDrain, api_key: str | None,
              limits: HttpLimits, protect_metrics: bool) -> tuple[FastAPI, APIRouter]:
    """A front's app and its routes (TEXT_ROUTES forwarded through `handle(request, path)`,
    WHOLE_ROUTES through `handle_whole(request, path)`, more to add, then
    app.include_router): error bodies, request limits, the key check, the drain its server's
    shutdown waits for, and request ids passed on upstream."""
    app = FastAPI(title=title, version=__version__)
    app.state.drain = drain
    install_error_handlers(app)
    install_request_limits(app, limits)
    install_api_key_guard(app, api_key, protect_metrics)
    app.add_middleware(RequestIdMiddleware)     # outermost: the id goes on upstream
    routes = APIRouter()
    for path in TEXT_ROUTES:
        routes.add_api_route(path, _forwarder(handle, path), methods=["POST"])
    for path in WHOLE_ROUTES:
        routes.add_api_route(path, _forwarder(handle_whole, path), methods=["POST"])
    return app, routes


def _forwarder(handle, path: str):
    async def forward(request: Request) -> Response:
        return await handle(request, path)
    return forward


class RelayDrain:
    """A front's open requests, for its server's shutdown (http.server.Drain): once stopping,
    new requests get a 503; streams still open when the grace time runs out end with an error
    event and [DONE] instead of a cut connection (their upstream requests close, and the
    servers behind abort them)."""

    def __init__(self) -> None:
        self._calls = 0                         # requests being handled (not yet answered)
        self._streams: set[_RelayedStream] = set()
        self.is_stopping = False

    @property
    def num_open(self) -> int:
        return self._calls + len(self._streams)

    def stop_admitting(self) -> None:
        self.is_stopping = True

    def end_open(self) -> None:
        for stream in list(self._streams):
            stream.stop()

    @contextlib.contextmanager
    def admit(self) -> Iterator[None]:
        """Around the handling of one request: a 503 once stopping, else counted as open."""
        if self.is_stopping:
            raise server_stopping()
        self._calls += 1
        try:
            yield
        finally:
            self._calls -= 1


async def relay(request: Request, upstream: Upstream, path: str, body: dict,
                drain: RelayDrain | None = None) -> Response:
    """POST the body upstream and answer the client with what comes back: the JSON as it is,
    or its event stream relayed as it arrives (closed upstream when the client leaves, so the
    server aborts the request)."""
    upstream.num_requests += 1
    upstream.num_in_flight += 1
    try:
        response = await until_disconnect(request, upstream.client.send(
            upstream.client.build_request("POST", path, json=body), stream=True))
    except httpx.HTTPError as exc:
        upstream.num_in_flight -= 1
        raise upstream.unavailable(exc) from exc
    except BaseException:
        upstream.num_in_flight -= 1
        raise
    is_stream = response.headers.get("content-type", "").startswith("text/event-stream")
    if response.status_code != 200 or not is_stream:
        try:
            content = await response.aread()
        except httpx.HTTPError as exc:
            raise upstream.unavailable(exc) from exc
        finally:
            upstream.num_in_flight -= 1
            await response.aclose()
        return Response(content, status_code=response.status_code,
                        media_type=response.headers.get("content-type"))
    stream = _RelayedStream(upstream, response, drain)
    return StreamingResponse(stream.events(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


_STOP = object()    # the drain ends the stream
_END = object()     # the upstream stream ended


class _RelayedStream:
    """One upstream event stream relayed to a client. A reader task pumps the upstream's
    chunks through a short queue (back-pressure kept), so the drain can end the stream
    between chunks without cancelling what starlette is sending."""

    def __init__(self, upstream: Upstream, response: httpx.Response,
                 drain: RelayDrain | None) -> None:
        self.upstream = upstream
        self.response = response
        self.drain = drain
        self.queue: asyncio.Queue = asyncio.Queue(maxsize=64)
        self.stopping = False

    def stop(self) -> None:
        self.stopping = True
        with contextlib.suppress(asyncio.QueueFull):
            self.queue.put_nowait(_STOP)

    async def _pump(self) -> None:
        try:
            async for chunk in self.response.aiter_raw():
                await self.queue.put(chunk)
            await self.queue.put(_END)
        except httpx.HTTPError as exc:      # the server died mid-stream
            await self.queue.put(exc)

    async def events(self) -> AsyncIterator[bytes]:
        if self.drain is not None:
            self.drain._streams.add(self)
        reader = asyncio.create_task(self._pump())
        try:
            while True:
                item = await self.queue.get()
                if item is _STOP or self.stopping:
                    yield (sse(server_stopping().body()) + SSE_DONE).encode()
                    return
                if item is _END:
                    return
                if isinstance(item, httpx.HTTPError):
                    yield (sse(self.upstream.unavailable(item).body()) + SSE_DONE).encode()
                    return
                yield item
        finally:
            reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            if self.drain is not None:
                self.drain._streams.discard(self)
            self.upstream.num_in_flight -= 1
            await self.response.aclose()


async def until_disconnect(request: Request, call: Awaitable[T]) -> T:
    """Await the call, cancelled if the client disconnects first (an upstream request then
    closes, and its server aborts it)."""
    task = asyncio.ensure_future(call)

    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if not task.done():
        task.cancel()
        raise APIError(499, "the client closed the request", code="client_closed")
    return task.result()


def upstream_error(response: httpx.Response) -> Response:
    """An upstream's error answer, passed on as it is."""
    return Response(response.content, status_code=response.status_code,
                    media_type=response.headers.get("content-type", "application/json"))


def json_response(data: Any, status: int = 200) -> JSONResponse:
    return JSONResponse(data, status_code=status)
