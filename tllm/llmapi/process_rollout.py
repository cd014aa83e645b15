"""ProcessLLM's rollout calls (sleep, wake, weight updates: tllm.llmapi.rollout) forwarded to
its engine process:

    server -> engine  ("rollout", call_id, method name, args)
    engine -> server  ("rollout_done", call_id, result, error | None)

The engine runs each call on a thread of its own (a weight update may take seconds; the
command pipe keeps serving submissions and aborts meanwhile), the caller's thread waits for
the answer. Only the names in ROLLOUT_METHODS are run."""
from __future__ import annotations

import itertools
import threading
from concurrent.futures import Future
from typing import Any, Callable

from tllm.llmapi.rollout import ROLLOUT_METHODS


class RolloutCalls:
    """The server side: the calls sent to one engine process and their answers."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self._futures: dict[int, Future] = {}
        self._lock = threading.Lock()

    def call(self, send: Callable[[tuple], None], name: str, args: tuple) -> Any:
        """Send the call, wait for its answer (the engine's error raised here)."""
        future: Future = Future()
        with self._lock:
            call_id = next(self._ids)
            self._futures[call_id] = future
        try:
            send(("rollout", call_id, name, args))
            return future.result()
        finally:
            with self._lock:
                self._futures.pop(call_id, None)

    def settle(self, message: tuple) -> None:
        """(Receiver thread.) A "rollout_done" message."""
        _, call_id, result, error = message
        with self._lock:
            future = self._futures.get(call_id)
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(result)

    def fail_all(self, error: BaseException) -> None:
        with self._lock:
            futures = list(self._futures.values())
        for future in futures:
            if not future.done():
                future.set_exception(error)


def run_rollout_call(llm, call_id: int, name: str, args: tuple,
                     answer: Callable[[int, Any, BaseException | None], None]) -> None:
    """The engine side: run `llm.<name>(*args)` on a thread, then answer."""
    def run() -> None:
        if name not in ROLLOUT_METHODS:
            answer(call_id, None, ValueError(f"unknown rollout call {name!r}"))
            return
        try:
            result = llm._rollout_call(name, *args)
        except Exception as exc:
            answer(call_id, None, exc)
        else:
            answer(call_id, result, None)

    threading.Thread(target=run, name=f"tllm-rollout-{name}", daemon=True).start()
