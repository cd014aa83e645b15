"""The RL-rollout methods of LLM and ProcessLLM, as vLLM and SGLang name them: sleep and
wake, new weights without a restart (in-process tensors, a checkpoint folder, a trainer's
process group), pause / resume generation and abort-all. Each class says how to reach its
engine's `RolloutControl` (tllm.executor.rollout): LLM directly, ProcessLLM by forwarding
the call to its engine process."""
from __future__ import annotations

from typing import Any, Iterable

import torch

from tllm.executor.rollout import RolloutControl
from tllm.runner.rank_rollout import RankRollout

ROLLOUT_METHODS = ("sleep", "wake_up", "is_sleeping", "pause_generation",
                   "resume_generation", "abort_all_requests", "update_weights",
                   "update_weights_from_disk", "init_weight_update_group",
                   "update_weights_from_distributed", "destroy_weight_update_group")


def rollout_control(engine, sleep_mode_policy: str) -> RolloutControl:
    """The control of an engine (tllm.llmapi.engine.Engine): its rank 0's parts."""
    executor = engine.executor
    runner = executor.runner
    executor.gate.sleep_mode_policy = sleep_mode_policy
    speculation = executor.speculation
    rank = RankRollout(runner.model, engine.kv_cache, runner.cuda_graphs, runner.piecewise,
                       engine.device, engine.dtype,
                       drafter=speculation.drafter if speculation is not None else None)
    return RolloutControl(executor, rank, engine.workers is not None)


class RolloutMethods:
    """Mixed into LLM and ProcessLLM; `_rollout_call(name, *args)` runs one method of
    RolloutControl (the one contract with the class it is mixed into)."""

    def _rollout_call(self, name: str, *args: Any) -> Any:
        raise NotImplementedError

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (its cached prefixes dropped) and move the weights to host
        memory (level 1) or drop them (level 2: load new ones with update_weights or
        update_weights_from_disk before generating). ValueError while requests are
        unfinished: pause_generation(abort=True) or wait for them first."""
        self._rollout_call("sleep", level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what sleep freed: both (None), or ["weights"] / ["kv_cache"] alone
        (weights first leaves room to update them before the cache comes back)."""
        self._rollout_call("wake_up", tags)

    @property
    def is_sleeping(self) -> bool:
        return self._rollout_call("is_sleeping")

    def pause_generation(self, abort: bool = False) -> None:
        """Launch no more steps (returns once those in flight end); `abort`: every
        unfinished request ends with finish reason "abort", else they wait for
        resume_generation()."""
        self._rollout_call("pause_generation", abort)

    def resume_generation(self) -> None:
        self._rollout_call("resume_generation")

    def abort_all_requests(self) -> None:
        """End every unfinished request (finish reason "abort")."""
        self._rollout_call("abort_all_requests")

    def update_weights(self, named_tensors: dict[str, torch.Tensor]
                       | Iterable[tuple[str, torch.Tensor]]) -> None:
        """New weights by their HF checkpoint names (all or some), sharded and quantized
        as at load; cached prefixes are dropped. Runs between steps."""
        self._rollout_call("update_weights", named_tensors)

    def update_weights_from_disk(self, path: str) -> None:
        """New weights from an HF folder of the same architecture (its safetensors)."""
        self._rollout_call("update_weights_from_disk", path)

    def init_weight_update_group(self, master_address: str, master_port: int,
                                 rank_offset: int, world_size: int,
                                 group_name: str = "weights", backend: str = "gloo") -> None:
        """Join a trainer's process group (the trainer is rank 0 and hosts the store:
        tllm.distributed.weight_sync.trainer_group); this engine's ranks are rank_offset
        on. Blocks until every rank has joined."""
        self._rollout_call("init_weight_update_group", master_address, master_port,
                           rank_offset, world_size, group_name, backend)

    def update_weights_from_distributed(self, names: list[str], dtypes: list, shapes: list,
                                        group_name: str = "weights") -> None:
        """Receive these tensors, broadcast by the trainer in this order, as new weights."""
        self._rollout_call("update_weights_from_distributed", names, dtypes, shapes,
                           group_name)

    def destroy_weight_update_group(self, group_name: str = "weights") -> None:
        self._rollout_call("destroy_weight_update_group", group_name)
