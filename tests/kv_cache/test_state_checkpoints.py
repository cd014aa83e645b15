"""State checkpoints at block boundaries: the mixer's two passes give the same outputs and
save the state a run stopping at the boundary would hold; the checkpoint pool keys, gives
back and restores rows; the prefix index ends a hit on a checkpointed block."""
import dataclasses

import torch

from tllm.kv_cache.block_pool import BlockPool
from tllm.kv_cache.prefix import PrefixIndex, chain_hash
from tllm.kv_cache.state_cache import StateCache
from tllm.kv_cache.state_checkpoints import StateCheckpoints
from tllm.layers.mamba2 import Mamba2Dims, Mamba2Mixer, MambaBatch, StateSpec
from tllm.request import Request
from tllm.sampling_params import SamplingParams

DIMS = Mamba2Dims(hidden_size=32, num_heads=4, head_dim=8, num_groups=2, state_size=8,
                  conv_kernel=4, chunk_size=4, eps=1e-5)


def _mixer(use_triton: bool, device) -> Mamba2Mixer:
    torch.manual_seed(0)
    mixer = Mamba2Mixer(DIMS)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
        mixer.A_log.copy_(torch.rand(DIMS.num_heads).log())
    mixer.use_triton = use_triton
    return mixer.to(device)


def _cache(rows: int, device="cpu") -> StateCache:
    cache = StateCache(StateSpec(DIMS, 1), num_slots=3, dtype=torch.float32, device=device)
    cache.checkpoints = StateCheckpoints(cache, rows, tokens_per_block=4)
    return cache


@torch.no_grad()
def check_saves_inside_segments(use_triton: bool, device) -> None:
    """Outputs as without saves; a save inside a segment holds the state a run stopping
    there would; one at a segment's end, the slot's final state (tests/kernels runs this
    through the Triton kernels)."""
    mixer = _mixer(use_triton, device)
    hidden = torch.randn(16, DIMS.hidden_size, device=device)
    plain = MambaBatch([11, 1, 4], [2, 0, 1], [0, 7, 0])
    want = mixer(hidden, plain, _cache(4, device).layers[0])
    cache = _cache(4, device)
    batch = cache.checkpoints.plan(plain)
    # the 11-token prompt saves at 8 (inside), the decode step nothing, the 4-token at 4
    assert (batch.save_after, cache.checkpoints.num_rows_held) == ([8, 0, 4], 2)
    state = cache.layers[0]
    torch.testing.assert_close(mixer(hidden, batch, state), want, rtol=1e-5, atol=1e-5)
    stopped = _cache(4, device).layers[0]   # the first request, stopped after 8 tokens
    mixer(hidden[:8], MambaBatch([8], [2], [0]), stopped)
    row = batch.save_rows[0]
    torch.testing.assert_close(state.saved.ssm[row], stopped.ssm[2], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.saved.conv[row], stopped.conv[2])
    torch.testing.assert_close(state.saved.ssm[batch.save_rows[2]], state.ssm[1])


def test_saves_inside_a_segment_change_nothing_else():
    check_saves_inside_segments(use_triton=False, device="cpu")


class _Slots:
    def __init__(self, slot_of):
        self.slot_of = slot_of


class _KV:
    def __init__(self, hashes):
        self.hashes = hashes
        self.prefixes = PrefixIndex(BlockPool(4), None, [None], 4)

    def block_hashes_of(self, request_id):
        return self.hashes[request_id]


def _request(request_id: str, num_tokens: int) -> Request:
    return Request(request_id, list(range(3, 3 + num_tokens)),
                   SamplingParams(max_tokens=1), max_new_tokens=1)


def test_rows_keyed_restored_and_given_back():
    cache = _cache(rows=2)
    checkpoints = cache.checkpoints
    first, second = _request("a", 10), _request("b", 10)
    kv = _KV({"a": [11, 12], "b": [11]})
    checkpoints.connect(kv)
    checkpoints.slots = _Slots(lambda r: {"a": 0, "b": 1}[r.request_id])
    checkpoints.plan(MambaBatch([9, 3], [0, 1], [0, 0]))
    cache.layers[0].saved.ssm.fill_(7.0)   # what the forward would have saved
    batch = type("Batch", (), {"requests": [first, second]})()
    checkpoints.update(batch)   # a's boundary at 8 (block 1: hash 12); b crossed none
    assert checkpoints.has(12) and not checkpoints.has(11)
    assert kv.prefixes.saved_states is checkpoints and checkpoints.num_rows_held == 0
    second.num_computed_tokens = 8
    kv.hashes["b"] = [11, 12]
    checkpoints.assign_slot(2, second)
    assert torch.equal(cache.layers[0].ssm[2], cache.layers[0].saved.ssm[0])
    assert checkpoints.num_restored == 1
    checkpoints.forget()
    assert not checkpoints.has(12)


def test_prefix_hit_ends_on_a_checkpoint():
    pool = BlockPool(8)
    index = PrefixIndex(pool, None, [None], 4)
    request = _request("r", 21)   # 5 full blocks may hit
    hashes = []
    for i, block in enumerate(pool.allocate(5)):
        hashes.append(chain_hash(request, hashes[-1] if hashes else None, i, 4))
        pool.cache_full_block(block, hashes[-1])
    assert len(index.find(request).block_hashes) == 5
    index.saved_states = _Saved({hashes[2]})
    assert index.find(request).block_hashes == hashes[:3]
    index.saved_states = _Saved(set())
    assert index.find(request).block_hashes == []


@dataclasses.dataclass
class _Saved:
    hashes: set[int]

    def has(self, block_hash: int) -> bool:
        return block_hash in self.hashes
