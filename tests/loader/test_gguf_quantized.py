"""SmolLM2's GGUF with its blocks kept (the CPU default: int8 linears per channel, a Q8_0
embedding decoded at lookup, an int8 LM head; "gguf_int4": the Q4_1 linears as exact int4)
against the same file dequantized at load (quantization="none"): greedy tokens over 32 tokens
on 4 prompts equal, or where they part each side's token is in the other's top-5; and the
weights held take about the file's bytes (int4) or well under the dequantized model's (int8).

Why they may part: the kept paths multiply bf16 (one row) or per-token int8 (more rows)
activations, the int8 weights are re-quantized per channel, they accumulate in another order,
and the LM head is int8 per vocabulary row; a near tie between two tokens can then flip."""
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
    return {"kept": run(None), "int4": run("gguf_int4"), "dense": run("none")}


def test_default_keeps_the_blocks(runs):
    _, info = runs["kept"]
    assert info["methods"] == {"GgufLinearMethod"} and info["forms"] == {"int8"}
    assert info["vocab"] == (GgufEmbedding, GgufLMHead)
    assert runs["int4"][1]["forms"] == {"int4"}
    assert runs["dense"][1]["forms"] == {"dense"}


def test_weights_take_about_the_files_bytes(runs):
    """Measured: int4 129 MB (linears 66 MB with their bf16 scales, the Q8_0 embedding 30 MB,
    the int8 head 28 MB) and int8 169 MB, against the file's 98 MB; 542 MB dequantized to
    float32."""
    file_bytes = smollm2_path().stat().st_size
    int4, int8 = runs["int4"][1]["bytes"], runs["kept"][1]["bytes"]
    dense = runs["dense"][1]["bytes"]
    assert int4 < 1.35 * file_bytes, (int4, file_bytes)
    assert int8 < 1.8 * file_bytes, (int8, file_bytes)
    assert dense > 3 * int8


# (kept path, prompts that may part, logprob gap where they agree). Measured: int4 parts on
# 2 of 4 prompts (at tokens 16 and 3), its logprobs within 0.136 (median 0.018); int8 parts
# on 3 (at 5, 16, 3), within 0.184 (median 0.018): its per-channel re-quantization of Q4_1
# adds ~0.8% weight error to what the reference (Q4_1 dequantized) holds. int4 once parted
# on a third prompt too (at token 3, a near-tie, in a full xdist run): which steps a request
# shares with others can vary with the machine's load, and neither path is batch-invariant,
# so int4 is allowed the third prompt as well; the top-5 and logprob checks stand.
BOUNDS = {"int4": (3, 0.15), "kept": (3, 0.25)}


@pytest.mark.parametrize("kept_path", ["kept", "int4"])
def test_greedy_tokens_match_the_dequantized_path(runs, kept_path):
    max_parted, max_gap = BOUNDS[kept_path]
    kept, _ = runs[kept_path]
    dense, _ = runs["dense"]
    parted = []
    for prompt, a, b in zip(PROMPTS, kept, dense):
        for i, (ta, tb) in enumerate(zip(a.token_ids, b.token_ids)):
            if ta != tb:  # each side's choice among the other's top 5, then they diverge
                assert ta in b.logprobs[i] and tb in a.logprobs[i], (prompt, i)
                parted.append((prompt, i))
                break
            # where they agree, the chosen token's logprob is close
            assert abs(a.logprobs[i][ta].logprob - b.logprobs[i][tb].logprob) < max_gap
        else:  # never parted: the same tokens, the same length (EOS at the same place)
            assert a.token_ids == b.token_ids, prompt
    assert len(parted) <= max_parted, parted
