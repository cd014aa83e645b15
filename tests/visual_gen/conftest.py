"""Tiny random Qwen-Image and Qwen-Image-Layered folders (built once per session), diffusers'
pipelines over them (the reference), and ours."""
from __future__ import annotations

import numpy as np
import pytest

from tests.visual_gen.tiny_cosmos import save_tiny_cosmos
from tests.visual_gen.tiny_models import diffusers_pipeline, save_tiny_model


@pytest.fixture(scope="session")
def qwen_image_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen_image"))


@pytest.fixture(scope="session")
def layered_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny_qwen_image_layered"), layered=True)


@pytest.fixture(scope="session")
def cosmos_dir(tmp_path_factory):
    return save_tiny_cosmos(tmp_path_factory.mktemp("tiny_cosmos3"))


@pytest.fixture(scope="session")
def cosmos_gen(cosmos_dir):
    from tllm.visual_gen import VisualGen
    return VisualGen(str(cosmos_dir), device="cpu", show_progress=False)


@pytest.fixture(scope="session")
def reference(qwen_image_dir):
    return diffusers_pipeline(qwen_image_dir)


@pytest.fixture(scope="session")
def layered_reference(layered_dir):
    return diffusers_pipeline(layered_dir, layered=True)


@pytest.fixture(scope="session")
def visual_gen(qwen_image_dir):
    from tllm.visual_gen import VisualGen
    return VisualGen(str(qwen_image_dir), device="cpu", show_progress=False)


@pytest.fixture(scope="session")
def layered_gen(layered_dir):
    from tllm.visual_gen import VisualGen
    return VisualGen(str(layered_dir), device="cpu", show_progress=False)


@pytest.fixture(scope="session")
def rgba_image():
    from PIL import Image
    pixels = (np.random.RandomState(0).rand(40, 56, 4) * 255).astype(np.uint8)
    return Image.fromarray(pixels)


def max_relative_error(actual, expected) -> float:
    return ((actual - expected).abs().max() / expected.abs().max()).item()
