"""The real default model: SmolLM2 from its GGUF, greedy tokens equal to HF transformers
loading the same GGUF."""
from __future__ import annotations

import pytest
import torch

from tllm import LLM, SamplingParams
from tllm.loader import smollm2_path

pytestmark = pytest.mark.slow

PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "Once upon a time, in a small village,", "The three primary colors are"]
NUM_NEW = 32


@pytest.fixture(scope="module")
def hf_smollm2():
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = smollm2_path()
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model, tokenizer


def test_smollm2_greedy_matches_hf(hf_smollm2):
    model, tokenizer = hf_smollm2
    # HF dequantizes the GGUF to float32: so does quantization="none" (the default keeps the
    # blocks and runs bf16 kernels; tests/loader/test_gguf_quantized.py checks it against this)
    with LLM("smollm2", quantization="none") as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NUM_NEW, temperature=0),
                               use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        assert output.prompt_token_ids == ids[0].tolist()
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=NUM_NEW, do_sample=False,
                                 pad_token_id=tokenizer.eos_token_id)
        ref_tokens = ref[0, ids.shape[1]:].tolist()
        assert output.outputs[0].token_ids == ref_tokens
        assert output.outputs[0].text == tokenizer.decode(ref_tokens, skip_special_tokens=True)
