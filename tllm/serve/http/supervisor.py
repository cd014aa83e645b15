"""Engine supervision: when the engine dies, the server restarts it (a bounded number of
attempts in a row, with backoff, each logged) or, configured so, asks the server to exit
non-zero at once so that an orchestrator restarts the whole server. Open requests do not wait
for either: ProcessLLM fails them (503) the moment its engine process's pipe closes."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """How the server answers an engine that died."""

    exit_on_failure: bool = False   # exit non-zero instead of restarting
    max_restarts: int = 3           # attempts in a row (no stable run between) before exiting
    backoff_s: float = 1.0          # wait before the 2nd attempt in a row; doubles each time
    max_backoff_s: float = 30.0
    stable_s: float = 60.0          # an engine up this long resets the count of attempts

    def delay_s(self, attempt: int) -> float:
        """Seconds to wait before attempt 1, 2, 3, ...: 0, backoff_s, 2 * backoff_s, ..."""
        if attempt <= 1:
            return 0.0
        return min(self.backoff_s * 2 ** (attempt - 2), self.max_backoff_s)


class EngineSupervisor:
    """Watches `llm.is_alive` from a thread of its own. An engine that can be restarted (one
    with `restart()`: ProcessLLM) is restarted by the policy; otherwise, or with
    `exit_on_failure`, or once every attempt in a row has failed, `on_fatal(reason)` is
    called (the server sets it to stop uvicorn; its exit status is then 1)."""

    def __init__(self, llm, policy: RestartPolicy = RestartPolicy(),
                 poll_s: float = 0.05) -> None:
        self.llm = llm
        self.policy = policy
        self.poll_s = poll_s
        self.on_fatal: Callable[[str], None] = lambda reason: None
        self.num_restarts = 0           # successful restarts since the server started
        self.fatal_reason: str | None = None
        self._attempt = 0               # attempts in a row
        self._status: str | None = None     # while the engine is down: what is being done
        self._up_since = time.monotonic()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="tllm-engine-supervisor",
                                        daemon=True)

    @property
    def can_restart(self) -> bool:
        return callable(getattr(self.llm, "restart", None))

    def status(self) -> str | None:
        """While the engine is down: what the supervisor is doing about it (or, in the
        moment before its watcher notices, how the engine died)."""
        if self._status is None and not self.llm.is_alive:
            return _death_note(self.llm)
        return self._status

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            if self.llm.is_alive:
                if self._attempt and time.monotonic() - self._up_since > self.policy.stable_s:
                    self._attempt = 0
                continue
            if not self._recover():
                return

    def _recover(self) -> bool:
        """Bring the engine back; False if the server must exit instead."""
        death = _death_note(self.llm)
        if self.policy.exit_on_failure:
            return self._give_up(f"{death}; exiting (--exit-on-engine-failure)")
        if not self.can_restart:
            return self._give_up(f"{death}; an engine in the server's process cannot be "
                                 "restarted: exiting")
        while self._attempt < self.policy.max_restarts:
            self._attempt += 1
            delay = self.policy.delay_s(self._attempt)
            self._status = (f"{death}; restarting it (attempt {self._attempt} of "
                            f"{self.policy.max_restarts})")
            logger.warning("%s in %.1f s", self._status, delay)
            if self._stop.wait(delay):
                return False
            started = time.monotonic()
            try:
                self.llm.restart()
            except Exception as exc:
                logger.error("engine restart attempt %d failed: %s: %s", self._attempt,
                             type(exc).__name__, exc)
                death = f"the engine failed to start ({type(exc).__name__})"
                continue
            self.num_restarts += 1
            self._up_since = time.monotonic()
            self._status = None
            logger.warning("engine restarted in %.1f s (pid %s)", self._up_since - started,
                           getattr(self.llm, "pid", "?"))
            return True
        return self._give_up(f"{death}; {self.policy.max_restarts} restarts in a row "
                             "failed: exiting")

    def _give_up(self, reason: str) -> bool:
        logger.error("%s", reason)
        self.fatal_reason = self._status = reason
        self.on_fatal(reason)
        return False


def _death_note(llm) -> str:
    code = getattr(llm, "exitcode", None)
    if code is None:
        return "the engine has stopped"
    return f"the engine process exited with code {code}"
