"""vLLM's use_beam_search / best_of / length_penalty / early_stopping over HTTP (completions
and chat): the choices equal LLM.generate's beams, best_of returns n choices, bad values and
streaming are a 400 naming the field."""
from __future__ import annotations

import httpx
import pytest

from tests.serve.helpers import assert_openai_error, wait_until_idle
from tllm import LLM, KvCacheConfig, SamplingParams
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread

PROMPT = [5, 17, 33, 2, 90, 41, 7]
BEAMS = dict(use_beam_search=True, best_of=4, n=2, length_penalty=0.5, early_stopping="never")


@pytest.fixture(scope="module")
def server(tiny_llama):
    llm = LLM(str(tiny_llama[0]), max_num_tokens=32, max_batch_size=8, max_seq_len=128,
              kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024))
    try:
        with ServerThread(build_app(llm, ServerConfig(model="tiny"))) as srv:
            srv.llm = llm
            yield srv
    finally:
        llm.shutdown()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as client:
        yield client
    wait_until_idle(server.llm)
    stats = server.llm.get_kv_cache_stats()
    assert stats["blocks_free"] == stats["blocks_total"]


def test_completions_beams_equal_the_llm_api(server, http):
    expected = server.llm.generate({"prompt_token_ids": PROMPT}, SamplingParams(
        temperature=0, max_tokens=6, **BEAMS), use_tqdm=False)
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                  "max_tokens": 6, **BEAMS})
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["text"] for c in choices] == [o.text for o in expected.outputs]
    assert response.json()["usage"]["completion_tokens"] == sum(
        len(o.token_ids) for o in expected.outputs)


def test_chat_bodies_take_the_beam_fields():
    from tllm.serve.openai.params import sampling_params
    from tllm.serve.openai.protocol import ChatCompletionRequest

    body = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                 **BEAMS)
    params = sampling_params(body, max_tokens=4)
    assert (params.use_beam_search, params.beam_width, params.n) == (True, 4, 2)
    assert (params.length_penalty, params.early_stopping, params.temperature) == (
        0.5, "never", 0.0)
    body = ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                 n=2, best_of=3)
    assert sampling_params(body, max_tokens=4).num_sequences == 3


def test_best_of_returns_n_choices(http):
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                  "max_tokens": 5, "n": 2, "best_of": 4,
                                                  "seed": 3})
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2


@pytest.mark.parametrize("extra, param", [
    ({"use_beam_search": True, "best_of": 2, "n": 3}, "best_of"),
    ({"use_beam_search": True, "best_of": 2, "temperature": 0.7}, "temperature"),
    ({"use_beam_search": True, "best_of": 2, "early_stopping": "sometimes"}, "early_stopping"),
    ({"length_penalty": 2.0}, "length_penalty"),
    ({"use_beam_search": True, "best_of": 2, "stream": True}, "use_beam_search"),
    ({"best_of": 3, "stream": True}, "best_of"),
    ({"use_beam_search": True, "best_of": 16}, "best_of"),  # over max_batch_size
    ({"best_of": 1, "n": 2}, "best_of"),
])
def test_bad_values_are_a_400_naming_the_field(http, extra, param):
    response = http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT,
                                                  "max_tokens": 4, **extra})
    assert assert_openai_error(response, 400)["param"] == param
