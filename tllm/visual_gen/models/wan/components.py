"""Wan's components around the denoising loop: the tokenizer and UMT5 text encoder (from
transformers), the VAE (AutoencoderKLWan, from diffusers: Wan 2.1's 8x for the A14B models,
Wan 2.2's 16x for TI2V-5B), the UniPC scheduler's config, and the transformer(s): ours, or
diffusers' as the reference; Wan 2.2 A14B has two experts, `transformer` for the high-noise
steps (timestep >= boundary_ratio * 1000) and `transformer_2` for the rest. Loaded from a
diffusers folder, or built with random weights in the real shapes for `dummy:` names."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tllm.visual_gen.memory import count_parameters
from tllm.visual_gen.models import to_dtype
from tllm.visual_gen.models.cosmos3.components import WAN22_VAE
from tllm.visual_gen.models.fused_weights import init_dummy_weights
from tllm.visual_gen.models.wan.transformer import (WAN22_T2V_A14B, WAN22_TI2V_5B, WanConfig,
                                                    WanTransformer)
from tllm.visual_gen.unipc import UniPCConfig

TRANSFORMER_IMPLS = ("auto", "tllm", "diffusers")
UMT5_XXL = dict(vocab_size=256384, d_model=4096, d_ff=10240, d_kv=64, num_heads=64,
                num_layers=24, feed_forward_proj="gated-gelu")
WAN21_VAE = dict(base_dim=96, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                 temperal_downsample=[False, True, True])


@dataclass(frozen=True)
class WanDummy:
    transformer: WanConfig
    vae: dict
    experts: int                    # 2: the A14B mixture of a high- and a low-noise expert
    boundary_ratio: float | None
    scheduler: UniPCConfig


DUMMIES = {
    "wan2.2-ti2v-5b": WanDummy(WAN22_TI2V_5B, WAN22_VAE, 1, None, UniPCConfig(flow_shift=5.0)),
    "wan2.2-t2v-a14b": WanDummy(WAN22_T2V_A14B, WAN21_VAE, 2, 0.875,
                                UniPCConfig(flow_shift=3.0)),
}
_OUTPUT_PROJECTIONS = ("self_out", "cross_out", "fc2")
_DUMMY_CORPUS = ("A cat walks on the grass, realistic style, a red fox runs in the snow, "
                 "bright tones, overexposed, static, blurred details, worst quality.")


@dataclass
class WanComponents:
    tokenizer: Any
    text_encoder: nn.Module
    vae: nn.Module
    transformer: nn.Module
    transformer_2: nn.Module | None
    boundary_ratio: float | None
    scheduler_config: UniPCConfig


class DiffusersWan(nn.Module):
    """diffusers' WanTransformer3DModel behind our transformer's forward (the reference)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    @property
    def config(self):
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def forward(self, hidden_states, timestep, encoder_hidden_states) -> torch.Tensor:
        return self.model(hidden_states=hidden_states, timestep=timestep,
                          encoder_hidden_states=encoder_hidden_states, return_dict=False)[0]


def load_components(path: str | Path, dtype: torch.dtype, device: torch.device,
                    transformer_impl: str = "auto") -> WanComponents:
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, UMT5EncoderModel

    path = Path(path)
    index = json.loads((path / "model_index.json").read_text())
    scheduler_class = (index.get("scheduler") or [None, None])[1]
    if scheduler_class != "UniPCMultistepScheduler":
        raise ValueError(f"Wan scheduler {scheduler_class!r} is not supported (UniPC only)")
    experts = [_load_transformer(path / name, dtype, device, transformer_impl)
               if (index.get(name) or [None])[0] else None
               for name in ("transformer", "transformer_2")]
    if experts[0] is None:
        raise ValueError(f"{path}: Wan folders without `transformer` are not supported")
    text_encoder = UMT5EncoderModel.from_pretrained(str(path / "text_encoder"), dtype=dtype)
    vae = AutoencoderKLWan.from_pretrained(str(path / "vae"), torch_dtype=dtype)
    return WanComponents(AutoTokenizer.from_pretrained(str(path / "tokenizer")),
                         text_encoder.to(device).eval(), vae.to(device).eval(), *experts,
                         index.get("boundary_ratio"),
                         UniPCConfig.from_model_dir(path, UniPCConfig(flow_shift=5.0)))


def _load_transformer(path: Path, dtype: torch.dtype, device: torch.device,
                      impl: str) -> nn.Module:
    if pick_impl(impl) == "diffusers":
        from diffusers import WanTransformer3DModel
        model = WanTransformer3DModel.from_pretrained(str(path), torch_dtype=dtype)
        return DiffusersWan(model.to(device).eval())
    return WanTransformer.from_pretrained(path, dtype, device)


def dummy_components(name: str, dtype: torch.dtype, device: torch.device, seed: int = 0,
                     transformer_impl: str = "auto") -> WanComponents:
    """Random weights in the shapes of Wan 2.2 TI2V-5B or T2V-A14B (UMT5-XXL, the VAE, the
    transformer(s)); the tokenizer is a small byte-level BPE."""
    from tllm.visual_gen.models.qwen_image.components import byte_level_tokenizer

    dummy = _dummy(name)
    if pick_impl(transformer_impl) != "tllm":
        raise ValueError("dummy Wan models run on tllm's transformer only")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        text_encoder, vae = _dummy_encoder_and_vae(dummy, dtype, device)
    experts = [_dummy_transformer(dummy.transformer, dtype, device, seed + i)
               for i in range(dummy.experts)]
    return WanComponents(byte_level_tokenizer(_DUMMY_CORPUS, vocab_size=1024),
                         text_encoder.eval(), vae.eval(), experts[0],
                         experts[1] if len(experts) > 1 else None, dummy.boundary_ratio,
                         dummy.scheduler)


def dummy_parameter_count(name: str) -> int:
    dummy = _dummy(name)
    meta = torch.device("meta")
    with meta:
        experts = [WanTransformer(dummy.transformer) for _ in range(dummy.experts)]
        return count_parameters([*_dummy_encoder_and_vae(dummy, torch.float32, meta),
                                 *experts])


def _dummy_transformer(config: WanConfig, dtype, device, seed: int) -> WanTransformer:
    with torch.device("meta"):
        model = WanTransformer(config)
    model = model.to(dtype).keep_fp32_parts().to_empty(device=device)
    init_dummy_weights(model, config.num_layers, _OUTPUT_PROJECTIONS, seed)
    with torch.no_grad():       # the modulation tables: small, as trained ones are
        for name, param in model.named_parameters():
            if name.endswith("scale_shift_table"):
                param.normal_(0.0, 0.02)
    return model.eval()


def _dummy_encoder_and_vae(dummy: WanDummy, dtype, device):
    from diffusers import AutoencoderKLWan
    from transformers import UMT5Config, UMT5EncoderModel

    z_dim = dummy.vae["z_dim"]
    with torch.device(device):
        text_encoder = UMT5EncoderModel._from_config(UMT5Config(**UMT5_XXL), dtype=dtype)
        vae = to_dtype(AutoencoderKLWan(**dummy.vae, latents_mean=[0.0] * z_dim,
                                        latents_std=[1.0] * z_dim), dtype)
    return text_encoder, vae


def _dummy(name: str) -> WanDummy:
    if name not in DUMMIES:
        raise ValueError(f"unknown Wan dummy {name!r}; choose one of {', '.join(DUMMIES)}")
    return DUMMIES[name]


def pick_impl(impl: str) -> str:
    if impl not in TRANSFORMER_IMPLS:
        raise ValueError(f"transformer_impl must be one of {TRANSFORMER_IMPLS}, got {impl!r}")
    return "diffusers" if impl == "diffusers" else "tllm"
