"""Test support: run an app on a loopback port in a background thread, and an engine double
(FakeLLM) for tests of the server and the serving benchmark that need no model."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
import types


from tllm.llmapi.llm import submit_all_or_none
from tllm.serve.http.server import GracefulServer, uvicorn_config
from tllm.outputs import CompletionDelta, Logprob
from tllm.sampling_params import SamplingParams


class ServerThread:
    """uvicorn serving `app` on 127.0.0.1 at a free port, in a daemon thread, configured as
    `tllm serve` configures it (http_server.uvicorn_config: the app's limits; its shutdown
    drains open requests for 2 s, then ends them with an error)."""

    def __init__(self, app, log_level: str = "warning") -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.app = app
        self.server = GracefulServer(uvicorn_config(app, log_level=log_level,
                                                    timeout_graceful_shutdown=2))
        self._thread = threading.Thread(target=self.server.run,
                                        kwargs={"sockets": [self._socket]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> ServerThread:
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        self._socket.close()
        ctx = getattr(self.app.state, "ctx", None)
        if ctx is not None:
            ctx.close()


class FakeTokenizer:
    """Bytes as tokens (vocabulary 256); chat messages as 'role: content' lines."""

    eos_token_ids = frozenset()
    vocab_size = 256

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(text.encode())

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(token_ids).decode(errors="replace")

    def encode_chat(self, messages, add_generation_prompt: bool = True, **kwargs) -> list[int]:
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return self.encode("\n".join(lines) + ("\nassistant: " if add_generation_prompt else ""))


class FakeLLM:
    """Generates 'abc...' one token per `token_delay_s` for every sample, until max_tokens or
    an abort; with `max_batch_size`, at most that many prompts run and the others wait. Set
    `is_alive = False`, `fail_with = exc` (raised on submission) or `fail_midway = exc`
    (raised after the first token) to see the server's answers."""

    def __init__(self, max_seq_len: int = 512, token_delay_s: float = 0.0,
                 max_batch_size: int | None = None) -> None:
        self.tokenizer = FakeTokenizer()
        self.max_seq_len = max_seq_len
        self.token_delay_s = token_delay_s
        self.args = types.SimpleNamespace(max_batch_size=max_batch_size)
        self.is_alive = True
        self.fail_with: Exception | None = None
        self.fail_midway: Exception | None = None
        self.num_steps = 0
        self.num_submitted = 0
        self.active: set[FakeResult] = set()     # submitted and not finished
        self.running: set[FakeResult] = set()    # ... and given a batch slot

    def get_stats(self) -> dict[str, int]:
        """Counts sequences (n of each prompt), as the engine's stats do."""
        num_active = _num_sequences(self.active)
        num_running = (num_active if self.args.max_batch_size is None
                       else _num_sequences(self.running))
        return {"num_running": num_running, "num_waiting": num_active - num_running,
                "kv_blocks_total": 1000, "kv_blocks_free": 1000 - len(self.active),
                "num_steps": self.num_steps}

    def has_free_slot(self, num_sequences: int = 1) -> bool:
        return (self.args.max_batch_size is None or not self.running
                or _num_sequences(self.running) + num_sequences <= self.args.max_batch_size)

    def generate_async(self, inputs: dict, params: SamplingParams,
                       streaming: bool = False) -> FakeResult:
        if self.fail_with is not None:
            raise self.fail_with
        token_ids = inputs["prompt_token_ids"]
        if not token_ids or max(token_ids) >= 256 or min(token_ids) < 0:
            raise ValueError("inputs: prompt token ids must be in [0, 256)")
        result = FakeResult(self, token_ids, params)
        result.request_id = str(self.num_submitted)    # as the engine numbers its requests
        self.num_submitted += 1
        return result

    async def submit_batch(self, inputs: list[dict], params: list[SamplingParams],
                           streaming: bool = False) -> list[FakeResult]:
        return submit_all_or_none(self.generate_async, inputs, params, streaming)


def _num_sequences(results) -> int:
    return sum(getattr(r, "num_sequences", 1) for r in results)


class FakeResult:
    """A fake engine handle on one prompt: `deltas()` yields CompletionDeltas, one per sample
    per step, as an engine's handle does."""

    def __init__(self, llm: FakeLLM, prompt_token_ids: list[int],
                 params: SamplingParams) -> None:
        self._llm = llm
        self._params = params
        self._is_aborted = False
        self.finished = False
        self.prompt_logprobs = None
        if params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] + [{t: Logprob(-1.0, 1)} for t in prompt_token_ids[1:]]
        llm.active.add(self)

    @property
    def num_sequences(self) -> int:
        return self._params.n

    def abort(self) -> None:
        self._is_aborted = True

    async def deltas(self):
        try:
            while not self._llm.has_free_slot(self.num_sequences) and not self._is_aborted:
                await asyncio.sleep(0.005)
            self._llm.running.add(self)
            for step in range(self._params.max_tokens):
                await asyncio.sleep(self._llm.token_delay_s)
                while not self._llm.is_alive:  # a dead engine sends nothing more
                    await asyncio.sleep(0.01)
                self._llm.num_steps += 1
                is_last = self._is_aborted or step == self._params.max_tokens - 1
                for index in range(self._params.n):
                    yield self._delta(index, step, ord("a") + step % 26, is_last)
                if is_last:
                    break
                if self._llm.fail_midway is not None:
                    raise self._llm.fail_midway
        finally:
            self.finished = True
            self._llm.active.discard(self)
            self._llm.running.discard(self)

    def _delta(self, index: int, step: int, token: int, is_last: bool) -> CompletionDelta:
        delta = CompletionDelta(index, [token], chr(token))
        if self._params.logprobs is not None:
            delta.logprobs = [{token: Logprob(-0.5, 1)}]
        if step == 0 and index == 0:
            delta.prompt_logprobs = self.prompt_logprobs
        if is_last:
            delta.finish_reason = "abort" if self._is_aborted else "length"
        return delta
