"""vLLM's `priority` field of completions bodies (chat bodies share it and its path to the
engine): served under the priority scheduling policy (the same tokens as without it), a 400
naming the field otherwise or when it is not an integer."""
from __future__ import annotations

import httpx
import pytest

from tests.serve.helpers import assert_openai_error, wait_until_idle
from tllm import LLM, KvCacheConfig, SchedulerConfig
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread

PROMPT = [5, 17, 33, 2, 90, 41, 7]


@pytest.fixture(scope="module", params=["fcfs", "priority"])
def server(request, tiny_llama):
    llm = LLM(str(tiny_llama[0]), max_num_tokens=32, max_batch_size=8, max_seq_len=128,
              kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024),
              scheduler_config=SchedulerConfig(scheduling_policy=request.param))
    try:
        with ServerThread(build_app(llm, ServerConfig(model="tiny"))) as srv:
            srv.llm, srv.policy = llm, request.param
            yield srv
    finally:
        llm.shutdown()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client
    wait_until_idle(server.llm)


def test_priority_is_served_or_refused_by_the_policy(server, http):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5, "temperature": 0}
    plain = http.post("/v1/completions", json=body)
    assert plain.status_code == 200, plain.text
    with_priority = http.post("/v1/completions", json={**body, "priority": -2})
    if server.policy == "priority":
        assert with_priority.status_code == 200, with_priority.text
        assert with_priority.json()["choices"][0]["text"] == plain.json()["choices"][0]["text"]
    else:
        assert assert_openai_error(with_priority, 400)["param"] == "priority"


def test_priority_must_be_an_integer(http):
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                  "max_tokens": 2, "priority": "high"})
    assert assert_openai_error(response, 400)["param"] == "priority"
