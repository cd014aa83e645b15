"""StateSwap: a swapped-out request's state rows go to the host when its slot is given back
and come back into whatever slot it takes next; a request preempted to recompute, or one
that ends while swapped out, leaves nothing behind. (End to end, against HF:
tests/models/test_nemotron_h_parity.py::test_preemption_keeps_answers.)"""
from types import SimpleNamespace

import torch

from tllm.kv_cache.state_cache import StateCache
from tllm.kv_cache.state_swap import StateSwap
from tllm.layers.mamba2 import Mamba2Dims, StateSpec

DIMS = Mamba2Dims(hidden_size=32, num_heads=4, head_dim=8, num_groups=2, state_size=8,
                  conv_kernel=4, chunk_size=4, eps=1e-5)


class FakeKvCache:
    def __init__(self, swapped: set[str]) -> None:
        self.swapped = swapped

    def is_swapped(self, request) -> bool:
        return request.request_id in self.swapped


def random_cache(num_slots: int = 3) -> StateCache:
    cache = StateCache(StateSpec(DIMS, num_layers=2), num_slots, torch.float32, "cpu")
    for layer in cache.layers:
        layer.conv.normal_()
        layer.ssm.normal_()
    return cache


def rows(cache: StateCache, slot: int) -> list[torch.Tensor]:
    return [t[slot].clone() for layer in cache.layers for t in (layer.conv, layer.ssm)]


def test_state_follows_the_request_into_another_slot():
    cache = random_cache()
    swap = StateSwap(cache, FakeKvCache({"a"}))
    a = SimpleNamespace(request_id="a")
    before = rows(cache, 1)
    swap.release_slot(1, a)
    for layer in cache.layers:   # another request takes slot 1 meanwhile
        layer.conv[1].normal_()
        layer.ssm[1].normal_()
    assert swap.holds(a)
    swap.assign_slot(2, a)
    for got, want in zip(rows(cache, 2), before):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert not swap.holds(a)
    assert swap.state_stats() == {"state_swapped_out": 1, "state_swapped_in": 1}


def test_recompute_and_ended_requests_leave_nothing():
    cache = random_cache()
    swap = StateSwap(cache, FakeKvCache({"gone"}))
    recomputed, gone = SimpleNamespace(request_id="r"), SimpleNamespace(request_id="gone")
    swap.release_slot(0, recomputed)      # not swapped: it restarts from position 0
    swap.release_slot(1, gone)
    swap.free(gone)                       # aborted while swapped out
    untouched = rows(cache, 2)
    swap.assign_slot(2, gone)
    swap.assign_slot(2, recomputed)
    for got, want in zip(rows(cache, 2), untouched):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert swap.state_stats() == {"state_swapped_out": 1, "state_swapped_in": 0}
