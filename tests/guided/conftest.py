"""A tiny random Llama with a byte-level BPE tokenizer (xgrammar needs token strings), one
LLM over it for the module, and a fast check that an output is a valid JSON prefix."""
from __future__ import annotations

import pytest

CORPUS = ['{"name": "ada", "age": 36, "tags": ["a", "b"]}', "[1, 2.5, -3e2, true, null]",
          '{"items": [{"id": 1}, {"id": 2}], "ok": false}', "hello world 0123456789",
          "the quick brown fox jumps over the lazy dog"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tllm.visual_gen.models.qwen_image.components import byte_level_tokenizer

    path = tmp_path_factory.mktemp("tiny_guided")
    tokenizer = byte_level_tokenizer(" ".join(CORPUS), vocab_size=360)
    tokenizer.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(tokenizer) + 8, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.1,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def think_model_dir(tmp_path_factory):
    """The tiny model with `<think>` and `</think>` as tokens of its vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tllm.visual_gen.models.qwen_image.components import byte_level_tokenizer

    path = tmp_path_factory.mktemp("tiny_think")
    tokenizer = byte_level_tokenizer(" ".join(CORPUS), vocab_size=360)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.save_pretrained(path)
    config = LlamaConfig(vocab_size=len(tokenizer) + 8, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, initializer_range=0.1,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, architectures=["LlamaForCausalLM"])
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(path)
    return str(path)
