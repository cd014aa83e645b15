"""diffusers' Cosmos3OmniTransformer behind our transformer's forward: the reference the
pipeline can run on (`transformer_impl="diffusers"`), one forward per guidance branch as
diffusers' pipeline calls it."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tllm.visual_gen.models.cosmos3.rope import JointLayout
from tllm.visual_gen.models.cosmos3.transformer import (_LAYER, _TOP, Cosmos3Transformer,
                                                        GenTokens)


class DiffusersCosmos3(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cpu") -> DiffusersCosmos3:
        from diffusers import Cosmos3OmniTransformer
        model = Cosmos3OmniTransformer.from_pretrained(str(path), torch_dtype=dtype)
        return cls(model.to(device).eval())

    @classmethod
    def from_ours(cls, ours: Cosmos3Transformer) -> DiffusersCosmos3:
        """diffusers' model with our weights (same values, their layout)."""
        from diffusers import Cosmos3OmniTransformer
        config = {k: v for k, v in vars(ours.config).items() if k != "action_gen"}
        with torch.device("meta"):
            model = Cosmos3OmniTransformer(**config)
        model = model.to(ours.dtype).to_empty(device=ours.device)
        state = diffusers_state_dict(ours)
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.startswith("lm_head")]
        if missing or unexpected:
            raise ValueError(f"weights did not map: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
        model.rotary_emb.inv_freq.copy_(_inv_freq(ours.config).to(ours.device))
        return cls(model.eval())

    @property
    def config(self):
        return self.model.config

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    def forward(self, gen: GenTokens, timestep: float, layouts: list[JointLayout]):
        vision_out, sound_out = [], []
        for layout in layouts:
            kwargs = diffusers_inputs(self.model.config, gen, timestep, layout)
            vision, sound, _ = self.model(**kwargs, return_dict=False)
            vision_out.append(vision[0][0])
            sound_out.append(None if sound is None else sound[0])
        sound = None if sound_out[0] is None else torch.stack(sound_out)
        return torch.stack(vision_out), sound


def diffusers_inputs(config, gen: GenTokens, timestep: float, layout: JointLayout) -> dict:
    """diffusers' keyword arguments for one branch (its positions kept on the layout)."""
    device = layout.input_ids.device
    p = config.latent_patch_size
    c, t, h, w = gen.vision.shape
    grid = (t, -(-h // p), -(-w // p))
    frame = grid[1] * grid[2]
    und = layout.und_len
    num_vision = t * frame
    noisy = torch.tensor(gen.noisy_frames, device=device, dtype=torch.long)
    mse = torch.cat([torch.arange(und + f * frame, und + (f + 1) * frame, device=device)
                     for f in gen.noisy_frames])
    kwargs = dict(
        input_ids=layout.input_ids, text_indexes=torch.arange(und, device=device),
        position_ids=layout.positions.to(device), und_len=und,
        sequence_length=und + num_vision + (0 if gen.sound is None else gen.sound.shape[1]),
        vision_tokens=[gen.vision[None]],
        vision_token_shapes=[grid],
        vision_sequence_indexes=torch.arange(und, und + num_vision, device=device),
        vision_mse_loss_indexes=mse,
        vision_timesteps=torch.full((len(mse),), int(timestep), device=device),
        vision_noisy_frame_indexes=[noisy])
    if gen.sound is not None:
        sound_len = gen.sound.shape[1]
        rows = torch.arange(und + num_vision, und + num_vision + sound_len, device=device)
        kwargs.update(sound_tokens=[gen.sound], sound_token_shapes=[(sound_len, 1, 1)],
                      sound_sequence_indexes=rows, sound_mse_loss_indexes=rows.clone(),
                      sound_timesteps=torch.full((sound_len,), int(timestep), device=device),
                      sound_noisy_frame_indexes=[torch.arange(sound_len, device=device)])
    return kwargs


def diffusers_state_dict(ours: Cosmos3Transformer) -> dict[str, torch.Tensor]:
    """Our weights under diffusers' names, as views of our fused parameters."""
    params = dict(ours.named_parameters())
    out = {}
    theirs_of = {v: k for k, v in _TOP.items()}
    for name, param in params.items():
        module, _, leaf = name.rpartition(".")
        if module in theirs_of:
            out[f"{theirs_of[module]}.{leaf}"] = param
        elif not name.startswith("layers."):
            out[name] = param
    for i, layer in enumerate(ours.layers):
        for theirs, (mine, slot) in _LAYER.items():
            if mine.endswith("_gate_up") and layer.is_relu2 and slot == 0:
                continue
            is_norm = mine.endswith(("_norm", "_norm_for_gen"))
            for leaf in ("weight",) if is_norm else ("weight", "bias"):
                p = params.get(f"layers.{i}.{mine}" if is_norm else f"layers.{i}.{mine}.{leaf}")
                if p is None:
                    continue
                rows = layer.slot_rows(mine, slot)
                out[f"layers.{i}.{theirs}.{leaf}"] = p if rows is None else p[rows]
        for norm in ("input_layernorm", "input_layernorm_moe_gen", "post_attention_layernorm",
                     "post_attention_layernorm_moe_gen"):
            out[f"layers.{i}.{norm}.weight"] = params[f"layers.{i}.{norm}.weight"]
    return out


def _inv_freq(config) -> torch.Tensor:
    return 1.0 / (config.rope_theta ** (torch.arange(0, config.head_dim, 2,
                                                     dtype=torch.float32) / config.head_dim))
