"""A fake engine that answers every request with a fixed text, one character a token: for the
tests of what the server makes of a model's output (tool calls, reasoning, events)."""
from __future__ import annotations

import asyncio

from tllm.outputs import CompletionDelta
from tllm.serve.testing import FakeLLM


class ScriptedLLM(FakeLLM):
    """Answers every request with `script`, one character per token, then ends with
    `finish_reason` ("length": cut short by max_tokens)."""

    script = ""
    finish_reason = "stop"

    def generate_async(self, inputs, params, streaming=False):
        self.last_prompt = inputs["prompt_token_ids"]
        self.last_params = params
        return _Scripted(self.script, params.n, self.finish_reason)


class _Scripted:
    prompt_logprobs = None
    finished = False

    def __init__(self, script: str, n: int, finish_reason: str) -> None:
        self.script, self.n, self.finish_reason = script, n, finish_reason

    def abort(self) -> None:
        pass

    async def deltas(self):
        for step, char in enumerate(self.script):
            await asyncio.sleep(0)
            for index in range(self.n):
                is_last = step == len(self.script) - 1
                yield CompletionDelta(index, [min(ord(char), 255)], char,
                                      finish_reason=self.finish_reason if is_last else None)
        self.finished = True
