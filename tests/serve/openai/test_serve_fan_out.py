"""Issue 31, finding 2: one request's fan-out (prompts x n x best_of) must not lock every
other client out. A cap per request (--max-sequences-per-request, 400), a queue check that
counts the request's own sequences, and a share: one request holds at most half of the
queue beyond the free batch slots (429). Over the engine double, whose stats count
sequences as the engine's do."""
from __future__ import annotations

import argparse
import asyncio

import httpx
import pytest

from tests.serve.helpers import assert_openai_error
from tllm.serve.cli_args import add_serve_parser, server_config
from tllm.serve.context import ServerConfig
from tllm.serve.http.errors import APIError
from tllm.serve.openai.generation import EngineClient
from tllm.serve.http.app import build_app
from tllm.serve.testing import FakeLLM, ServerThread

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
COMPLETION = {"model": "fake", "prompt": "hi", "max_tokens": 1}
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def http():
    with ServerThread(build_app(FakeLLM(), ServerConfig(model="fake"))) as server:
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            yield client


def test_the_reproducer_is_refused_at_once_and_others_are_served(http):
    """{"prompt": ["hi"]*64, "n": 128} was 8,192 sequences admitted: every other client got
    429 until it ended."""
    body = {**COMPLETION, "prompt": ["hi"] * 64, "n": 128}
    error = assert_openai_error(http.post(COMPLETIONS, json=body), 400)
    assert error["code"] == "too_many_sequences" and error["param"] == "n"
    assert "8192 sequences" in error["message"]
    assert "--max-sequences-per-request" in error["message"]
    assert http.post(COMPLETIONS, json=COMPLETION).status_code == 200


OVER_THE_CAP = [
    ("prompts", {"prompt": ["hi"] * 257}, "prompt"),
    ("token-id prompts", {"prompt": [[104, 105]] * 300}, "prompt"),
    ("prompts x n", {"prompt": ["hi"] * 3, "n": 128}, "n"),
    ("prompts x best_of", {"prompt": ["hi"] * 3, "n": 1, "best_of": 100}, "best_of"),
    ("prompts x beams", {"prompt": ["hi"] * 3, "n": 2, "best_of": 100,
                         "use_beam_search": True}, "best_of"),
]


@pytest.mark.parametrize("fields,param", [c[1:] for c in OVER_THE_CAP],
                         ids=[c[0] for c in OVER_THE_CAP])
def test_more_sequences_than_the_cap_is_a_400(http, fields, param):
    error = assert_openai_error(http.post(COMPLETIONS, json={**COMPLETION, **fields}), 400)
    assert (error["code"], error["param"]) == ("too_many_sequences", param), error


@pytest.mark.parametrize("fields", [{"prompt": ["hi"] * 2, "n": 128},
                                    {"prompt": ["hi"] * 256}], ids=["2 x 128", "256 prompts"])
def test_the_default_cap_is_256(http, fields):
    response = http.post(COMPLETIONS, json={**COMPLETION, **fields})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 256


def test_a_configured_cap_applies_to_chat_too():
    config = ServerConfig(model="fake", max_sequences_per_request=4)
    with ServerThread(build_app(FakeLLM(), config)) as server, \
            httpx.Client(base_url=server.base_url, timeout=30) as client:
        body = {"messages": MESSAGES, "max_tokens": 1}
        assert client.post(CHAT, json={**body, "n": 4}).status_code == 200
        error = assert_openai_error(client.post(CHAT, json={**body, "n": 5}), 400)
        assert "at most 4" in error["message"] and error["param"] == "n"
        error = assert_openai_error(client.post(COMPLETIONS, json={
            **COMPLETION, "prompt": ["a", "b", "c"], "n": 2}), 400)
        assert "6 sequences (3 prompts x 2 each)" in error["message"]


def test_the_flag():
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    for argv, expected in (([], 256), (["--max-sequences-per-request", "64"], 64),
                           (["--max-sequences-per-request", "0"], None)):
        args = parser.parse_args(["serve", *argv])
        assert server_config(args, "m").max_sequences_per_request == expected


# ---- the queue: a request's own sequences count, and it holds at most half ----

def engine_client(num_running: int, num_waiting: int) -> EngineClient:
    """Batch 8, queue 8 (a share of 4), with the stats given."""
    fake = FakeLLM(max_batch_size=8)
    fake.get_stats = lambda: {"num_running": num_running, "num_waiting": num_waiting}
    return EngineClient(fake, metrics=None, max_queue_size=8, stuck_timeout_s=60)


@pytest.mark.parametrize("num_running,num_waiting,num_sequences,is_refused", [
    (0, 0, 12, False),      # idle: 8 take the free slots, 4 (the share) wait
    (0, 0, 1, False),
    (4, 0, 8, False),       # 4 free slots, 4 wait
    (4, 0, 9, True),        # ... 5 would wait: more than the share
    (8, 0, 4, False),
    (8, 0, 5, True),        # no free slot: 5 would wait
    (8, 4, 4, False),       # 4 + 4 waiting = the queue
    (8, 5, 4, True),        # 5 + 4 > 8
    (8, 7, 1, False), (8, 8, 1, True),     # single sequences, as before
])
def test_the_queue_counts_the_request_and_its_share(num_running, num_waiting, num_sequences,
                                                    is_refused):
    engine = engine_client(num_running, num_waiting)
    if not is_refused:
        engine._check_queue(num_sequences)
        return
    with pytest.raises(APIError) as refused:
        engine._check_queue(num_sequences)
    assert refused.value.status == 429 and refused.value.code == "queue_full"
    assert refused.value.headers["Retry-After"] == "1"


def test_a_request_that_could_never_be_admitted_is_a_400_not_a_429():
    engine = engine_client(0, 0)
    engine.check_fan_out(1, 12, 12)     # 8 slots + a share of 4
    with pytest.raises(APIError) as refused:
        engine.check_fan_out(1, 13, 13)
    assert refused.value.status == 400 and "at most 12" in refused.value.message


async def open_streams(base_url: str, bodies: list[dict]) -> list[int]:
    """Open each stream in turn (each admitted or refused before the next); statuses, then
    hang up on all (which aborts them)."""
    statuses = []
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        streams = []
        try:
            for body in bodies:
                stream = client.stream("POST", COMPLETIONS, json=body)
                response = await stream.__aenter__()
                streams.append(stream)
                statuses.append(response.status_code)
        finally:
            for stream in streams:
                await stream.__aexit__(None, None, None)
    return statuses


def test_a_fan_out_leaves_room_for_other_clients():
    """Batch 8, queue 8: a request of 2 prompts x n 6 (12 sequences) is admitted; single
    requests of other clients still are, until the queue is full; a second fan-out while
    busy gets 429 (its share), one of 13 sequences a 400."""
    fake = FakeLLM(token_delay_s=0.05, max_batch_size=8)
    long = {"model": "fake", "max_tokens": 400, "stream": True}
    bodies = ([{**long, "prompt": ["a", "b"], "n": 6}] + [{**long, "prompt": "c"}] * 4
              + [{**long, "prompt": "d"}, {**long, "prompt": "e", "n": 5}])
    with ServerThread(build_app(fake, ServerConfig(model="fake", max_queue_size=8))) as server:
        statuses = asyncio.run(open_streams(server.base_url, bodies))
        assert statuses == [200] * 5 + [429, 429], statuses
        with httpx.Client(base_url=server.base_url, timeout=30) as client:
            error = assert_openai_error(client.post(COMPLETIONS, json={
                **COMPLETION, "n": 13}), 400)
            assert error["code"] == "too_many_sequences"
