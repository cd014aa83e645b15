"""Where a rank sits among the GPUs: its tensor-parallel and pipeline-parallel coordinates.

Ranks are laid out tensor-parallel first, as in TensorRT-LLM's `Mapping`: with tp_size=2 and
pp_size=2, ranks 0 and 1 form pipeline stage 0 and ranks 2 and 3 form stage 1; rank 0 and
rank 2 hold the same tensor-parallel shard of different layers.

Mixture-of-experts layers use the same tensor-parallel ranks in one of two ways: every expert
sliced across them (moe_tp_size = tp_size, the default), or, with `enable_expert_parallel`,
whole experts spread over them (moe_ep_size = tp_size, each rank holding E / tp_size)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mapping:
    world_size: int = 1
    tp_size: int = 1
    pp_size: int = 1
    rank: int = 0
    enable_expert_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("world_size", "tp_size", "pp_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive integer, got "
                                 f"{getattr(self, name)!r}")
        if self.world_size != self.tp_size * self.pp_size:
            raise ValueError(f"world_size ({self.world_size}) must equal tp_size x pp_size "
                             f"({self.tp_size} x {self.pp_size})")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")

    @classmethod
    def single(cls) -> Mapping:
        return cls()

    def with_rank(self, rank: int) -> Mapping:
        return Mapping(self.world_size, self.tp_size, self.pp_size, rank,
                       self.enable_expert_parallel)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp_size

    @property
    def pp_rank(self) -> int:
        return self.rank // self.tp_size

    @property
    def tp_group(self) -> list[int]:
        """Ranks that hold the other shards of this rank's layers."""
        first = self.pp_rank * self.tp_size
        return list(range(first, first + self.tp_size))

    @property
    def moe_ep_size(self) -> int:
        """Ranks the experts of a MoE layer are spread over (1: every rank holds all)."""
        return self.tp_size if self.enable_expert_parallel else 1

    @property
    def moe_ep_rank(self) -> int:
        return self.tp_rank if self.enable_expert_parallel else 0

    @property
    def moe_tp_size(self) -> int:
        """Ranks each expert's intermediate features are sliced across."""
        return 1 if self.enable_expert_parallel else self.tp_size

    @property
    def moe_tp_rank(self) -> int:
        return 0 if self.enable_expert_parallel else self.tp_rank

    @property
    def pp_group(self) -> list[int]:
        """Ranks that hold this rank's shard in every stage, first stage first."""
        return [stage * self.tp_size + self.tp_rank for stage in range(self.pp_size)]

    @staticmethod
    def all_tp_groups(tp_size: int, pp_size: int) -> list[list[int]]:
        return [list(range(s * tp_size, (s + 1) * tp_size)) for s in range(pp_size)]

    @staticmethod
    def all_pp_groups(tp_size: int, pp_size: int) -> list[list[int]]:
        return [[s * tp_size + t for s in range(pp_size)] for t in range(tp_size)]

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def prev_stage_rank(self) -> int:
        return self.rank - self.tp_size

    @property
    def next_stage_rank(self) -> int:
        return self.rank + self.tp_size

    @property
    def is_driver(self) -> bool:
        """Rank 0 runs the scheduler and the sampler and tells the other ranks what to run."""
        return self.rank == 0

    @property
    def is_parallel(self) -> bool:
        return self.world_size > 1

    def stage_layers(self, num_layers: int) -> range:
        """The layers of this rank's pipeline stage: contiguous, earlier stages take the
        remainder one layer each."""
        if num_layers < self.pp_size:
            raise ValueError(f"pipeline_parallel_size ({self.pp_size}) exceeds the model's "
                             f"{num_layers} layers")
        base, extra = divmod(num_layers, self.pp_size)
        start = self.pp_rank * base + min(self.pp_rank, extra)
        return range(start, start + base + (1 if self.pp_rank < extra else 0))
