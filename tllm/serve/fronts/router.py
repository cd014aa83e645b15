"""`tllm serve router --replica URL ... --policy cache_aware|round_robin|least_loaded`: one
OpenAI-compatible front over N aggregated replicas (`tllm serve MODEL` each).

cache_aware sends a request to the replica most likely to hold its prompt's prefix in its KV
cache: the router tokenizes the prompt with the model's tokenizer (token-id prompts as they
are; without a tokenizer, the text's bytes), hashes its full blocks in a chain as the prefix
cache does, and remembers which blocks each replica was sent (an LRU per replica, as
SGLang's router keeps an approximate tree). A replica whose remembered blocks match at least
`cache_threshold` of the prompt's blocks wins, unless load is out of balance (the busiest
replica has more than `balance_abs` requests in flight over the idlest and `balance_rel`
times as many): then, as when nothing matches, the least loaded replica takes it."""
from __future__ import annotations

import asyncio
import itertools
import json
import sys
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from tllm.cli_parser import FlagParser
from tllm.log import add_log_args, configure_logging
from tllm.serve.http.errors import server_stopping
from tllm.serve.http.limits import HttpLimits, add_http_limit_args, http_limits_from_args
from tllm.serve.http.metrics import CONTENT_TYPE_LATEST
from tllm.serve.fronts.proxy import (RelayDrain, Upstream, front_app, pick_least_loaded,
                                     read_json_body, relay, relay_whole)

POLICIES = ("cache_aware", "round_robin", "least_loaded")
BYTES_PER_TOKEN = 4     # without a tokenizer, a block of text is this many bytes per token


def block_hashes(tokens: list[int], block_size: int) -> list[int]:
    """The chained hash of each full block (block i's covers blocks 0..i)."""
    hashes: list[int] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        hashes.append(hash((hashes[-1] if hashes else None,
                            tuple(tokens[start:start + block_size]))))
    return hashes


class PrefixAffinity:
    """The block hashes a replica was sent, least recently used forgotten first."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def match(self, hashes: list[int]) -> int:
        """How many leading blocks of the prompt the replica likely holds."""
        for i, block_hash in enumerate(hashes):
            if block_hash not in self._blocks:
                return i
        return len(hashes)

    def add(self, hashes: list[int]) -> None:
        for block_hash in hashes:
            self._blocks[block_hash] = None
            self._blocks.move_to_end(block_hash)
        while len(self._blocks) > self.capacity:
            self._blocks.popitem(last=False)


@dataclass
class RouterConfig:
    replicas: list[str]
    policy: str = "cache_aware"
    block_size: int = 32
    cache_threshold: float = 0.3
    balance_abs: int = 8
    balance_rel: float = 1.5
    cache_capacity_blocks: int = 1 << 18
    api_key: str | None = None


@dataclass
class RouterStats:
    num_requests: int = 0
    num_hits: int = 0            # requests sent where some of their prefix was
    prompt_blocks: int = 0       # full prompt blocks routed
    matched_blocks: int = 0      # of those, expected in the chosen replica's cache
    num_balanced: int = 0        # cache_aware requests sent by load (imbalance or no match)

    @property
    def hit_rate(self) -> float:
        return self.matched_blocks / self.prompt_blocks if self.prompt_blocks else 0.0


class Router:
    def __init__(self, config: RouterConfig, tokenizer=None) -> None:
        if config.policy not in POLICIES:
            raise ValueError(f"--policy: one of {POLICIES}, got {config.policy!r}")
        if not config.replicas:
            raise ValueError("--replica: at least one replica URL")
        self.config = config
        self.tokenizer = tokenizer
        self.replicas = [Upstream(url, config.api_key) for url in config.replicas]
        self.affinity = [PrefixAffinity(config.cache_capacity_blocks) for _ in self.replicas]
        self.stats = RouterStats()
        self._turns = itertools.count()
        # one tokenizing thread: HF tokenizers are not reentrant
        self._tokenize_pool = ThreadPoolExecutor(1, thread_name_prefix="tllm-router-tokenize")
        self.drain = RelayDrain()   # what its server's shutdown waits for, then ends

    async def handle(self, request: Request, path: str) -> Response:
        with self.drain.admit():
            body = await read_json_body(request)
            # hashed under every policy, so that their hit rates compare
            tokens, block_size = await asyncio.get_running_loop().run_in_executor(
                self._tokenize_pool, self._prompt_tokens, body)
            index = self.choose(block_hashes(tokens, block_size))
            return await relay(request, self.replicas[index], path, body, self.drain)

    async def handle_whole(self, request: Request, path: str) -> Response:
        """The pooling and token routes: any replica answers them (least loaded; they
        leave nothing in its cache to route by)."""
        return await relay_whole(request, self.replicas, next(self._turns), path, self.drain)

    def choose(self, hashes: list[int]) -> int:
        """The replica for a prompt with these block hashes (and count it)."""
        turn = next(self._turns)
        policy = self.config.policy
        if policy == "round_robin":
            index = turn % len(self.replicas)
        elif policy == "least_loaded":
            index = self._least_loaded(turn)
        else:
            index = self._cache_aware(hashes, turn)
        matched = self.affinity[index].match(hashes)
        self.affinity[index].add(hashes)
        stats = self.stats
        stats.num_requests += 1
        stats.num_hits += matched > 0
        stats.prompt_blocks += len(hashes)
        stats.matched_blocks += matched
        return index

    def _least_loaded(self, turn: int) -> int:
        return self.replicas.index(pick_least_loaded(self.replicas, turn))

    def _cache_aware(self, hashes: list[int], turn: int) -> int:
        config = self.config
        live = [i for i, r in enumerate(self.replicas) if r.is_up] or list(range(len(self.replicas)))
        loads = [self.replicas[i].num_in_flight for i in live]
        imbalanced = (max(loads) - min(loads) > config.balance_abs
                      and max(loads) > config.balance_rel * min(loads))
        if hashes and not imbalanced:
            best = max(live, key=lambda i: (self.affinity[i].match(hashes),
                                            -self.replicas[i].num_in_flight))
            if self.affinity[best].match(hashes) >= config.cache_threshold * len(hashes):
                return best
        self.stats.num_balanced += 1
        return self._least_loaded(turn)

    def _prompt_tokens(self, body: dict) -> tuple[list[int], int]:
        """The prompt's tokens for hashing, and the block size to hash them with."""
        block_size, prompt = self.config.block_size, body.get("prompt")
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
            prompt = prompt[0]      # a batch: routed by its first prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
            return prompt, block_size
        text = prompt if isinstance(prompt, str) else None
        try:
            if self.tokenizer is not None and text is not None:
                return self.tokenizer.encode(text), block_size
            messages = body.get("messages")
            if self.tokenizer is not None and isinstance(messages, list):
                return self.tokenizer.encode_chat(messages), block_size
        except Exception:  # noqa: BLE001 - the replica will answer a bad prompt properly
            pass
        if text is None:
            text = json.dumps(body.get("messages"), sort_keys=True)
        return list(text.encode()), block_size * BYTES_PER_TOKEN

    def stats_dict(self) -> dict:
        stats = self.stats
        return {"policy": self.config.policy, "requests": stats.num_requests,
                "hits": stats.num_hits, "hit_rate": stats.hit_rate,
                "prompt_blocks": stats.prompt_blocks, "matched_blocks": stats.matched_blocks,
                "balanced_by_load": stats.num_balanced,
                "replicas": [{"url": r.url, "requests": r.num_requests,
                              "in_flight": r.num_in_flight, "failures": r.num_failures}
                             for r in self.replicas]}


class _RouterCollector:
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self):
        router, stats = self.router, self.router.stats
        yield CounterMetricFamily("tllm_router_requests", "requests routed",
                                  value=stats.num_requests)
        yield GaugeMetricFamily("tllm_router_prefix_hit_rate", "prompt blocks expected in "
                                "the chosen replica's cache, of all routed", value=stats.hit_rate)
        per_replica = CounterMetricFamily("tllm_router_replica_requests",
                                          "requests sent to each replica", labels=["replica"])
        in_flight = GaugeMetricFamily("tllm_router_replica_in_flight",
                                      "requests in flight per replica", labels=["replica"])
        for replica in router.replicas:
            per_replica.add_metric([replica.url], replica.num_requests)
            in_flight.add_metric([replica.url], replica.num_in_flight)
        yield per_replica
        yield in_flight


def build_router_app(router: Router, limits: HttpLimits = HttpLimits(),
                     protect_metrics: bool = False) -> FastAPI:
    """The router's app; with an api_key, clients must send it too (auth.ApiKeyGuard)."""
    app, routes = front_app("tllm router", router.handle, router.handle_whole,
                            router.drain, router.config.api_key,
                            limits, protect_metrics)
    app.state.router = router
    registry = CollectorRegistry()
    registry.register(_RouterCollector(router))

    @routes.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(await pick_least_loaded(router.replicas, 0).get_json("/v1/models"))

    @routes.get("/health")
    async def health() -> Response:
        if router.drain.is_stopping:
            raise server_stopping()
        for replica in router.replicas:
            try:
                if (await replica.client.get("/health", timeout=2.0)).status_code == 200:
                    return JSONResponse({"status": "ok"})
            except Exception:  # noqa: BLE001 - try the next
                continue
        return JSONResponse({"error": {"message": "no replica is healthy", "type":
                                       "service_unavailable", "param": None,
                                       "code": "upstream_unavailable"}}, status_code=503)

    @routes.get("/router/stats")
    async def router_stats() -> Response:
        return JSONResponse(router.stats_dict())

    @routes.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    app.include_router(routes)
    return app


def run_router(argv: list[str]) -> int:
    """`tllm serve router --replica URL [--replica URL ...] [--policy P] [--model M]`."""
    from tllm.serve.http.server import run_uvicorn
    parser = FlagParser(prog="tllm serve router",
                        description="An OpenAI-compatible front over replicas "
                        "of `tllm serve MODEL`.")
    parser.add_argument("--replica", action="append", required=True, metavar="URL")
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware")
    parser.add_argument("--model", help="the replicas' model, for its tokenizer (cache_aware; "
                        "without it the prompt text's bytes are hashed)")
    parser.add_argument("--block-size", type=int, default=32,
                        help="tokens per hashed block (the replicas' tokens_per_block)")
    parser.add_argument("--cache-threshold", type=float, default=0.3)
    parser.add_argument("--balance-abs", type=int, default=8)
    parser.add_argument("--balance-rel", type=float, default=1.5)
    parser.add_argument("--api-key", help="required from clients ('Authorization: Bearer "
                        "KEY'; not on /health, /version, nor on /metrics and the docs without "
                        "--protect-metrics) and sent to the replicas")
    parser.add_argument("--protect-metrics", action="store_true",
                        help="with --api-key: /metrics and the docs need the key too")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    add_log_args(parser)
    add_http_limit_args(parser.add_argument_group("connection limits"))
    args = parser.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    tokenizer = None
    if args.model is not None:
        from tllm import loader
        tokenizer = loader.load_tokenizer(loader.resolve_model(args.model))
    router = Router(RouterConfig(args.replica, args.policy, args.block_size,
                                 args.cache_threshold, args.balance_abs, args.balance_rel,
                                 api_key=args.api_key), tokenizer)
    print(f"router ({args.policy}) over {len(router.replicas)} replicas on "
          f"http://{args.host}:{args.port}/v1", file=sys.stderr)
    app = build_router_app(router, http_limits_from_args(args), args.protect_metrics)
    run_uvicorn(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
