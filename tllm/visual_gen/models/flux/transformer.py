"""FLUX.1's transformer (diffusers' `FluxTransformer2DModel`, our implementation): packed 2x2
latent patches and T5 states in, a timestep (+ guidance for FLUX.1-dev) + pooled CLIP
embedding driving AdaLN everywhere, double-stream blocks (each stream its own weights, one
joint attention: Qwen-Image's MMDiT block, the same computation) then single-stream blocks
over the joint sequence (attention and MLP in parallel, one fused input projection), and a
modulated final norm and projection out. RoPE over 3 position axes (text ids and image ids
as the pipeline gives them).

Our joint sequence is [image, text] (diffusers' is [text, image]: attention does not depend
on key order, and every other op is per token). Loads diffusers' checkpoints and names,
fusing Q/K/V (and, in single blocks, the MLP's input projection with them) as it loads."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tllm.visual_gen.models.checkpoint import load_named, transformer_from_folder
from tllm.visual_gen.models.fused_weights import FusedWeightLoader, diffusers_views
from tllm.visual_gen.models.qwen_image.blocks import (KeyPadding, QwenImageBlock,
                                                      gated_residual, joint_attention,
                                                      modulated_norm, qk_norm_rope)
from tllm.visual_gen.models.qwen_image.rope import RopeTables
from tllm.visual_gen.step_cache import BlockStack, StepCache, run_blocks

TIMESTEP_CHANNELS = 256
ROPE_THETA = 10000
# TeaCache's published rescale polynomial for FLUX.1 (ali-vilab/TeaCache, TeaCache4FLUX;
# highest power first), fitted on the first double block's modulated image input
TEACACHE_COEFFICIENTS = (4.98651651e+02, -2.83781631e+02, 5.58554382e+01, -3.82021401e+00,
                         2.64230861e-01)


@dataclass(frozen=True)
class FluxConfig:
    """diffusers' FluxTransformer2DModel config (same names; defaults: FLUX.1-schnell)."""
    patch_size: int = 1
    in_channels: int = 64
    out_channels: int | None = None
    num_layers: int = 19
    num_single_layers: int = 38
    attention_head_dim: int = 128
    num_attention_heads: int = 24
    joint_attention_dim: int = 4096
    pooled_projection_dim: int = 768
    guidance_embeds: bool = False
    axes_dims_rope: tuple[int, ...] = (16, 56, 56)

    def __post_init__(self) -> None:
        object.__setattr__(self, "axes_dims_rope", tuple(self.axes_dims_rope))
        if sum(self.axes_dims_rope) != self.attention_head_dim or any(
                d % 2 for d in self.axes_dims_rope):
            raise ValueError(f"axes_dims_rope {self.axes_dims_rope} must be even dims summing "
                             f"to attention_head_dim {self.attention_head_dim}")
        if self.patch_size != 1:
            raise ValueError("only patch_size 1 (the pipeline packs 2x2 patches) is supported")

    @classmethod
    def from_dict(cls, d: Mapping) -> FluxConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


FLUX1_DEV = FluxConfig(guidance_embeds=True)
FLUX1_SCHNELL = FluxConfig()


def timestep_features(t: torch.Tensor, channels: int = TIMESTEP_CHANNELS) -> torch.Tensor:
    """Sinusoids of t (already scaled to [0, 1000]), cos first, float32: diffusers'
    Timesteps(channels, flip_sin_to_cos=True, downscale_freq_shift=0)."""
    half = channels // 2
    exponent = -math.log(10000) * torch.arange(half, dtype=torch.float32, device=t.device) / half
    args = t[:, None].float() * exponent.exp()[None, :]
    return torch.cat([args.cos(), args.sin()], dim=-1)


class MLPEmbedding(nn.Module):
    """linear_1, SiLU, linear_2 (diffusers' TimestepEmbedding and text projection)."""

    def __init__(self, in_dim: int, dim: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(in_dim, dim)
        self.linear_2 = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.silu(self.linear_1(x)))


class FluxSingleBlock(nn.Module):
    """A single-stream block: x + gate * out(cat(attention(h), gelu(mlp(h)))), h the
    modulated norm of x; Q, K, V and the MLP's input come from one projection."""

    def __init__(self, dim: int, num_heads: int, head_dim: int) -> None:
        super().__init__()
        self.dim, self.num_heads, self.head_dim = dim, num_heads, head_dim
        self.mod = nn.Linear(dim, 3 * dim)              # shift, scale, gate
        self.qkv_mlp = nn.Linear(dim, 3 * dim + 4 * dim)
        self.q_norm, self.k_norm = nn.Parameter(torch.ones(head_dim)), nn.Parameter(
            torch.ones(head_dim))
        self.proj_out = nn.Linear(5 * dim, dim)

    def forward(self, x: torch.Tensor, silu_temb: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        shift, scale, gate = self.mod(silu_temb)[:, None].chunk(3, dim=-1)
        h = modulated_norm(x, shift, scale, None)
        qkv, mlp = self.qkv_mlp(h).split([3 * self.dim, 4 * self.dim], dim=-1)
        batch, seq = x.shape[:2]
        q, k, v = (x.new_empty(batch, seq, self.num_heads, self.head_dim) for _ in range(3))
        qk_norm_rope(qkv, self.q_norm, self.k_norm, cos, sin, (q, k, v), 0)
        (attn,) = joint_attention(q, k, v, KeyPadding())
        out = self.proj_out(torch.cat([attn, F.gelu(mlp, approximate="tanh")], dim=-1))
        return gated_residual(x, out, gate, None)


class FluxTransformer(nn.Module):
    """FLUX.1's transformer; `forward` gives diffusers' `forward(..., return_dict=False)[0]`."""

    supports_step_cache = True

    def __init__(self, config: FluxConfig) -> None:
        super().__init__()
        self.config = config
        dim, heads = config.inner_dim, config.num_attention_heads
        head_dim = config.attention_head_dim
        self.time_embed = MLPEmbedding(TIMESTEP_CHANNELS, dim)
        self.guidance_embed = (MLPEmbedding(TIMESTEP_CHANNELS, dim) if config.guidance_embeds
                               else None)
        self.text_embed = MLPEmbedding(config.pooled_projection_dim, dim)
        self.context_in = nn.Linear(config.joint_attention_dim, dim)
        self.x_in = nn.Linear(config.in_channels, dim)
        self.blocks = nn.ModuleList(QwenImageBlock(dim, heads, head_dim)
                                    for _ in range(config.num_layers))
        self.single_blocks = nn.ModuleList(FluxSingleBlock(dim, heads, head_dim)
                                           for _ in range(config.num_single_layers))
        self.norm_out = nn.Linear(dim, 2 * dim)     # the final AdaLN: scale, then shift
        self.proj_out = nn.Linear(dim, config.out_channels or config.in_channels)
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.x_in.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.x_in.weight.device

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                pooled_projections: torch.Tensor, timestep: torch.Tensor,
                img_ids: torch.Tensor, txt_ids: torch.Tensor,
                guidance: torch.Tensor | None = None,
                step_cache: StepCache | None = None) -> torch.Tensor:
        """hidden_states [B, N, in_channels] packed latents; encoder_hidden_states [B, L,
        joint_attention_dim]; pooled_projections [B, pooled_projection_dim]; timestep [B] in
        [0, 1]; img_ids [N, 3], txt_ids [L, 3]; guidance [B] (FLUX.1-dev's scale);
        step_cache: see step_cache.py. Returns [B, N, out_channels]."""
        num_img = hidden_states.shape[1]
        img = self.x_in(hidden_states)
        txt = self.context_in(encoder_hidden_states)
        silu_temb = F.silu(self._conditioning(timestep, guidance, pooled_projections, img.dtype))
        stack = self._block_stack(silu_temb, self.rope_tables(img_ids, txt_ids), num_img)
        (img,) = stack.hidden(run_blocks(stack, (img, txt), step_cache))
        scale, shift = self.norm_out(silu_temb[:, None]).chunk(2, dim=-1)
        return self.proj_out(modulated_norm(img, shift, scale, None))

    def _block_stack(self, silu_temb: torch.Tensor, rope: RopeTables,
                     num_img: int) -> BlockStack:
        """The double- then single-stream blocks as one stack, for run_blocks: the state is
        (img, txt) while double blocks run, the joint [image, text] sequence after."""
        joint_rope = (torch.cat([rope.img_cos, rope.txt_cos]),
                      torch.cat([rope.img_sin, rope.txt_sin]))
        num_double = len(self.blocks)

        def run(start: int, stop: int, state):
            for index in range(start, stop):
                if index < num_double:
                    state = self.blocks[index](*state, silu_temb, rope, KeyPadding(), None)
                    continue
                if isinstance(state, tuple):
                    state = torch.cat(state, dim=1)
                state = self.single_blocks[index - num_double](state, silu_temb, *joint_rope)
            return state

        def hidden(state) -> list[torch.Tensor]:     # the image stream's hidden states
            return [state[0] if isinstance(state, tuple) else state[:, :num_img]]

        def with_residuals(state, residuals):
            if isinstance(state, tuple):
                return state[0] + residuals[0], state[1]
            return torch.cat([state[:, :num_img] + residuals[0], state[:, num_img:]], dim=1)

        def modulated_input(state) -> torch.Tensor:
            if num_double:
                return self.blocks[0].modulated_input(state[0], silu_temb, None)
            return hidden(state)[0]     # no double block (not a released shape)

        num_blocks = num_double + len(self.single_blocks)
        return BlockStack(first=lambda state: run(0, 1, state),
                          rest=lambda state: run(1, num_blocks, state),
                          modulated_input=modulated_input, hidden=hidden,
                          with_residuals=with_residuals, coefficients=TEACACHE_COEFFICIENTS)

    def _conditioning(self, timestep, guidance, pooled, dtype) -> torch.Tensor:
        """The AdaLN input [B, d]: timestep (+ guidance) + pooled-text embeddings."""
        emb = self.time_embed(timestep_features(timestep.to(dtype) * 1000).to(pooled.dtype))
        if self.guidance_embed is not None:
            if guidance is None:
                raise ValueError("this transformer (guidance_embeds) needs guidance")
            emb = emb + self.guidance_embed(
                timestep_features(guidance.to(dtype) * 1000).to(pooled.dtype))
        return emb + self.text_embed(pooled)

    def rope_tables(self, img_ids: torch.Tensor, txt_ids: torch.Tensor) -> RopeTables:
        img_cos, img_sin = self._rope(img_ids)
        txt_cos, txt_sin = self._rope(txt_ids)
        return RopeTables(img_cos, img_sin, txt_cos, txt_sin)

    def _rope(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """float32 (cos, sin) [tokens, head_dim / 2] of ids [tokens, 3]: angles in float64, as
        diffusers' FluxPosEmbed computes them."""
        angles = []
        positions = ids.float()
        freq_dtype = torch.float32 if ids.device.type == "mps" else torch.float64
        for axis, dim in enumerate(self.config.axes_dims_rope):
            inv = 1.0 / ROPE_THETA ** (torch.arange(0, dim, 2, dtype=freq_dtype,
                                                    device=ids.device) / dim)
            angles.append(torch.outer(positions[:, axis], inv))
        angles = torch.cat(angles, dim=-1)
        return angles.cos().float(), angles.sin().float()

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device = "cpu") -> FluxTransformer:
        return transformer_from_folder(cls, FluxConfig, _loader, path, dtype, device)

    def load_diffusers_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        load_named(_loader(self), state_dict.items())

    def diffusers_state_dict(self, names: list[str]) -> dict[str, torch.Tensor]:
        """Our weights under diffusers' `names` (views, no copies)."""
        return diffusers_views(self, names, _our_name)


def _loader(model: FluxTransformer) -> FusedWeightLoader:
    return FusedWeightLoader(model, _our_name, "FLUX")


_TOP = {
    "time_text_embed.timestep_embedder": "time_embed",
    "time_text_embed.guidance_embedder": "guidance_embed",
    "time_text_embed.text_embedder": "text_embed",
    "context_embedder": "context_in", "x_embedder": "x_in",
    "norm_out.linear": "norm_out", "proj_out": "proj_out",
}
# diffusers module in a double block -> (our module, slot, slots)
_DOUBLE = {
    "norm1.linear": ("mod", 0, 2), "norm1_context.linear": ("mod", 1, 2),
    "attn.to_q": ("img_qkv", 0, 3), "attn.to_k": ("img_qkv", 1, 3),
    "attn.to_v": ("img_qkv", 2, 3),
    "attn.add_q_proj": ("txt_qkv", 0, 3), "attn.add_k_proj": ("txt_qkv", 1, 3),
    "attn.add_v_proj": ("txt_qkv", 2, 3),
    "attn.to_out.0": ("img_out", 0, 1), "attn.to_add_out": ("txt_out", 0, 1),
    "ff.net.0.proj": ("img_fc1", 0, 1), "ff.net.2": ("img_fc2", 0, 1),
    "ff_context.net.0.proj": ("txt_fc1", 0, 1), "ff_context.net.2": ("txt_fc2", 0, 1),
}
_DOUBLE_NORMS = {"attn.norm_q": "img_q_norm", "attn.norm_k": "img_k_norm",
                 "attn.norm_added_q": "txt_q_norm", "attn.norm_added_k": "txt_k_norm"}
# qkv_mlp rows: q, k, v (dim each), then the MLP's 4 * dim: slots of dim rows, the MLP 4 slots
_SINGLE = {"norm.linear": ("mod", 0, 1), "attn.to_q": ("qkv_mlp", 0, 7),
           "attn.to_k": ("qkv_mlp", 1, 7), "attn.to_v": ("qkv_mlp", 2, 7),
           "proj_out": ("proj_out", 0, 1)}
_SINGLE_NORMS = {"attn.norm_q": "q_norm", "attn.norm_k": "k_norm"}


def _our_name(name: str) -> tuple:
    """diffusers parameter name -> (our parameter, row slot, slots[, span])."""
    module, leaf = name.rsplit(".", 1)
    for theirs, ours in _TOP.items():
        if module == theirs or module.startswith(theirs + "."):
            return f"{ours}{module[len(theirs):]}.{leaf}", 0, 1
    kind, index, local = (module.split(".", 2) + ["", ""])[:3]
    if kind == "transformer_blocks":
        prefix, names, norms = f"blocks.{index}", _DOUBLE, _DOUBLE_NORMS
    elif kind == "single_transformer_blocks":
        prefix, names, norms = f"single_blocks.{index}", _SINGLE, _SINGLE_NORMS
        if local == "proj_mlp":     # the MLP's 4 * dim rows, after q, k and v
            return f"{prefix}.qkv_mlp.{leaf}", 3, 7, 4
    else:
        return name, 0, 1
    if local in norms and leaf == "weight":
        return f"{prefix}.{norms[local]}", 0, 1
    if local in names:
        ours, slot, slots = names[local]
        return f"{prefix}.{ours}.{leaf}", slot, slots
    return f"{prefix}.{local}.{leaf}", 0, 1
