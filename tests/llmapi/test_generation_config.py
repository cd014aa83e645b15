"""generation_config (vLLM's --generation-config auto|vllm|PATH): the model's
generation_config.json gives the default temperature, top_p, top_k, min_p and
repetition_penalty of calls and requests that do not set them; `vllm` ignores it; the
start-up log names what was taken; a broken file or setting is a ValueError naming it."""
from __future__ import annotations

import json
import logging
import shutil

import pytest

from tests.conftest import make_tiny_model
from tllm import LLM, SamplingParams
from tllm.llmapi.cli_args import llm_kwargs
from tllm.loader.generation_config import config_file, sampling_defaults
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.openai.params import sampling_params
from tllm.serve.openai.protocol import CompletionRequest
from tllm.serve.testing import FakeLLM, ServerThread

RECOMMENDED = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "min_p": 0.05,
               "repetition_penalty": 1.1}
KWARGS = dict(max_seq_len=64, max_batch_size=2, max_num_tokens=64)
PROMPT = {"prompt_token_ids": [1, 5, 9, 200]}


def write_config(folder, **values) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "eos_token_id": [2, 3], "do_sample": True, "max_new_tokens": 9,
         **values}))


def test_auto_reads_the_model_folder_and_vllm_ignores_it(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tllm.loader.generation_config")
    write_config(tmp_path, **RECOMMENDED)
    assert sampling_defaults("auto", tmp_path) == RECOMMENDED   # no EOS, no max_new_tokens
    assert "temperature=0.6, top_p=0.9, top_k=20" in caplog.text
    assert sampling_defaults("vllm", tmp_path) == {}
    assert sampling_defaults("auto", None) == {}     # a GGUF file or random weights
    assert sampling_defaults("auto", tmp_path / "elsewhere") == {}


def test_a_path_names_a_folder_or_the_file(tmp_path):
    write_config(tmp_path / "other", temperature=0.3)
    assert sampling_defaults(str(tmp_path / "other"), None) == {"temperature": 0.3}
    file = tmp_path / "other" / "generation_config.json"
    assert config_file(str(file), tmp_path) == file
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no generation_config.json there"):
        sampling_defaults(str(tmp_path / "empty"), None)


@pytest.mark.parametrize("text,message", [
    ("{not json", "not readable JSON"),
    ('{"temperature": "hot"}', "temperature must be a number"),
    ('{"temperature": -1}', "temperature"),
    ('{"top_p": 1.5}', "top_p"),
])
def test_a_broken_file_is_an_error_naming_it(tmp_path, text, message):
    (tmp_path / "generation_config.json").write_text(text)
    with pytest.raises(ValueError, match=message) as info:
        sampling_defaults("auto", tmp_path)
    assert "generation_config.json" in str(info.value) and "vllm" in str(info.value)


def test_a_setting_that_is_no_path_is_refused():
    with pytest.raises(ValueError, match="generation_config must be 'auto', 'vllm'"):
        LLM("dummy:smollm2-135m", generation_config="/no/such/folder")


def test_the_flag_reaches_the_llm_arguments():
    import argparse
    from tllm.llmapi.cli_args import add_engine_args
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = parser.parse_args(["--generation-config", "vllm"])
    assert llm_kwargs(args)["generation_config"] == "vllm"


def test_requests_without_the_fields_get_the_model_defaults():
    body = CompletionRequest(model="m", prompt="hi")
    params = sampling_params(body, 4, defaults=RECOMMENDED)
    assert (params.temperature, params.top_p, params.top_k, params.min_p,
            params.repetition_penalty) == (0.6, 0.9, 20, 0.05, 1.1)
    own = sampling_params(CompletionRequest(model="m", prompt="hi", temperature=0, top_k=-1),
                          4, defaults=RECOMMENDED)
    assert (own.temperature, own.top_k, own.top_p) == (0.0, -1, 0.9)
    plain = sampling_params(body, 4)
    assert (plain.temperature, plain.top_k, plain.top_p) == (1.0, -1, 1.0)
    beams = sampling_params(CompletionRequest(model="m", prompt="hi", use_beam_search=True,
                                              best_of=2, n=2), 4, defaults=RECOMMENDED)
    assert beams.temperature == 0.0


def test_the_server_applies_the_engine_defaults():
    llm = FakeLLM()
    llm.sampling_defaults = {"temperature": 0.6, "top_p": 0.9}
    submitted: list[SamplingParams] = []
    generate = llm.generate_async
    llm.generate_async = lambda inputs, params, streaming=False: (
        submitted.append(params) or generate(inputs, params, streaming))
    with ServerThread(build_app(llm, ServerConfig(model="fake"))) as server:
        import httpx
        with httpx.Client(base_url=server.base_url, timeout=10) as http:
            for path, body in (("/v1/completions", {"prompt": "hi"}),
                               ("/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hi"}],
                                 "top_p": 0.5})):
                response = http.post(path, json={"model": "fake", "max_tokens": 2, **body})
                assert response.status_code == 200, response.text
    assert [(p.temperature, p.top_p) for p in submitted] == [(0.6, 0.9), (0.6, 0.5)]


@pytest.fixture(scope="module")
def recommending_model(tmp_path_factory):
    """A tiny random Llama whose generation_config.json asks for top_k 1 (greedy whatever
    the temperature)."""
    path = tmp_path_factory.mktemp("recommending")
    make_tiny_model("Llama", path)
    write_config(path, temperature=0.7, top_k=1)
    return path


def test_generate_without_params_takes_the_model_defaults(recommending_model, caplog):
    caplog.set_level(logging.INFO, logger="tllm.loader.generation_config")
    greedy = SamplingParams(temperature=0.0)
    with LLM(str(recommending_model), **KWARGS) as llm:
        assert llm.sampling_defaults == {"temperature": 0.7, "top_k": 1}
        assert "temperature=0.7, top_k=1" in caplog.text
        default = llm.get_default_sampling_params()
        assert (default.temperature, default.top_k, default.max_tokens) == (0.7, 1, 32)
        assert (llm.generate(PROMPT, use_tqdm=False).outputs[0].token_ids
                == llm.generate(PROMPT, greedy, use_tqdm=False).outputs[0].token_ids)


def test_vllm_keeps_tllms_defaults(recommending_model, tmp_path):
    with LLM(str(recommending_model), generation_config="vllm", **KWARGS) as llm:
        assert llm.sampling_defaults == {}
        assert llm.get_default_sampling_params() == SamplingParams()
    other = tmp_path / "other"
    shutil.copytree(recommending_model, other)
    write_config(other, repetition_penalty=1.2)
    with LLM(str(recommending_model), generation_config=str(other), **KWARGS) as llm:
        assert llm.sampling_defaults == {"repetition_penalty": 1.2}


def test_the_cli_takes_its_flags_over_the_model_over_greedy():
    import argparse
    import types
    from tllm.cli import _sampling_params
    args = argparse.Namespace(max_tokens=4, seed=None, temperature=None, top_k=None, top_p=0.5)
    llm = types.SimpleNamespace(sampling_defaults={"temperature": 0.6, "top_p": 0.9})
    params = _sampling_params(args, llm)
    assert (params.temperature, params.top_k, params.top_p) == (0.6, -1, 0.5)
    llm.sampling_defaults = {}
    assert _sampling_params(args, llm).temperature == 0.0
