"""diffusers' QwenImageTransformer2DModel behind the forward of our transformer: the reference
the pipelines can run on (`transformer_impl="diffusers"`), e.g. to compare against ours."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


class DiffusersQwenImageTransformer(nn.Module):
    """Wraps a diffusers QwenImageTransformer2DModel; `config` is diffusers' config."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cpu") -> DiffusersQwenImageTransformer:
        from diffusers import QwenImageTransformer2DModel
        model = QwenImageTransformer2DModel.from_pretrained(str(path), torch_dtype=dtype)
        return cls(model.to(device).eval())

    @property
    def config(self):
        return self.model.config

    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_hidden_states_mask: torch.Tensor | None, timestep: torch.Tensor,
                img_shapes: list, guidance: torch.Tensor | None = None,
                additional_t_cond: torch.Tensor | None = None) -> torch.Tensor:
        return self.model(hidden_states=hidden_states,
                          encoder_hidden_states=encoder_hidden_states,
                          encoder_hidden_states_mask=encoder_hidden_states_mask,
                          timestep=timestep, img_shapes=img_shapes, guidance=guidance,
                          additional_t_cond=additional_t_cond, return_dict=False)[0]
