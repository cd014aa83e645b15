"""A keys-only KV cache (MLA's latent cache): one tensor per layer, the pair's value the key
tensor itself; the engine sizes it by what it really holds, so a memory budget holds as many
more tokens as the latent is smaller than the expanded heads; blocks still swap and offload."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from tllm.attention.interface import KVCacheSpec
from tllm.config import LlmArgs
from tllm.kv_cache.manager import KVCacheManager
from tllm.runner import build

# DeepSeek-V3's attention shape: 128 heads, q/k heads of 128 + 64 dims, v heads of 128
HEADS, NOPE, ROPE, V_DIM, RANK = 128, 128, 64, 128, 512
LATENT = KVCacheSpec(num_layers=2, num_kv_heads=1, head_dim=RANK + ROPE, keys_only=True)
# the same attention without the latent cache: every head's key and value (values padded
# to the key's head size, as one cache tensor shape per layer holds them)
EXPANDED = KVCacheSpec(num_layers=2, num_kv_heads=HEADS, head_dim=NOPE + ROPE)


def test_bytes_per_token():
    assert LATENT.bytes_per_token(2) == (RANK + ROPE) * 2
    assert EXPANDED.bytes_per_token(2) == 2 * HEADS * (NOPE + ROPE) * 2
    assert EXPANDED.bytes_per_token(2) // LATENT.bytes_per_token(2) == 85


def _build(spec: KVCacheSpec, budget_bytes: int, monkeypatch) -> KVCacheManager:
    monkeypatch.setattr(build, "kv_cache_budget", lambda *args: budget_bytes)
    config = SimpleNamespace(hidden_size=64, intermediate_size=96, vocab_size=384)
    args = LlmArgs(model="unused", max_batch_size=1024, max_num_tokens=16,
                   cuda_graph_config=None)
    model = SimpleNamespace(kv_cache_spec=spec, quant_config=None)
    return build.build_kv_cache(config, args, torch.float32, torch.device("cpu"), 4096,
                                reserve_full_generation=False, model=model)


def _stored_bytes(kv: KVCacheManager) -> int:
    unique = {t.data_ptr(): t for pair in kv.kv_caches for t in pair}
    return sum(t.numel() * t.element_size() for t in unique.values())


def test_capacity_shows_the_saving(monkeypatch):
    budget = 64 << 20
    latent = _build(LATENT, budget, monkeypatch)
    expanded = _build(EXPANDED, budget, monkeypatch)
    for k, v in latent.kv_caches:
        assert v is k
    assert latent.capacity_tokens >= 80 * expanded.capacity_tokens
    assert _stored_bytes(latent) <= budget and _stored_bytes(expanded) <= budget
    per_token = _stored_bytes(latent) / latent.capacity_tokens
    assert per_token == LATENT.num_layers * LATENT.bytes_per_token(4)


def test_keys_only_blocks_round_trip():
    kv = KVCacheManager(num_layers=2, num_kv_heads=1, head_dim=6, num_blocks=4,
                        tokens_per_block=2, dtype=torch.float32, device="cpu", keys_only=True)
    for k, _ in kv.kv_caches:
        k.normal_()
    data = kv._read_block(1)
    assert data.shape == (2, 1, 2, 1, 6)
    kv._write_block(3, data)
    for k, v in kv.kv_caches:
        assert torch.equal(k[3], k[1]) and v is k
    blocks = kv.read_blocks([1, 2])
    assert blocks.shape == (2, 2, 1, 2, 1, 6)
    kv.write_blocks([0, 3], blocks)
    for k, _ in kv.kv_caches:
        assert torch.equal(k[0], k[1]) and torch.equal(k[3], k[2])
