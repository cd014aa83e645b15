"""Tiny random Wan pipelines, built in-process and saved as diffusers folders, so that our
VisualGen and diffusers' WanPipeline load the same weights: "moe" is Wan 2.2 A14B's design
(two experts switched at boundary_ratio, Wan 2.1's 8x VAE), "dense" TI2V-5B's (one
transformer, Wan 2.2's 16x VAE, expand_timesteps)."""
from __future__ import annotations

from pathlib import Path

import torch

from tests.visual_gen.tiny_cosmos import tiny_vae as tiny_wan22_vae
from tllm.visual_gen.models.qwen_image.components import TINY_CORPUS, byte_level_tokenizer

SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                 solver_order=2)
BOUNDARY_RATIO = 0.875      # with 3 steps at shift 3: timesteps 999 | 857, 600


def tiny_transformer(z_dim: int, **overrides):
    from diffusers import WanTransformer3DModel
    config = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12,
                  in_channels=z_dim, out_channels=z_dim, text_dim=32, freq_dim=32, ffn_dim=32,
                  num_layers=2, rope_max_seq_len=32)
    model = WanTransformer3DModel(**{**config, **overrides}).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return model


def tiny_wan21_vae():
    from diffusers import AutoencoderKLWan
    return AutoencoderKLWan(base_dim=3, z_dim=16, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                            temperal_downsample=[False, True, True],
                            latents_mean=torch.randn(16).tolist(),
                            latents_std=(torch.rand(16) + 0.5).tolist()).eval()


def save_tiny_wan(path: Path, kind: str, seed: int = 0) -> Path:
    from diffusers import UniPCMultistepScheduler, WanPipeline
    from transformers import UMT5Config, UMT5EncoderModel
    torch.manual_seed(seed)
    tokenizer = byte_level_tokenizer(TINY_CORPUS, vocab_size=400)
    text_encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=len(tokenizer), d_model=32, d_ff=64, d_kv=8, num_heads=4, num_layers=2,
        feed_forward_proj="gated-gelu")).eval()
    common = dict(tokenizer=tokenizer, text_encoder=text_encoder,
                  scheduler=UniPCMultistepScheduler(**SCHEDULER))
    if kind == "moe":
        pipe = WanPipeline(vae=tiny_wan21_vae(), transformer=tiny_transformer(16),
                           transformer_2=tiny_transformer(16), boundary_ratio=BOUNDARY_RATIO,
                           **common)
    else:
        vae = tiny_wan22_vae()
        pipe = WanPipeline(vae=vae, transformer=tiny_transformer(vae.config.z_dim),
                           expand_timesteps=True, **common)
    pipe.save_pretrained(path)
    return Path(path)


def diffusers_wan(path: Path):
    from diffusers import WanPipeline
    pipe = WanPipeline.from_pretrained(path)
    pipe.set_progress_bar_config(disable=True)
    return pipe
