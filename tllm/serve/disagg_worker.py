"""A disaggregated worker's extra routes and flags (`tllm serve MODEL --role
context|generation`): GET /disagg/info tells the server's role, its KV transport and, for a
context server, its KV endpoint and source id; a context server also names its source id in
every response (the X-TLLM-KV-Source header), which the front passes on to a generation
server as `opaque_state`. The completions and chat routes take `disaggregated_params` as
they are.

The deployment's shared KV secret comes from --kv-secret-file or the TLLM_KV_SECRET
environment variable, read here only, and is never logged."""
from __future__ import annotations

import os
from pathlib import Path

from fastapi import APIRouter
from pydantic import SecretStr
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tllm.serve.http.errors import APIError

KV_SOURCE_HEADER = "x-tllm-kv-source"
SECRET_ENV = "TLLM_KV_SECRET"


def disagg_routes(llm) -> APIRouter:
    routes = APIRouter(include_in_schema=False)

    @routes.get("/disagg/info")
    async def info() -> Response:
        data = getattr(llm, "disagg_info", None)   # read now: a restarted engine has a new one
        if data is None:
            raise APIError(404, "this server has no disaggregation role", code="not_found")
        return JSONResponse(data)

    @routes.get("/disagg/stats")
    async def stats() -> Response:
        """The engine's counters: KV blocks free and total, requests held, transfers."""
        return JSONResponse(llm.get_stats())

    return routes


class KVSourceHeader:
    """Adds a context server's KV source id to each response, read as the response starts
    (a restarted engine has a new one)."""

    def __init__(self, app: ASGIApp, llm) -> None:
        self.app = app
        self.llm = llm

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_source(message: Message) -> None:
            source_id = (getattr(self.llm, "disagg_info", None) or {}).get("kv_source_id")
            if message["type"] == "http.response.start" and source_id:
                message = {**message, "headers": [*message.get("headers", []),
                                                  (KV_SOURCE_HEADER.encode(),
                                                   source_id.encode())]}
            await send(message)
        await self.app(scope, receive, send_with_source)


def disagg_kwargs(args) -> dict | None:
    """LLM(disaggregation=...) from `tllm serve`'s --role flags (None without --role)."""
    if args.role is None:
        return None
    config = {"role": args.role, "transport": args.kv_transport,
              "hold_timeout_s": args.kv_hold_timeout}
    if args.kv_port is not None:
        config["kv_port"] = args.kv_port
    if args.kv_host is not None:
        config["kv_host"] = args.kv_host
    if args.kv_sources:
        config["kv_sources"] = tuple(e.strip() for e in args.kv_sources.split(",") if e.strip())
    secret = read_kv_secret(args.kv_secret_file)
    if secret is not None:
        config["secret"] = SecretStr(secret)    # shown as '**********' wherever printed
    return config


def read_kv_secret(path: str | None) -> str | None:
    """The deployment's shared KV secret: the file's first line, else $TLLM_KV_SECRET."""
    if path is not None:
        try:
            lines = Path(path).read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"--kv-secret-file: cannot read {path} ({exc.strerror})") from None
        if not lines or not lines[0].strip():
            raise ValueError(f"--kv-secret-file: {path} is empty")
        return lines[0].strip()
    return os.environ.get(SECRET_ENV) or None


def add_disagg_args(group) -> None:
    group.add_argument("--role", choices=["context", "generation"],
                       help="disaggregated serving: a context (prefill) or generation "
                            "(decode) server behind `tllm serve disaggregated`")
    group.add_argument("--kv-transport", choices=["tcp", "cuda_ipc"], default="tcp",
                       help="how KV blocks move between the two kinds of server (cuda_ipc: "
                            "both on one GPU host; default tcp)")
    group.add_argument("--kv-host", help="context server: the address its KV endpoint "
                       "listens on (default 127.0.0.1; on another, set a shared secret)")
    group.add_argument("--kv-port", type=int, help="context server: its KV endpoint's port "
                       "(default: a free one, announced at GET /disagg/info)")
    group.add_argument("--kv-sources", metavar="HOST:PORT,...",
                       help="generation server: the KV endpoints (--kv-host:--kv-port) of the "
                            "context servers it may fetch from; it connects to no other "
                            "address (required with --role generation)")
    group.add_argument("--kv-secret-file", metavar="PATH",
                       help="a file whose first line is a secret shared by the deployment's "
                            "context and generation servers: each proves it knows it before "
                            "KV moves (default: $TLLM_KV_SECRET; neither: no authentication)")
    group.add_argument("--kv-hold-timeout", type=float, default=30.0,
                       help="context server: seconds a prefilled request's KV waits to be "
                            "fetched before it is freed (default 30)")
