"""A tiny random FLUX.1 (dev: guidance-embedded, or schnell), built in-process and saved as a
diffusers folder, so that our VisualGen and diffusers' FluxPipeline load the same weights."""
from __future__ import annotations

from pathlib import Path

import torch

from tllm.visual_gen.models.qwen_image.components import TINY_CORPUS, byte_level_tokenizer

DEV_SCHEDULER = dict(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                     base_image_seq_len=256, max_image_seq_len=4096)
SCHNELL_SCHEDULER = dict(shift=1.0, use_dynamic_shifting=False)


def tiny_transformer(guidance_embeds: bool):
    from diffusers import FluxTransformer2DModel
    model = FluxTransformer2DModel(
        in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
        guidance_embeds=guidance_embeds, axes_dims_rope=(4, 6, 6)).eval()
    with torch.no_grad():       # away from the zero-initialised modulations and outputs
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def save_tiny_flux(path: Path, dev: bool = True, seed: int = 0) -> Path:
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel
    torch.manual_seed(seed)
    tokenizer = byte_level_tokenizer(TINY_CORPUS, vocab_size=400)
    tokenizer.model_max_length = 77
    vocab = len(tokenizer)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, projection_dim=32, bos_token_id=0,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>")))
    t5 = T5EncoderModel(T5Config(vocab_size=vocab, d_model=32, d_ff=64, d_kv=8, num_heads=4,
                                 num_layers=2, feed_forward_proj="gated-gelu"))
    vae = AutoencoderKL(block_out_channels=[8, 16], layers_per_block=1, latent_channels=4,
                        norm_num_groups=4, down_block_types=["DownEncoderBlock2D"] * 2,
                        up_block_types=["UpDecoderBlock2D"] * 2, scaling_factor=0.6,
                        shift_factor=0.1, use_quant_conv=False, use_post_quant_conv=False)
    scheduler = FlowMatchEulerDiscreteScheduler(**(DEV_SCHEDULER if dev else SCHNELL_SCHEDULER))
    FluxPipeline(scheduler=scheduler, vae=vae.eval(), text_encoder=clip.eval(),
                 tokenizer=tokenizer, text_encoder_2=t5.eval(), tokenizer_2=tokenizer,
                 transformer=tiny_transformer(dev)).save_pretrained(path)
    return Path(path)


def diffusers_flux(path: Path):
    from diffusers import FluxPipeline
    pipe = FluxPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe
