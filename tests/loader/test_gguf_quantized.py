"""SmolLM2's GGUF with its blocks kept (the CPU default: int4 linears, a Q8_0 embedding decoded
at lookup, an int8 LM head) against the same file dequantized at load (quantization="none"):
greedy tokens over 32 tokens on 4 prompts equal, or where they part each side's token is in
the other's top-5; and the weights held take about the file's bytes.

Why they may part: the kept path multiplies bf16 activations with bf16 scales (torch's CPU
int4/int8 kernels are vectorised for bf16 only), accumulates in another order, and its LM head
is re-quantized to int8 per vocabulary row; a near tie between two tokens can then flip."""
from __future__ import annotations

import pytest
import torch

from tllm import LLM, SamplingParams
from tllm.layers.quant.gguf import GgufEmbedding, GgufLinearMethod, GgufLMHead
from tllm.loader import smollm2_path

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,", "The three primary colors are"]
NUM_NEW = 32
PARAMS = SamplingParams(max_tokens=NUM_NEW, temperature=0, logprobs=5)


def held_bytes(model: torch.nn.Module) -> int:
    """Bytes of every distinct parameter and buffer storage (a tied head counted once)."""
    storages = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        storage = tensor.untyped_storage()
        storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def run(quantization: str | None):
    with LLM("smollm2", quantization=quantization) as llm:
        model = llm._engine.executor.runner.model
        layers = {type(m.quant).__name__ for m in model.modules() if hasattr(m, "quant")}
        info = {"bytes": held_bytes(model), "methods": layers,
                "vocab": (type(model.embed_tokens), type(model.lm_head)),
                "forms": {m.quant.form for m in model.modules()
                          if isinstance(getattr(m, "quant", None), GgufLinearMethod)}}
        outputs = [o.outputs[0] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    return outputs, info


@pytest.fixture(scope="module")
def runs():
    return {"kept": run(None), "dense": run("none")}


def test_default_keeps_the_blocks(runs):
    _, info = runs["kept"]
    assert info["methods"] == {"GgufLinearMethod"} and info["forms"] == {"int4"}
    assert info["vocab"] == (GgufEmbedding, GgufLMHead)
    _, dense = runs["dense"]
    assert dense["forms"] == {"dense"}


def test_weights_take_about_the_files_bytes(runs):
    """Measured: 129 MB kept (int4 linears 66 MB with their bf16 scales, the Q8_0 embedding
    30 MB, the int8 head 28 MB) against the file's 98 MB; 542 MB dequantized to float32."""
    file_bytes = smollm2_path().stat().st_size
    kept, dense = runs["kept"][1]["bytes"], runs["dense"][1]["bytes"]
    assert kept < 1.35 * file_bytes, (kept, file_bytes)
    assert dense > 4 * kept


def test_greedy_tokens_match_the_dequantized_path(runs):
    kept, _ = runs["kept"]
    dense, _ = runs["dense"]
    parted = []
    for prompt, a, b in zip(PROMPTS, kept, dense):
        assert len(a.token_ids) == len(b.token_ids) == NUM_NEW or a.token_ids == b.token_ids
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:  # each side's choice among the other's top 5, then they diverge
                assert ta in b.logprobs[i] and tb in a.logprobs[i], (prompt, i)
                parted.append((prompt, i))
                break
            # where they agree, the chosen token's logprob is close
            assert abs(a.logprobs[i][ta].logprob - b.logprobs[i][tb].logprob) < 0.15
    assert len(parted) <= 2, parted
