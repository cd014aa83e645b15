"""A disaggregated worker's extra route (`tllm serve MODEL --role context|generation`):
GET /disagg/info tells a front the server's role, its KV transport and, for a context
server, the KV endpoint generation servers fetch from (the `opaque_state` the front passes
on). The completions and chat routes take `disaggregated_params` as they are."""
from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import JSONResponse, Response

from tllm.serve.errors import APIError


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
    return config


def add_disagg_args(group) -> None:
    group.add_argument("--role", choices=["context", "generation"],
                       help="disaggregated serving: a context (prefill) or generation "
                            "(decode) server behind `tllm serve disaggregated`")
    group.add_argument("--kv-transport", choices=["tcp", "cuda_ipc"], default="tcp",
                       help="how KV blocks move between the two kinds of server (cuda_ipc: "
                            "both on one GPU host; default tcp)")
    group.add_argument("--kv-host", help="context server: the address its KV endpoint "
                       "listens on (default 127.0.0.1)")
    group.add_argument("--kv-port", type=int, help="context server: its KV endpoint's port "
                       "(default: a free one, announced at GET /disagg/info)")
    group.add_argument("--kv-hold-timeout", type=float, default=30.0,
                       help="context server: seconds a prefilled request's KV waits to be "
                            "fetched before it is freed (default 30)")
