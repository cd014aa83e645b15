"""`tllm visual` on tiny model folders (PNG files written), `tllm serve` picking the images
server for a visual model, and the registry that tells visual models apart."""
from __future__ import annotations

import pytest
from PIL import Image

from tllm.cli import build_parser, main
from tllm.visual_gen import registry


def test_writes_a_png(qwen_image_dir, tmp_path, capsys):
    out = tmp_path / "cat.png"
    code = main(["visual", "--model", str(qwen_image_dir), "--prompt", "a cat", "--out",
                 str(out), "--steps", "2", "--height", "32", "--width", "48", "--seed", "1",
                 "--negative-prompt", " ", "--device", "cpu"])
    assert code == 0
    assert capsys.readouterr().out.split() == [str(out)]
    with Image.open(out) as image:
        assert image.format == "PNG" and image.size == (48, 32)


def test_cache_and_fp8_flags(qwen_image_dir, tmp_path, capsys):
    out = tmp_path / "fox.png"
    assert main(["visual", "-m", str(qwen_image_dir), "-p", "a fox", "--out", str(out),
                 "--steps", "6", "--height", "32", "--width", "32", "--seed", "2",
                 "--cache", "first_block", "--cache-threshold", "10", "--quantization", "fp8",
                 "--device", "cpu"]) == 0
    assert "steps skipped by the cache: [4]" in capsys.readouterr().err
    assert out.exists()


def test_several_images_are_numbered(qwen_image_dir, tmp_path):
    out = tmp_path / "img.png"
    assert main(["visual", "-m", str(qwen_image_dir), "-p", "a cat", "-p", "a fox", "--n", "2",
                 "--out", str(out), "--steps", "1", "--height", "16", "--width", "16",
                 "--device", "cpu"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"img_{i}.png" for i in range(4)]


def test_layered_writes_one_png_per_layer(layered_dir, rgba_image, tmp_path):
    source = tmp_path / "input.png"
    rgba_image.save(source)
    out = tmp_path / "out.png"
    assert main(["visual", "-m", str(layered_dir), "-p", "a cat", "--image", str(source),
                 "--layers", "2", "--steps", "1", "--out", str(out), "--device", "cpu"]) == 0
    for i in range(2):
        with Image.open(tmp_path / f"out_{i}.png") as layer:
            assert layer.mode == "RGBA" and layer.size == (768, 544)


def test_user_errors_are_one_line(qwen_image_dir, tmp_path, capsys):
    args = ["visual", "-m", str(qwen_image_dir), "-p", "a cat", "--out", str(tmp_path / "x.png")]
    assert main([*args, "--height", "40"]) == 1
    assert "height must be a positive multiple of 16" in capsys.readouterr().err
    assert main(["visual", "-m", str(tmp_path), "-p", "a cat"]) == 1
    assert "not a diffusers model folder" in capsys.readouterr().err


def test_serve_picks_the_images_server(qwen_image_dir, monkeypatch):
    import tllm.serve.visual.images
    served = []

    def serve_images(args, config) -> int:
        served.append(config.model)
        return 0

    monkeypatch.setattr(tllm.serve.visual.images, "serve_images", serve_images)
    args = build_parser().parse_args(["serve", str(qwen_image_dir)])
    assert args.run(args) == 0 and served == [str(qwen_image_dir)]


def test_registry(qwen_image_dir, layered_dir, tmp_path):
    assert registry.resolve(str(qwen_image_dir)).class_name == "QwenImagePipeline"
    assert registry.resolve(str(layered_dir)).class_name == "QwenImageLayeredPipeline"
    spec = registry.resolve("dummy:qwen-image-layered")
    assert (spec.class_name, spec.dummy_preset) == ("QwenImageLayeredPipeline",
                                                    "qwen-image-layered")
    assert registry.is_visual_model("dummy:qwen-image") and registry.is_visual_model(
        str(qwen_image_dir))
    assert not registry.is_visual_model("dummy:llama-3.1-8b")
    assert not registry.is_visual_model(str(tmp_path)) and not registry.is_visual_model(None)
    with pytest.raises(ValueError, match="unknown visual dummy"):
        registry.resolve("dummy:nope")
    (tmp_path / "model_index.json").write_text('{"_class_name": "StableDiffusionXLPipeline"}')
    with pytest.raises(ValueError, match="not supported"):
        registry.resolve(str(tmp_path))
