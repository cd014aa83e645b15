"""LLaVA (tiny, random, fp32; CLIP tower, Llama decoder): greedy tokens equal HF
transformers' for prompts with 0, 1 and 2 images in one continuous batch with text-only
requests, chunked prefill cutting through the images."""
from __future__ import annotations

import torch

from tests.multimodal.conftest import make_image
from tests.multimodal.test_qwen2_5_vl import NUM_NEW, make_llm, params


def hf_greedy(model, processor, text: str, images: list) -> list[int]:
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NUM_NEW, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def test_greedy_matches_hf_in_continuous_batch(tiny_llava):
    path, hf_model, processor = tiny_llava
    cases = [("describe the picture", []),
             ("<image>\ndescribe the picture", [make_image(28, 28, 1)]),
             ("compare <image> and <image>", [make_image(56, 84, 2), make_image(40, 30, 3)]),
             ("the quick brown fox", [])]
    inputs = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text
              for text, images in cases]
    with make_llm(path) as llm:
        outputs = llm.generate(inputs, params(), use_tqdm=False)
    for (text, images), output in zip(cases, outputs):
        assert output.outputs[0].token_ids == hf_greedy(hf_model, processor, text, images)
