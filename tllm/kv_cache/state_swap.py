"""Preemption by swap for a hybrid model's state-space layers: a request swapped out keeps
its state (every layer's conv and SSM/recurrent rows of its batch slot) in host memory
beside its KV blocks, and gets it back in whatever slot it takes when it is swapped in.

When. The scheduler swaps the request's KV blocks out (KVCacheManager.swap_out) and the
step's input building gives its batch slot back before any new request takes one; the slot's
rows are copied to the host then, on the stream that ran the request's last step (so after
it: the copy waits for that step's state). When the request is readmitted past position 0,
the rows are copied into its new slot before that step's forward. A request that ends while
swapped out drops its copy (`free`).

The host tier's capacity counts KV blocks only; a request's state is a fixed size
(StateSpec.bytes_per_request: Nemotron-H-8B 97 MiB) and comes on top. Single rank only, as
swapping is (LlmArgs refuses swap with tensor/pipeline parallelism)."""
from __future__ import annotations

import torch

from tllm.scheduler.interface import ResourceManager


class StateSwap(ResourceManager):
    """A batch-slot listener (release_slot saves a swapped-out request's rows, assign_slot
    restores them) and a resource manager (free drops them)."""

    def __init__(self, cache, kv_cache) -> None:
        self.cache = cache          # the StateCache
        self.kv_cache = kv_cache    # tells whether a preempted request was swapped out
        self._host: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self.num_swapped_out = 0
        self.num_swapped_in = 0

    def holds(self, request) -> bool:
        return request.request_id in self._host

    def release_slot(self, slot: int, request=None) -> None:
        if request is None or not self.kv_cache.is_swapped(request):
            return  # ended, or preempted to recompute (it restarts from position 0)
        # copy=True: on a CPU engine .to("cpu") would alias the slot's rows
        self._host[request.request_id] = [
            (layer.conv[slot].to("cpu", copy=True), layer.ssm[slot].to("cpu", copy=True))
            for layer in self.cache.layers]
        self.num_swapped_out += 1

    def assign_slot(self, slot: int, request) -> None:
        rows = self._host.pop(request.request_id, None)
        if rows is None:
            return
        for layer, (conv, ssm) in zip(self.cache.layers, rows):
            layer.conv[slot].copy_(conv)
            layer.ssm[slot].copy_(ssm)
        self.num_swapped_in += 1

    def free(self, request) -> None:
        self._host.pop(request.request_id, None)

    def state_stats(self) -> dict[str, int]:
        return {"state_swapped_out": self.num_swapped_out,
                "state_swapped_in": self.num_swapped_in}
