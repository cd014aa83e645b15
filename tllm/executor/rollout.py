"""Rank 0's rollout operations (RL post-training between rollouts): pause and resume
generation, abort everything, sleep and wake, new weights (in-process tensors, a checkpoint
folder, a trainer's process group). Each runs on the loop thread once no step is in flight
(`PyExecutor.call_when_quiet`), on rank 0 and, sent as a `RankCommand`, on every other rank;
the caller's thread waits for it."""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

import torch

from tllm.distributed import comm, weight_sync
from tllm.runner.rank_rollout import SLEEP_LEVELS, WAKE_TAGS, RankCommand, RankRollout

if TYPE_CHECKING:
    from tllm.executor.py_executor import PyExecutor


class RolloutControl:
    """What `LLM.sleep`, `LLM.update_weights` and the others call."""

    def __init__(self, executor: PyExecutor, rank: RankRollout, has_workers: bool) -> None:
        self.executor = executor
        self.rank = rank
        self.has_workers = has_workers

    @property
    def gate(self):
        return self.executor.gate

    # ---- generation ----

    def pause_generation(self, abort: bool = False) -> None:
        """No new step launches (requests submitted meanwhile wait); returns once the steps
        in flight have ended. `abort`: every unfinished request ends now (finish reason
        "abort"); otherwise they resume where they were."""
        self.gate.is_paused = True
        if abort:
            self.executor.abort_all()
        self._when_quiet(lambda: None)

    def resume_generation(self) -> None:
        self.gate.is_paused = False
        self.executor.call_soon(lambda: None)   # an idle loop looks at the gate again

    def abort_all_requests(self) -> None:
        """Every request submitted so far ends (finish reason "abort"); returns once they
        have."""
        self.executor.abort_all()
        self._when_quiet(lambda: None)

    # ---- sleep and wake ----

    def sleep(self, level: int = 1) -> None:
        if level not in SLEEP_LEVELS:
            raise ValueError(f"level must be 1 (weights to host memory) or 2 (weights "
                             f"dropped), got {level!r}")
        self._when_quiet(lambda: self._sleep(level))

    def _sleep(self, level: int) -> None:
        unfinished = self.executor.scheduler.has_unfinished
        if unfinished and not self.gate.is_sleeping:
            raise ValueError("sleep: requests are unfinished; abort them "
                             "(pause_generation(abort=True) or abort_all_requests()) or "
                             "wait for them first")
        self.gate.is_sleeping = True
        self._on_ranks(RankCommand("sleep", {"level": level}))
        if level == 2:
            self.gate.needs_weights = True

    def wake_up(self, tags: list[str] | None = None) -> None:
        if tags is not None and (isinstance(tags, str) or not set(tags) <= set(WAKE_TAGS)
                                 or not tags):
            raise ValueError(f"tags must be None or a list of {', '.join(WAKE_TAGS)}, "
                             f"got {tags!r}")
        self._when_quiet(lambda: self._wake(tags))

    def _wake(self, tags: list[str] | None) -> None:
        self._on_ranks(RankCommand("wake", {"tags": None if tags is None else list(tags)}))
        self.gate.is_sleeping = self.rank.is_sleeping
        self.executor.call_soon(lambda: None)

    @property
    def is_sleeping(self) -> bool:
        return self.gate.is_sleeping

    # ---- weights ----

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        tensors = _named_tensors(named_tensors)
        if self.has_workers:   # the other ranks get them through the ranks' own group
            tensors = [(name, tensor.detach().cpu()) for name, tensor in tensors]
        self._update(RankCommand("update", {"tensors": tensors}))

    def update_weights_from_disk(self, path: str) -> None:
        if not isinstance(path, str) or not path:
            raise ValueError(f"path must be a folder of safetensors files, got {path!r}")
        self._update(RankCommand("update_from_disk", {"path": path}))

    def init_weight_update_group(self, master_address: str, master_port: int,
                                 rank_offset: int, world_size: int,
                                 group_name: str = "weights", backend: str = "gloo") -> None:
        if not isinstance(rank_offset, int) or rank_offset < 1:
            raise ValueError(f"rank_offset must be >= 1 (the trainer is rank 0), got "
                             f"{rank_offset!r}")
        weight_sync.check_group_args(master_address, master_port, rank_offset, world_size,
                                     group_name, backend)
        self._when_quiet(lambda: self._on_ranks(RankCommand("init_group", {
            "master_address": master_address, "master_port": master_port,
            "rank_offset": rank_offset, "world_size": world_size, "group_name": group_name,
            "backend": backend})))

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                        group_name: str = "weights") -> None:
        weight_sync.check_specs(list(names), list(dtypes), list(shapes))
        self._update(RankCommand("update_from_group", {
            "names": list(names), "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes], "group_name": group_name}))

    def destroy_weight_update_group(self, group_name: str = "weights") -> None:
        self._when_quiet(lambda: self._on_ranks(
            RankCommand("destroy_group", {"group_name": group_name})))

    def _update(self, command: RankCommand) -> None:
        def run() -> None:
            self._on_ranks(command)
            self.gate.needs_weights = self.rank.weights_dropped
            self.executor.call_soon(lambda: None)
        self._when_quiet(run)

    # ---- plumbing ----

    def _on_ranks(self, command: RankCommand):
        if self.has_workers:
            comm.broadcast_object(command)
        return self.rank.apply(command)

    def _when_quiet(self, fn):
        if not self.executor.is_alive:
            raise RuntimeError("the engine has stopped")
        return self.executor.call_when_quiet(fn).result()


def _named_tensors(named_tensors) -> list[tuple[str, torch.Tensor]]:
    if isinstance(named_tensors, dict):
        named_tensors = named_tensors.items()
    pairs = []
    for item in named_tensors:
        if (not isinstance(item, tuple) or len(item) != 2 or not isinstance(item[0], str)
                or not isinstance(item[1], torch.Tensor)):
            raise ValueError("named_tensors: expected (name, torch.Tensor) pairs or a dict "
                             f"of them, got an item {type(item).__name__}")
        pairs.append(item)
    return pairs
