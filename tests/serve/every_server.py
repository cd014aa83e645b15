"""Every kind of server tllm starts, built without a model (the engine double, a visual model
double, fronts over addresses nobody listens on), for the tests that must hold on all of
them: connection limits, the API key's reach."""
from __future__ import annotations

import types

from tllm.serve.context import ServerConfig
from tllm.serve.fronts.disagg_front import DisaggFront, DisaggFrontConfig, build_front_app
from tllm.serve.visual.images import build_images_app
from tllm.serve.http.app import build_app
from tllm.serve.fronts.router import Router, RouterConfig, build_router_app
from tllm.serve.testing import FakeLLM, ServerThread

KINDS = ("text", "generation_role", "visual", "router", "disaggregated_front")
NOBODY = "127.0.0.1:9"      # the discard port: a front's upstreams refuse at once
# A POST route of each kind that reads a body (for the body-read timeout).
BODY_ROUTE = {"text": "/v1/completions", "generation_role": "/v1/completions",
              "visual": "/v1/images/generations", "router": "/v1/completions",
              "disaggregated_front": "/v1/completions"}


def build(kind: str, api_key: str | None = None, protect_metrics: bool = False, **limits):
    """The app of a server of this kind; `limits` are ServerConfig's limit fields."""
    config = ServerConfig(model="fake", api_key=api_key, protect_metrics=protect_metrics,
                          **limits)
    if kind in ("text", "generation_role"):
        llm = FakeLLM()
        if kind == "generation_role":    # what `--role generation` adds: /disagg/*
            llm.disagg_info = {"role": "generation", "transport": "tcp"}
        return build_app(llm, config)
    if kind == "visual":      # a video model: the images and the videos routes
        gen = types.SimpleNamespace(makes_video=True, takes_image=False)
        return build_images_app(gen, config)
    if kind == "router":
        router = Router(RouterConfig([NOBODY], policy="round_robin", api_key=api_key))
        return build_router_app(router, config.http_limits, protect_metrics)
    if kind == "disaggregated_front":
        front = DisaggFront(DisaggFrontConfig(
            context_servers={"urls": [NOBODY]}, generation_servers={"urls": [NOBODY]},
            api_key=api_key))
        return build_front_app(front, config.http_limits, protect_metrics)
    raise ValueError(f"kind: one of {KINDS}, got {kind!r}")


def serve(kind: str, **kwargs) -> ServerThread:
    return ServerThread(build(kind, **kwargs))
