"""Our LTX-2 transformer against diffusers' LTX2VideoTransformer3DModel on the same tiny random
weights (fp32, relative error <= 1e-5): both rotary layouts, padded prompts, image-to-video's
clean first-frame tokens with either cross-timestep rule, and rows with the audio-video cross
attention switched off (modality guidance) batched with ordinary ones. Also the rotary tables
against diffusers' own, and the checkpoint name mapping both ways."""
from __future__ import annotations

import pytest
import torch

from tests.visual_gen.tiny_ltx2 import TEXT_DIM, tiny_transformer
from tllm.visual_gen.models.ltx2.config import LTX2Config
from tllm.visual_gen.models.ltx2.diffusers_transformer import DiffusersLTX2
from tllm.visual_gen.models.ltx2.rope import LTX2Rope, audio_positions, video_positions
from tllm.visual_gen.models.ltx2.transformer import LTX2Inputs, LTX2Transformer

FRAMES, HEIGHT, WIDTH, AUDIO_FRAMES, TEXT = 3, 4, 5, 7, 6


def _relative(actual, expected) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.fixture(scope="module", params=["split", "interleaved"])
def models(request):
    torch.manual_seed(0)
    theirs = tiny_transformer(rope_type=request.param)
    ours = LTX2Transformer(LTX2Config.from_dict(theirs.config))
    ours.load_diffusers_state_dict(theirs.state_dict())
    return ours, DiffusersLTX2(theirs)


def _inputs(config, batch: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    rope = LTX2Rope.build(config, video_positions(FRAMES, HEIGHT, WIDTH, config, 25.0),
                          audio_positions(AUDIO_FRAMES, config))
    video = torch.randn(batch, FRAMES * HEIGHT * WIDTH, config.in_channels, generator=gen)
    audio = torch.randn(batch, AUDIO_FRAMES, config.audio_in_channels, generator=gen)
    text = torch.randn(2, batch, TEXT, TEXT_DIM, generator=gen)
    mask = torch.ones(batch, TEXT, dtype=torch.long)
    mask[0, :2] = 0     # left padding, as Gemma's prompts are padded
    return rope, video, audio, text, mask


@pytest.mark.parametrize("case", [
    dict(), dict(clean_tokens=HEIGHT * WIDTH), dict(clean_tokens=HEIGHT * WIDTH,
                                                    use_cross_timestep=False),
    dict(cross_rows=torch.tensor([1.0, 1.0, 0.0]))],
    ids=["t2v", "i2v", "i2v-own-timestep", "isolated-row"])
def test_transformer_equals_diffusers(models, case):
    ours, theirs = models
    rope, video, audio, (video_text, audio_text), mask = _inputs(ours.config, 3, 1)
    timestep = torch.tensor([731.0, 731.0, 731.0])
    outputs = []
    for model in (ours, theirs):
        text = model.encode_text(video_text, audio_text, mask)
        outputs.append(model(LTX2Inputs(video, audio, timestep, text, rope, **case)))
    (got_video, got_audio), (want_video, want_audio) = outputs
    assert got_video.shape == video.shape and got_audio.shape == audio.shape
    assert _relative(got_video, want_video) <= 1e-5
    assert _relative(got_audio, want_audio) <= 1e-5


def test_isolated_rows_differ_from_cross_ones(models):
    ours, _ = models
    rope, video, audio, (video_text, audio_text), _ = _inputs(ours.config, 2, 2)
    video, audio, video_text, audio_text = (t[:1].expand(2, *t.shape[1:])
                                            for t in (video, audio, video_text, audio_text))
    text = ours.encode_text(video_text, audio_text, None)
    got_video, _ = ours(LTX2Inputs(video, audio, torch.tensor([500.0, 500.0]), text, rope,
                                   cross_rows=torch.tensor([1.0, 0.0])))
    assert not torch.allclose(got_video[0], got_video[1])


def test_weights_map_back_to_diffusers(models):
    ours, theirs = models
    again = DiffusersLTX2.from_ours(ours)
    for name, tensor in theirs.model.state_dict().items():
        assert torch.equal(again.model.state_dict()[name], tensor), name


def test_rope_tables_equal_diffusers(models):
    ours, theirs = models
    config = ours.config
    rope = LTX2Rope.build(config, video_positions(FRAMES, HEIGHT, WIDTH, config, 24.0),
                          audio_positions(AUDIO_FRAMES, config))
    model = theirs.model
    coords = model.rope.prepare_video_coords(1, FRAMES, HEIGHT, WIDTH, "cpu", fps=24.0)
    audio_coords = model.audio_rope.prepare_audio_coords(1, AUDIO_FRAMES, "cpu")
    x = torch.randn(1, FRAMES * HEIGHT * WIDTH, config.inner_dim)
    expected = _diffusers_rotate(x, model.rope(coords), config.rope_type)
    assert torch.allclose(rope.video.apply(x), expected, atol=1e-6)
    xa = torch.randn(1, AUDIO_FRAMES, config.audio_inner_dim)
    expected = _diffusers_rotate(xa, model.audio_rope(audio_coords), config.rope_type)
    assert torch.allclose(rope.audio.apply(xa), expected, atol=1e-6)


def _diffusers_rotate(x, freqs, rope_type):
    from diffusers.models.transformers.transformer_ltx2 import (apply_interleaved_rotary_emb,
                                                                apply_split_rotary_emb)
    fn = apply_split_rotary_emb if rope_type == "split" else apply_interleaved_rotary_emb
    return fn(x, freqs)


@pytest.mark.parametrize("option", [{"gated_attn": True}, {"cross_attn_mod": True},
                                    {"perturbed_attn": True}])
def test_unsupported_options_are_refused(option):
    with pytest.raises(ValueError, match="not supported"):
        LTX2Config.from_dict({**LTX2Config().to_diffusers(), **option})
