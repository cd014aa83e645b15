"""FLUX.1's components around the denoising loop: CLIP (pooled prompt embedding) and T5
(prompt states) tokenizers and encoders from transformers, the VAE (AutoencoderKL, from
diffusers), the flow-match scheduler's config and the transformer (ours, or diffusers' as the
reference); loaded from a diffusers folder, or built with random weights in the real shapes
for `dummy:flux.1-dev` / `dummy:flux.1-schnell` (benchmarks: speed does not depend on
weights)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tllm.visual_gen.memory import count_parameters
from tllm.visual_gen.models import to_dtype
from tllm.visual_gen.models.flux.transformer import FLUX1_DEV, FLUX1_SCHNELL, FluxTransformer
from tllm.visual_gen.models.fused_weights import init_dummy_weights
from tllm.visual_gen.schedulers import FlowMatchConfig

TRANSFORMER_IMPLS = ("auto", "tllm", "diffusers")
# FLUX.1-dev's scheduler_config.json (resolution-dependent shift); schnell's has none.
FLUX_DEV_SCHEDULER = FlowMatchConfig(shift=3.0, use_dynamic_shifting=True, base_shift=0.5,
                                     max_shift=1.15, base_image_seq_len=256,
                                     max_image_seq_len=4096)
FLUX_SCHNELL_SCHEDULER = FlowMatchConfig(shift=1.0)
# FLUX.1's VAE (16 latent channels, 8x downsampling), CLIP ViT-L/14's text tower, T5-v1.1-XXL.
FLUX_VAE = dict(in_channels=3, out_channels=3, latent_channels=16,
                block_out_channels=[128, 256, 512, 512], layers_per_block=2,
                down_block_types=["DownEncoderBlock2D"] * 4,
                up_block_types=["UpDecoderBlock2D"] * 4, scaling_factor=0.3611,
                shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False)
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, projection_dim=768,
              hidden_act="quick_gelu")
T5_XXL = dict(vocab_size=32128, d_model=4096, d_ff=10240, d_kv=64, num_heads=64,
              num_layers=24, feed_forward_proj="gated-gelu", is_encoder_decoder=False)
DUMMIES = {"flux.1-dev": (FLUX1_DEV, FLUX_DEV_SCHEDULER),
           "flux.1-schnell": (FLUX1_SCHNELL, FLUX_SCHNELL_SCHEDULER)}
_OUTPUT_PROJECTIONS = ("img_out", "txt_out", "img_fc2", "txt_fc2", "proj_out")
_DUMMY_CORPUS = ("A photo of a cat holding a sign that says hello world, in a city street at "
                 "night with neon lights, a portrait, a landscape with mountains, rivers, trees "
                 "and a blue sky, highly detailed.")
CLIP_MAX_TOKENS = 77


@dataclass
class FluxComponents:
    tokenizer: Any          # CLIP's
    text_encoder: nn.Module
    tokenizer_2: Any        # T5's
    text_encoder_2: nn.Module
    vae: nn.Module
    transformer: nn.Module
    scheduler_config: FlowMatchConfig


class DiffusersFlux(nn.Module):
    """diffusers' FluxTransformer2DModel behind our transformer's forward (the reference)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    @property
    def config(self):
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep,
                img_ids, txt_ids, guidance=None) -> torch.Tensor:
        return self.model(hidden_states=hidden_states, encoder_hidden_states=encoder_hidden_states,
                          pooled_projections=pooled_projections, timestep=timestep,
                          img_ids=img_ids, txt_ids=txt_ids, guidance=guidance,
                          return_dict=False)[0]


def load_components(path: str | Path, dtype: torch.dtype, device: torch.device,
                    transformer_impl: str = "auto") -> FluxComponents:
    from diffusers import AutoencoderKL
    from transformers import AutoTokenizer, CLIPTextModel, T5EncoderModel

    path = Path(path)
    clip = CLIPTextModel.from_pretrained(str(path / "text_encoder"), dtype=dtype)
    t5 = T5EncoderModel.from_pretrained(str(path / "text_encoder_2"), dtype=dtype)
    vae = AutoencoderKL.from_pretrained(str(path / "vae"), torch_dtype=dtype)
    if pick_impl(transformer_impl) == "diffusers":
        from diffusers import FluxTransformer2DModel
        model = FluxTransformer2DModel.from_pretrained(str(path / "transformer"),
                                                       torch_dtype=dtype)
        transformer = DiffusersFlux(model.to(device).eval())
    else:
        transformer = FluxTransformer.from_pretrained(path / "transformer", dtype, device)
    return FluxComponents(
        AutoTokenizer.from_pretrained(str(path / "tokenizer")), clip.to(device).eval(),
        AutoTokenizer.from_pretrained(str(path / "tokenizer_2")), t5.to(device).eval(),
        vae.to(device).eval(), transformer,
        FlowMatchConfig.from_model_dir(path, FLUX_SCHNELL_SCHEDULER))


def dummy_components(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                     transformer_impl: str = "auto") -> FluxComponents:
    """Random weights in FLUX.1's shapes (12B transformer, T5-XXL, CLIP-L, the VAE); the
    tokenizers are small byte-level BPEs (the real ones cannot be built offline)."""
    from tllm.visual_gen.models.qwen_image.components import byte_level_tokenizer

    config, scheduler = _dummy(name)
    if pick_impl(transformer_impl) != "tllm":
        raise ValueError("dummy FLUX models run on tllm's transformer only")
    tokenizer = byte_level_tokenizer(_DUMMY_CORPUS, vocab_size=1024)
    tokenizer.model_max_length = CLIP_MAX_TOKENS
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        clip, t5, vae = _dummy_encoders_and_vae(dtype, device)
    with torch.device("meta"):
        transformer = FluxTransformer(config)
    transformer = transformer.to(dtype).to_empty(device=device)
    init_dummy_weights(transformer, config.num_layers + config.num_single_layers,
                       _OUTPUT_PROJECTIONS, seed)
    return FluxComponents(tokenizer, clip.eval(), tokenizer, t5.eval(), vae.eval(),
                          transformer.eval(), scheduler)


def dummy_parameter_count(name: str) -> int:
    config, _ = _dummy(name)
    meta = torch.device("meta")
    with meta:
        return count_parameters([*_dummy_encoders_and_vae(torch.float32, meta),
                                 FluxTransformer(config)])


def _dummy_encoders_and_vae(dtype: torch.dtype, device: torch.device):
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    with torch.device(device):
        clip = CLIPTextModel._from_config(CLIPTextConfig(**CLIP_L), dtype=dtype)
        t5 = T5EncoderModel._from_config(T5Config(**T5_XXL), dtype=dtype)
        vae = to_dtype(AutoencoderKL(**FLUX_VAE), dtype)
    return clip, t5, vae


def _dummy(name: str):
    if name not in DUMMIES:
        raise ValueError(f"unknown FLUX dummy {name!r}; choose one of {', '.join(DUMMIES)}")
    return DUMMIES[name]


def pick_impl(impl: str) -> str:
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl must be one of {TRANSFORMER_IMPLS}, got {impl!r}")
    return "diffusers" if impl == "diffusers" else "tllm"
