"""`tllm serve router`: the policy on its own (block-hash affinity, load balance), then two
aggregated replicas (real processes) behind the router: repeated prefixes go to one replica
(hit rate in /router/stats), mixed load keeps both busy."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.disagg.conftest import start_servers, tiny_model_dir  # noqa: F401 (a fixture)
from tllm.serve.fronts.router import PrefixAffinity, Router, RouterConfig, block_hashes, build_router_app
from tllm.serve.testing import ServerThread


def test_block_hashes_chain_full_blocks():
    a, b = block_hashes(list(range(70)), 32), block_hashes(list(range(64)) + [9] * 6, 32)
    assert len(a) == 2 and a == b      # the partial tail is not hashed
    assert block_hashes([5] + list(range(1, 64)), 32)[1] != a[1]   # chained: prefix matters


def test_affinity_matches_leading_blocks_and_forgets_oldest():
    affinity = PrefixAffinity(capacity_blocks=3)
    affinity.add([1, 2, 3])
    assert affinity.match([1, 2, 9]) == 2 and affinity.match([9, 1]) == 0
    affinity.add([4])
    assert affinity.match([1]) == 0


def test_cache_aware_prefers_the_replica_with_the_prefix_unless_imbalanced():
    router = Router(RouterConfig(["a:1", "b:2"], balance_abs=2, balance_rel=1.5))
    shared = block_hashes(list(range(256)), 32)
    first = router.choose(shared)
    assert all(router.choose(shared) == first for _ in range(5))
    router.replicas[first].num_in_flight = 10   # busy: the other replica takes it
    assert router.choose(shared) != first
    assert router.stats_dict()["hit_rate"] > 0.5


def test_bad_policy_is_refused():
    with pytest.raises(ValueError, match="--policy"):
        Router(RouterConfig(["a:1"], policy="random"))


@pytest.fixture(scope="module")
def replicas(tiny_model_dir):
    servers = start_servers((tiny_model_dir,), (tiny_model_dir, "--no-engine-process"))
    yield servers
    for server in servers:
        server.stop()


def _run_router(replicas, policy: str, bodies: list[dict]) -> dict:
    router = Router(RouterConfig([r.url for r in replicas], policy=policy, block_size=8))

    async def send_all() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            responses = await asyncio.gather(*(client.post("/v1/completions", json=b)
                                               for b in bodies))
            assert all(r.status_code == 200 for r in responses), [r.text for r in responses]

    with ServerThread(build_router_app(router)) as server:
        asyncio.run(send_all())
        stats = httpx.get(server.base_url + "/router/stats").json()
        metrics = httpx.get(server.base_url + "/metrics").text
    assert "tllm_router_prefix_hit_rate" in metrics
    return stats


@pytest.mark.slow  # two replica processes
def test_repeated_prefix_goes_to_one_replica(replicas):
    system = "the quick brown fox jumps over the lazy dog. " * 3
    bodies = [{"prompt": system + f"q{i}", "max_tokens": 2} for i in range(6)]
    stats = _run_router(replicas, "cache_aware", bodies[:1])  # warms nothing: a new router
    router_stats = _run_router(replicas, "cache_aware", bodies)
    counts = [r["requests"] for r in router_stats["replicas"]]
    assert sorted(counts) == [0, 6], router_stats
    assert router_stats["hit_rate"] > 0.6 and router_stats["hits"] == 5
    assert stats["requests"] == 1


@pytest.mark.slow  # two replica processes
def test_mixed_load_keeps_both_replicas_busy(replicas):
    bodies = [{"prompt": f"{i} hello world {i} " * 3, "max_tokens": 4} for i in range(16)]
    stats = _run_router(replicas, "cache_aware", bodies)
    assert all(r["requests"] >= 4 for r in stats["replicas"]), stats
    round_robin = _run_router(replicas, "round_robin", bodies[:4])
    assert [r["requests"] for r in round_robin["replicas"]] == [2, 2]


def test_the_request_id_goes_through_the_router():
    """The client's X-Request-Id reaches the replica (so both logs name the request alike) and
    comes back; without one the router makes one, and the replica gets that."""
    from tllm.serve.context import ServerConfig
    from tllm.serve.http.app import build_app
    from tllm.serve.testing import FakeLLM

    seen: list[str | None] = []
    replica_app = build_app(FakeLLM(), ServerConfig(model="fake"))

    @replica_app.middleware("http")
    async def record_id(request, call_next):
        seen.append(request.headers.get("x-request-id"))
        return await call_next(request)

    body = {"model": "fake", "prompt": "hi", "max_tokens": 2}
    with ServerThread(replica_app) as replica:
        router = Router(RouterConfig([replica.base_url], policy="round_robin"))
        with ServerThread(build_router_app(router)) as front:
            given = httpx.post(front.base_url + "/v1/completions", json=body,
                               headers={"X-Request-Id": "trace-42"}, timeout=30)
            made = httpx.post(front.base_url + "/v1/completions", json=body, timeout=30)
    assert given.status_code == made.status_code == 200, (given.text, made.text)
    assert given.headers["x-request-id"] == "trace-42"
    assert made.headers["x-request-id"].startswith("req-")
    assert seen == ["trace-42", made.headers["x-request-id"]]


def test_a_stopping_router_drains_then_ends_open_streams_with_an_error_event():
    """Shutdown through a front: new requests and /health get a 503, a short stream
    finishes, a long one ends with an error event and [DONE] (not a cut connection), and the
    replica aborts it."""
    from tests.serve.helpers import assert_openai_error
    from tests.serve.http.test_serve_shutdown import (LONG, assert_ended_with_error,
                                                      stream_in_thread)
    from tllm.serve.context import ServerConfig
    from tllm.serve.http.app import build_app
    from tllm.serve.testing import FakeLLM

    llm = FakeLLM(token_delay_s=0.05)
    with ServerThread(build_app(llm, ServerConfig(model="fake"))) as replica:
        router = Router(RouterConfig([replica.base_url], policy="round_robin"))
        front = ServerThread(build_router_app(router))
        with front, httpx.Client(base_url=front.base_url, timeout=10) as idle:
            assert idle.get("/health").status_code == 200
            long, long_events = stream_in_thread(front.base_url, {**LONG, "max_tokens": 400})
            short, short_events = stream_in_thread(front.base_url, {**LONG, "max_tokens": 8})
            front.server.should_exit = True
            deadline = time.monotonic() + 5
            while (health := idle.get("/health")).status_code == 200:
                assert time.monotonic() < deadline, "/health did not say it"
            assert_openai_error(health, 503)
            refused = idle.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert assert_openai_error(refused, 503)["code"] == "server_shutting_down"
            short.join(10)
            long.join(10)
        deadline = time.monotonic() + 5
        while llm.active and time.monotonic() < deadline:
            time.sleep(0.02)
    assert short_events[-1] == "[DONE]"
    assert json.loads(short_events[-2])["choices"][0]["finish_reason"] == "length"
    assert_ended_with_error(long_events)
    assert not llm.active    # the replica aborted the long one when the front let go
