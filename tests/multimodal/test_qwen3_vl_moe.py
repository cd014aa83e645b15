"""Qwen3-VL-MoE (tiny, random, fp32: 4 experts, top-2, the last layer dense; DeepStack on
the first two layers): greedy tokens and top-5 logprobs equal HF transformers' for prompts
with 0, 1 and 2 images in one continuous batch, 8-token prefill chunks cutting through the
images; the checkpoint's transposed stacked experts load."""
from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from tests.multimodal.conftest import IMAGE, QwenReference, make_image, tiny_tokenizer
from tests.multimodal.test_qwen3_vl import (VISION_ARGS, chat_text, check_logprobs,
                                            hf_greedy, make_llm, params, text_args,
                                            tiny_image_processor, token_ids)


def tiny_moe_config(tokenizer):
    from transformers import Qwen3VLMoeConfig
    text = dict(text_args(tokenizer), num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=48, decoder_sparse_step=1, mlp_only_layers=[2])
    return Qwen3VLMoeConfig(text_config=text, vision_config=VISION_ARGS,
                            **token_ids(tokenizer),
                            architectures=["Qwen3VLMoeForConditionalGeneration"])


def hub_layout(file) -> None:
    """The stacked experts transposed as the hub's checkpoints store them (save_pretrained
    writes the modules' layout)."""
    from safetensors.torch import load_file, save_file
    tensors = load_file(file)
    for name in tensors:
        if name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            tensors[name] = tensors[name].transpose(1, 2).contiguous()
    save_file(tensors, file, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def tiny_qwen3_vl_moe(tmp_path_factory):
    from transformers import Qwen3VLMoeForConditionalGeneration
    path = tmp_path_factory.mktemp("tiny_qwen3_vl_moe")
    tokenizer = tiny_tokenizer()
    images = tiny_image_processor()
    torch.manual_seed(0)
    model = Qwen3VLMoeForConditionalGeneration(tiny_moe_config(tokenizer)).eval()
    model.save_pretrained(path)
    hub_layout(path / "model.safetensors")
    images.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path, model, QwenReference(images, tokenizer, model.config)


def test_greedy_and_logprobs_match_hf(tiny_qwen3_vl_moe):
    path, hf_model, reference = tiny_qwen3_vl_moe
    cases = [(chat_text(IMAGE, "describe the picture"), [make_image(64, 96, 1)]),
             (chat_text("what is in this image?"), []),
             (chat_text("compare ", IMAGE, " and ", IMAGE),
              [make_image(96, 96, 2), make_image(64, 64, 3)])]
    inputs = [{"prompt": text, "multi_modal_data": {"image": images}} if images else text
              for text, images in cases]
    with safe_open(str(path / "model.safetensors"), "pt") as f:   # [E, H, 2I] on disk
        assert f.get_slice("model.language_model.layers.0.mlp.experts.gate_up_proj"
                           ).get_shape() == [4, 64, 96]
    with make_llm(path) as llm:
        outputs = llm.generate(inputs, params(), use_tqdm=False)
    for (text, images), output in zip(cases, outputs):
        tokens, logprobs = hf_greedy(hf_model, reference, text, images)
        assert output.outputs[0].token_ids == tokens
        check_logprobs(output.outputs[0].logprobs, logprobs)
