"""Tiny random Qwen-Image and Qwen-Image-Layered models, built in-process and saved as
diffusers-format folders (model_index.json, one folder per component), so that our VisualGen
and diffusers' pipelines load the very same weights."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from tllm.visual_gen.models.qwen_image.components import (TINY_VAE, tiny_text_encoder_config,
                                                          tiny_tokenizer)
from tllm.visual_gen.models.qwen_image.transformer import TINY_CONFIG

SCHEDULER = dict(base_shift=0.5, max_shift=0.9, base_image_seq_len=256, max_image_seq_len=8192,
                 shift_terminal=0.02, use_dynamic_shifting=True, time_shift_type="exponential")
# The layered pipeline tells images from latents by the channels (8); 16x downsampling keeps
# diffusers' smallest bucket (640) small.
LAYERED_VAE = dict(base_dim=4, z_dim=8, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=0,
                   temperal_downsample=[False, True, True, True], input_channels=4)
MAX_CAPTION_PIXELS = 28 * 28 * 16


def save_tiny_model(path: Path, layered: bool = False, seed: int = 0) -> Path:
    """Build and save a tiny model (the package's tiny shapes, random latent statistics);
    returns its folder."""
    from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler,
                           QwenImageLayeredPipeline, QwenImagePipeline,
                           QwenImageTransformer2DModel)
    from transformers import Qwen2_5_VLForConditionalGeneration
    torch.manual_seed(seed)
    tokenizer = tiny_tokenizer()
    vae_shape = LAYERED_VAE if layered else TINY_VAE
    z_dim = vae_shape["z_dim"]
    vae = AutoencoderKLQwenImage(
        **vae_shape, latents_mean=torch.randn(z_dim).tolist(),
        latents_std=(torch.rand(z_dim) + 0.5).tolist()).eval()
    shape = dataclasses.replace(TINY_CONFIG, in_channels=4 * z_dim, out_channels=z_dim,
                                use_additional_t_cond=layered, use_layer3d_rope=layered)
    transformer = QwenImageTransformer2DModel(**dataclasses.asdict(shape)).eval()
    text_encoder = Qwen2_5_VLForConditionalGeneration(tiny_text_encoder_config(tokenizer))
    components = dict(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER), vae=vae,
                      text_encoder=text_encoder.eval(), tokenizer=tokenizer,
                      transformer=transformer)
    if layered:
        QwenImageLayeredPipeline(**components, processor=None).save_pretrained(path)
    else:
        QwenImagePipeline(**components).save_pretrained(path)
    return Path(path)


def diffusers_pipeline(path: Path, layered: bool = False):
    from diffusers import QwenImageLayeredPipeline, QwenImagePipeline
    if layered:
        pipe = QwenImageLayeredPipeline.from_pretrained(path, processor=None)
    else:
        pipe = QwenImagePipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe


class TinyVLProcessor:
    """Stands in for Qwen2VLProcessor, which transformers cannot build without torchvision:
    the same outputs (pixel patches from Qwen2VLImageProcessorPil; the prompt with
    <|image_pad|> repeated once per merged patch), small images. Captions go through it in
    both pipelines alike."""

    def __init__(self, tokenizer) -> None:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil)
        self.tokenizer = tokenizer
        self.images = Qwen2VLImageProcessorPil(min_pixels=28 * 28 * 4,
                                               max_pixels=MAX_CAPTION_PIXELS)

    def __call__(self, text: str, images, padding: bool = True, return_tensors: str = "pt"):
        from transformers import BatchFeature
        vision = self.images(images=[images], return_tensors=return_tensors)
        merge = self.images.merge_size ** 2
        num_tokens = int(vision["image_grid_thw"][0].prod()) // merge
        text = text.replace("<|image_pad|>", "<|image_pad|>" * num_tokens)
        return BatchFeature({**self.tokenizer(text, return_tensors=return_tensors), **vision})

    def batch_decode(self, *args, **kwargs) -> list[str]:
        return self.tokenizer.batch_decode(*args, **kwargs)
