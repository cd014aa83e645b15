"""Where the loop's updated requests go: once a step's results are applied, the requests it
changed are handed over in one batch, and a thread of their own calls each one's
`on_update` (which builds its delta: new tokens, text, logprobs, the end, and passes it
to its caller). Building deltas, detokenizing and waking callers' event loops then never
hold up the loop thread, which launches the next step instead; the output thread runs
while the loop waits on the device (or, on a CPU, while torch computes).

Requests reach `on_update` in the order they were handed over, one thread calling them all,
so a request's deltas keep their order and its last one (it has ended) comes last."""
from __future__ import annotations

import logging
import queue
import threading

from tllm.request import Request

logger = logging.getLogger(__name__)
_STOP = None


class OutputStage:
    def __init__(self) -> None:
        self._pending: list[Request] = []
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="tllm-outputs", daemon=True)
        self._thread.start()

    def add(self, request: Request) -> None:
        """The request changed in this iteration (loop thread)."""
        if request.on_update is not None and (request.stream_outputs or request.is_finished):
            self._pending.append(request)

    def flush(self) -> None:
        """Hand over what this iteration changed (loop thread)."""
        if self._pending:
            pending, self._pending = self._pending, []
            self._queue.put(pending)

    def deliver_now(self, requests: list[Request]) -> None:
        """From any thread: these requests changed (the engine failing them, say)."""
        self._queue.put([r for r in requests if r.on_update is not None])

    def close(self) -> None:
        """Deliver everything handed over, then stop the thread."""
        self.flush()
        self._queue.put(_STOP)
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def _run(self) -> None:
        while (batch := self._queue.get()) is not _STOP:
            seen: set[int] = set()
            for request in batch:
                if id(request) in seen:  # one delta covers every change before it
                    continue
                seen.add(id(request))
                try:
                    request.on_update(request)
                except Exception:  # a caller's failure must not stop everyone's outputs
                    logger.exception("delivering the output of request %s failed",
                                     request.request_id)
