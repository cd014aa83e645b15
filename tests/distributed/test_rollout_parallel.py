"""RL rollouts under tensor parallelism on the CPU (gloo, a process per rank): each rank
takes its shard of new weights (in-process tensors, or a trainer's broadcast to every rank),
and sleep/wake reach the worker ranks; greedy tokens equal a single-process engine's."""
from __future__ import annotations

import pytest

from tests.llmapi.test_rollout import (ENGINE, TRAINER, _greedy, _tensors,  # noqa: F401
                                       models)
from tllm import LLM

pytestmark = pytest.mark.slow


def test_tp2_update_weights_sleep_wake_and_trainer_group(models):
    import socket
    import subprocess
    import sys
    (first, _), (second, expected) = models
    tensors = _tensors(second)
    with LLM(first, tensor_parallel_size=2, **ENGINE) as llm:
        llm.update_weights(tensors)
        assert _greedy(llm) == expected
        llm.sleep(level=1)
        llm.wake_up()
        assert _greedy(llm) == expected
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        trainer = subprocess.Popen([sys.executable, "-c", TRAINER.replace(
            "world_size=2", "world_size=3"), first, str(port)])
        try:
            llm.init_weight_update_group("127.0.0.1", port, 1, 3, group_name="rl")
            llm.update_weights_from_distributed(
                list(tensors), [str(t.dtype) for t in tensors.values()],
                [list(t.shape) for t in tensors.values()], group_name="rl")
            assert trainer.wait(timeout=60) == 0
        finally:
            trainer.kill()
        assert _greedy(llm) == models[0][1]
