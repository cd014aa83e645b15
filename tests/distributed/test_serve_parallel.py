"""`tllm serve --pp-size 2` path end to end: the server over a pipeline-parallel SmolLM2
(two processes, gloo) answers the openai client with the single-process engine's greedy text,
streaming included."""
from __future__ import annotations

import openai
import pytest

from tllm import LLM, KvCacheConfig, SamplingParams
from tllm.cli import build_parser
from tllm.serve.cli_args import llm_arguments
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread

pytestmark = pytest.mark.slow
PROMPTS = ["The capital of France is", "def fibonacci(n):"]
ENGINE = dict(max_seq_len=256, max_batch_size=8, kv_cache_config=KvCacheConfig(max_tokens=4096))


@pytest.fixture(scope="module")
def expected():
    with LLM("smollm2", **ENGINE) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0),
                               use_tqdm=False)
    return [o.outputs[0].text for o in outputs]


def test_server_over_pipeline_parallel_engine(expected):
    _, kwargs = llm_arguments(build_parser().parse_args(["serve", "smollm2", "--pp-size", "2"]))
    with LLM("smollm2", **ENGINE, **kwargs) as llm:
        assert llm.args.pipeline_parallel_size == 2
        with ServerThread(build_app(llm, ServerConfig(model="smollm2"))) as server:
            client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x",
                                   max_retries=0)
            texts = [client.completions.create(model="smollm2", prompt=p, max_tokens=16,
                                               temperature=0).choices[0].text for p in PROMPTS]
            stream = client.completions.create(model="smollm2", prompt=PROMPTS[0],
                                               max_tokens=16, temperature=0, stream=True)
            streamed = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert texts == expected
    assert streamed == expected[0]
