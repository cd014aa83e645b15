"""Keeping long-lived objects out of the garbage collector's full passes, for processes that
serve: a pass over a loaded model's objects took 100-165 ms on a 2-core CPU and stalled
every stream (vLLM's API server freezes its start-up objects too)."""
from __future__ import annotations

import contextlib
import gc


@contextlib.contextmanager
def frozen_heap():
    """Everything alive now out of the garbage collector's passes (gc.freeze) while the
    block runs. Unfrozen after: frozen objects are never freed at exit, and native
    extensions (triton's nanobind types) then print pages of "leaked" warnings."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
