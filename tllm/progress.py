"""Progress bars for long work (loading weights, the benchmarks): tqdm on stderr, as vLLM
shows them. A bar stays off when asked (a command's --disable-tqdm), when tllm's log level
is above INFO (`--log-level warning`, or a program that set the "tllm" logger so), and
under tqdm's own TQDM_DISABLE=1, which turns every bar off."""
from __future__ import annotations

import logging
import os
import sys
from typing import Iterable

from tqdm.auto import tqdm

# Seconds between a bar's updates when stderr is a file or a pipe, not a terminal.
_LOG_INTERVAL_S = 2.0


def is_quiet() -> bool:
    """True under TQDM_DISABLE (read here, at each bar: tqdm reads it once, at import) or
    when the "tllm" logger was set above INFO, where progress would be noise."""
    if os.environ.get("TQDM_DISABLE", "").lower() in ("1", "true", "yes", "on"):
        return True
    level = logging.getLogger("tllm").level
    return level != logging.NOTSET and level > logging.INFO


def progress_bar(iterable: Iterable | None = None, *, total: float | None = None,
                 desc: str | None = None, unit: str = "it", disable: bool = False) -> tqdm:
    """A tqdm bar (a context manager; `update(n)` advances it), off as the module says."""
    options = {"total": total, "desc": desc, "unit": unit, "dynamic_ncols": True}
    if not _is_terminal(sys.stderr):
        options["mininterval"] = _LOG_INTERVAL_S   # a log file gets a few updates, not dozens
    if disable or is_quiet():
        options["disable"] = True
    return tqdm(iterable, **options)


def _is_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())
