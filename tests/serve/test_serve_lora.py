"""LoRA adapters over HTTP: --lora-modules listed by /v1/models (parent: the base model, no
server path) and routed by "model", answers naming the model asked for; POST
/v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies) behind the API key, loading
only from --lora-modules folders and --lora-allowed-paths (403 elsewhere, links and ".."
resolved); unknown names 404, bad folders (a pickled .bin, a missing layer, wrong shapes) 400
at load, nothing else breaks."""
from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch

pytest.importorskip("peft")

from tests.lora.adapters import hf_greedy, make_adapter  # noqa: E402
from tests.serve.helpers import assert_openai_error, wait_until_idle  # noqa: E402
from tllm import LLM, KvCacheConfig  # noqa: E402
from tllm.serve.context import ServerConfig  # noqa: E402
from tllm.serve.lora import parse_lora_modules  # noqa: E402
from tllm.serve.http.app import build_app  # noqa: E402
from tllm.serve.testing import FakeLLM, ServerThread  # noqa: E402

PROMPT = [5, 17, 33, 2, 90, 41, 7]
NUM_NEW = 6
KEY = "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def folders(tiny_llama, tmp_path_factory):
    """Adapters under an allowed root: two good ones (folder, PeftModel), one whose rank is
    too high, and one outside the root (with a link to it from inside)."""
    _, base = tiny_llama
    root = tmp_path_factory.mktemp("serve_adapters")
    one = make_adapter(base, root / "one", ["q_proj", "v_proj"], rank=4, alpha=8, seed=5)
    two = make_adapter(base, root / "two", ["o_proj", "down_proj"], rank=8, alpha=8, seed=6)
    make_adapter(base, root / "big", ["q_proj"], rank=32, alpha=8, seed=7)
    outside = tmp_path_factory.mktemp("outside") / "adapter"
    shutil.copytree(root / "two", outside)
    (root / "link").symlink_to(outside, target_is_directory=True)
    return {"root": root, "one": (root / "one", one), "two": (root / "two", two),
            "big": (root / "big", None), "outside": (outside, None)}


@pytest.fixture(scope="module")
def server(tiny_llama, folders):
    llm = LLM(str(tiny_llama[0]), max_num_tokens=32, max_batch_size=4, max_seq_len=128,
              enable_lora=True, max_loras=2, max_lora_rank=8,
              kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024))
    config = ServerConfig(model="tiny", api_key=KEY,
                          lora_modules=(("one", str(folders["one"][0])),),
                          lora_allowed_paths=(str(folders["root"]),))
    try:
        with ServerThread(build_app(llm, config)) as srv:
            srv.llm = llm
            yield srv
    finally:
        llm.shutdown()


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60, headers=AUTH) as client:
        yield client
    wait_until_idle(server.llm)
    assert server.llm._engine.lora.num_active_slots == 0


def complete(http, model: str) -> httpx.Response:
    return http.post("/v1/completions", json={"model": model, "prompt": PROMPT,
                                              "max_tokens": NUM_NEW, "temperature": 0,
                                              "logprobs": 0})


def token_ids(response: httpx.Response) -> list[int]:
    assert response.status_code == 200, response.text
    tokens = response.json()["choices"][0]["logprobs"]["tokens"]
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_models_lists_the_adapters_with_their_parent_and_no_path(http, folders, tiny_llama):
    response = http.get("/v1/models")
    data = response.json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [("tiny", None), ("one", "tiny")]
    assert [m["root"] for m in data] == ["tiny", "one"]
    assert str(folders["root"]) not in response.text and str(tiny_llama[0]) not in response.text


def test_answers_name_the_model_asked_for(http):
    assert complete(http, "one").json()["model"] == "one"
    assert complete(http, "tiny").json()["model"] == "tiny"
    body = {"model": "one", "prompt": PROMPT, "max_tokens": 2, "stream": True,
            "stream_options": {"include_usage": True}}
    with http.stream("POST", "/v1/completions", json=body) as stream:
        chunks = [json.loads(line[6:]) for line in stream.iter_lines()
                  if line.startswith("data: {")]
    assert len(chunks) >= 2 and {c["model"] for c in chunks} == {"one"}
    del body["model"]  # no "model": the base's name
    assert http.post("/v1/completions", json={**body, "stream": False,
                                              "stream_options": None}).json()["model"] == "tiny"


def test_chat_and_responses_name_the_adapter(server, folders):
    """Chat and the Responses API (the tiny model has no tokenizer: the engine double, with
    the real engine's LoRA targets) answer with the adapter's name."""
    fake = FakeLLM()
    fake.lora_targets = server.llm.lora_targets
    config = ServerConfig(model="fake", lora_modules=(("one", str(folders["one"][0])),))
    with ServerThread(build_app(fake, config)) as srv, \
            httpx.Client(base_url=srv.base_url, timeout=30) as client:
        chat = client.post("/v1/chat/completions", json={
            "model": "one", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert chat.status_code == 200 and chat.json()["model"] == "one", chat.text
        answer = client.post("/v1/responses", json={"model": "one", "input": "hi",
                                                    "max_output_tokens": 2})
        assert answer.status_code == 200 and answer.json()["model"] == "one", answer.text


def test_model_name_routes_to_the_adapter(http, tiny_llama, folders):
    _, base = tiny_llama
    assert token_ids(complete(http, "one")) == hf_greedy(folders["one"][1], PROMPT, NUM_NEW)
    assert token_ids(complete(http, "tiny")) == hf_greedy(base, PROMPT, NUM_NEW)
    chat = http.post("/v1/chat/completions", json={
        "model": "one", "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400  # routed; the tiny model has no tokenizer for chat


def test_unknown_model_is_404(http):
    error = assert_openai_error(complete(http, "nope"), 404)
    assert error["param"] == "model" and error["code"] == "model_not_found"


def test_load_route_unload(http, folders):
    path = str(folders["two"][0])
    response = http.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": path})
    assert response.status_code == 200, response.text
    assert "two" in [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert token_ids(complete(http, "two")) == hf_greedy(folders["two"][1], PROMPT, NUM_NEW)
    again = http.post("/v1/load_lora_adapter", json={"lora_name": "two", "lora_path": path})
    assert "already been loaded" in assert_openai_error(again, 400)["message"]
    assert http.post("/v1/unload_lora_adapter", json={"lora_name": "two"}).status_code == 200
    assert_openai_error(complete(http, "two"), 404)
    missing = http.post("/v1/unload_lora_adapter", json={"lora_name": "two"})
    assert_openai_error(missing, 404)


def load(http, name: str, path) -> httpx.Response:
    return http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})


def test_bad_folders_are_400_and_nothing_breaks(http, folders):
    big = load(http, "big", folders["big"][0])
    assert "max_lora_rank" in assert_openai_error(big, 400)["message"]
    nowhere = load(http, "x", folders["root"] / "none")
    assert "adapter_config.json" in assert_openai_error(nowhere, 400)["message"]
    assert_openai_error(http.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400)
    assert token_ids(complete(http, "one")) == hf_greedy(folders["one"][1], PROMPT, NUM_NEW)


class _RunsOpen:
    """A pickle that would create a file when loaded (weights_only must refuse it)."""

    def __init__(self, path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _broken_copy(folders, name: str, weights_file: str, make) -> object:
    """Adapter "one" copied under the allowed root, its weights replaced by what `make`
    returns from them, saved as safetensors or (torch.save) as adapter_model.bin."""
    from safetensors.torch import load_file, save_file
    path = folders["root"] / "bad" / name
    shutil.rmtree(path, ignore_errors=True)
    shutil.copytree(folders["one"][0], path)
    weights = make(load_file(path / "adapter_model.safetensors"))
    if weights_file == "bin":
        (path / "adapter_model.safetensors").unlink()
        torch.save(weights, path / "adapter_model.bin")
    else:
        save_file(weights, path / "adapter_model.safetensors")
    return path


def _renamed(weights, old: str, new: str) -> dict:
    return {k.replace(old, new): v for k, v in weights.items()}


def _replaced(weights, part: str, shape: tuple[int, ...]) -> dict:
    return {k: torch.randn(shape) if part in k else v for k, v in weights.items()}


MARKER = "pickle_ran"
BAD_ADAPTERS = {  # name: (weights file, its weights from adapter "one"'s, the 400 says)
    "pickled code": ("bin", lambda w: {**w, "x": _RunsOpen(MARKER)}, "weights_only"),
    "pickled list": ("bin", lambda w: list(w.values()), "plain state dict"),
    "missing layer": ("safetensors", lambda w: _renamed(w, "layers.1.", "layers.7."),
                      "no projection 'layers.7.self_attn.q_proj'"),
    "missing projection": ("safetensors", lambda w: _renamed(w, "self_attn.v_", "mlp.v_"),
                           "no projection 'layers.0.mlp.v_proj'"),
    "wrong out_features": ("safetensors", lambda w: _replaced(w, "q_proj.lora_B", (68, 4)),
                           "the model needs (4, 64) and (64, 4)"),
    "wrong in_features": ("safetensors", lambda w: _replaced(w, "v_proj.lora_A", (4, 60)),
                          "(in_features 64, out_features 32)"),
    "rank 0": ("safetensors", lambda w: {k: v[:0] if "lora_A" in k else v[:, :0]
                                         for k, v in w.items()}, "r >= 1"),
    "integer weights": ("safetensors", lambda w: {k: v.to(torch.int32) for k, v in w.items()},
                        "floating-point"),
}


@pytest.mark.parametrize("case", list(BAD_ADAPTERS))
def test_bad_adapters_are_refused_at_load_with_a_400(http, folders, monkeypatch, tmp_path,
                                                     case):
    """What would fail every request once loaded is a 400 naming it at load; the .bin pickle
    runs nothing (the server's working directory is where it would write)."""
    weights_file, make, message = BAD_ADAPTERS[case]
    path = _broken_copy(folders, case.replace(" ", "_"), weights_file, make)
    monkeypatch.chdir(tmp_path)
    error = assert_openai_error(load(http, "bad", path), 400)
    assert message in error["message"] and error["param"] == "lora_path"
    assert not (tmp_path / MARKER).exists()
    assert_openai_error(complete(http, "bad"), 404)  # not registered
    assert token_ids(complete(http, "one")) == hf_greedy(folders["one"][1], PROMPT, NUM_NEW)


def test_a_plain_bin_adapter_still_loads(http, folders):
    path = _broken_copy(folders, "plain_bin", "bin", dict)
    assert load(http, "bin", path).status_code == 200
    try:
        assert token_ids(complete(http, "bin")) == hf_greedy(folders["one"][1], PROMPT,
                                                             NUM_NEW)
    finally:
        http.post("/v1/unload_lora_adapter", json={"lora_name": "bin"})


@pytest.mark.parametrize("where", ["outside", "dot-dot", "link", "root's parent", "relative"])
def test_paths_outside_the_allowed_folders_are_403(http, folders, where):
    root, outside = folders["root"], folders["outside"][0]
    path = {"outside": outside, "dot-dot": root / ".." / outside.parent.name / outside.name,
            "link": root / "link", "root's parent": root.parent, "relative": "adapter"}[where]
    error = assert_openai_error(load(http, "evil", path), 403)
    assert error["code"] == "lora_path_not_allowed" and error["type"] == "permission_error"
    shown = error["message"].replace(str(path), "<path>")  # the client's own path, and no other
    assert "--lora-allowed-paths" in shown and str(root) not in shown and "/" not in shown
    assert_openai_error(complete(http, "evil"), 404)


def test_a_null_byte_in_the_path_is_a_400(http):
    assert_openai_error(load(http, "x", "/tmp/a\x00b"), 400)


def test_a_bad_lora_module_stops_the_start(server, folders):
    path = _broken_copy(folders, "start", "safetensors",
                        lambda w: _renamed(w, "layers.1.", "layers.9."))
    config = ServerConfig(model="tiny", lora_modules=(("bad", str(path)),))
    with pytest.raises(ValueError, match="layers.9"):
        build_app(server.llm, config)


def test_lora_routes_need_the_api_key(server, folders):
    with httpx.Client(base_url=server.base_url, timeout=30) as anonymous:
        response = anonymous.post("/v1/load_lora_adapter", json={
            "lora_name": "two", "lora_path": str(folders["two"][0])})
        assert_openai_error(response, 401)


def test_lora_modules_flag_parses_name_path_pairs():
    assert parse_lora_modules(["a=/x", "b=/y=z"]) == (("a", "/x"), ("b", "/y=z"))
    with pytest.raises(ValueError, match="name=path"):
        parse_lora_modules(["nopath"])


def test_lora_modules_without_enable_lora_refuse_to_start(tiny_llama, folders):
    with LLM(str(tiny_llama[0]), max_num_tokens=16, max_batch_size=2, max_seq_len=64,
             kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=256)) as llm:
        config = ServerConfig(model="tiny", lora_modules=(("one", str(folders["one"][0])),))
        with pytest.raises(ValueError, match="--enable-lora"):
            build_app(llm, config)
