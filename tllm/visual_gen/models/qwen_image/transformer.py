"""Qwen-Image's MMDiT denoiser (diffusers' `QwenImageTransformer2DModel`, our implementation):
patch embeddings in, a timestep embedding driving AdaLN in every block, a stack of two-stream
blocks (blocks.py) over image and text tokens with 3D RoPE (rope.py), and a modulated final
norm and projection out. Loads diffusers' checkpoints and parameter names, fusing Q/K/V and the
two streams' modulation linears as it loads.

One forward takes a batch whose rows may have different text lengths (classifier-free
guidance's [uncond, cond], right-padded with `encoder_hidden_states_mask` zeros); each row's
result is that of the row run alone."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tllm.layers.norm import RMSNorm
from tllm.loader.hf import CheckpointError
from tllm.visual_gen.models.checkpoint import load_named, transformer_from_folder
from tllm.visual_gen.models.qwen_image.blocks import KeyPadding, QwenImageBlock, modulated_norm
from tllm.visual_gen.models.qwen_image.rope import ImageShapes, QwenRope
from tllm.visual_gen.step_cache import BlockStack, StepCache, run_blocks

TIMESTEP_CHANNELS = 256
# TeaCache's rescale polynomial for Qwen-Image (ComfyUI-TeaCache's fit, highest power first)
TEACACHE_COEFFICIENTS = (-450.0, 280.0, -45.0, 3.2, -0.02)


@dataclass(frozen=True)
class QwenImageTransformerConfig:
    """diffusers' QwenImageTransformer2DModel config: same field names and defaults (the
    defaults are the 20B Qwen-Image shape)."""
    patch_size: int = 2
    in_channels: int = 64
    out_channels: int | None = 16
    num_layers: int = 60
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 3584
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, int, int] = (16, 56, 56)
    zero_cond_t: bool = False
    use_additional_t_cond: bool = False
    use_layer3d_rope: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        if len(self.axes_dims_rope) != 3 or sum(self.axes_dims_rope) != self.attention_head_dim:
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope} must be three dims summing "
                             f"to attention_head_dim {self.attention_head_dim}")
        if min(self.patch_size, self.in_channels, self.num_layers, self.attention_head_dim,
               self.num_attention_heads, self.joint_attention_dim) <= 0:
            raise ValueError(f"config sizes must be positive: {self}")

    @classmethod
    def from_dict(cls, d: Mapping) -> QwenImageTransformerConfig:
        """From a diffusers config.json dict; other keys ("_class_name", ...) are ignored."""
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    @property
    def out_dim(self) -> int:
        """Channels per output token: a patch of the output latent."""
        return self.patch_size ** 2 * (self.out_channels or self.in_channels)


# A tiny shape (the tests' and dummy:qwen-image-tiny's): two layers, 32 wide, over 4-channel
# latents and 32-wide text states.
TINY_CONFIG = QwenImageTransformerConfig(
    in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
    joint_attention_dim=32, axes_dims_rope=(8, 4, 4))
DUMMY_CONFIGS = {
    "qwen-image": QwenImageTransformerConfig(),
    "qwen-image-layered": QwenImageTransformerConfig(use_additional_t_cond=True,
                                                     use_layer3d_rope=True),
    "qwen-image-tiny": TINY_CONFIG,
}


def dummy_transformer_config(name: str) -> QwenImageTransformerConfig:
    """The real shape of a released model ("qwen-image", "qwen-image-layered"), or the tiny
    one ("qwen-image-tiny"), for dummy weights."""
    if name not in DUMMY_CONFIGS:
        raise ValueError(f"unknown Qwen-Image transformer {name!r}; choose one of "
                         f"{', '.join(sorted(DUMMY_CONFIGS))}")
    return DUMMY_CONFIGS[name]


class TimestepEmbedding(nn.Module):
    """Sinusoidal timestep features (cos first, timesteps scaled by 1000) through a SiLU MLP,
    plus a learned embedding of `additional_t_cond` (Qwen-Image-Layered's is-RGB flag)."""

    def __init__(self, dim: int, use_additional_t_cond: bool) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(TIMESTEP_CHANNELS, dim)
        self.linear_2 = nn.Linear(dim, dim)
        self.addition_t_embedding = nn.Embedding(2, dim) if use_additional_t_cond else None

    def forward(self, timestep: torch.Tensor, additional_t_cond: torch.Tensor | None
                ) -> torch.Tensor:
        """timestep: [B] in the model's dtype; the sinusoids are computed in float32."""
        half = TIMESTEP_CHANNELS // 2
        exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32,
                                                   device=timestep.device) / half
        args = 1000 * (timestep[:, None].float() * exponent.exp()[None, :])
        features = torch.cat([args.cos(), args.sin()], dim=-1).to(timestep.dtype)
        temb = self.linear_2(F.silu(self.linear_1(features)))
        if self.addition_t_embedding is not None:
            if additional_t_cond is None:
                raise ValueError("this transformer (use_additional_t_cond) needs additional_t_cond")
            temb = temb + self.addition_t_embedding(additional_t_cond).to(temb.dtype)
        return temb


class QwenImageTransformer(nn.Module):
    """Qwen-Image's transformer; `forward` gives diffusers' `forward(..., return_dict=False)[0]`."""

    supports_step_cache = True

    def __init__(self, config: QwenImageTransformerConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.inner_dim
        self.rope = QwenRope(config.axes_dims_rope, layered=config.use_layer3d_rope)
        self.time_embed = TimestepEmbedding(dim, config.use_additional_t_cond)
        self.txt_norm = RMSNorm(config.joint_attention_dim, eps=1e-6)
        self.img_in = nn.Linear(config.in_channels, dim)
        self.txt_in = nn.Linear(config.joint_attention_dim, dim)
        self.blocks = nn.ModuleList(
            QwenImageBlock(dim, config.num_attention_heads, config.attention_head_dim)
            for _ in range(config.num_layers))
        self.norm_out = nn.Linear(dim, 2 * dim)  # the final AdaLN: scale, then shift
        self.proj_out = nn.Linear(dim, config.out_dim)
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.img_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.img_in.weight.device

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_mask: torch.Tensor | None, timestep: torch.Tensor,
                img_shapes, guidance: torch.Tensor | None = None,
                additional_t_cond: torch.Tensor | None = None,
                step_cache: StepCache | None = None) -> torch.Tensor:
        """hidden_states [B, N, in_channels] packed latents; encoder_hidden_states
        [B, L, joint_attention_dim] with encoder_hidden_states_mask [B, L] (1 = valid, or
        None); timestep [B] in [0, 1]; img_shapes as diffusers' pipelines pass them (per row, a
        list of (frames, rows, columns) per image; rows must agree); step_cache: see
        step_cache.py. Returns [B, N, out_dim]."""
        if guidance is not None:  # no released Qwen-Image is guidance-distilled
            raise ValueError("guidance embeddings are not supported (guidance must be None)")
        batch, num_img = hidden_states.shape[:2]
        self._check_inputs(hidden_states, encoder_hidden_states, encoder_hidden_states_mask)
        shapes = sample_shapes(img_shapes, num_img)
        img = self.img_in(hidden_states)
        txt = self.txt_in(self.txt_norm(encoder_hidden_states))
        temb = self._timestep_embedding(timestep, additional_t_cond, batch, img.dtype)
        silu_temb = F.silu(temb)
        rope = self.rope.tables(shapes, txt.shape[1], img.device)
        padding = KeyPadding.from_text_mask(encoder_hidden_states_mask, num_img, img.device)
        split = math.prod(shapes[0]) if self.config.zero_cond_t else None
        stack = self._block_stack(silu_temb, rope, padding, split)
        img, _ = run_blocks(stack, (img, txt), step_cache)
        scale, shift = self.norm_out(silu_temb[:batch, None]).chunk(2, dim=-1)
        return self.proj_out(modulated_norm(img, shift, scale, None))

    def _block_stack(self, silu_temb, rope, padding, split) -> BlockStack:
        """The blocks over the state (img, txt), for run_blocks."""
        def run(blocks, state):
            for block in blocks:
                state = block(*state, silu_temb, rope, padding, split)
            return state

        return BlockStack(
            first=lambda state: run(self.blocks[:1], state),
            rest=lambda state: run(self.blocks[1:], state),
            modulated_input=lambda state: self.blocks[0].modulated_input(state[0], silu_temb,
                                                                         split),
            hidden=lambda state: [state[0]],
            with_residuals=lambda state, residuals: (state[0] + residuals[0], state[1]),
            coefficients=TEACACHE_COEFFICIENTS)

    def _timestep_embedding(self, timestep, additional_t_cond, batch: int, dtype) -> torch.Tensor:
        """[B, d]; under zero_cond_t [2B, d], the second half for timestep 0 (the reference
        images' tokens)."""
        device = self.device
        t = _per_row(timestep, batch, "timestep", device).to(dtype)
        cond = None if additional_t_cond is None else _per_row(
            additional_t_cond, batch, "additional_t_cond", device).long()
        if self.config.zero_cond_t:
            t = torch.cat([t, t * 0])
            cond = None if cond is None else torch.cat([cond, cond])
        return self.time_embed(t, cond)

    def _check_inputs(self, hidden_states, encoder_hidden_states, mask) -> None:
        config = self.config
        if hidden_states.dim() != 3 or hidden_states.shape[-1] != config.in_channels:
            raise ValueError(f"hidden_states must be [B, N, {config.in_channels}], "
                             f"got {tuple(hidden_states.shape)}")
        if (encoder_hidden_states.dim() != 3
                or encoder_hidden_states.shape[0] != hidden_states.shape[0]
                or encoder_hidden_states.shape[-1] != config.joint_attention_dim):
            raise ValueError(f"encoder_hidden_states must be [B, L, {config.joint_attention_dim}]"
                             f", got {tuple(encoder_hidden_states.shape)}")
        if mask is not None and tuple(mask.shape) != tuple(encoder_hidden_states.shape[:2]):
            raise ValueError(f"encoder_hidden_states_mask must be [B, L] = "
                             f"{tuple(encoder_hidden_states.shape[:2])}, got {tuple(mask.shape)}")

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device = "cpu") -> QwenImageTransformer:
        """A diffusers `transformer/` folder: config.json and (sharded) safetensors. Weights are
        read shard by shard straight onto `device`; no full copy passes through the host."""
        return transformer_from_folder(cls, QwenImageTransformerConfig, DiffusersWeightLoader, path, dtype, device)

    def load_diffusers_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Loads a diffusers state dict (its parameter names), checking every weight is there."""
        load_named(DiffusersWeightLoader(self), state_dict.items())

    def diffusers_state_dict(self) -> dict[str, torch.Tensor]:
        """Our weights under diffusers' names, as views of our (fused) parameters: no copies."""
        params = dict(self.named_parameters())
        out = {}
        for theirs, ours in _TOP_LEVEL_NAMES.items():
            for leaf in ("weight", "bias"):
                if f"{ours}.{leaf}" in params:
                    out[f"{theirs}.{leaf}"] = params[f"{ours}.{leaf}"]
        for i in range(len(self.blocks)):
            prefix = f"transformer_blocks.{i}"
            for theirs, (ours, slot, slots) in _BLOCK_NAMES.items():
                for leaf in ("weight", "bias"):
                    param = params[f"blocks.{i}.{ours}.{leaf}"]
                    rows = param.shape[0] // slots
                    out[f"{prefix}.{theirs}.{leaf}"] = param[slot * rows:(slot + 1) * rows]
            for theirs, ours in _BLOCK_NORMS.items():
                out[f"{prefix}.{theirs}.weight"] = params[f"blocks.{i}.{ours}"]
        return out


def sample_shapes(img_shapes, num_tokens: int) -> ImageShapes:
    """One sample's image shapes from diffusers' per-row `img_shapes`; rows must agree and the
    shapes must account for all `num_tokens` image tokens."""
    if isinstance(img_shapes, tuple) and len(img_shapes) == 3 and isinstance(img_shapes[0], int):
        img_shapes = [img_shapes]
    rows = [(tuple(row),) if isinstance(row[0], int) else tuple(tuple(s) for s in row)
            for row in img_shapes]
    if not rows or any(row != rows[0] for row in rows):
        raise ValueError(f"img_shapes must be the same for every row, got {img_shapes}")
    shapes = tuple(tuple(int(n) for n in s) for s in rows[0])
    if any(len(s) != 3 or min(s) <= 0 for s in shapes):
        raise ValueError(f"img_shapes entries must be (frames, rows, columns), got {shapes}")
    if sum(math.prod(s) for s in shapes) != num_tokens:
        raise ValueError(f"img_shapes {shapes} cover {sum(math.prod(s) for s in shapes)} "
                         f"tokens but hidden_states has {num_tokens}")
    return shapes


def _per_row(values, batch: int, name: str, device: torch.device) -> torch.Tensor:
    values = torch.as_tensor(values, device=device).reshape(-1)
    if values.numel() not in (1, batch):
        raise ValueError(f"{name} must have one value or one per row ({batch}), "
                         f"got {values.numel()}")
    return values.expand(batch)


# diffusers module -> ours, outside the blocks
_TOP_LEVEL_NAMES = {
    "time_text_embed.timestep_embedder.linear_1": "time_embed.linear_1",
    "time_text_embed.timestep_embedder.linear_2": "time_embed.linear_2",
    "time_text_embed.addition_t_embedding": "time_embed.addition_t_embedding",
    "txt_norm": "txt_norm", "img_in": "img_in", "txt_in": "txt_in",
    "norm_out.linear": "norm_out", "proj_out": "proj_out",
}
# diffusers module in a block -> (our module, its row slot, number of slots fused into it)
_BLOCK_NAMES = {
    "img_mod.1": ("mod", 0, 2), "txt_mod.1": ("mod", 1, 2),
    "attn.to_q": ("img_qkv", 0, 3), "attn.to_k": ("img_qkv", 1, 3),
    "attn.to_v": ("img_qkv", 2, 3),
    "attn.add_q_proj": ("txt_qkv", 0, 3), "attn.add_k_proj": ("txt_qkv", 1, 3),
    "attn.add_v_proj": ("txt_qkv", 2, 3),
    "attn.to_out.0": ("img_out", 0, 1), "attn.to_add_out": ("txt_out", 0, 1),
    "img_mlp.net.0.proj": ("img_fc1", 0, 1), "img_mlp.net.2": ("img_fc2", 0, 1),
    "txt_mlp.net.0.proj": ("txt_fc1", 0, 1), "txt_mlp.net.2": ("txt_fc2", 0, 1),
}
# diffusers' QK-norm modules -> our parameters
_BLOCK_NORMS = {"attn.norm_q": "img_q_norm", "attn.norm_k": "img_k_norm",
                "attn.norm_added_q": "txt_q_norm", "attn.norm_added_k": "txt_k_norm"}


def _our_name(name: str) -> tuple[str, int, int]:
    """diffusers parameter name -> (our parameter name, row slot, slots)."""
    module, leaf = name.rsplit(".", 1)
    if module in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[module]}.{leaf}", 0, 1
    parts = module.split(".", 2)
    if len(parts) == 3 and parts[0] == "transformer_blocks" and parts[1].isdigit():
        prefix, local = f"blocks.{parts[1]}", parts[2]
        if local in _BLOCK_NORMS and leaf == "weight":
            return f"{prefix}.{_BLOCK_NORMS[local]}", 0, 1
        if local in _BLOCK_NAMES:
            ours, slot, slots = _BLOCK_NAMES[local]
            return f"{prefix}.{ours}.{leaf}", slot, slots
    raise CheckpointError(f"unexpected weight {name!r} for a Qwen-Image transformer")


class DiffusersWeightLoader:
    """Copies diffusers-named tensors into the model's (fused) parameters, one at a time, and
    checks at the end that every parameter was filled exactly."""

    def __init__(self, model: QwenImageTransformer) -> None:
        self.params = dict(model.named_parameters())
        self.filled: dict[str, set[int]] = {}
        self.slots: dict[str, int] = {}

    @torch.no_grad()
    def load(self, name: str, tensor: torch.Tensor) -> None:
        ours, slot, slots = _our_name(name)
        if ours not in self.params:
            raise CheckpointError(f"weight {name!r} does not fit this config (no {ours})")
        param = self.params[ours]
        rows = param.shape[0] // slots
        target = param[slot * rows:(slot + 1) * rows]
        if tuple(tensor.shape) != tuple(target.shape):
            raise CheckpointError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                  f"expected {tuple(target.shape)}")
        if slot in self.filled.setdefault(ours, set()):
            raise CheckpointError(f"weight {name!r} given twice")
        target.copy_(tensor)
        self.filled[ours].add(slot)
        self.slots[ours] = slots

    def finish(self) -> None:
        missing = [n for n in self.params if len(self.filled.get(n, ())) != self.slots.get(n, 1)]
        if missing:
            raise CheckpointError(f"checkpoint lacks weights for {len(missing)} parameters, "
                                  f"e.g. {missing[:3]}")


_OUTPUT_PROJECTIONS = ("img_out", "txt_out", "img_fc2", "txt_fc2")


@torch.no_grad()
def init_dummy_weights(model: QwenImageTransformer, seed: int = 0, std: float = 0.02) -> None:
    """Random weights for benchmarks, generated on the model's device: norms at one, the rest
    normal(0, std), the residual branches' output projections scaled by 1/sqrt(2 * layers) so a
    deep stack stays well inside bf16's range."""
    generator = torch.Generator(device=model.device).manual_seed(seed)
    out_std = std / math.sqrt(2 * model.config.num_layers)
    for name, param in model.named_parameters():
        module = name.split(".")[-2] if "." in name else ""
        if name.endswith(("_norm", "norm.weight")):
            param.fill_(1.0)
        elif module in _OUTPUT_PROJECTIONS and name.endswith("weight"):
            param.normal_(0.0, out_std, generator=generator)
        else:
            param.normal_(0.0, std, generator=generator)
