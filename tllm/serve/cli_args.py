"""`tllm serve`: its command line, and how the command line and a YAML file of LLM arguments
combine (command line over file over defaults)."""
from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from tllm.cli_types import (non_negative_float, non_negative_int, positive_float,
                             positive_int)
from tllm.extras import require_extra
from tllm.llmapi.cli_args import add_engine_args, llm_kwargs
from tllm.llmapi.flag_aliases import add_peer_server_flags
from tllm.log import add_log_args, configure_logging
from tllm.loader import DEFAULT_MODEL
from tllm.serve.http.cors import add_cors_args, parse_origins
from tllm.serve.disagg_worker import add_disagg_args, disagg_kwargs
from tllm.serve.http.limits import add_http_limit_args
from tllm.serve.lora import parse_lora_modules
from tllm.serve.http.rollout_routes import (add_rollout_args, rollout_llm_kwargs,
                                            rollout_server_options)
from tllm.serve.openai.parser_choice import AUTO
from tllm.serve.openai.reasoning import REASONING_PARSERS
from tllm.serve.openai.tool_parsers import TOOL_PARSERS
from tllm.serve.pooling.cli_args import add_pooling_args, max_pooling_inputs, pooling_llm_kwargs
from tllm.visual_gen.registry import is_visual_model

logger = logging.getLogger(__name__)


def _run_disaggregated(argv: list[str]) -> int:
    from tllm.serve.fronts.disagg_front import run_disaggregated
    return run_disaggregated(argv)


def _run_router(argv: list[str]) -> int:
    from tllm.serve.fronts.router import run_router
    return run_router(argv)


# `tllm serve disaggregated -c disagg.yml` and `tllm serve router --replica URL ...`: fronts
# over other servers, with flags of their own (no model of theirs to load)
FRONT_COMMANDS = {("serve", "disaggregated"): _run_disaggregated,
                  ("serve", "router"): _run_router}


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `serve` subcommand to an argparse subparsers object."""
    parser = subparsers.add_parser(
        "serve", help="serve a model over an OpenAI-compatible HTTP API",
        description="Serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                    "/v1/chat/completions, /v1/models, /health, /version, /metrics).")
    parser.add_argument("model_arg", nargs="?", metavar="MODEL",
                        help=f"HF model directory, .gguf file, '{DEFAULT_MODEL}' (default) or "
                             "'dummy:<preset>'")
    parser.add_argument("--model", "-m", dest="model_opt", help="the same as MODEL")
    _add_server_args(parser.add_argument_group("server"))
    add_engine_args(parser.add_argument_group("engine (over the --config file)"))
    parser.set_defaults(run=run_serve)
    return parser


def _add_server_args(group) -> None:
    group.add_argument("--host", default="127.0.0.1", help="address to listen on "
                       "(default 127.0.0.1; 0.0.0.0 listens on every interface)")
    group.add_argument("--port", type=int, default=8000)
    group.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on every "
                       "route but /health and /version (and /metrics and the API docs, "
                       "without --protect-metrics); /dashboard?api_key=KEY starts a session")
    group.add_argument("--protect-metrics", action="store_true",
                       help="with --api-key: /metrics, /docs, /redoc and /openapi.json need "
                            "the key too (default: they stay open, as in vLLM)")
    group.add_argument("--served-model-name", help="the model name clients send (default: "
                       "MODEL as given)")
    group.add_argument("--chat-template", help="a Jinja chat template file (or the template "
                       "itself) instead of the model's")
    _add_output_parser_args(group)
    add_pooling_args(group)
    group.add_argument("--max-queue-size", type=non_negative_int, default=1024,
                       help="answer 429 while this many requests wait beyond the free "
                            "batch slots (default 1024; 0 means no limit)")
    group.add_argument("--max-sequences-per-request", type=non_negative_int, default=256,
                       help="answer 400 to a request of more sequences (prompts x n, or x "
                            "best_of / the beam width) than this (default 256; 0 means no "
                            "limit)")
    add_http_limit_args(group)
    group.add_argument("--strict-request-fields", action="store_true",
                       help="answer 400 to a request field the server does not know "
                            "(default: ignore it, with a warning in the log and its name in "
                            "the X-Ignored-Fields response header, as vLLM does)")
    add_cors_args(group)
    group.add_argument("--shutdown-timeout", type=non_negative_float, default=5.0,
                       metavar="SECONDS", help="on Ctrl-C or SIGTERM, open requests get this "
                       "long to finish (new ones get 503); then each ends with an error (a "
                       "stream: an error event and [DONE]) (default 5; 0: at once)")
    group.add_argument("--stuck-timeout", type=float, default=120.0,
                       help="seconds without an engine step, with work queued, after which "
                            "/health answers 503 (default 120)")
    _add_media_args(group)
    _add_engine_process_args(group)
    _add_lora_args(group)
    add_rollout_args(group)
    add_log_args(group)
    group.add_argument("--log-stats-interval", type=non_negative_float, default=10.0,
                       metavar="SECONDS", help="log a stats line (running, waiting, KV use, "
                       "tokens/s) this often while busy (default 10; 0: never)")
    group.add_argument("--grpc-port", type=int, help="also serve gRPC (tllm/serve/grpc/"
                       "tllm.proto: Generate, Abort, Health, ModelInfo) on this port")
    add_disagg_args(group)
    add_peer_server_flags(group)


def _add_output_parser_args(group) -> None:
    group.add_argument("--tool-call-parser", choices=[AUTO, "none", *sorted(TOOL_PARSERS)],
                       default=AUTO,
                       help="tool_choice auto: parse tool calls from the model's output in "
                            "this format (hermes: Qwen2.5/Qwen3; qwen3_coder; llama3_json; "
                            "pythonic: Llama 3.2/4; mistral; deepseek_v3). Default auto: the "
                            "one the chat template shows (<tool_call> hermes, <function= "
                            "qwen3_coder, [TOOL_CALLS] mistral, <|python_tag|> llama3_json, "
                            "DeepSeek's tool tokens deepseek_v3), else none: auto answers in "
                            "text. required and named functions need no parser")
    group.add_argument("--reasoning-parser", choices=[AUTO, "none", *sorted(REASONING_PARSERS)],
                       default=AUTO,
                       help="split the model's reasoning into reasoning_content: <think>..."
                            "</think> (qwen3: an output that opens with <think>; deepseek_r1: "
                            "the template opened it; think: either, read from the prompt), "
                            "granite (Here is my thought process: ... Here is my response:), "
                            "gpt_oss (harmony's analysis channel). Default auto: the one the "
                            "chat template shows (<think> think, <|channel|> gpt_oss, "
                            "Granite's phrase granite), else none")


def _add_media_args(group) -> None:
    group.add_argument("--image-url-ttl", type=positive_float, default=3600.0,
                       help="visual models: seconds a response_format=url image stays served "
                            "(default 3600, as OpenAI's)")
    group.add_argument("--max-image-pixels", type=positive_int, default=4096 * 4096,
                       help="visual models: answer 400 to an input image (`image`, "
                            "`input_reference`) of more pixels than this, read from its "
                            "header before decoding (default 16,777,216: 4096 x 4096)")
    group.add_argument("--visual-max-batch-size", type=positive_int, default=4,
                       help="image models: run up to this many compatible requests (same "
                            "size, steps, guidance) as one transformer batch (default 4; 1: "
                            "no batching). --max-queue-size caps the requests pending (429)")
    group.add_argument("--visual-batch-window-ms", type=non_negative_float, default=10.0,
                       help="image models: wait at most this long after a request arrives "
                            "for others to batch with it (default 10)")


def _add_engine_process_args(group) -> None:
    group.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                       help="text models: run the engine in a process of its own, so HTTP "
                            "work does not slow its loop (default; --no-engine-process keeps "
                            "it in the server's process)")
    group.add_argument("--exit-on-engine-failure", action="store_true",
                       help="when the engine process dies, exit with status 1 (for an "
                            "orchestrator to restart the server) instead of restarting it")
    group.add_argument("--max-engine-restarts", type=positive_int, default=3,
                       help="restart attempts in a row (backoff 0, 1, 2, 4 ... s; an engine "
                            "up 60 s resets the count) before the server gives up and exits "
                            "with status 1 (default 3)")


def _add_lora_args(group) -> None:
    group.add_argument("--lora-modules", nargs="+", metavar="NAME=PATH",
                       help="with --enable-lora: serve these PEFT adapter folders as models "
                            "(\"model\": NAME); more through POST /v1/load_lora_adapter")
    group.add_argument("--lora-allowed-paths", nargs="+", metavar="DIR",
                       help="POST /v1/load_lora_adapter may load adapters from these folders "
                            "and below them (symlinks and .. resolved first), besides the "
                            "--lora-modules folders; any other lora_path gets a 403")


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, then serve until interrupted."""
    from tllm.llmapi.llm import LLM
    from tllm.gc_heap import frozen_heap
    from tllm.llmapi.process_llm import ProcessLLM
    from tllm.serve.http.server import build_server, run_until_stopped
    from tllm.serve.http.app import build_app
    from tllm.serve.http.stats_log import StatsLogger, server_stats

    configure_logging(args.log_level, args.log_format)
    model, llm_kwargs = llm_arguments(args)
    config = server_config(args, model)
    if is_visual_model(model):  # a diffusers folder or a dummy: visual name
        from tllm.serve.visual.images import serve_images
        return serve_images(args, config)
    llm = (ProcessLLM if args.engine_process else LLM)(model=model, **llm_kwargs)
    app = build_app(llm, config)
    # No lifespan events: the LLM is loaded already and shut down below. On Ctrl-C or
    # SIGTERM, open requests get --shutdown-timeout seconds, then end with an error.
    server = build_server(app, host=args.host, port=args.port, log_level=args.log_level,
                          shutdown_timeout_s=args.shutdown_timeout)
    supervisor = app.state.ctx.supervisor
    supervisor.on_fatal = lambda reason: setattr(server, "should_exit", True)
    logger.info("serving %s on http://%s:%d/v1", config.model_name, args.host, args.port)
    stats_log = StatsLogger(server_stats(llm, app.state.ctx.metrics),
                            args.log_stats_interval).start()
    # What start-up built (modules, model or tokenizer, the app) lives as long as the
    # server: out of the collector's full passes, which took 100-165 ms each on a 2-core
    # CPU and stall the event loop every stream shares (vLLM's API server does the same).
    try:
        with frozen_heap():
            run_until_stopped(_serving(args, server, app.state.ctx))
    finally:
        stats_log.close()
        app.state.ctx.close()
        llm.shutdown()
    if supervisor.fatal_reason is not None:    # the supervisor has logged why
        return 1
    return 0 if server.started else 1


def _serving(args: argparse.Namespace, server, ctx):
    """What runs the server: uvicorn's run, or with --grpc-port the gRPC server beside it."""
    if args.grpc_port is None:
        return server.run
    require_extra("grpc", "--grpc-port")
    from tllm.serve.grpc.server import run_with_grpc
    logger.info("gRPC on %s:%d", args.host, args.grpc_port)
    return lambda: run_with_grpc(server, ctx, args.host, args.grpc_port)


def llm_arguments(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    """(model, LLM keyword arguments): the --config file's, overridden by the flags given."""
    kwargs = llm_kwargs(args, model=args.model_arg or args.model_opt)
    if getattr(args, "seed", None) is not None:
        kwargs["seed"] = args.seed
    if getattr(args, "role", None) is not None:
        kwargs["disaggregation"] = disagg_kwargs(args)
    kwargs.update(pooling_llm_kwargs(args))
    kwargs.update(rollout_llm_kwargs(args))
    return kwargs.pop("model"), kwargs


def server_config(args: argparse.Namespace, model: str):
    from tllm.serve.context import ServerConfig
    return ServerConfig(model=model, served_model_name=args.served_model_name,
                        api_key=args.api_key, max_queue_size=args.max_queue_size or None,
                        max_sequences_per_request=args.max_sequences_per_request or None,
                        max_body_bytes=args.max_body_bytes,
                        chat_template=_read_chat_template(args.chat_template),
                        stuck_timeout_s=args.stuck_timeout,
                        image_url_ttl_s=args.image_url_ttl,
                        max_image_pixels=args.max_image_pixels,
                        body_read_timeout_s=args.body_read_timeout,
                        max_header_bytes=args.max_header_bytes,
                        keep_alive_timeout_s=args.keep_alive_timeout,
                        header_read_timeout_s=args.header_read_timeout,
                        max_connections=args.max_connections,
                        protect_metrics=args.protect_metrics,
                        exit_on_engine_failure=args.exit_on_engine_failure,
                        max_engine_restarts=args.max_engine_restarts,
                        tool_call_parser=args.tool_call_parser,
                        reasoning_parser=args.reasoning_parser,
                        lora_modules=parse_lora_modules(getattr(args, "lora_modules", None)),
                        lora_allowed_paths=tuple(getattr(args, "lora_allowed_paths", None) or ()),
                        strict_request_fields=getattr(args, "strict_request_fields", False),
                        allowed_origins=parse_origins(getattr(args, "allowed_origins", None)),
                        max_pooling_inputs=max_pooling_inputs(args),
                        **rollout_server_options(args))


def _read_chat_template(value: str | None) -> str | None:
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{{" in value or "{%" in value:
        return value
    raise FileNotFoundError(f"--chat-template {value!r}: no such file")
