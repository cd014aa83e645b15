"""The official openai client against our server with SmolLM2: completions, chat, streaming
with usage, logprobs, n > 1, stop, echo; greedy text equals LLM.generate's."""
from __future__ import annotations

import math

import openai
import pytest

from tests.serve.conftest import MODEL
from tests.serve.helpers import wait_until_idle
from tllm import SamplingParams
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(autouse=True)
def _engine_idle_after(smollm2):
    yield
    wait_until_idle(smollm2)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, **kwargs)


def test_completion_equals_llm_generate(client, smollm2):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0)
    expected = smollm2.generate(PROMPT, greedy(12), use_tqdm=False).outputs[0]
    assert out.choices[0].text == expected.text
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens == len(smollm2.tokenizer.encode(PROMPT))
    assert out.usage.completion_tokens == 12
    assert out.model == MODEL and out.object == "text_completion"


def test_chat_equals_llm_chat(client, smollm2):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12,
                                         temperature=0)
    expected = smollm2.chat(QUESTION, greedy(12), use_tqdm=False)
    assert out.choices[0].message.content == expected.outputs[0].text
    assert "Paris" in out.choices[0].message.content
    assert out.choices[0].message.role == "assistant"
    assert out.usage.prompt_tokens == len(expected.prompt_token_ids)


def test_streamed_completion_with_usage(client, smollm2):
    chunks = list(client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10,
                                            temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    content = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in content) == \
        smollm2.generate(PROMPT, greedy(10), use_tqdm=False).outputs[0].text
    assert [c.choices[0].finish_reason for c in content].count("length") == 1
    assert content[-1].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10


def test_streamed_chat_with_usage(client, smollm2):
    chunks = list(client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=10,
                                                 temperature=0, stream=True,
                                                 stream_options={"include_usage": True}))
    content = [c for c in chunks if c.choices]
    assert content[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in content)
    assert text == smollm2.chat(QUESTION, greedy(10), use_tqdm=False).outputs[0].text
    assert sum(1 for c in content if c.choices[0].finish_reason) == 1
    assert content[-1].choices[0].finish_reason is not None
    assert chunks[-1].usage.completion_tokens >= 1


def test_completion_logprobs_match_the_engine(client, smollm2):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0,
                                    logprobs=3)
    lp = out.choices[0].logprobs
    expected = smollm2.generate(PROMPT, greedy(6, logprobs=3), use_tqdm=False).outputs[0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for i, token_id in enumerate(expected.token_ids):
        assert lp.token_logprobs[i] == pytest.approx(expected.logprobs[i][token_id].logprob,
                                                     abs=1e-4)
        assert len(lp.top_logprobs[i]) >= 3 - 1  # top-3 (distinct token strings)
        assert max(lp.top_logprobs[i].values()) == pytest.approx(lp.token_logprobs[i])


def test_echo_with_max_tokens_0_scores_the_prompt(client, smollm2):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=0, echo=True,
                                    logprobs=1, temperature=0)
    choice = out.choices[0]
    ids = smollm2.tokenizer.encode(PROMPT)
    ref = smollm2.generate(PROMPT, greedy(1, prompt_logprobs=1), use_tqdm=False)
    assert choice.text == PROMPT
    assert len(choice.logprobs.tokens) == len(ids)
    assert choice.logprobs.token_logprobs[0] is None
    for position, token_id, value in zip(ref.prompt_logprobs[1:], ids[1:],
                                         choice.logprobs.token_logprobs[1:]):
        assert value == pytest.approx(position[token_id].logprob, abs=1e-4)
    assert out.usage.completion_tokens == 0


def test_echo_with_generation(client, smollm2):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True,
                                    temperature=0)
    assert out.choices[0].text == \
        PROMPT + smollm2.generate(PROMPT, greedy(4), use_tqdm=False).outputs[0].text


def test_chat_logprobs(client):
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=5,
                                         temperature=0, logprobs=True, top_logprobs=2)
    entries = out.choices[0].logprobs.content
    assert len(entries) == out.usage.completion_tokens
    for entry in entries:
        assert len(entry.top_logprobs) == 2
        assert entry.token == entry.top_logprobs[0].token  # greedy picks the top token
        assert entry.logprob <= 0 and not math.isinf(entry.logprob)
        assert bytes(entry.bytes).decode(errors="replace") == entry.token


def test_n_samples(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, n=3,
                                    temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 18
    stream = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=4, n=2,
                                            temperature=1.0, seed=7, stream=True)
    finishes = [(c.choices[0].index, c.choices[0].finish_reason) for c in stream
                if c.choices and c.choices[0].finish_reason]
    assert sorted(index for index, _ in finishes) == [0, 1]


def test_seed_makes_sampling_reproducible(client):
    def sample():
        return client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6,
                                         temperature=1.0, seed=123).choices[0].text
    assert sample() == sample()


def test_stop_string(client, smollm2):
    full = smollm2.generate(PROMPT, greedy(12), use_tqdm=False).outputs[0].text
    stop = full.split()[1]  # a word from the middle of the greedy answer
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0,
                                    stop=[stop, "never appears"])
    assert out.choices[0].text == full[:full.index(stop)]
    assert out.choices[0].finish_reason == "stop"


def test_prompt_forms_and_batches(client, smollm2):
    ids = smollm2.tokenizer.encode(PROMPT)
    expected = smollm2.generate(PROMPT, greedy(5), use_tqdm=False).outputs[0].text
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=5, temperature=0)
    assert by_ids.choices[0].text == expected
    batch = client.completions.create(model=MODEL, prompt=[PROMPT, "Hello", PROMPT],
                                      max_tokens=5, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert batch.choices[0].text == batch.choices[2].text == expected
    lists = client.completions.create(model=MODEL, prompt=[ids, ids[:3]], max_tokens=5,
                                      temperature=0)
    assert lists.choices[0].text == expected and len(lists.choices) == 2


def test_extra_sampling_fields(client):
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0,
                                    extra_body={"min_tokens": 8, "ignore_eos": True,
                                                "top_k": 5, "min_p": 0.05,
                                                "repetition_penalty": 1.2,
                                                "skip_special_tokens": False})
    assert out.usage.completion_tokens == 8


def test_models_endpoint(client, smollm2):
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].max_model_len == smollm2.max_seq_len


def test_chat_template_override(smollm2):
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    config = ServerConfig(model=MODEL, chat_template=template)
    with ServerThread(build_app(smollm2, config)) as server:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0)
        out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=1)
    text = "user: What is the capital of France?\n"
    assert out.usage.prompt_tokens == len(smollm2.tokenizer.encode(text,
                                                                   add_special_tokens=False))


def test_logit_bias_forces_a_token(client, smollm2):
    forced = smollm2.tokenizer.encode(" banana")[0]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0,
                                    logit_bias={str(forced): 100})
    assert out.choices[0].text == smollm2.tokenizer.decode([forced] * 3)
