"""Shared fixtures: tiny random HF models saved to disk (the reference for parity tests)."""
from __future__ import annotations

import os
import zlib

import pytest
import torch

TINY = dict(vocab_size=384, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            initializer_range=0.1, eos_token_id=2, bos_token_id=1, pad_token_id=0)


def _tiny_config(arch: str):
    import transformers
    extra = {"Qwen3": {"head_dim": 16}, "Mistral": {"sliding_window": None}}.get(arch, {})
    config_cls = getattr(transformers, f"{arch}Config")
    return config_cls(**TINY, **extra, architectures=[f"{arch}ForCausalLM"])


def make_tiny_model(arch: str, path, seed: int = 0):
    """Save a random HF model of the given family ("Llama", "Mistral", "Qwen2", "Qwen3")."""
    import transformers
    torch.manual_seed(seed)
    model = getattr(transformers, f"{arch}ForCausalLM")(_tiny_config(arch)).eval()
    model.save_pretrained(path)
    return model


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    """(directory, HF model) of a tiny random Llama."""
    path = tmp_path_factory.mktemp("tiny_llama")
    return path, make_tiny_model("Llama", path)


# one thread a worker when pytest-xdist runs two (the 2 cores are shared), else two
TORCH_THREADS = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


@pytest.fixture(autouse=True)
def _torch_threads():
    torch.set_num_threads(TORCH_THREADS)


@pytest.fixture(autouse=True)
def _seed_per_test(request):
    """Each test's random inputs depend on its own id, not on which tests ran before it in
    its worker (run serially, the order fixed them; under xdist it varies)."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
