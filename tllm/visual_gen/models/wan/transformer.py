"""Wan 2.1 / 2.2's video transformer (diffusers' `WanTransformer3DModel`, our implementation,
text-to-video): a 3D patch embedding of the latent video, a timestep embedding projected to
six modulation vectors per block (added to each block's learned table), blocks of
self-attention with 3D RoPE (frame, row, column), cross-attention to the UMT5 text states
and a GELU MLP, then a modulated final norm and projection, unpatchified back to a video.

Numerics follow diffusers' (float32 norms and modulation, QK-RMSNorm across heads, the time
embedder and the modulation tables kept in float32 when the rest is bf16). Loads diffusers'
checkpoints and names, fusing self-attention's Q/K/V and cross-attention's K/V as it loads."""
from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tllm.kernels.triton.ltx2_norms import norm_rope_ref
from tllm.loader.hf import CheckpointError, iter_safetensors, safetensors_files
from tllm.visual_gen.models.checkpoint import load_named
from tllm.visual_gen.models.flux.transformer import MLPEmbedding, timestep_features
from tllm.visual_gen.models.fused_weights import FusedWeightLoader, diffusers_views
from tllm.visual_gen.step_cache import BlockStack, StepCache, run_blocks

ROPE_THETA = 10000.0
# TeaCache's published rescale polynomials for Wan 2.1 text-to-video (ali-vilab/TeaCache,
# TeaCache4Wan2.1: the fits on the timestep embedding `e`; highest power first), by the
# transformer's width: 14B (5120, also each expert of Wan 2.2 A14B, the same shape) and
# 1.3B (1536). Wan 2.2 TI2V-5B (3072) has no published fit (see WanTransformer._block_stack).
TEACACHE_COEFFICIENTS = {
    5120: (-5784.54975374, 5449.50911966, -1811.16591783, 256.27178429, -13.02252404),
    1536: (2.39676752e+03, -1.31110545e+03, 2.01331979e+02, -8.29855975e+00, 1.37887774e-01),
}


@dataclass(frozen=True)
class WanConfig:
    """diffusers' WanTransformer3DModel config (same names; defaults: Wan 2.1/2.2 14B)."""
    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 40
    attention_head_dim: int = 128
    in_channels: int = 16
    out_channels: int = 16
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 13824
    num_layers: int = 40
    cross_attn_norm: bool = True
    qk_norm: str | None = "rms_norm_across_heads"
    eps: float = 1e-6
    image_dim: int | None = None
    added_kv_proj_dim: int | None = None
    rope_max_seq_len: int = 1024
    pos_embed_seq_len: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "patch_size", tuple(self.patch_size))
        if self.image_dim is not None or self.added_kv_proj_dim is not None:
            raise ValueError("image-conditioned Wan transformers (image_dim, "
                             "added_kv_proj_dim) are not supported")
        if self.qk_norm != "rms_norm_across_heads":
            raise ValueError(f"qk_norm {self.qk_norm!r} is not supported")

    @classmethod
    def from_dict(cls, d: Mapping) -> WanConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    @property
    def inner_dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim


WAN22_TI2V_5B = WanConfig(num_attention_heads=24, in_channels=48, out_channels=48,
                          ffn_dim=14336, num_layers=30)
WAN22_T2V_A14B = WanConfig()
# kept in float32 when the model runs in bf16/fp16, as diffusers keeps them
_FP32_MODULES = ("time_embed", "scale_shift_table")


class WanRope:
    """cos/sin [tokens, inner_dim / 2] (float32) of a (frames, rows, columns) token grid, one
    per rotated pair of every head: each head's pairs split between the axes as diffusers
    splits them (angles in float64), the same for every head."""

    def __init__(self, head_dim: int, num_heads: int) -> None:
        spatial = 2 * (head_dim // 6)
        self.dims = (head_dim - 2 * spatial, spatial, spatial)
        self.num_heads = num_heads
        self._last: tuple[tuple, tuple[torch.Tensor, torch.Tensor]] | None = None

    def tables(self, grid: tuple[int, int, int], device: torch.device):
        key = (grid, str(device))
        if self._last is None or self._last[0] != key:     # one video size at a time
            axes = []
            for axis, (size, dim) in enumerate(zip(grid, self.dims)):
                inv = 1.0 / ROPE_THETA ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
                angles = torch.outer(torch.arange(size, dtype=torch.float64), inv)
                shape = [1, 1, 1, dim // 2]
                shape[axis] = size
                axes.append(angles.view(shape).expand(*grid, dim // 2))
            angles = torch.cat(axes, dim=-1).reshape(math.prod(grid), -1)
            angles = angles.repeat(1, self.num_heads)
            self._last = (key, (angles.cos().float().to(device),
                                angles.sin().float().to(device)))
        return self._last[1]


def uses_triton(x: torch.Tensor) -> bool:
    """Whether the elementwise work runs in the Triton kernels (CUDA tensors; tests also
    run them on the CPU under the Triton interpreter)."""
    return x.is_cuda


def qk_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            rope: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """RMSNorm across the heads (x [B, S, H * D], rows may be strided), then RoPE."""
    tables = () if rope is None else rope
    if uses_triton(x):
        from tllm.kernels.triton.ltx2_norms import norm_rope
        return norm_rope(x, weight, eps, *tables)
    return norm_rope_ref(x, weight, eps, *tables)


def modulated_norm(x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor, eps: float,
                   residual: tuple[torch.Tensor, torch.Tensor] | None = None):
    """LayerNorm(x) * (1 + scale) + shift in float32, rounded once to x's dtype; with
    residual=(y, gate), first x = x + gate * y (float32, rounded): returns (x, that norm).
    shift, scale, gate: [B, 1, d] float32 views of one tensor."""
    if uses_triton(x):
        from tllm.kernels.triton.mmdit import adaln_modulate
        return adaln_modulate(x, shift, scale, eps, None, residual)
    if residual is not None:
        x = gated_add(x, *residual)
    h = (F.layer_norm(x.float(), x.shape[-1:], eps=eps) * (1 + scale) + shift).type_as(x)
    return h if residual is None else (x, h)


def gated_add(x: torch.Tensor, y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return (x.float() + y.float() * gate).type_as(x)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int) -> torch.Tensor:
    """SDPA over [B, S, H * D] inputs -> [B, S, H * D] (cuDNN/flash preferred on CUDA)."""
    q, k, v = (t.unflatten(-1, (heads, -1)).transpose(1, 2) for t in (q, k, v))
    with _sdpa_backends(q.device):
        out = F.scaled_dot_product_attention(q, k, v)
    return out.transpose(1, 2).flatten(2)


def _sdpa_backends(device: torch.device):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                        SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], set_priority=True)


class WanBlock(nn.Module):
    """Self-attention (RoPE), cross-attention to the text, MLP; the modulation vectors are
    shift, scale, gate for self-attention, then for the MLP. The residual adds are fused
    into the norm that follows them (on CUDA, one Triton kernel each)."""

    def __init__(self, config: WanConfig) -> None:
        super().__init__()
        dim = config.inner_dim
        self.num_heads, self.eps = config.num_attention_heads, config.eps
        self.self_qkv = nn.Linear(dim, 3 * dim)
        self.self_q_norm, self.self_k_norm = nn.Parameter(torch.ones(dim)), nn.Parameter(
            torch.ones(dim))
        self.self_out = nn.Linear(dim, dim)
        self.cross_q, self.cross_kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)
        self.cross_q_norm, self.cross_k_norm = nn.Parameter(torch.ones(dim)), nn.Parameter(
            torch.ones(dim))
        self.cross_out = nn.Linear(dim, dim)
        self.norm2 = nn.LayerNorm(dim, config.eps) if config.cross_attn_norm else None
        self.fc1, self.fc2 = nn.Linear(dim, config.ffn_dim), nn.Linear(config.ffn_dim, dim)
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 6, dim))

    def forward(self, x: torch.Tensor, text: torch.Tensor, temb_proj: torch.Tensor,
                rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        mods = self._modulations(temb_proj)
        h = modulated_norm(x, mods[0], mods[1], self.eps)
        x, h = self._cross_norm(x, self._self_attention(h, rope), mods)
        x, h = modulated_norm(x, mods[3], mods[4], self.eps,
                              (self._cross_attention(h, text), mods[8]))
        return gated_add(x, self.fc2(F.gelu(self.fc1(h), approximate="tanh")), mods[5])

    def modulated_input(self, x: torch.Tensor, temb_proj: torch.Tensor) -> torch.Tensor:
        """Self-attention's modulated input (step caching's signal)."""
        mods = self._modulations(temb_proj)
        return modulated_norm(x, mods[0], mods[1], self.eps)

    def _modulations(self, temb_proj: torch.Tensor) -> list[torch.Tensor]:
        """[B, 1, d] float32 views of one tensor: shift, scale, gate (self-attention), the
        same for the MLP, norm2's bias and weight - 1 (norm2 as a modulated norm), ones
        (the cross-attention's ungated residual)."""
        table = self.scale_shift_table + temb_proj.float()           # [B, 6, d]
        extra = table.new_ones(table.shape[0], 3, table.shape[2])
        if self.norm2 is not None:
            extra[:, 0], extra[:, 1] = self.norm2.bias.float(), self.norm2.weight.float() - 1
        return list(torch.cat([table, extra], dim=1).split(1, dim=1))

    def _cross_norm(self, x, attn, mods):
        """x + gate * attn, and norm2 of it (the cross-attention's input)."""
        if self.norm2 is None:
            x = gated_add(x, attn, mods[2])
            return x, x
        if uses_triton(x):
            from tllm.kernels.triton.mmdit import adaln_modulate
            return adaln_modulate(x, mods[6], mods[7], self.eps, None, (attn, mods[2]))
        x = gated_add(x, attn, mods[2])
        return x, F.layer_norm(x.float(), x.shape[-1:], self.norm2.weight.float(),
                               self.norm2.bias.float(), self.eps).type_as(x)

    def _self_attention(self, h: torch.Tensor, rope) -> torch.Tensor:
        q, k, v = self.self_qkv(h).chunk(3, dim=-1)
        q = qk_norm(q, self.self_q_norm, self.eps, rope)
        k = qk_norm(k, self.self_k_norm, self.eps, rope)
        return self.self_out(attention(q, k, v, self.num_heads))

    def _cross_attention(self, h: torch.Tensor, text: torch.Tensor) -> torch.Tensor:
        q = qk_norm(self.cross_q(h), self.cross_q_norm, self.eps)
        k, v = self.cross_kv(text).chunk(2, dim=-1)
        k = qk_norm(k, self.cross_k_norm, self.eps)
        return self.cross_out(attention(q, k, v, self.num_heads))


class WanTransformer(nn.Module):
    """Wan's transformer; `forward` gives diffusers' `forward(..., return_dict=False)[0]`."""

    supports_step_cache = True

    def __init__(self, config: WanConfig) -> None:
        super().__init__()
        self.config = config
        dim = config.inner_dim
        self.rope = WanRope(config.attention_head_dim, config.num_attention_heads)
        self.patch_embedding = nn.Conv3d(config.in_channels, dim, config.patch_size,
                                         stride=config.patch_size)
        self.time_embed = MLPEmbedding(config.freq_dim, dim)
        self.time_proj = nn.Linear(dim, 6 * dim)
        self.text_embed_1 = nn.Linear(config.text_dim, dim)
        self.text_embed_2 = nn.Linear(dim, dim)
        self.blocks = nn.ModuleList(WanBlock(config) for _ in range(config.num_layers))
        self.proj_out = nn.Linear(dim, config.out_channels * math.prod(config.patch_size))
        self.scale_shift_table = nn.Parameter(torch.zeros(1, 2, dim))
        self.requires_grad_(False)

    @property
    def dtype(self) -> torch.dtype:
        return self.proj_out.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.proj_out.weight.device

    def keep_fp32_parts(self) -> WanTransformer:
        """The time embedder and the modulation tables back in float32 (after a cast)."""
        for name, module in self.named_modules():
            if name == "time_embed":
                module.float()
        for name, param in self.named_parameters():
            if name.endswith("scale_shift_table"):
                param.data = param.data.float()
        return self

    def forward(self, hidden_states: torch.Tensor, timestep: torch.Tensor,
                encoder_hidden_states: torch.Tensor,
                step_cache: StepCache | None = None) -> torch.Tensor:
        """hidden_states [B, C, F, H, W] latents; timestep [B] in [0, 1000]; text states
        [B, L, text_dim]; step_cache: see step_cache.py. Returns [B, out_channels, F, H, W]."""
        batch, _, frames, height, width = hidden_states.shape
        pt, ph, pw = self.config.patch_size
        grid = (frames // pt, height // ph, width // pw)
        rope = self.rope.tables(grid, hidden_states.device)
        x = self.patch_embedding(hidden_states).flatten(2).transpose(1, 2).contiguous()
        features = timestep_features(timestep.reshape(-1), self.config.freq_dim)
        temb = self.time_embed(features.to(self.time_embed.linear_1.weight.dtype))
        temb = temb.type_as(encoder_hidden_states)
        temb_proj = self.time_proj(F.silu(temb)).unflatten(1, (6, -1))
        text = self.text_embed_2(F.gelu(self.text_embed_1(encoder_hidden_states),
                                        approximate="tanh"))
        x = run_blocks(self._block_stack(text, temb, temb_proj, rope), x, step_cache)
        shift, scale = (self.scale_shift_table + temb[:, None]).chunk(2, dim=1)
        x = modulated_norm(x, shift.float().contiguous(), scale.float().contiguous(),
                           self.config.eps)
        out = self.proj_out(x).reshape(batch, *grid, pt, ph, pw, -1)
        return out.permute(0, 7, 1, 4, 2, 5, 3, 6).flatten(6, 7).flatten(4, 5).flatten(2, 3)

    def _block_stack(self, text, temb, temb_proj, rope) -> BlockStack:
        """The blocks over x, for run_blocks. TeaCache's signal is the one its polynomial was
        fitted on: the timestep embedding where a published fit exists for this width, else
        the first block's modulated input (used as is)."""
        coefficients = TEACACHE_COEFFICIENTS.get(self.config.inner_dim)

        def run(blocks, x):
            for block in blocks:
                x = block(x, text, temb_proj, rope)
            return x

        def modulated_input(x: torch.Tensor) -> torch.Tensor:
            if coefficients is not None:
                return temb
            return self.blocks[0].modulated_input(x, temb_proj)

        return BlockStack(first=lambda x: run(self.blocks[:1], x),
                          rest=lambda x: run(self.blocks[1:], x),
                          modulated_input=modulated_input, hidden=lambda x: [x],
                          with_residuals=lambda x, residuals: x + residuals[0],
                          coefficients=coefficients, network=self)

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                        device: str | torch.device = "cpu") -> WanTransformer:
        """A diffusers `transformer/` folder, read shard by shard onto `device`."""
        path = Path(path)
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{path} has no config.json; expected a diffusers "
                                  "transformer folder")
        config = WanConfig.from_dict(json.loads((path / "config.json").read_text()))
        with torch.device("meta"):
            model = cls(config)
        model = model.to(dtype).keep_fp32_parts().to_empty(device=device)
        load_named(_loader(model), iter_safetensors(safetensors_files(path),
                                                    str(torch.device(device))))
        return model.eval()

    def load_diffusers_state_dict(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        load_named(_loader(self), state_dict.items())

    def diffusers_state_dict(self, names: list[str]) -> dict[str, torch.Tensor]:
        return diffusers_views(self, names, _our_name)


def _loader(model: WanTransformer) -> FusedWeightLoader:
    return FusedWeightLoader(model, _our_name, "Wan")


_TOP = {"condition_embedder.time_embedder": "time_embed",
        "condition_embedder.time_proj": "time_proj",
        "condition_embedder.text_embedder.linear_1": "text_embed_1",
        "condition_embedder.text_embedder.linear_2": "text_embed_2"}
_BLOCK = {"attn1.to_q": ("self_qkv", 0, 3), "attn1.to_k": ("self_qkv", 1, 3),
          "attn1.to_v": ("self_qkv", 2, 3), "attn1.to_out.0": ("self_out", 0, 1),
          "attn2.to_q": ("cross_q", 0, 1), "attn2.to_k": ("cross_kv", 0, 2),
          "attn2.to_v": ("cross_kv", 1, 2), "attn2.to_out.0": ("cross_out", 0, 1),
          "ffn.net.0.proj": ("fc1", 0, 1), "ffn.net.2": ("fc2", 0, 1)}
_NORMS = {"attn1.norm_q": "self_q_norm", "attn1.norm_k": "self_k_norm",
          "attn2.norm_q": "cross_q_norm", "attn2.norm_k": "cross_k_norm"}


def _our_name(name: str) -> tuple | None:
    """diffusers parameter name -> (our parameter, row slot, slots); None to skip."""
    if "norm_added_q" in name:      # diffusers ignores these too
        return None
    if "." not in name:             # the output's scale_shift_table
        return name, 0, 1
    module, leaf = name.rsplit(".", 1)
    for theirs, ours in _TOP.items():
        if module == theirs or module.startswith(theirs + "."):
            return f"{ours}{module[len(theirs):]}.{leaf}", 0, 1
    parts = name.split(".", 2)
    if parts[0] != "blocks" or len(parts) < 3:
        return name, 0, 1
    prefix, local = f"blocks.{parts[1]}", parts[2].rsplit(".", 1)[0]
    if local in _NORMS and leaf == "weight":
        return f"{prefix}.{_NORMS[local]}", 0, 1
    if local in _BLOCK:
        ours, slot, slots = _BLOCK[local]
        return f"{prefix}.{ours}.{leaf}", slot, slots
    return f"{prefix}.{parts[2]}", 0, 1
