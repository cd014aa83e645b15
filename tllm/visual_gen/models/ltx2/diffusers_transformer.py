"""diffusers' LTX2VideoTransformer3DModel behind our transformer's interface: the reference
the pipeline can run on (`transformer_impl="diffusers"`), called as diffusers' pipeline calls
it (one call for the guidance branches with cross attention, one for the isolated ones)."""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from tllm.visual_gen.models.ltx2.config import LTX2Config
from tllm.visual_gen.models.ltx2.transformer import LTX2Inputs, LTX2Transformer, our_name


class DiffusersText:
    """What diffusers' forward takes for the prompt: the connector outputs and their mask."""

    def __init__(self, video: torch.Tensor, audio: torch.Tensor, mask: torch.Tensor | None):
        self.video, self.audio, self.mask = video, audio, mask


class DiffusersLTX2(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model
        self.config = LTX2Config.from_dict(dict(model.config))

    @classmethod
    def from_pretrained(cls, path: str | Path, dtype: torch.dtype = torch.bfloat16,
                        device: torch.device | str = "cpu") -> DiffusersLTX2:
        from diffusers import LTX2VideoTransformer3DModel
        model = LTX2VideoTransformer3DModel.from_pretrained(str(path), torch_dtype=dtype)
        return cls(model.to(device).eval())

    @classmethod
    def from_ours(cls, ours: LTX2Transformer) -> DiffusersLTX2:
        """diffusers' model sharing our weights (views of our fused parameters, no copy)."""
        from diffusers import LTX2VideoTransformer3DModel
        with torch.device("meta"):
            model = LTX2VideoTransformer3DModel(**ours.config.to_diffusers())
        params = dict(ours.named_parameters())
        state = {}
        for name in model.state_dict():
            mine, rows = our_name(ours, name)
            state[name] = params[mine] if rows is None else params[mine][rows]
        model.load_state_dict(state, strict=True, assign=True)
        if any(t.is_meta for t in [*model.parameters(), *model.buffers()]):
            raise ValueError("diffusers' LTX-2 model has tensors our weights do not fill")
        return cls(model.eval().requires_grad_(False))

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def device(self) -> torch.device:
        return self.model.device

    def encode_text(self, video_text, audio_text, mask) -> DiffusersText:
        return DiffusersText(video_text.to(self.dtype), audio_text.to(self.dtype), mask)

    def forward(self, inputs: LTX2Inputs) -> tuple[torch.Tensor, torch.Tensor]:
        rows = torch.ones(inputs.video.shape[0]) if inputs.cross_rows is None else (
            inputs.cross_rows.cpu())
        out_video, out_audio = [], []
        for isolate in (False, True):
            index = torch.nonzero(rows == (0 if isolate else 1)).flatten()
            if len(index):
                video, audio = self._call(inputs, index.to(inputs.video.device), isolate)
                out_video.append((index, video))
                out_audio.append((index, audio))
        return _gather(out_video), _gather(out_audio)

    def _call(self, inputs: LTX2Inputs, index: torch.Tensor, isolate: bool):
        text = inputs.text
        t = inputs.timestep[index].to(self.dtype)
        video = inputs.video[index].to(self.dtype)
        video_t = t[:, None].expand(-1, video.shape[1])
        if inputs.clean_tokens:
            video_t = video_t.clone()
            video_t[:, :inputs.clean_tokens] = 0
        mask = None if text.mask is None else text.mask[index]
        video_pos, audio_pos = inputs.rope.video_positions, inputs.rope.audio_positions
        out = self.model(
            hidden_states=video, audio_hidden_states=inputs.audio[index].to(self.dtype),
            encoder_hidden_states=text.video[index], audio_encoder_hidden_states=text.audio[index],
            timestep=video_t if inputs.clean_tokens else t, audio_timestep=t, sigma=t,
            encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
            video_coords=_as_coords(video_pos, len(index)),
            audio_coords=_as_coords(audio_pos, len(index)), isolate_modalities=isolate,
            use_cross_timestep=inputs.use_cross_timestep, return_dict=False)
        return out


def _as_coords(positions: torch.Tensor, batch: int) -> torch.Tensor:
    """Midpoints [A, N] as diffusers' [B, A, N] coordinates (it takes 3D ones as they are)."""
    return positions[None].expand(batch, -1, -1)


def _gather(pieces) -> torch.Tensor:
    first = pieces[0][1]
    out = first.new_empty(sum(len(i) for i, _ in pieces), *first.shape[1:])
    for index, value in pieces:
        out[index] = value
    return out
