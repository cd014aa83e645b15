"""LTX-2 against diffusers' LTX2Pipeline on the same tiny random components: the video and
audio latents after a few steps (<= 1e-4) with guidance off and with every guidance it runs
(CFG with per-stream scales, modality isolation, rescale), the decoded frames and waveform
(<= 1e-3) at diffusers' defaults; the same seed gives the same video and sound; the registry,
image-to-video against LTX2ImageToVideoPipeline; `tllm visual --out clip.mp4` with its AAC
track, bad parameters."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.visual_gen.tiny_ltx2 import MAX_TEXT_TOKENS, diffusers_ltx2, save_tiny_ltx2
from tllm.visual_gen import registry
from tllm.visual_gen.models.ltx2.pipeline import VideoRequest
from tllm.visual_gen.params import VisualGenParams

FRAMES, SIZE, RATE, STEPS = 5, 32, 25.0, 3
PROMPT, NEGATIVE = "a robot dancing", "blurry"
NO_GUIDANCE = dict(guidance_scale=1.0, audio_guidance_scale=1.0, modality_scale=1.0,
                   guidance_rescale=0.0)
ALL_GUIDANCE = dict(guidance_scale=4.0, audio_guidance_scale=6.0, modality_scale=2.5,
                    guidance_rescale=0.5)


def _relative(actual, expected) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()


@pytest.fixture(scope="module")
def ltx2_dir(tmp_path_factory):
    return save_tiny_ltx2(tmp_path_factory.mktemp("tiny_ltx2"))


@pytest.fixture(scope="module")
def reference(ltx2_dir):
    return diffusers_ltx2(ltx2_dir)


@pytest.fixture(scope="module")
def gen(ltx2_dir):
    from tllm.visual_gen import VisualGen
    return VisualGen(str(ltx2_dir), device="cpu", show_progress=False)


def _params(**kwargs) -> VisualGenParams:
    return VisualGenParams(num_frames=FRAMES, height=SIZE, width=SIZE, frame_rate=RATE,
                           num_inference_steps=STEPS, negative_prompt=NEGATIVE, **kwargs)


def _reference(reference, seed: int, output_type: str, **scales):
    """diffusers' run: (packed video latents of the last step, its output)."""
    seen = {}

    def keep_latents(_, step, timestep, tensors):
        seen["latents"] = tensors["latents"]
        return {}

    audio_scales = {}
    if scales:
        audio_scales = dict(audio_modality_scale=scales["modality_scale"],
                            audio_guidance_rescale=scales["guidance_rescale"], stg_scale=0.0,
                            audio_stg_scale=0.0)
    out = reference(prompt=PROMPT, negative_prompt=NEGATIVE, height=SIZE, width=SIZE,
                    num_frames=FRAMES, frame_rate=RATE, num_inference_steps=STEPS,
                    generator=torch.Generator().manual_seed(seed), output_type=output_type,
                    max_sequence_length=MAX_TEXT_TOKENS, callback_on_step_end=keep_latents,
                    **scales, **audio_scales)
    return seen["latents"], out


@pytest.mark.parametrize("scales", [NO_GUIDANCE, ALL_GUIDANCE], ids=["no-guidance", "guided"])
def test_latents_equal_diffusers(reference, gen, scales):
    ref_video, ref_out = _reference(reference, 7, "latent", **scales)
    final = gen.pipeline.denoise_video(PROMPT, VideoRequest.resolve(_params(**scales)), 7)
    assert _relative(final["video"], ref_video) <= 1e-4
    vae = gen.pipeline.audio_vae       # diffusers returns denormalised, unpacked audio latents
    audio = (final["audio"] * vae.latents_std + vae.latents_mean).unflatten(2, (-1, 2))
    assert _relative(audio.transpose(1, 2), ref_out.audio) <= 1e-4


def test_decoded_video_and_audio_equal_diffusers(reference, gen):
    """At diffusers' default guidance (its STG branch is the cond one for LTX-2.0: skipped)."""
    _, ref_out = _reference(reference, 3, "np")
    out = gen.generate(PROMPT, _params(seed=3, return_latents=True))
    grid = gen.pipeline.latent_grid(VideoRequest.resolve(_params()))
    frames = gen.pipeline.decode_video(out.latents, grid).numpy()
    assert frames.shape == ref_out.frames[0].shape == (FRAMES, SIZE, SIZE, 3)
    assert np.abs(frames - ref_out.frames[0]).max() <= 1e-3
    assert out.audio[0].shape == ref_out.audio[0].shape and out.audio[0].shape[0] == 2
    assert (out.audio[0] - ref_out.audio[0]).abs().max().item() <= 1e-3
    assert out.videos[0].dtype == np.uint8 and out.videos[0].shape == frames.shape
    assert out.frame_rate == RATE and out.sample_rate == 16000


def test_same_seed_same_video_and_sound(gen):
    fast = dict(num_frames=FRAMES, height=SIZE, width=SIZE, num_inference_steps=2,
                **NO_GUIDANCE)
    first = gen.generate(["a cube", "a fox"], VisualGenParams(seed=11, **fast))
    again = gen.generate("a fox", VisualGenParams(seed=12, **fast))
    assert first.seeds == [11, 12] and len(first.videos) == len(first.audio) == 2
    assert np.array_equal(first.videos[1], again.videos[0])
    assert torch.equal(first.audio[1], again.audio[0])
    assert not np.array_equal(first.videos[0], first.videos[1])


@pytest.mark.parametrize("field,value,match", [
    ("num_frames", 8, "2 \\* k \\+ 1"), ("height", 48, "multiple of 32"),
    ("layers", 2, "layered"), ("modality_scale", 0.5, ">= 1"),
    ("guidance_rescale", 2.0, "\\[0, 1\\]")])
def test_bad_video_params(gen, field, value, match):
    with pytest.raises(ValueError, match=match):
        gen.generate("a fox", VisualGenParams(**{field: value}))


def test_image_to_video_equals_diffusers(ltx2_dir, gen):
    """LTX2ImageToVideoPipeline on the same folder: the image (H.264-recompressed, resized)
    is the clean first latent frame."""
    from diffusers import LTX2ImageToVideoPipeline
    from PIL import Image
    reference = LTX2ImageToVideoPipeline.from_pretrained(ltx2_dir)
    reference.set_progress_bar_config(disable=True)
    image = Image.fromarray((np.random.RandomState(0).rand(40, 56, 3) * 255).astype(np.uint8))
    scales = dict(guidance_scale=3.0, audio_guidance_scale=1.0, modality_scale=1.0,
                  guidance_rescale=0.0)
    seen = {}

    def keep_latents(_, step, timestep, tensors):
        seen["latents"] = tensors["latents"]
        return {}

    ref_out = reference(image=image, prompt=PROMPT, negative_prompt=NEGATIVE, height=SIZE,
                        width=SIZE, num_frames=FRAMES, frame_rate=RATE,
                        num_inference_steps=STEPS, generator=torch.Generator().manual_seed(5),
                        output_type="np", max_sequence_length=MAX_TEXT_TOKENS,
                        callback_on_step_end=keep_latents, stg_scale=0.0, audio_stg_scale=0.0,
                        audio_modality_scale=1.0, audio_guidance_rescale=0.0, **scales)
    out = gen.generate(PROMPT, _params(seed=5, return_latents=True, **scales), image=image)
    assert _relative(out.latents, seen["latents"]) <= 1e-4
    grid = gen.pipeline.latent_grid(VideoRequest.resolve(_params()))
    frames = gen.pipeline.decode_video(out.latents, grid).numpy()
    assert np.abs(frames - ref_out.frames[0]).max() <= 1e-3
    assert (out.audio[0] - ref_out.audio[0]).abs().max().item() <= 1e-3
    with pytest.raises(ValueError, match="image"):
        gen.generate(["a", "b", "c"], _params(), image=[image, image])


def test_folder_and_dummy_are_visual_models(ltx2_dir):
    assert registry.resolve(str(ltx2_dir)).class_name == "LTX2Pipeline"
    assert registry.resolve("dummy:ltx2").dummy_preset == "ltx2"
    assert registry.is_visual_model("dummy:ltx2")
    assert registry.resolve(str(ltx2_dir)).pipeline_class().takes_image is False


def test_visual_writes_an_mp4_with_sound(ltx2_dir, tmp_path, capsys):
    from tllm.cli import main
    from tllm.visual_gen.video_io import decode_mp4
    out = tmp_path / "clip.mp4"
    code = main(["visual", "--model", str(ltx2_dir), "--prompt", "a fox", "--out", str(out),
                 "--steps", "2", "--num-frames", "5", "--height", "32", "--width", "64",
                 "--frame-rate", "12", "--seed", "1", "--device", "cpu"])
    assert code == 0
    assert capsys.readouterr().out.split() == [str(out)]
    frames, rate, has_audio = decode_mp4(out.read_bytes())
    assert frames.shape == (5, 32, 64, 3) and rate == 12 and has_audio
