"""A tiny random Cosmos 3 (mixture-of-transformers, Wan 2.2-style VAE, UniPC), built
in-process and saved as a diffusers folder, so that our VisualGen and diffusers'
Cosmos3OmniPipeline load the very same weights."""
from __future__ import annotations

from pathlib import Path

import torch

from tllm.visual_gen.models.cosmos3.components import chat_tokenizer

CORPUS = ("You are a helpful assistant who will generate videos from a give prompt. The video "
          "is seconds long and is of FPS. This video is not of resolution. a red fox runs "
          "in the snow, a robot arm picks up a cube")
SCHEDULER = dict(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0,
                 solver_order=2)
Z_DIM = 4


def tiny_transformer_config(tokenizer, **overrides) -> dict:
    config = dict(head_dim=16, hidden_size=64, intermediate_size=96, latent_channel=Z_DIM,
                  latent_patch_size=2, num_attention_heads=4, num_hidden_layers=2,
                  num_key_value_heads=2, patch_latent_dim=4 * Z_DIM, rope_axes_dim=[4, 2, 2],
                  rope_theta=10000.0, vocab_size=len(tokenizer),
                  unified_3d_mrope_temporal_modality_margin=50)
    return {**config, **overrides}


def tiny_transformer(tokenizer, **overrides):
    from diffusers import Cosmos3OmniTransformer
    model = Cosmos3OmniTransformer(**tiny_transformer_config(tokenizer, **overrides)).eval()
    with torch.no_grad():       # norms and embeddings away from their init values
        for name, param in model.named_parameters():
            if "norm" in name or "modality_embed" in name:
                param.add_(torch.randn_like(param) * 0.2)
    return model


def tiny_vae():
    from diffusers import AutoencoderKLWan
    return AutoencoderKLWan(
        base_dim=8, decoder_base_dim=8, z_dim=Z_DIM, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
        out_channels=12, patch_size=2, scale_factor_spatial=16, scale_factor_temporal=4,
        latents_mean=torch.randn(Z_DIM).tolist(),
        latents_std=(torch.rand(Z_DIM) + 0.5).tolist()).eval()


def save_tiny_cosmos(path: Path, seed: int = 0) -> Path:
    from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler
    torch.manual_seed(seed)
    tokenizer = chat_tokenizer(CORPUS, vocab_size=300)
    pipe = Cosmos3OmniPipeline(transformer=tiny_transformer(tokenizer), text_tokenizer=tokenizer,
                               vae=tiny_vae(), scheduler=UniPCMultistepScheduler(**SCHEDULER),
                               enable_safety_checker=False)
    pipe.save_pretrained(path)
    return Path(path)


def diffusers_cosmos(path: Path):
    from diffusers import Cosmos3OmniPipeline
    pipe = Cosmos3OmniPipeline.from_pretrained(path, enable_safety_checker=False)
    pipe.set_progress_bar_config(disable=True)
    return pipe
