"""POST /tokenize and /detokenize on every model: the round trip on SmolLM2 (a prompt, and
chat messages through its template, equal to the tokenizer's own) and on the engine
doubles."""
from __future__ import annotations

import httpx
import pytest

from tests.serve.conftest import MAX_SEQ_LEN
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import FakeLLM, ServerThread
from tllm.serve.testing_pooling import FakePoolingLLM

PROMPT = "The capital of France is Paris. Ünïcödé ✓"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is the capital of France?"}]


@pytest.mark.slow
def test_round_trip_on_smollm2(http, smollm2):
    tokens = http.post("/tokenize", json={"prompt": PROMPT}).json()
    assert tokens["tokens"] == smollm2.tokenizer.encode(PROMPT)
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == MAX_SEQ_LEN
    text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
    assert text == {"prompt": PROMPT}


@pytest.mark.slow
def test_chat_messages_through_the_template_on_smollm2(http, smollm2):
    body = http.post("/tokenize", json={"messages": MESSAGES}).json()
    assert body["tokens"] == smollm2.tokenizer.encode_chat(MESSAGES)
    continued = http.post("/tokenize", json={"messages": MESSAGES,
                                             "add_generation_prompt": False}).json()
    assert continued["count"] < body["count"]
    text = http.post("/detokenize", json={"tokens": body["tokens"]}).json()["prompt"]
    assert text.endswith("<|im_start|>assistant\n") and "Be brief." in text


@pytest.mark.parametrize("llm", [FakeLLM(), FakePoolingLLM(task="score")],
                         ids=["generate", "score"])
def test_round_trip_on_the_doubles(llm):
    with ServerThread(build_app(llm, ServerConfig(model="fake"))) as server:
        with httpx.Client(base_url=server.base_url) as client:
            tokens = client.post("/tokenize", json={"prompt": "héllo"}).json()
            text = client.post("/detokenize", json={"tokens": tokens["tokens"]}).json()
            chat = client.post("/tokenize", json={"messages": [
                {"role": "user", "content": "hi"}]}).json()
    assert tokens == {"count": 6, "max_model_len": 512, "tokens": list("héllo".encode())}
    assert text == {"prompt": "héllo"}
    assert bytes(chat["tokens"]).decode() == "user: hi\nassistant: "
