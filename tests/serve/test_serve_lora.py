"""LoRA adapters over HTTP: --lora-modules listed by /v1/models (parent: the base model) and
routed by "model"; POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies)
behind the API key; unknown names 404, bad folders 400, nothing else breaks."""
from __future__ import annotations

import httpx
import pytest

pytest.importorskip("peft")

from tests.lora.adapters import hf_greedy, make_adapter  # noqa: E402
from tests.serve.helpers import assert_openai_error, wait_until_idle  # noqa: E402
from tllm import LLM, KvCacheConfig  # noqa: E402
from tllm.serve.context import ServerConfig  # noqa: E402
from tllm.serve.lora import parse_lora_modules  # noqa: E402
from tllm.serve.openai_server import build_app  # noqa: E402
from tllm.serve.testing import ServerThread  # noqa: E402

PROMPT = [5, 17, 33, 2, 90, 41, 7]
NUM_NEW = 6
KEY = "secret"
AUTH = {"Authorization": f"Bearer {KEY}"}


@pytest.fixture(scope="module")
def folders(tiny_llama, tmp_path_factory):
    """Two adapters (folder, PeftModel) and a folder whose rank is too high."""
    _, base = tiny_llama
    root = tmp_path_factory.mktemp("serve_adapters")
    one = make_adapter(base, root / "one", ["q_proj", "v_proj"], rank=4, alpha=8, seed=5)
    two = make_adapter(base, root / "two", ["o_proj", "down_proj"], rank=8, alpha=8, seed=6)
    make_adapter(base, root / "big", ["q_proj"], rank=32, alpha=8, seed=7)
    return {"one": (root / "one", one), "two": (root / "two", two), "big": (root / "big", None)}


@pytest.fixture(scope="module")
def server(tiny_llama, folders):
    llm = LLM(str(tiny_llama[0]), max_num_tokens=32, max_batch_size=4, max_seq_len=128,
              enable_lora=True, max_loras=2, max_lora_rank=8,
              kv_cache_config=KvCacheConfig(tokens_per_block=4, max_tokens=1024))
    config = ServerConfig(model="tiny", api_key=KEY,
                          lora_modules=(("one", str(folders["one"][0])),))
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


def test_models_lists_the_adapters_with_their_parent(http, folders):
    data = http.get("/v1/models").json()["data"]
    assert [(m["id"], m.get("parent")) for m in data] == [("tiny", None), ("one", "tiny")]
    assert data[1]["root"] == str(folders["one"][0])


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


def test_bad_folders_are_400_and_nothing_breaks(http, folders, tmp_path):
    big = http.post("/v1/load_lora_adapter",
                    json={"lora_name": "big", "lora_path": str(folders["big"][0])})
    assert "max_lora_rank" in assert_openai_error(big, 400)["message"]
    nowhere = http.post("/v1/load_lora_adapter",
                        json={"lora_name": "x", "lora_path": str(tmp_path / "none")})
    assert "adapter_config.json" in assert_openai_error(nowhere, 400)["message"]
    assert_openai_error(http.post("/v1/load_lora_adapter", json={"lora_name": "x"}), 400)
    assert token_ids(complete(http, "one")) == hf_greedy(folders["one"][1], PROMPT, NUM_NEW)


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
