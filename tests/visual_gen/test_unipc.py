"""Our UniPC scheduler against diffusers' UniPCMultistepScheduler (flow prediction, flow
sigmas): the same sigmas and timesteps, and the same sample after every step, for the
configurations Cosmos 3's pipeline runs (its default schedule and its native flow schedule)
and the solver options around them."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tllm.visual_gen.unipc import UniPCConfig, UniPCScheduler

CONFIGS = [
    dict(),
    dict(flow_shift=5.0),
    dict(flow_shift=3.0, solver_order=1),
    dict(flow_shift=3.0, solver_order=3),
    dict(flow_shift=2.0, solver_type="bh1", final_sigmas_type="sigma_min"),
    dict(flow_shift=4.0, lower_order_final=False, final_sigmas_type="sigma_min"),
    dict(flow_shift=1.5, disable_corrector=[0, 2]),
    dict(flow_shift=3.0, shift_terminal=0.1),
    dict(use_dynamic_shifting=True),
]


def _diffusers(config: dict):
    from diffusers import UniPCMultistepScheduler
    return UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True,
                                   **config)


def _velocity(sample: torch.Tensor, index: int) -> torch.Tensor:
    """A stand-in model: depends on the sample and the step, so errors would compound."""
    gen = torch.Generator().manual_seed(100 + index)
    return 0.7 * sample + torch.randn(sample.shape, generator=gen)


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: ",".join(f"{k}={v}" for k, v in
                                                                   c.items()) or "default")
@pytest.mark.parametrize("native_sigmas", [False, True])
@pytest.mark.parametrize("num_steps", [1, 2, 7])
def test_unipc_equals_diffusers(config, native_sigmas, num_steps):
    sigmas = None
    if native_sigmas:   # Cosmos3OmniPipeline's use_native_flow_schedule
        sigmas = np.linspace(1.0 - 1.0 / 1000, 0.0, num_steps + 1)[:-1]
    mu = 0.8 if config.get("use_dynamic_shifting") else None
    if config.get("shift_terminal") and num_steps == 1:
        pytest.skip("diffusers stretches a one-step schedule to NaN (0 / 0); ours keeps it")
    theirs = _diffusers(config)
    theirs.set_timesteps(num_steps, sigmas=sigmas, mu=mu)
    ours = UniPCScheduler(UniPCConfig.from_dict(config))
    ours.set_timesteps(num_steps, sigmas=sigmas, mu=mu)
    assert torch.equal(ours.sigmas, theirs.sigmas)
    assert torch.equal(ours.timesteps, theirs.timesteps)

    sample = torch.randn(1, 4, 3, 5, 6, generator=torch.Generator().manual_seed(0))
    ref = sample.clone()
    for index, t in enumerate(theirs.timesteps):
        ref = theirs.step(_velocity(ref, index), t, ref, return_dict=False)[0]
        sample = ours.step(_velocity(sample, index), index, sample)
        assert torch.isfinite(sample).all()
        err = ((sample - ref).abs().max() / ref.abs().max()).item()
        assert err <= 1e-6, f"step {index}: {err}"


def test_unipc_rejects_what_it_does_not_run():
    with pytest.raises(ValueError, match="prediction_type"):
        UniPCConfig.from_dict({"prediction_type": "epsilon"})
    with pytest.raises(ValueError, match="use_karras_sigmas"):
        UniPCConfig.from_dict({"use_karras_sigmas": True})
    with pytest.raises(ValueError, match="solver_order"):
        UniPCConfig(solver_order=4)
    scheduler = UniPCScheduler(UniPCConfig())
    scheduler.set_timesteps(3)
    x = torch.randn(1, 2)
    with pytest.raises(ValueError, match="in order"):
        scheduler.step(x, 1, x)
    with pytest.raises(ValueError, match="mu"):
        UniPCScheduler(UniPCConfig(use_dynamic_shifting=True)).set_timesteps(3)
