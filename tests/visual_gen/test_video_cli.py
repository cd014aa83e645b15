"""MP4 files: `tllm visual --out clip.mp4` on the tiny Cosmos 3 folder, and encode_mp4 with an
audio track (decoded back with PyAV)."""
from __future__ import annotations

import numpy as np

from tllm.cli import main
from tllm.visual_gen import registry
from tllm.visual_gen.video_io import decode_mp4, encode_mp4


def test_visual_writes_an_mp4(cosmos_dir, tmp_path, capsys):
    out = tmp_path / "clip.mp4"
    code = main(["visual", "--model", str(cosmos_dir), "--prompt", "a fox", "--out", str(out),
                 "--steps", "2", "--num-frames", "5", "--height", "32", "--width", "48",
                 "--frame-rate", "12", "--seed", "1", "--device", "cpu"])
    assert code == 0
    assert capsys.readouterr().out.split() == [str(out)]
    frames, rate, has_audio = decode_mp4(out.read_bytes())
    assert frames.shape == (5, 32, 48, 3) and rate == 12 and not has_audio


def test_encode_mp4_with_audio_track():
    rng = np.random.RandomState(0)
    frames = np.repeat(np.linspace(0, 255, 9, dtype=np.uint8)[:, None, None, None], 3, -1)
    frames = np.broadcast_to(frames, (9, 30, 41, 3)).copy()     # odd width: padded
    audio = np.sin(np.linspace(0, 200, 16000 * 9 // 24))[None].repeat(2, 0) * 0.5
    data = encode_mp4(frames, 24.0, audio + rng.rand(*audio.shape) * 0.01, 16000)
    decoded, rate, has_audio = decode_mp4(data)
    assert decoded.shape == (9, 30, 42, 3) and rate == 24 and has_audio
    assert np.abs(decoded[:, :, :41].astype(int) - frames).mean() < 3   # lossy, but close


def test_cosmos_folder_and_dummy_are_visual_models(cosmos_dir):
    assert registry.resolve(str(cosmos_dir)).class_name == "Cosmos3OmniPipeline"
    assert registry.resolve("dummy:cosmos").dummy_preset == "cosmos"
    assert registry.is_visual_model("dummy:cosmos")
