"""ProcessLLM forwards the rollout calls to its engine process: a weight update from disk
and sleep/wake there give the tokens an in-process engine gives; an engine error comes
back as itself."""
from __future__ import annotations

import asyncio

import pytest

from tests.llmapi.test_rollout import ENGINE, GREEDY, PROMPTS, models  # noqa: F401
from tllm.llmapi.process_llm import ProcessLLM


def _greedy(llm) -> list[list[int]]:
    async def complete():
        results = await llm.submit_batch([{"prompt_token_ids": p} for p in PROMPTS],
                                         [GREEDY] * len(PROMPTS))
        return [(await r).outputs[0].token_ids for r in results]
    return asyncio.run(complete())


def test_process_llm_rollout_calls(models):
    (first, expected), (second, expected_second) = models
    with ProcessLLM(first, **ENGINE) as llm:
        assert not llm.is_sleeping
        llm.sleep(level=1)
        assert llm.is_sleeping
        llm.wake_up()
        assert _greedy(llm) == expected
        llm.pause_generation()
        llm.update_weights_from_disk(second)
        llm.resume_generation()
        assert _greedy(llm) == expected_second
        with pytest.raises(ValueError, match="level"):
            llm.sleep(level=5)
