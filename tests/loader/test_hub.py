"""Hub ids ("org/name") resolve through a local Hugging Face cache, offline: the same model as
its folder, the tokenizer from the same snapshot, a revision picks its snapshot, a missing id
says where it looked and why it could not download."""
from __future__ import annotations

import shutil

import pytest

from tests.conftest import make_tiny_model
from tllm import LLM, KvCacheConfig, SamplingParams
from tllm.loader import CheckpointError, resolve_model
from tllm.loader.hub import looks_like_hub_id

REPO = "tiny-org/tiny-llama"
MAIN = "a" * 40  # snapshot folders are named by commit hash
V2 = "b" * 40
KV = KvCacheConfig(max_tokens=256)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0)
PROMPT = [5, 17, 42, 7]


def _save_tokenizer(path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", "hello", "world"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>",
                            pad_token="<pad>", unk_token="<unk>").save_pretrained(path)


@pytest.fixture(scope="module")
def hub_cache(tiny_llama, tmp_path_factory):
    """An HF cache holding REPO: main -> the tiny Llama (with a tokenizer), tag v2 -> another
    seed's weights."""
    cache = tmp_path_factory.mktemp("hf_cache")
    repo = cache / f"models--{REPO.replace('/', '--')}"
    main = repo / "snapshots" / MAIN
    shutil.copytree(tiny_llama[0], main)
    _save_tokenizer(main)
    make_tiny_model("Llama", repo / "snapshots" / V2, seed=1)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    (repo / "refs" / "v2").write_text(V2)
    return cache


@pytest.fixture
def offline_cache(hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub_cache


def _greedy(model: str, **kwargs) -> list[int]:
    with LLM(model, kv_cache_config=KV, max_seq_len=64, **kwargs) as llm:
        output = llm.generate(PROMPT, GREEDY, use_tqdm=False)
        return output.outputs[0].token_ids


@pytest.mark.parametrize("model, is_id", [
    ("Qwen/Qwen2.5-0.5B-Instruct", True), ("org/name.v1_x", True), ("smollm2", False),
    ("dummy:llama-3.1-8b", False), ("a/b/c", False), ("./m", False), ("/abs/path", False)])
def test_what_looks_like_a_hub_id(model, is_id):
    assert looks_like_hub_id(model) is is_id


def test_hub_id_generates_as_its_folder(offline_cache, tiny_llama):
    assert resolve_model(REPO).path == offline_cache / "models--tiny-org--tiny-llama" / \
        "snapshots" / MAIN
    with LLM(REPO, kv_cache_config=KV, max_seq_len=64) as llm:
        hub_tokens = llm.generate(PROMPT, GREEDY, use_tqdm=False).outputs[0].token_ids
        # the tokenizer comes from the same snapshot (the local folder has none)
        assert llm.tokenizer is not None
        assert llm.tokenizer.encode("hello world", add_special_tokens=False) == [4, 5]
    assert hub_tokens == _greedy(str(tiny_llama[0]))


def test_engine_process_resolves_the_id(offline_cache, tiny_llama):
    """ProcessLLM (what `tllm serve` runs): the engine process resolves the id too."""
    import asyncio

    from tllm.llmapi.process_llm import ProcessLLM
    llm = ProcessLLM(REPO, kv_cache_config=KV, max_seq_len=64)
    try:
        assert llm.tokenizer is not None
        output = asyncio.run(_complete(llm, PROMPT))
        assert output.outputs[0].token_ids == _greedy(str(tiny_llama[0]))
    finally:
        llm.shutdown()


async def _complete(llm, prompt: list[int]):
    [result] = await llm.submit_batch([{"prompt_token_ids": prompt}], [GREEDY])
    return await result


def test_revision_picks_its_snapshot(offline_cache):
    assert resolve_model(REPO, revision="v2").path.name == V2
    assert resolve_model(REPO, revision=V2).path.name == V2
    assert _greedy(REPO, revision="v2") != _greedy(REPO)


def test_download_dir_is_the_cache_searched(hub_cache, monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))  # empty: only download_dir has it
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(REPO, download_dir=str(hub_cache)).path.name == MAIN


def test_missing_id_offline_names_id_and_cache(offline_cache):
    with pytest.raises(CheckpointError) as info:
        LLM("tiny-org/no-such-model", kv_cache_config=KV)
    message = str(info.value)
    assert "tiny-org/no-such-model" in message and str(offline_cache) in message
    assert "offline" in message


def test_missing_revision_offline(offline_cache):
    with pytest.raises(CheckpointError, match="revision 'nope'.*offline"):
        resolve_model(REPO, revision="nope")


def test_incomplete_snapshot_offline(offline_cache, tmp_path, monkeypatch):
    repo = tmp_path / "models--tiny-org--partial"
    (repo / "snapshots" / MAIN).mkdir(parents=True)
    (repo / "snapshots" / MAIN / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(CheckpointError, match="lacks weight files.*offline"):
        resolve_model("tiny-org/partial")


def test_unreachable_hub_says_so(tmp_path, monkeypatch):
    """Online but no route to the hub: huggingface_hub's connection error, reported."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_OFFLINE", False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # discard port: refused at once
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")
    with pytest.raises(CheckpointError, match="tiny-org/absent.*could not be reached"):
        resolve_model("tiny-org/absent")


def test_local_paths_and_builtins_unchanged(tiny_llama):
    assert resolve_model(str(tiny_llama[0])).kind == "hf"
    assert resolve_model("dummy:smollm2-135m").kind == "dummy"
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve_model("/no/such/model")
