"""Request fields (issue 38): unknown ones ignored and named in X-Ignored-Fields, or a 400
with --strict-request-fields; the chat template's fields (chat_template_kwargs, documents,
reasoning_effort, add_generation_prompt, continue_final_message) reach the template, which
is checked on the prompt an engine double receives."""
from __future__ import annotations

import logging

import httpx
import openai
import pytest

from tests.serve.helpers import assert_openai_error
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.openai.request_fields import MAX_NAMES_CHARS
from tllm.serve.testing import FakeLLM, ServerThread
from tllm.tokenizer import Tokenizer

COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
HI = [{"role": "user", "content": "hi"}]
BASES = {COMPLETIONS: {"model": "fake", "prompt": "hi", "max_tokens": 2},
         CHAT: {"model": "fake", "messages": HI, "max_tokens": 2},
         RESPONSES: {"model": "fake", "input": "hi", "max_output_tokens": 2}}
# Renders every variable the fields set, so the prompt shows what the template received.
TEMPLATE = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}"
            "{% if tools %}tools={{ tools | tojson }};{% endif %}"
            "{% if documents %}documents={{ documents | tojson }};{% endif %}"
            "{% if reasoning_effort is defined %}effort={{ reasoning_effort }};{% endif %}"
            "{% if enable_thinking is defined %}thinking={{ enable_thinking }};{% endif %}"
            "{% if step is defined %}next={{ step + 1 }};{% endif %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")


class RecordingLLM(FakeLLM):
    """The engine double with a real (byte-level) HF tokenizer and chat template; keeps
    each prompt it is given, as text."""

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = Tokenizer(_byte_tokenizer(TEMPLATE))
        self.prompts: list[str] = []

    def generate_async(self, inputs: dict, params, streaming: bool = False):
        self.prompts.append(self.tokenizer.decode(inputs["prompt_token_ids"]))
        return super().generate_async(inputs, params, streaming)


def _byte_tokenizer(chat_template: str):
    """An HF tokenizer of the 256 bytes (ids below 256, as the engine double wants)."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Backend(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=backend)
    hf.chat_template = chat_template
    return hf


@pytest.fixture(scope="module")
def llm():
    return RecordingLLM()


def _serve(llm, **config):
    return ServerThread(build_app(llm, ServerConfig(model="fake", **config)))


@pytest.fixture(scope="module")
def server(llm):
    with _serve(llm) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def strict_http(llm):
    with _serve(llm, strict_request_fields=True) as srv:
        with httpx.Client(base_url=srv.base_url, timeout=30) as client:
            yield client


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none", max_retries=0)


def _prompt(llm: RecordingLLM, http: httpx.Client, **fields) -> str:
    response = http.post(CHAT, json={**BASES[CHAT], **fields})
    assert response.status_code == 200, response.text
    return llm.prompts[-1]


# ---- unknown fields ----

UNKNOWN = [
    (COMPLETIONS, {"temprature": 0.5}, "temprature"),
    (CHAT, {"verbosity": "low"}, "verbosity"),
    (CHAT, {"messages": [{**HI[0], "refusal": None}]}, "messages.0.refusal"),
    (CHAT, {"stream": True, "stream_options": {"usage": True}}, "stream_options.usage"),
    (RESPONSES, {"prompt_cache_key": "k"}, "prompt_cache_key"),
]


@pytest.mark.parametrize("path,fields,name", UNKNOWN, ids=[u[2] for u in UNKNOWN])
def test_unknown_fields_are_ignored_and_named(http, caplog, path, fields, name):
    with caplog.at_level(logging.WARNING, logger="tllm.serve.openai.request_fields"):
        response = http.post(path, json={**BASES[path], **fields})
    assert response.status_code == 200, response.text
    assert response.headers["x-ignored-fields"] == name
    assert any(name in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("path,fields,name", UNKNOWN, ids=[u[2] for u in UNKNOWN])
def test_strict_server_refuses_them(strict_http, path, fields, name):
    response = strict_http.post(path, json={**BASES[path], **fields})
    error = assert_openai_error(response, 400)
    assert error["param"] == name and "unrecognized request argument" in error["message"]
    assert strict_http.post(path, json=BASES[path]).status_code == 200


def test_known_fields_carry_no_header(http):
    response = http.post(CHAT, json=BASES[CHAT])
    assert response.status_code == 200
    assert "x-ignored-fields" not in response.headers


def test_header_names_are_encoded_and_cut(http):
    fields = {"a\nb: c": 1, "": 2, **{f"field_{i:04}": i for i in range(500)}}
    response = http.post(COMPLETIONS, json={**BASES[COMPLETIONS], **fields})
    assert response.status_code == 200, response.text
    header = response.headers["x-ignored-fields"]
    assert header.startswith('a%0Ab%3A%20c, "", field_0000, ') and header.endswith(" more)")
    assert len(header) <= MAX_NAMES_CHARS + 20


def test_an_ignored_nested_field_never_reaches_the_template(llm, http):
    tool = {"type": "function", "function": {"name": "f", "secret_extra": "zzz"}}
    prompt = _prompt(llm, http, tools=[tool])
    assert '"name": "f"' in prompt and "zzz" not in prompt


# ---- the chat template's fields ----

def test_chat_template_kwargs_through_the_openai_client(llm, client):
    client.chat.completions.create(model="fake", messages=HI, max_tokens=2,
                                   extra_body={"chat_template_kwargs": {
                                       "enable_thinking": False}})
    assert llm.prompts[-1] == "<user>hi</user>thinking=False;<assistant>"


def test_documents_and_reasoning_effort(llm, client):
    client.chat.completions.create(model="fake", messages=HI, max_tokens=2,
                                   reasoning_effort="low",
                                   extra_body={"documents": [{"title": "t", "text": "x"}]})
    assert llm.prompts[-1] == ('<user>hi</user>documents=[{"title": "t", "text": "x"}];'
                               "effort=low;<assistant>")


def test_no_generation_prompt(llm, http):
    assert _prompt(llm, http, add_generation_prompt=False) == "<user>hi</user>"


def test_continue_final_message(llm, http):
    messages = [*HI, {"role": "assistant", "content": "Once upon"}]
    prompt = _prompt(llm, http, messages=messages, add_generation_prompt=False,
                     continue_final_message=True)
    assert prompt == "<user>hi</user><assistant>Once upon"


def test_chat_template_kwargs_over_the_fields(llm, http):
    prompt = _prompt(llm, http, reasoning_effort="low",
                     chat_template_kwargs={"reasoning_effort": "high", "step": 1})
    assert prompt == "<user>hi</user>effort=high;next=2;<assistant>"


REFUSED = [
    ("continue with a generation prompt", {"continue_final_message": True},
     "continue_final_message"),
    ("the same through the kwargs", {"chat_template_kwargs": {"continue_final_message": True}},
     "continue_final_message"),
    ("a template of the client's", {"chat_template_kwargs": {"chat_template": "{{ 1 }}"}},
     "chat_template_kwargs"),
    ("tokenize", {"chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("a clash with messages", {"chat_template_kwargs": {"messages": []}},
     "chat_template_kwargs"),
    ("a variable the template cannot add to", {"chat_template_kwargs": {"step": "a"}},
     "messages"),
    ("kwargs not an object", {"chat_template_kwargs": ["enable_thinking"]},
     "chat_template_kwargs"),
    ("unknown reasoning effort", {"reasoning_effort": "extreme"}, "reasoning_effort"),
    ("documents not objects", {"documents": ["text"]}, "documents.0"),
]


@pytest.mark.parametrize("fields,param", [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused_with_a_400_naming_the_field(http, fields, param):
    error = assert_openai_error(http.post(CHAT, json={**BASES[CHAT], **fields}), 400)
    assert error["param"] == param, error
