"""The state-space layers' state cache: sizes per request, rows per slot, and the options a
hybrid model refuses until state checkpoints land."""
import pytest
import torch

from tllm.config import LlmArgs
from tllm.kv_cache.state_cache import StateCache, check_hybrid_args
from tllm.layers.mamba2 import Mamba2Dims, StateSpec

DIMS = Mamba2Dims(hidden_size=32, num_heads=4, head_dim=8, num_groups=2, state_size=8,
                  conv_kernel=4, chunk_size=4, eps=1e-5)


def test_state_per_request_and_slots():
    spec = StateSpec(DIMS, num_layers=3)
    conv = DIMS.conv_dim * 3 * 2          # bf16 conv state, K-1 = 3 inputs
    ssm = 4 * 8 * 8 * 4                   # fp32 SSM state
    assert spec.bytes_per_request(torch.bfloat16) == 3 * (conv + ssm)
    cache = StateCache(spec, num_slots=5, dtype=torch.bfloat16, device="cpu")
    assert len(cache.layers) == 3
    assert cache.layers[0].conv.shape == (5, DIMS.conv_dim, 3)
    assert cache.layers[0].ssm.shape == (5, 4, 8, 8)


def test_refuses_swap_preemption():
    args = LlmArgs(model="x", scheduler_config={"preemption_mode": "swap"})
    with pytest.raises(ValueError, match="preemption_mode"):
        check_hybrid_args(args)
