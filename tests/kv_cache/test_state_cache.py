"""The state-space layers' state cache: sizes per request, rows per slot, and the options a
hybrid model refuses (speculation; checkpoints: test_state_checkpoints.py; swap preemption
keeps answers: tests/models/test_nemotron_h_parity.py)."""
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
    # a row per slot and a scratch row (a decode graph's padding rows write there)
    assert cache.pad_slot == 5
    assert cache.layers[0].conv.shape == (6, DIMS.conv_dim, 3)
    assert cache.layers[0].ssm.shape == (6, 4, 8, 8)


def test_decode_step_reads_device_slots_and_zeroes_new_requests():
    """A decode step reaches the mixers as DecodeSlots (device slots); a request at position
    0 in it (a one-token prompt) has its slot zeroed in every layer first, others kept."""
    from types import SimpleNamespace
    from tllm.layers.mamba2 import DecodeSlots
    cache = StateCache(StateSpec(DIMS, num_layers=2), num_slots=4, dtype=torch.float32,
                       device="cpu")
    for layer in cache.layers:
        layer.conv.normal_()
        layer.ssm.normal_()
    kept = [layer.ssm[3].clone() for layer in cache.layers]
    slots = torch.tensor([3, 1])
    metadata = SimpleNamespace(max_query_len=1, request_slots=slots, request_slots_cpu=[3, 1],
                               query_lens_cpu=[1, 1], seq_lens_cpu=[8, 1], capture=None)
    batch = cache.batch(metadata)
    assert isinstance(batch, DecodeSlots) and batch.slots is slots
    for layer, ssm in zip(cache.layers, kept):
        assert not layer.conv[1].any() and not layer.ssm[1].any()
        torch.testing.assert_close(layer.ssm[3], ssm)


def test_refuses_speculation():
    args = LlmArgs(model="x", speculative_config={"decoding_type": "NGram"})
    with pytest.raises(ValueError, match="speculative_config"):
        check_hybrid_args(args)


def test_nemotron_h_8b_state_beside_kv():
    """Nemotron-H-8B's per-request state (24 Mamba layers, fixed) against its 4 attention
    layers' KV at 8k tokens."""
    from tllm.loader.dummy import dummy_config
    from tllm.models.nemotron_h import ATTENTION, MAMBA, block_kinds, mamba_dims
    config = dummy_config("nemotron-h-8b")
    kinds = block_kinds(config)
    assert (kinds.count(MAMBA), kinds.count(ATTENTION), len(kinds)) == (24, 4, 52)
    dims = mamba_dims(config)
    assert dims.inner_size * 2 + 2 * dims.num_groups * dims.state_size + dims.num_heads == 18560
    state = StateSpec(dims, kinds.count(MAMBA)).bytes_per_request(torch.bfloat16)
    kv_8k = 8192 * 4 * 2 * config.num_key_value_heads * config.head_dim * 2
    assert round(state / 2**20, 1) == 97.4 and kv_8k == 128 * 2**20
