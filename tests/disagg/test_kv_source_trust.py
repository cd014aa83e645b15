"""Issue 31, item 1 (remote code execution on a generation server): hostile KV endpoints
answer with the audit's payload (a JSON header, then a pickle that would create a directory).
Nothing executes: the request computes its prompt itself and the server keeps serving. A
request that names an address is a 400 and the address is never contacted; a generation
server connects only to its configured sources."""
from __future__ import annotations

import pickle
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from tests.disagg.fake_kv_source import (FakeKVSource, answers_old_style, crafted_pickle,
                                         impostor)
from tllm import LLM, KvCacheConfig, SamplingParams
from tllm.disagg.importer import KVImporter, KVSource
from tllm.disagg.sources import KVSources
from tllm.config import DisaggConfig
from tllm.request import Request
from tllm.serve.context import ServerConfig
from tllm.serve.http.app import build_app
from tllm.serve.testing import ServerThread

TAKEN_ID = "7a" * 16        # the source id the taken-over context server announces
GREEDY = {"max_tokens": 8, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    markers = tmp_path_factory.mktemp("rce")
    endpoints = SimpleNamespace(
        markers=markers,
        old=FakeKVSource(answers_old_style(markers / "old")),
        taken=FakeKVSource(impostor(TAKEN_ID, markers / "taken")),
        unconfigured=FakeKVSource(answers_old_style(markers / "unconfigured")))
    yield endpoints
    for source in (endpoints.old, endpoints.taken, endpoints.unconfigured):
        source.close()


@pytest.fixture(scope="module")
def generation(tiny_model_dir, hostile):
    """A generation server whose configured sources are both hostile."""
    llm = LLM(tiny_model_dir, max_seq_len=256, kv_cache_config=KvCacheConfig(
        max_tokens=512, tokens_per_block=8), disaggregation=DisaggConfig(
            role="generation", kv_sources=(hostile.old.endpoint, hostile.taken.endpoint)))
    try:
        with ServerThread(build_app(llm, ServerConfig(model=tiny_model_dir))) as server:
            yield llm, server
    finally:
        llm.shutdown()


def _completion(server, opaque_state=None, prompt="the quick brown fox") -> httpx.Response:
    body = {"prompt": prompt, **GREEDY}
    if opaque_state is not None:
        body["disaggregated_params"] = {"request_type": "generation_only",
                                        "ctx_request_id": "ctx-1", "opaque_state": opaque_state}
    return httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)


def _no_payload_ran(hostile) -> bool:
    return not any(hostile.markers.iterdir())


def test_the_payload_is_live(tmp_path):
    """(The check the others rely on: unpickling it does create the directory.)"""
    pickle.loads(crafted_pickle(tmp_path / "ran"))   # noqa: S301 - our own test payload
    assert (tmp_path / "ran").is_dir()


def test_a_taken_over_source_runs_nothing(generation, hostile):
    llm, server = generation
    failed = llm.get_stats()["disagg_num_failed"]
    reference = _completion(server)
    answer = _completion(server, TAKEN_ID)
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["text"] == reference.json()["choices"][0]["text"]
    assert hostile.taken.num_connections >= 1 and hostile.old.num_connections >= 1
    assert llm.get_stats()["disagg_num_failed"] == failed + 1
    assert _no_payload_ran(hostile)
    assert _completion(server).status_code == 200       # and it keeps serving


@pytest.mark.parametrize("address", ["tcp://127.0.0.1:{port}", "127.0.0.1:{port}",
                                     "localhost:{port}", "http://127.0.0.1:{port}/kv"])
def test_an_address_in_the_request_is_refused(generation, hostile, address):
    _, server = generation
    answer = _completion(server, address.format(port=hostile.unconfigured.port))
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "disaggregated_params" and "address" in error["message"]
    assert hostile.unconfigured.num_connections == 0


def test_an_unknown_source_id_contacts_only_configured_sources(generation, hostile):
    llm, server = generation
    answer = _completion(server, "0" * 32)
    assert answer.status_code == 200, answer.text      # computed here
    assert hostile.unconfigured.num_connections == 0
    assert _no_payload_ran(hostile)


@pytest.mark.parametrize("transport", ["tcp", "cuda_ipc"])
def test_importer_rejects_the_payload_on_either_transport(generation, hostile, transport,
                                                         caplog):
    """The transfer thread itself (cuda_ipc's answers are parsed on a CPU too)."""
    llm, _ = generation
    submitted = threading.Event()
    importer = KVImporter(llm._engine.kv_cache, lambda request: submitted.set(),
                          lambda request_id: None, transport, 1 << 20,
                          KVSources([hostile.taken.endpoint], None, 5.0))
    request = Request("trust-1", [1, 2, 3, 4, 5], SamplingParams(max_tokens=2), 2)
    try:
        importer.submit(request, KVSource(TAKEN_ID, "ctx-1"))
        assert submitted.wait(10)
    finally:
        importer.close()
    assert request.kv_import is None and importer.stats.num_failed == 1
    reply = "TcpFetchReply" if transport == "tcp" else "IpcFetchReply"
    assert f"malformed {reply}" in caplog.text
    assert _no_payload_ran(hostile)


def test_no_pickle_in_the_kv_transfer_code():
    import tllm.disagg.wire
    for path in Path(tllm.disagg.wire.__file__).parent.glob("*.py"):
        code = path.read_text()
        assert not re.search(r"import pickle|pickle\.|marshal|torch\.load", code), path


# ---- how a generation server learns its sources and the secret (`tllm serve` flags) ----

def _disaggregation(*argv: str) -> dict:
    import argparse

    from tllm.serve.cli_args import add_serve_parser, llm_arguments
    parser = argparse.ArgumentParser(prog="tllm")
    add_serve_parser(parser.add_subparsers(dest="command", required=True))
    return llm_arguments(parser.parse_args(["serve", "m", *argv]))[1]["disaggregation"]


def test_kv_sources_and_secret_file_flags(tmp_path, monkeypatch):
    monkeypatch.setenv("TLLM_KV_SECRET", "from-env")
    (tmp_path / "secret").write_text("from-file\n")
    config = _disaggregation("--role", "generation", "--kv-sources", "ctx1:8100, ctx2:8100",
                             "--kv-secret-file", str(tmp_path / "secret"))
    assert config["kv_sources"] == ("ctx1:8100", "ctx2:8100")
    assert config["secret"].get_secret_value() == "from-file"
    assert "from-file" not in repr(config)
    assert _disaggregation("--role", "context")["secret"].get_secret_value() == "from-env"
    monkeypatch.delenv("TLLM_KV_SECRET")
    assert "secret" not in _disaggregation("--role", "context")
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(ValueError, match="--kv-secret-file: .* is empty"):
        _disaggregation("--role", "context", "--kv-secret-file", str(tmp_path / "empty"))


@pytest.mark.parametrize("config, match", [
    (dict(role="generation"), "kv_sources: a generation server needs"),
    (dict(role="generation", kv_sources=("tcp://ctx",)), "not a KV endpoint"),
    (dict(role="generation", kv_sources=("ctx:99999",)), "not a KV endpoint"),
    (dict(role="context", kv_sources=("ctx:1",)), "only a generation server"),
    (dict(role="context", secret=""), "secret: empty"),
])
def test_disaggregation_config_errors_never_show_the_secret(config, match):
    from tllm.config import LlmArgs
    config = {"secret": "hunter2", **config}
    with pytest.raises(ValueError, match=match) as error:
        LlmArgs(model="m", disaggregation=config)
    assert "hunter2" not in str(error.value)
    with pytest.raises(ValueError, match=match) as error:
        DisaggConfig(**config)
    assert "hunter2" not in str(error.value)
