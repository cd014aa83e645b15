"""The video pipelines' shared generate(): with several prompts, each with its own input
image, every video of a prompt is conditioned on that prompt's image (Cosmos 3 once took
image i for video i, so a prompt's second video used the next prompt's image)."""
from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from tllm.visual_gen.params import VisualGenParams


def _image(seed: int) -> Image.Image:
    return Image.fromarray((np.random.RandomState(seed).rand(32, 32, 3) * 255).astype(np.uint8))


def _params(**kwargs) -> VisualGenParams:
    return VisualGenParams(num_frames=5, height=32, width=32, num_inference_steps=2,
                           guidance_scale=1.0, output_type="latent", **kwargs)


def test_every_video_of_a_prompt_uses_its_image(cosmos_gen):
    images = [_image(0), _image(1)]
    batch = cosmos_gen.generate(["a cube", "a fox"], _params(seed=20, num_images_per_prompt=2),
                                image=images)
    assert batch.seeds == [20, 21, 22, 23]
    for index, (prompt, image) in enumerate([("a cube", 0), ("a fox", 1)]):
        alone = cosmos_gen.generate(prompt, _params(seed=20 + 2 * index,
                                                    num_images_per_prompt=2),
                                    image=images[image])
        assert torch.equal(batch.latents[2 * index:2 * index + 2], alone.latents)
