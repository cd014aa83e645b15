"""`tllm serve disaggregated -c disagg.yml`: an OpenAI-compatible front over context
(prefill) and generation (decode) servers, in TensorRT-LLM's shape.

Each completion or chat request goes first to a context server, as itself with
`max_tokens: 1`, unstreamed, and `disaggregated_params: {request_type: context_only,
ctx_request_id}`: the server prefills it and keeps its prompt's KV blocks under that id. Then
it goes, as the client sent it, to a generation server with `{request_type:
generation_only, ctx_request_id, opaque_state: <the context server's KV source id>}` (the id
came back in the prefill's X-TLLM-KV-Source header): that server fetches the blocks from the
configured context server (its --kv-sources) that has this id, decodes, and its answer
(streamed or not: usage, logprobs, stop strings as any server's) is relayed to the client.
Neither the front nor a request ever tells a generation server an address. Requests that
need the prompt computed where they are answered (echo with logprobs: prompt logprobs), or
that hold several prompts, run whole on a generation server. The pooling and token routes
(/v1/embeddings, /v1/score, /v1/rerank, /tokenize, ...) run whole on a context server."""
from __future__ import annotations

import itertools
import logging
import uuid

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tllm.cli_parser import FlagParser
from tllm.log import add_log_args, configure_logging
from tllm.serve.fronts.disagg_config import DisaggFrontConfig
from tllm.serve.disagg_worker import KV_SOURCE_HEADER
from tllm.serve.http.errors import APIError, server_stopping
from tllm.serve.http.limits import HttpLimits, add_http_limit_args, http_limits_from_args
from tllm.serve.fronts.proxy import (RelayDrain, Upstream, front_app, pick_least_loaded,
                                     read_json_body, relay, relay_whole, until_disconnect,
                                     upstream_error)

logger = logging.getLogger(__name__)
# Fields of the client's request the context server's prefill does without.
_NOT_FOR_PREFILL = ("stream", "stream_options", "n", "best_of", "max_tokens",
                    "max_completion_tokens", "min_tokens")


class DisaggFront:
    """Picks a context and a generation server per request (fewest in flight) and runs the
    two phases."""

    def __init__(self, config: DisaggFrontConfig) -> None:
        self.config = config
        self.context = [Upstream(u, config.api_key) for u in config.context_servers.urls]
        self.generation = [Upstream(u, config.api_key) for u in config.generation_servers.urls]
        self._turns = itertools.count()
        self.num_disaggregated = 0
        self.num_whole = 0
        self.drain = RelayDrain()   # what its server's shutdown waits for, then ends

    async def handle(self, request: Request, path: str) -> Response:
        with self.drain.admit():
            return await self._run(request, path, await read_json_body(request))

    async def _run(self, request: Request, path: str, body: dict) -> Response:
        generation = pick_least_loaded(self.generation, next(self._turns))
        if _runs_whole(body):
            self.num_whole += 1
            return await relay(request, generation, path, body, self.drain)
        context = pick_least_loaded(self.context, next(self._turns))
        ctx_request_id = f"ctx-{uuid.uuid4().hex}"
        answer = await until_disconnect(request, context.post_json(
            path, _prefill_body(body, ctx_request_id)))
        if answer.status_code != 200:
            return upstream_error(answer)
        source_id = answer.headers.get(KV_SOURCE_HEADER)
        if source_id is None:
            raise APIError(503, f"{context.url} did not name its KV source: is it a tllm "
                           "context server (--role context)?", code="upstream_unavailable")
        self.num_disaggregated += 1
        return await relay(request, generation, path, {**body, "disaggregated_params": {
            "request_type": "generation_only", "ctx_request_id": ctx_request_id,
            "opaque_state": source_id}}, self.drain)

    async def handle_whole(self, request: Request, path: str) -> Response:
        """The pooling and token routes, whole on a context server: pooling is a prefill
        with nothing kept (a context server's kind of work), so the generation servers'
        decode steps are not slowed by it."""
        return await relay_whole(request, self.context, next(self._turns), path, self.drain)

    async def health(self) -> Response:
        """200 once some context and some generation server answer their /health."""
        if self.drain.is_stopping:
            raise server_stopping()
        down = []
        for kind, servers in (("context", self.context), ("generation", self.generation)):
            if not any([await _is_healthy(s) for s in servers]):
                down.append(kind)
        if down:
            return APIError(503, f"no {' and no '.join(down)} server is healthy",
                            code="upstream_unavailable").response()
        return JSONResponse({"status": "ok"})

    def stats(self) -> dict:
        return {"disaggregated_requests": self.num_disaggregated,
                "whole_requests": self.num_whole,
                "servers": [{"url": s.url, "kind": kind, "requests": s.num_requests,
                             "in_flight": s.num_in_flight, "failures": s.num_failures}
                            for kind, group in (("context", self.context),
                                                ("generation", self.generation))
                            for s in group]}

    async def aclose(self) -> None:
        for server in self.context + self.generation:
            await server.aclose()


def _runs_whole(body: dict) -> bool:
    prompt = body.get("prompt")
    is_batch = isinstance(prompt, list) and bool(prompt) and not isinstance(prompt[0], int)
    return (is_batch and len(prompt) > 1) or (bool(body.get("echo"))
                                              and body.get("logprobs") is not None)


def _prefill_body(body: dict, ctx_request_id: str) -> dict:
    prefill = {k: v for k, v in body.items() if k not in _NOT_FOR_PREFILL}
    prefill["max_tokens"] = 1
    prefill["disaggregated_params"] = {"request_type": "context_only",
                                       "ctx_request_id": ctx_request_id}
    return prefill


async def _is_healthy(server: Upstream) -> bool:
    try:
        return (await server.client.get("/health", timeout=2.0)).status_code == 200
    except Exception:  # noqa: BLE001 - any failure is "not healthy"
        return False


def build_front_app(front: DisaggFront, limits: HttpLimits = HttpLimits(),
                    protect_metrics: bool = False) -> FastAPI:
    """The front's app; with an api_key, clients must send it too (auth.ApiKeyGuard)."""
    app, routes = front_app("tllm disaggregated front", front.handle, front.handle_whole,
                            front.drain, front.config.api_key, limits, protect_metrics)
    app.state.front = front

    @routes.get("/v1/models")
    async def models() -> Response:
        server = pick_least_loaded(front.generation, 0)
        return JSONResponse(await server.get_json("/v1/models"))

    @routes.get("/health")
    async def health() -> Response:
        return await front.health()

    @routes.get("/disagg/stats")
    async def stats() -> Response:
        return JSONResponse(front.stats())

    app.include_router(routes)
    return app


def run_disaggregated(argv: list[str]) -> int:
    """`tllm serve disaggregated -c disagg.yml [--host H] [--port P]`."""
    from tllm.serve.http.server import run_uvicorn
    parser = FlagParser(prog="tllm serve disaggregated",
                        description="An OpenAI-compatible front over context "
                        "and generation servers (tllm serve MODEL --role ...).")
    parser.add_argument("-c", "--config", required=True, metavar="YAML",
                        help="TensorRT-LLM's disaggregated config as it is: hostname, port, "
                             "context_servers and generation_servers ({num_instances, urls}); "
                             "the servers' own options in it (model, backend, ...) are "
                             "ignored with a note: start each with tllm serve MODEL --role")
    parser.add_argument("--host", help="overrides the file's hostname")
    parser.add_argument("--port", type=int, help="overrides the file's port")
    add_log_args(parser)
    parser.add_argument("--protect-metrics", action="store_true",
                        help="with the file's api_key: the docs need the key too")
    add_http_limit_args(parser.add_argument_group("connection limits"))
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    config = DisaggFrontConfig.from_yaml(args.config)
    front = DisaggFront(config)
    host, port = args.host or config.hostname, args.port or config.port
    logger.info("disaggregated front on http://%s:%d/v1: %d context, %d generation servers",
                host, port, len(front.context), len(front.generation))
    app = build_front_app(front, http_limits_from_args(args), args.protect_metrics)
    run_uvicorn(app, host=host, port=port, log_level=args.log_level)
    return 0
