"""A periodic stats line while the server runs (`--log-stats-interval`): running and waiting
sequences, KV cache use, prompt and generation tokens/s over the interval. An idle server
logs nothing (one line when it goes idle, then silence), so its log does not fill with
zeros."""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger(__name__)
PROMPT_TOKENS = "tllm:prompt_tokens_total"
GENERATION_TOKENS = "tllm:generation_tokens_total"


@dataclass
class _Point:
    time: float
    prompt_tokens: float
    generation_tokens: float
    preemptions: int


class StatsLogger:
    """Call `tick(stats)` every interval (the thread `start` makes does) with the engine's
    stats (LLM.get_stats) plus the server's token counters (PROMPT_TOKENS,
    GENERATION_TOKENS: ServerMetrics.samples())."""

    def __init__(self, read_stats: Callable[[], dict] | None = None,
                 interval_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.read_stats = read_stats
        self.interval_s = interval_s
        self.clock = clock
        self._last: _Point | None = None
        self._was_active = False    # the last line logged showed requests running/waiting
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self, stats: dict) -> str | None:
        """Log the line for this interval, if there is one to log; returns it."""
        point = _Point(self.clock(), stats.get(PROMPT_TOKENS, 0),
                       stats.get(GENERATION_TOKENS, 0), int(stats.get("num_preemptions", 0)))
        last, self._last = self._last, point
        is_active = bool(stats.get("num_running") or stats.get("num_waiting"))
        if last is None:
            return None     # the first reading only starts the interval
        moved = (point.prompt_tokens, point.generation_tokens) != (last.prompt_tokens,
                                                                   last.generation_tokens)
        if not (is_active or moved or self._was_active):
            return None     # idle, and the last line said so already
        self._was_active = is_active
        line, fields = _line(stats, last, point)
        logger.info("%s", line, extra={"fields": fields})
        return line

    def start(self) -> StatsLogger:
        """Tick every interval in a daemon thread (nothing with an interval of 0)."""
        if self.interval_s > 0 and self.read_stats is not None:
            self._thread = threading.Thread(target=self._run, name="tllm-stats-log",
                                            daemon=True)
            self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.tick(self.read_stats())
            except Exception as exc:    # an engine restarting: the next tick reads again
                logger.debug("stats not read: %s", exc)


def _line(stats: dict, last: _Point, point: _Point) -> tuple[str, dict]:
    """The stats line of the interval from `last` to `point`, and its numbers."""
    seconds = max(point.time - last.time, 1e-9)
    fields = {"num_running": stats.get("num_running", 0),
              "num_waiting": stats.get("num_waiting", 0),
              "kv_usage_pct": round(100.0 * kv_usage(stats), 1),
              "prompt_tokens_per_s": round((point.prompt_tokens - last.prompt_tokens)
                                           / seconds, 1),
              "generation_tokens_per_s": round((point.generation_tokens
                                                - last.generation_tokens) / seconds, 1),
              "preemptions": point.preemptions - last.preemptions}
    line = ("running {num_running}, waiting {num_waiting}, KV cache {kv_usage_pct}% used, "
            "prompt {prompt_tokens_per_s} tok/s, generation {generation_tokens_per_s} "
            "tok/s".format(**fields))
    if fields["preemptions"]:
        line += f", {fields['preemptions']} preempted"
    return line, fields


def kv_usage(stats: dict) -> float:
    """The fraction of KV blocks in use."""
    total = stats.get("kv_blocks_total", 0)
    return 1.0 - stats.get("kv_blocks_free", total) / total if total else 0.0


def server_stats(llm, metrics) -> Callable[[], dict]:
    """The stats a server's StatsLogger reads: the engine's and the token counters."""
    def read() -> dict:
        samples = metrics.samples()
        return {**llm.get_stats(), PROMPT_TOKENS: samples.get(PROMPT_TOKENS, 0),
                GENERATION_TOKENS: samples.get(GENERATION_TOKENS, 0)}
    return read
