"""VisualGenParams: every rule raises a ValueError naming its field."""
from __future__ import annotations

import pytest

from tllm.visual_gen import VisualGenParams


@pytest.mark.parametrize("field, value", [
    ("height", 0), ("height", 100), ("width", -16), ("width", 8192), ("width", 64.0),
    ("num_inference_steps", 0), ("num_inference_steps", 1001), ("num_inference_steps", True),
    ("true_cfg_scale", 0.5), ("true_cfg_scale", float("nan")), ("guidance_scale", -1.0),
    ("negative_prompt", 3), ("seed", -1), ("seed", 2**63), ("num_images_per_prompt", 0),
    ("layers", 0), ("resolution", 512), ("output_type", "np"), ("cfg_normalize", 1),
    ("return_latents", "yes"),
])
def test_invalid_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^VisualGenParams\.{field} "):
        VisualGenParams(**{field: value})


def test_valid_values():
    params = VisualGenParams(height=32, width=48, num_inference_steps=1, seed=0,
                             negative_prompt=" ", true_cfg_scale=1.0, layers=3,
                             resolution=1024, output_type="latent")
    assert not params.is_cfg    # a scale of 1 disables guidance
    assert VisualGenParams(negative_prompt="", true_cfg_scale=4.0).is_cfg
    assert not VisualGenParams(true_cfg_scale=4.0).is_cfg
