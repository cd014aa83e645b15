"""Malformed and hostile requests, table-driven: each gets the right 4xx with OpenAI's error
body; then the server answers a normal request and the KV pool is whole."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest

from tests.serve.conftest import MAX_SEQ_LEN, MODEL
from tests.serve.helpers import assert_openai_error, wait_until_idle

pytestmark = pytest.mark.slow
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
TOKENIZE, DETOKENIZE, EMBEDDINGS = "/tokenize", "/detokenize", "/v1/embeddings"
DROP = object()  # a field to leave out of the base body
JSON = {"content-type": "application/json"}
BASES = {COMPLETIONS: {"model": MODEL, "prompt": "Hello", "max_tokens": 2},
         TOKENIZE: {"model": MODEL, "prompt": "Hello"},
         DETOKENIZE: {"model": MODEL, "tokens": [1, 2]},
         EMBEDDINGS: {"model": MODEL, "input": "Hello"},
         CHAT: {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                "max_tokens": 2}}


@dataclass
class Case:
    name: str
    fields: dict | None = None   # merged into the base body of the path
    status: int = 400
    param: str | None = None
    code: str | None = None
    path: str = COMPLETIONS
    raw: bytes | None = None     # sent as is instead of a JSON body
    headers: dict = field(default_factory=lambda: dict(JSON))
    method: str = "POST"

    def body(self) -> bytes | None:
        if self.raw is not None or self.fields is None:
            return self.raw
        merged = {**BASES[self.path], **self.fields}
        return json.dumps({k: v for k, v in merged.items() if v is not DROP}).encode()


def chat(name, fields, status=400, param=None, code=None) -> Case:
    return Case(name, fields, status, param, code, path=CHAT)


TOO_LONG = "word " * (MAX_SEQ_LEN + 10)
CASES = [
    # out-of-range sampling values
    Case("negative temperature", {"temperature": -1}, param="temperature"),
    Case("top_p zero", {"top_p": 0}, param="top_p"),
    Case("top_p above 1", {"top_p": 1.5}, param="top_p"),
    Case("top_k below -1", {"top_k": -2}, param="top_k"),
    Case("min_p above 1", {"min_p": 1.5}, param="min_p"),
    Case("presence_penalty above 2", {"presence_penalty": 3}, param="presence_penalty"),
    Case("frequency_penalty below -2", {"frequency_penalty": -2.5}, param="frequency_penalty"),
    Case("repetition_penalty zero", {"repetition_penalty": 0}, param="repetition_penalty"),
    Case("min_tokens above max_tokens", {"min_tokens": 5, "max_tokens": 2}, param="min_tokens"),
    Case("negative min_tokens", {"min_tokens": -1}, param="min_tokens"),
    # max_tokens
    Case("zero max_tokens", {"max_tokens": 0}, param="max_tokens"),
    Case("negative max_tokens", {"max_tokens": -5}, param="max_tokens"),
    Case("huge max_tokens", {"max_tokens": 10**9}, param="max_tokens",
         code="context_length_exceeded"),
    Case("max_tokens 0 with echo but streaming", {"max_tokens": 0, "echo": True,
                                                  "stream": True}, param="max_tokens"),
    # prompts
    Case("empty prompt", {"prompt": ""}, param="prompt"),
    Case("empty prompt list", {"prompt": []}, param="prompt"),
    Case("empty token list in a batch", {"prompt": [[1, 2], []]}, param="prompt"),
    Case("empty string in a batch", {"prompt": ["a", ""]}, param="prompt"),
    Case("mixed prompt list", {"prompt": ["a", 1]}, param="prompt"),
    Case("token id outside the vocabulary", {"prompt": [1, 49152]}, param="prompt"),
    Case("huge token id", {"prompt": [2**70]}, param="prompt"),
    Case("negative token id", {"prompt": [1, -1]}, param="prompt"),
    Case("prompt too long (ids)", {"prompt": [1] * (MAX_SEQ_LEN + 1)}, param="prompt",
         code="context_length_exceeded"),
    Case("prompt too long (text)", {"prompt": TOO_LONG}, param="prompt",
         code="context_length_exceeded"),
    Case("prompt of the wrong type", {"prompt": 123}, param="prompt"),
    Case("prompt missing", {"prompt": DROP}, param="prompt"),
    # logprobs, n, stop, seed, logit_bias, unsupported options
    Case("logprobs above 20", {"logprobs": 21}, param="logprobs"),
    Case("negative logprobs", {"logprobs": -1}, param="logprobs"),
    Case("huge n", {"n": 10**6}, param="n"),
    Case("zero n", {"n": 0}, param="n"),
    Case("empty stop string", {"stop": ""}, param="stop"),
    Case("empty string in stop list", {"stop": ["ok", ""]}, param="stop"),
    Case("too many stop strings", {"stop": [f"s{i}" for i in range(17)]}, param="stop"),
    Case("negative stop token id", {"stop_token_ids": [-1]}, param="stop_token_ids"),
    Case("seed beyond 64 bits", {"seed": 2**70}, param="seed"),
    Case("logit_bias with a bad key", {"logit_bias": {"abc": 1}}, param="logit_bias"),
    Case("logit_bias out of range", {"logit_bias": {"5": 1000}}, param="logit_bias"),
    Case("best_of below n", {"best_of": 1, "n": 2}, param="best_of"),
    Case("suffix", {"suffix": "end"}, param="suffix"),
    # wrong types, bad JSON (unknown fields are ignored: test_serve_request_fields.py)
    Case("string temperature", {"temperature": "hot"}, param="temperature"),
    Case("numeric string max_tokens", {"max_tokens": "10"}, param="max_tokens"),
    Case("float max_tokens", {"max_tokens": 2.5}, param="max_tokens"),
    Case("boolean n", {"n": True}, param="n"),
    Case("string stream", {"stream": "yes"}, param="stream"),
    Case("NaN temperature", raw=b'{"prompt": "Hi", "temperature": NaN}', param="temperature"),
    Case("infinite top_p", raw=b'{"prompt": "Hi", "top_p": Infinity}', param="top_p"),
    Case("invalid JSON", raw=b'{"prompt": "Hi",'),
    Case("empty body", raw=b""),
    Case("JSON array body", raw=b'["Hi"]'),
    Case("invalid UTF-8", raw=b'{"prompt": "\xff\xfe"}'),
    Case("deeply nested JSON", raw=b"[" * 100_000 + b"]" * 100_000),
    Case("wrong content type", raw=b"prompt=Hi", status=415,
         headers={"content-type": "application/x-www-form-urlencoded"}),
    Case("body over the cap", {"prompt": "x" * (2 << 20)}, status=413),
    # model and routes
    Case("unknown model", {"model": "gpt-5"}, status=404, param="model",
         code="model_not_found"),
    Case("unknown route", raw=b"{}", status=404, path="/v1/engines"),
    Case("wrong method", None, status=405, method="DELETE"),
    # chat
    chat("no messages", {"messages": []}, param="messages"),
    chat("messages missing", {"messages": DROP}, param="messages"),
    chat("unknown role", {"messages": [{"role": "wizard", "content": "x"}]},
         param="messages.0.role"),
    chat("tool message without tool_call_id", {"messages": [{"role": "tool", "content": "x"}]},
         param="messages.0"),
    chat("image content part", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/x.png"}}]}]},
        param="messages.0.content.0"),
    chat("content of the wrong type", {"messages": [{"role": "user", "content": 5}]},
         param="messages.0.content"),
    chat("top_logprobs above 20", {"logprobs": True, "top_logprobs": 21},
         param="top_logprobs"),
    chat("top_logprobs without logprobs", {"top_logprobs": 2}, param="top_logprobs"),
    chat("zero max_completion_tokens", {"max_completion_tokens": 0},
         param="max_completion_tokens"),
    chat("tool without a function name", {"tools": [{"type": "function", "function": {}}]},
         param="tools.0.function.name"),
    chat("unknown response format", {"response_format": {"type": "xml"}},
         param="response_format.type"),
    chat("conversation too long", {"messages": [{"role": "user", "content": TOO_LONG}]},
         param="messages", code="context_length_exceeded"),
    chat("max_tokens past the context", {"max_tokens": MAX_SEQ_LEN}, param="max_tokens",
         code="context_length_exceeded"),
    chat("unknown chat model", {"model": "other"}, status=404, param="model"),
    # the token routes (every model), and a pooling route of a generation model
    Case("tokenize prompt and messages", {"messages": [{"role": "user", "content": "x"}]},
         path=TOKENIZE),
    Case("tokenize empty messages", {"prompt": DROP, "messages": []}, param="messages",
         path=TOKENIZE),
    Case("tokenize unknown model", {"model": "other"}, status=404, param="model",
         path=TOKENIZE),
    Case("detokenize id outside the vocabulary", {"tokens": [49152]}, param="tokens",
         path=DETOKENIZE),
    Case("detokenize string ids", {"tokens": ["1"]}, param="tokens.0", path=DETOKENIZE),
    Case("embeddings of a generation model", {}, param="model", code="unsupported_task",
         path=EMBEDDINGS),
]


def test_the_table_is_large_enough():
    assert len(CASES) >= 40
    assert len({case.name for case in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_malformed_request_is_refused(http, smollm2, case):
    response = http.request(case.method, case.path, content=case.body(), headers=case.headers)
    error = assert_openai_error(response, case.status)
    if case.param is not None:
        assert error["param"] == case.param, error
    if case.code is not None:
        assert error["code"] == case.code, error
    normal = http.post(COMPLETIONS, json={"model": MODEL, "prompt": "Hi", "max_tokens": 1})
    assert normal.status_code == 200, normal.text
    wait_until_idle(smollm2)
