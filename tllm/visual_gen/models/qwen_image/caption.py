"""Captions of input images, for Qwen-Image-Layered prompts left empty: the text encoder
(Qwen2.5-VL) describes the image, as diffusers' QwenImageLayeredPipeline does with its
`processor`. The instructions below are the model's captioning prompts, verbatim from
diffusers (its output must match theirs)."""
from __future__ import annotations

from typing import Any

import torch

MAX_CAPTION_TOKENS = 512

CAPTION_PROMPTS = {
    "en": (
        '<|im_start|>system\n'
        'You are a helpful assistant.<|im_end|>\n'
        '<|im_start|>user\n'
        '# Image Annotator\n'
        'You are a professional\n'
        'image annotator. Please write an image caption based on the input image:\n'
        '1. Write the caption using natural,\n'
        'descriptive language without structured formats or rich text.\n'
        '2. Enrich caption details by including: \n'
        ' - Object\n'
        'attributes, such as quantity, color, shape, size, material, state, position, '
        'actions, and so on\n'
        ' - Vision Relations\n'
        'between objects, such as spatial relations, functional relations, possessive '
        'relations, attachment relations, action\n'
        'relations, comparative relations, causal relations, and so on\n'
        ' - Environmental details, such as weather, lighting,\n'
        'colors, textures, atmosphere, and so on\n'
        ' - Identify the text clearly visible in the image, without translation or\n'
        'explanation, and highlight it in the caption with quotation marks\n'
        '3. Maintain authenticity and accuracy:\n'
        ' - Avoid\n'
        'generalizations\n'
        ' - Describe all visible information in the image, while do not add information '
        'not explicitly shown in\n'
        'the image\n'
        '<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n'
        '<|im_start|>assistant\n'),
    "zh": (
        '<|im_start|>system\n'
        'You are a helpful assistant.<|im_end|>\n'
        '<|im_start|>user\n'
        '# 图像标注器\n'
        '你是一个专业的图像标注器。请基于输入图像，撰写图注:\n'
        '1.\n'
        '使用自然、描述性的语言撰写图注，不要使用结构化形式或富文本形式。\n'
        '2. 通过加入以下内容，丰富图注细节：\n'
        ' - 对象的属性：如数量、颜色、形状、大小、位置、材质、状态、动作等\n'
        ' -\n'
        '对象间的视觉关系：如空间关系、功能关系、动作关系、从属关系、比较关系、因果关系等\n'
        ' - 环境细节：例如天气、光照、颜色、纹理、气氛等\n'
        ' - 文字内容：识别图像中清晰可见的文字，不做翻译和解释，用引号在图注中强调\n'
        '3.\n'
        '保持真实性与准确性：\n'
        ' - 不要使用笼统的描述\n'
        ' -\n'
        '描述图像中所有可见的信息，但不要加入没有在图像中出现的内容\n'
        '<|vision_start|><|image_pad|><|vision_end|><|im_end|>\n'
        '<|im_start|>assistant\n'),
}


@torch.no_grad()
def caption_image(processor: Any, text_encoder: Any, image: Any, language: str) -> str:
    """A caption of a PIL image, decoded greedily (the text encoder's generation config)."""
    inputs = processor(text=CAPTION_PROMPTS[language], images=image, padding=True,
                       return_tensors="pt").to(text_encoder.device)
    generated = text_encoder.generate(**inputs, max_new_tokens=MAX_CAPTION_TOKENS)
    new_tokens = generated[:, inputs["input_ids"].shape[1]:]
    text = processor.batch_decode(new_tokens, skip_special_tokens=True,
                                  clean_up_tokenization_spaces=False)[0]
    return text.strip()
