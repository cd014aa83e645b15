"""Our flow-matching Euler scheduler against diffusers' FlowMatchEulerDiscreteScheduler: the
same sigmas and timesteps bit for bit, and the same step."""
from __future__ import annotations

import json
from dataclasses import asdict

import numpy as np
import pytest
import torch

from tllm.visual_gen.schedulers import (QWEN_IMAGE_SCHEDULER, FlowMatchConfig,
                                        FlowMatchEulerScheduler, calculate_shift)

CONFIGS = [QWEN_IMAGE_SCHEDULER, FlowMatchConfig(shift=3.0),
           FlowMatchConfig(use_dynamic_shifting=True, time_shift_type="linear")]


def _reference(config: FlowMatchConfig):
    from diffusers import FlowMatchEulerDiscreteScheduler
    return FlowMatchEulerDiscreteScheduler(**asdict(config))


def _base_sigmas(kind: str, num_steps: int):
    if kind == "qwen-image":
        return np.linspace(1.0, 1 / num_steps, num_steps)
    if kind == "layered":
        return np.linspace(1.0, 0, num_steps + 1)[:-1]
    return None     # the scheduler's own default


@pytest.mark.parametrize("config", CONFIGS, ids=["qwen-image", "shift3", "linear"])
@pytest.mark.parametrize("num_steps", [4, 20, 50])
@pytest.mark.parametrize("kind", ["qwen-image", "layered", "default"])
def test_schedule_equals_diffusers(config, num_steps, kind):
    ours, ref = FlowMatchEulerScheduler(config), _reference(config)
    for image_seq_len in (64, 1024, 4096, 8192):     # 256px .. 1024x2048 px images
        mu = calculate_shift(image_seq_len, config)
        sigmas = _base_sigmas(kind, num_steps)
        ours.set_timesteps(num_steps, mu=mu, sigmas=sigmas)
        ref.set_timesteps(num_steps, mu=mu, sigmas=sigmas)
        assert torch.equal(ours.sigmas, ref.sigmas), (image_seq_len, ours.sigmas, ref.sigmas)
        assert torch.equal(ours.timesteps, ref.timesteps)


def test_calculate_shift_equals_diffusers():
    from diffusers.pipelines.qwenimage.pipeline_qwenimage import calculate_shift as reference
    c = QWEN_IMAGE_SCHEDULER
    for seq_len in (16, 256, 1000, 4096, 8192):
        assert calculate_shift(seq_len, c) == reference(
            seq_len, c.base_image_seq_len, c.max_image_seq_len, c.base_shift, c.max_shift)


def test_one_step_is_finite_where_diffusers_gives_nan():
    # With shift_terminal, diffusers stretches [1] by 0 / 0; one step should go 1 -> 0.
    ours, ref = FlowMatchEulerScheduler(QWEN_IMAGE_SCHEDULER), _reference(QWEN_IMAGE_SCHEDULER)
    ours.set_timesteps(1, mu=0.7, sigmas=[1.0])
    with np.errstate(invalid="ignore"):
        ref.set_timesteps(1, mu=0.7, sigmas=[1.0])
    assert torch.isnan(ref.sigmas[0])
    assert ours.sigmas.tolist() == [1.0, 0.0] and ours.timesteps.tolist() == [1000.0]
    # Without shift_terminal the two agree on one step too.
    config = FlowMatchConfig(use_dynamic_shifting=True)
    ours, ref = FlowMatchEulerScheduler(config), _reference(config)
    ours.set_timesteps(1, mu=0.7)
    ref.set_timesteps(1, mu=0.7)
    assert torch.equal(ours.sigmas, ref.sigmas)


def test_step_equals_diffusers():
    ours, ref = FlowMatchEulerScheduler(QWEN_IMAGE_SCHEDULER), _reference(QWEN_IMAGE_SCHEDULER)
    sigmas = np.linspace(1.0, 1 / 4, 4)
    ours.set_timesteps(4, mu=0.8, sigmas=sigmas)
    ref.set_timesteps(4, mu=0.8, sigmas=sigmas)
    ref.set_begin_index(0)
    generator = torch.Generator().manual_seed(0)
    sample = torch.randn(2, 6, 16, generator=generator)
    ours_sample, ref_sample = sample, sample
    for i, t in enumerate(ref.timesteps):
        velocity = torch.randn(2, 6, 16, generator=generator)
        ours_sample = ours.step(velocity, i, ours_sample)
        ref_sample = ref.step(velocity, t, ref_sample, return_dict=False)[0]
    assert torch.equal(ours_sample, ref_sample)


def test_config_from_model_dir(tmp_path):
    assert FlowMatchConfig.from_model_dir(tmp_path, QWEN_IMAGE_SCHEDULER) is QWEN_IMAGE_SCHEDULER
    _reference(QWEN_IMAGE_SCHEDULER).save_config(tmp_path / "scheduler")
    assert FlowMatchConfig.from_model_dir(tmp_path, FlowMatchConfig()) == QWEN_IMAGE_SCHEDULER
    data = json.loads((tmp_path / "scheduler" / "scheduler_config.json").read_text())
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        FlowMatchConfig.from_dict({**data, "use_karras_sigmas": True})
    with pytest.raises(ValueError, match="mu is required"):
        FlowMatchEulerScheduler(QWEN_IMAGE_SCHEDULER).set_timesteps(4)
