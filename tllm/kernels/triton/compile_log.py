"""`TLLM_LOG_TRITON_COMPILES=1`: log every Triton kernel compile with its duration, to find
compiles that land in the middle of serving (each one stalls the whole batch for its
duration); a value other than 0/1 is a file the lines are appended to as well. Off by
default; installed on first import of the launch helpers."""
from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger(__name__)
_started: dict[str, float] = {}


def _before(**hook_kwargs) -> None:
    """jit_cache_hook: runs before a compile (a truthy return would skip it)."""
    _started[str(hook_kwargs.get("repr"))] = time.perf_counter()
    return None


def _after(**hook_kwargs) -> None:
    name = str(hook_kwargs.get("repr"))
    started = _started.pop(name, None)
    took = "" if started is None else f" in {time.perf_counter() - started:.2f} s"
    logger.warning("triton compiled %s%s", name[:300], took)


def install_from_env() -> bool:
    """Install the hooks when TLLM_LOG_TRITON_COMPILES is set; whether they were installed
    (False also on a Triton without runtime hooks)."""
    value = os.environ.get("TLLM_LOG_TRITON_COMPILES", "0")
    if value in ("", "0"):
        return False
    try:
        from triton import knobs
    except ImportError:
        return False
    if value != "1" and not logger.handlers:
        logger.addHandler(logging.FileHandler(value))
    knobs.runtime.jit_cache_hook = _before
    knobs.runtime.jit_post_compile_hook = _after
    return True
