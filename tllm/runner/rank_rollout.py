"""What one rank does for RL rollouts between steps: sleep (the KV cache's memory released,
the weights moved to host memory or dropped, the CUDA graphs dropped), wake (memory back,
graphs captured again) and new weights. Rank 0 runs these on its loop thread and sends the
same `RankCommand` to the other ranks, which run it in their step loop (runner/step.py's
plans travel the same way), so every rank keeps the one order of collectives.

Memory is released by shrinking each tensor's storage to zero bytes and grown back on wake:
every module, the KV cache manager and the runner keep the same tensor objects. The new
storage has a new address, so CUDA graphs (which captured the old ones) are dropped on
sleep and captured again on wake; an in-place weight update keeps every address, and the
graphs stay.

A drafter (rank 0's only: the other ranks run none) sleeps and wakes with the target: its
KV cache freed, its own weights to host memory at either level (sleep(level=2) drops only
what update_weights can bring back, the target's); modules it shares with the target (a
layer-skip draft's layers, an EAGLE-3 or MTP head's embedding) move once, as the target's,
and see its new weights. A separate draft model keeps its weights through update_weights;
MTP's module takes the target checkpoint's names of its layer."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Iterator

import torch
from torch import nn

from tllm.distributed import weight_sync
from tllm.kv_cache.manager import KVCacheManager
from tllm.kv_cache.transfer import stored_tensors
from tllm.loader.weight_update import (NamedTensors, check_updatable, checkpoint_keys,
                                       checkpoint_tensors, update_model_weights)
from tllm.speculative.interface import Drafter

logger = logging.getLogger(__name__)
SLEEP_LEVELS = (1, 2)
WAKE_TAGS = ("weights", "kv_cache")


@dataclass
class RankCommand:
    """A rollout operation every rank runs (`RankRollout.apply`): "sleep" (level),
    "wake" (tags), "update" (tensors), "update_from_disk" (path), "init_group" (the
    trainer group's address, ...), "update_from_group" (names, dtypes, shapes, group_name),
    "destroy_group" (group_name)."""

    name: str
    args: dict = field(default_factory=dict)


@dataclass
class _Parked:
    """A storage shrunk to nothing, its size, and (level 1 on a GPU) its bytes on the host."""

    storage: torch.UntypedStorage
    nbytes: int
    host: torch.Tensor | None = None


class RankRollout:
    """This rank's model, KV cache and graphs, put to sleep, woken and given new weights."""

    def __init__(self, model: nn.Module, kv_cache: KVCacheManager, graphs, piecewise,
                 device: torch.device, dtype: torch.dtype, rank_offset: int = 0,
                 drafter: Drafter | None = None) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.drafter = drafter
        self.graphs = graphs
        self.piecewise = piecewise
        self.device = device
        self.dtype = dtype
        self.rank = rank_offset   # this rank among the engine's (after the trainer's)
        self.parked_weights: list[_Parked] | None = None
        self.parked_kv: list[_Parked] | None = None
        self.weights_dropped = False      # level 2: garbage until new weights come
        self._missing: set[str] = set()   # of those, the keys no update has brought yet
        self.groups: dict[str, object] = {}

    @property
    def is_sleeping(self) -> bool:
        return self.parked_weights is not None or self.parked_kv is not None

    def apply(self, command: RankCommand):
        handlers = {"sleep": self.sleep, "wake": self.wake, "update": self.update_weights,
                    "update_from_disk": self.update_from_disk,
                    "init_group": self.init_group, "update_from_group": self.update_from_group,
                    "destroy_group": self.destroy_group}
        return handlers[command.name](**command.args)

    # ---- sleep and wake ----

    def sleep(self, level: int) -> None:
        if self.is_sleeping:    # (a second sleep, of any level, changes nothing)
            return
        self.kv_cache.reset_prefix_cache()     # its contents are about to go
        self._release_graphs()
        self.parked_kv = [_park(s, keep=False) for s in _storages(self._kv_tensors())]
        on_gpu = self.device.type == "cuda"    # a CPU's weights are host memory already
        keep = level == 1 and on_gpu
        if level == 1 and not keep:
            self.parked_weights = []
        else:
            self.parked_weights = [_park(s, keep) for s in _storages(self.model.parameters())]
        if on_gpu:   # after the target's: what the drafter shares with it is parked already
            self.parked_weights += [_park(s, True) for s in _storages(self._draft_params())]
        if level == 2:
            self.weights_dropped = True
            self._missing = checkpoint_keys(self.model)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    def wake(self, tags: list[str] | None = None) -> None:
        tags = list(WAKE_TAGS) if tags is None else tags
        was_sleeping = self.is_sleeping
        if "weights" in tags and self.parked_weights is not None:
            for parked in self.parked_weights:
                _unpark(parked)
            self.parked_weights = None
        if "kv_cache" in tags and self.parked_kv is not None:
            for parked in self.parked_kv:
                _unpark(parked)
            self.parked_kv = None
            self._zero_null_block()
        if was_sleeping and not self.is_sleeping:
            self._capture_graphs()

    def _kv_caches(self) -> list[KVCacheManager]:
        draft = self.drafter.kv_cache if self.drafter is not None else None
        return [self.kv_cache] + ([draft] if draft is not None else [])

    def _kv_tensors(self, kv_caches: list[KVCacheManager] | None = None
                    ) -> Iterator[torch.Tensor]:
        for kv_cache in kv_caches or self._kv_caches():
            for pair in kv_cache.slot_caches:
                yield from stored_tensors(pair)

    def _draft_params(self) -> Iterator[torch.Tensor]:
        module = self.drafter.own_module() if self.drafter is not None else None
        return module.parameters() if module is not None else iter(())

    def _zero_null_block(self) -> None:
        """Kernels may load the sliding windows' null block: it must hold numbers."""
        for kv_cache in self._kv_caches():
            if kv_cache.has_windows:
                for tensor in self._kv_tensors([kv_cache]):
                    tensor[kv_cache.null_block].zero_()

    def _release_graphs(self) -> None:
        for runner in (self.graphs, self.piecewise, self._draft_graphs):
            if runner is not None:
                runner.release()

    @property
    def _draft_graphs(self):
        """A draft head's CUDA graphs (tllm.speculative.head_graphs), if it has any."""
        return getattr(self.drafter, "graphs", None)

    def _capture_graphs(self) -> None:
        if self.graphs is not None and self.graphs.batch_sizes:
            self.graphs.capture()
        if self.piecewise is not None:
            self.piecewise.pool = self.graphs.pool if self.graphs is not None else None
            self.piecewise.capture()
        if self._draft_graphs is not None:
            self._draft_graphs.capture()

    # ---- weights ----

    def update_weights(self, tensors: NamedTensors) -> None:
        if self.parked_weights is not None:
            raise ValueError("update_weights: the weights are asleep; "
                             "wake_up(tags=['weights']) first")
        drafter = self.drafter
        takes = drafter.takes_target_weight if drafter is not None else None
        draft_tensors: list[tuple[str, torch.Tensor]] = []
        if takes is not None:   # the drafter's share of the target's names, on the way
            tensors = _tee(tensors, takes, draft_tensors)
        loaded = update_model_weights(self.model, tensors, self.dtype)
        if draft_tensors:
            drafter.update_weights(draft_tensors, self.dtype)
        self.kv_cache.reset_prefix_cache()   # blocks computed with the old weights
        self._missing -= loaded
        if self.weights_dropped and not self._missing:
            self.weights_dropped = False

    def update_from_disk(self, path: str) -> None:
        self.update_weights(checkpoint_tensors(path))

    def init_group(self, master_address: str, master_port: int, rank_offset: int,
                   world_size: int, group_name: str, backend: str) -> None:
        if group_name in self.groups:
            raise ValueError(f"group_name: a weight update group {group_name!r} exists")
        self.groups[group_name] = weight_sync.join_group(
            master_address, master_port, rank_offset + self.rank, world_size,
            group_name, backend, self.device)

    def update_from_group(self, names: list[str], dtypes: list, shapes: list,
                          group_name: str) -> None:
        group = self.groups.get(group_name)
        if group is None:
            raise ValueError(f"group_name: no weight update group {group_name!r} "
                             "(init_weight_update_group first)")
        check_updatable(self.model)
        tensors = weight_sync.receive(group, names, dtypes, shapes, self.device)
        try:
            self.update_weights(tensors)
        finally:   # the trainer sends every tensor: take the rest of a failed update
            for _ in tensors:
                pass

    def destroy_group(self, group_name: str) -> None:
        group = self.groups.pop(group_name, None)
        if group is not None:
            weight_sync.leave_group(group)


def _tee(tensors: NamedTensors, takes, taken: list) -> Iterator[tuple[str, torch.Tensor]]:
    """Every pair, and those `takes` names appended to `taken` as they pass."""
    for name, tensor in tensors:
        if takes(name):
            taken.append((name, tensor))
        yield name, tensor


def _storages(tensors: Iterable[torch.Tensor]) -> list[torch.UntypedStorage]:
    """Each distinct storage once (a tied head shares its embedding's)."""
    seen: dict[int, torch.UntypedStorage] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        # (a storage torch does not own, e.g. a memory-mapped file, cannot shrink: it stays)
        if storage.nbytes() and storage.resizable() and storage.data_ptr() not in seen:
            seen[storage.data_ptr()] = storage
    return list(seen.values())


def _park(storage: torch.UntypedStorage, keep: bool) -> _Parked:
    nbytes = storage.nbytes()
    host = None
    if keep:
        host = torch.empty(nbytes, dtype=torch.uint8,
                           pin_memory=storage.device.type == "cuda")
        host.copy_(_bytes(storage))
    storage.resize_(0)
    return _Parked(storage, nbytes, host)


def _unpark(parked: _Parked) -> None:
    parked.storage.resize_(parked.nbytes)
    if parked.host is not None:
        _bytes(parked.storage).copy_(parked.host)


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)

