"""Model loading: each kind of bad model path gives one clear error; GGUF row order; dummy."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.conftest import make_tiny_model
from tllm import LLM, KvCacheConfig, SamplingParams
from tllm.loader import CheckpointError
from tllm.loader.gguf import unpermute_rows

KV = KvCacheConfig(max_tokens=256)


def test_missing_path():
    with pytest.raises(CheckpointError, match="does not exist"):
        LLM("/no/such/model", kv_cache_config=KV)


def test_directory_without_config(tmp_path):
    with pytest.raises(CheckpointError, match="config.json"):
        LLM(str(tmp_path), kv_cache_config=KV)


def test_unknown_architecture(tiny_llama, tmp_path):
    shutil.copytree(tiny_llama[0], tmp_path / "m")
    config_file = tmp_path / "m" / "config.json"
    config = json.loads(config_file.read_text())
    config["architectures"] = ["FooForCausalLM"]
    config_file.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="unsupported model architecture 'FooForCausalLM'"):
        LLM(str(tmp_path / "m"), kv_cache_config=KV)


def test_corrupt_weights(tiny_llama, tmp_path):
    shutil.copytree(tiny_llama[0], tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(CheckpointError, match="corrupt"):
        LLM(str(tmp_path / "m"), kv_cache_config=KV)


def test_missing_weights(tmp_path):
    from safetensors.torch import load_file, save_file
    make_tiny_model("Llama", tmp_path)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(CheckpointError, match="lacks 1 weights"):
        LLM(str(tmp_path), kv_cache_config=KV)


def test_sharded_checkpoint_loads(tmp_path):
    model = make_tiny_model("Llama", tmp_path / "one")
    model.save_pretrained(tmp_path / "sharded", max_shard_size="100KB")
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    ids = [4, 8, 15, 16, 23, 42]
    with LLM(str(tmp_path / "sharded"), kv_cache_config=KV) as llm:
        out = llm.generate(ids, SamplingParams(temperature=0), use_tqdm=False)
    ref = model.generate(torch.tensor([ids]), max_new_tokens=len(out.outputs[0].token_ids),
                         do_sample=False, pad_token_id=0)
    assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()


def test_pytorch_bin_checkpoint_loads(tiny_llama, tmp_path):
    """An older checkpoint without safetensors: its pytorch_model.bin (weights_only)."""
    from safetensors.torch import load_file
    shutil.copytree(tiny_llama[0], tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    torch.save(load_file(weights), tmp_path / "m" / "pytorch_model.bin")
    weights.unlink()
    ids = [4, 8, 15, 16, 23, 42]
    with LLM(str(tmp_path / "m"), kv_cache_config=KV) as llm:
        out = llm.generate(ids, SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    ref = tiny_llama[1].generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                 pad_token_id=0)
    assert out.outputs[0].token_ids == ref[0, len(ids):].tolist()


def test_unpermute_undoes_llama_cpp_permutation():
    n_head, head_dim, cols = 3, 8, 5
    w = torch.randn(n_head * head_dim, cols)
    # llama.cpp's convert script interleaves the two rotary halves of every head
    permuted = (w.reshape(n_head, 2, head_dim // 2, cols).swapaxes(1, 2)
                .reshape(n_head * head_dim, cols))
    assert torch.equal(unpermute_rows(permuted, n_head), w)


def test_dummy_preset_and_unknown_preset():
    with pytest.raises(ValueError, match="unknown dummy preset"):
        LLM("dummy:nope", kv_cache_config=KV)
    with LLM("dummy:smollm2-135m", kv_cache_config=KV) as llm:
        out = llm.generate([1, 2, 3], use_tqdm=False)
    assert len(out.outputs[0].token_ids) > 0
