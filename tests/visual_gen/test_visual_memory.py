"""dummy:qwen-image-tiny (the Qwen-Image pipeline in the tests' tiny shapes, for a CPU), and the
memory check before a visual model is allocated: its estimate, the error, the warnings, the
override."""
from __future__ import annotations

import logging

import pytest
import torch
from PIL import Image

from tllm.cli import main
from tllm.log import unconfigure_logging
from tllm.visual_gen import VisualGen, VisualGenParams, memory, registry
from tllm.visual_gen.models.qwen_image.components import dummy_parameter_count

GIB = 1024 ** 3
FULL_SIZE_DUMMIES = ["dummy:qwen-image", "dummy:qwen-image-layered", "dummy:cosmos",
                     "dummy:ltx2"]


class Allocated(Exception):
    """Raised in place of building a full-size dummy: the check let it through."""


@pytest.fixture
def small_memory(monkeypatch):
    """The device has 1 GiB free."""
    monkeypatch.setattr(memory, "available_memory", lambda device: GIB)


@pytest.fixture
def no_allocation(monkeypatch):
    """Building a full-size dummy raises Allocated instead."""
    def from_dummy(*args, **kwargs):
        raise Allocated
    for model in FULL_SIZE_DUMMIES:
        monkeypatch.setattr(registry.resolve(model).pipeline_class(), "from_dummy",
                            classmethod(from_dummy))


def test_tiny_preset_generates_an_image_on_a_cpu():
    gen = VisualGen("dummy:qwen-image-tiny", device="cpu", show_progress=False)
    out = gen.generate("a red fox", VisualGenParams(height=64, width=96, num_inference_steps=2,
                                                    seed=0, return_latents=True))
    assert out.images[0].size == (96, 64) and out.images[0].mode == "RGB"
    assert torch.isfinite(out.latents).all()
    pipe = gen.pipeline     # the estimate counts what was built
    built = memory.count_parameters([pipe.text_encoder, pipe.vae, pipe.transformer])
    assert built == dummy_parameter_count("qwen-image-tiny")


def test_tiny_preset_through_the_cli(tmp_path, capsys):
    out = tmp_path / "fox.png"
    assert main(["visual", "-m", "dummy:qwen-image-tiny", "--prompt", "a red fox", "--out",
                 str(out), "--steps", "2", "--height", "32", "--width", "32",
                 "--device", "cpu"]) == 0
    with Image.open(out) as image:
        assert image.size == (32, 32)


@pytest.mark.parametrize("model", FULL_SIZE_DUMMIES)
def test_a_model_that_does_not_fit_raises_before_allocating(model, small_memory,
                                                            no_allocation):
    with pytest.raises(memory.ModelTooLargeError) as raised:
        VisualGen(model, device="cpu")
    assert isinstance(raised.value, ValueError)
    message = str(raised.value)
    assert model in message and "1.0 GiB of available RAM" in message
    assert memory.SKIP_ENV in message and "check_memory=False" in message


def test_the_tiny_preset_fits_without_a_warning(small_memory, caplog):
    with caplog.at_level(logging.WARNING, logger="tllm"):
        VisualGen("dummy:qwen-image-tiny", device="cpu", show_progress=False)
    assert caplog.records == []


def test_the_check_can_be_skipped(small_memory, no_allocation, monkeypatch):
    with pytest.raises(Allocated):
        VisualGen("dummy:qwen-image", device="cpu", check_memory=False)
    monkeypatch.setenv(memory.SKIP_ENV, "1")
    with pytest.raises(Allocated):
        VisualGen("dummy:qwen-image", device="cpu")


def test_warnings_near_the_limit_and_for_a_large_model_on_a_cpu(monkeypatch, caplog):
    monkeypatch.setattr(memory, "available_memory", lambda device: 100 * GIB)
    with caplog.at_level(logging.WARNING, logger="tllm"):
        memory.check_fits("big", 90 * GIB, torch.device("cuda"))
        [near] = caplog.records
        assert "90% of the 100.0 GiB" in near.getMessage()
        caplog.clear()
        memory.check_fits("mid", 3 * GIB, torch.device("cpu"))
        [slow] = caplog.records
        assert "very slow on a CPU" in slow.getMessage()
        caplog.clear()
        memory.check_fits("mid", 3 * GIB, torch.device("cuda"))
        assert caplog.records == []


def test_estimates():
    spec = registry.resolve("dummy:qwen-image")
    params = spec.pipeline_class().dummy_parameter_count("qwen-image")
    assert 28e9 < params < 29.5e9       # the 20B transformer and the 8B text encoder
    assert memory.estimate_weight_bytes(spec, torch.bfloat16) == 2 * params
    assert memory.estimate_weight_bytes(spec, torch.float32) == 4 * params


def test_a_folder_is_estimated_from_its_checkpoint_headers(qwen_image_dir):
    """The tests' folder has the tiny preset's shapes: the same count, from the files."""
    spec = registry.resolve(str(qwen_image_dir))
    expected = dummy_parameter_count("qwen-image-tiny")
    assert memory.estimate_weight_bytes(spec, torch.bfloat16) == 2 * expected
    assert memory.estimate_weight_bytes(spec, torch.float32) == 4 * expected


@pytest.mark.parametrize("command", [["visual", "-m", "dummy:qwen-image", "-p", "a fox"],
                                     ["serve", "dummy:qwen-image"]])
def test_commands_say_it_in_one_line(command, small_memory, no_allocation, capsys):
    try:
        assert main([*command, "--device", "cpu"]) == 1
    finally:
        unconfigure_logging()       # `tllm serve` configured it
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: model 'dummy:qwen-image' needs about")


def test_a_corrupt_checkpoint_file_is_named(tmp_path):
    (tmp_path / "transformer").mkdir()
    bad = tmp_path / "transformer" / "model.safetensors"
    bad.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="corrupt or unreadable weight file .*model.safetensors"):
        memory.folder_weight_bytes(tmp_path, 2)
