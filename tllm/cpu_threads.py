"""CPU threading for the engine: the executor loop runs torch in its own thread, and GNU
OpenMP (torch's intra-op threads on Linux) slows every parallel region started from a second
thread once the calling thread keeps a thread team of its own: with more OpenMP threads than
cores, its workers stop spinning and each region waits ~90 us to wake them (measured on the
2-core development VMs: a decode step of SmolLM2 took 61 ms in the loop thread against 34 ms
in the main thread). Building the model runs parallel copies in the caller's thread, so once
the engine is built the caller's team is released (OpenMP 5's omp_pause_resource_all)."""
from __future__ import annotations

import ctypes
import glob
import logging
import os

logger = logging.getLogger(__name__)
_OMP_PAUSE_SOFT = 1


def release_caller_openmp_threads() -> bool:
    """Free the OpenMP thread teams of this process's idle threads (they are made again on a
    thread's next parallel region). True when the runtime did it."""
    lib = _libgomp()
    if lib is None or not hasattr(lib, "omp_pause_resource_all"):
        return False
    return lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0


def _libgomp():
    import torch
    candidates = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*"))
    try:
        return ctypes.CDLL(candidates[0] if candidates else "libgomp.so.1")
    except OSError:  # another OpenMP runtime (Intel, LLVM) or none: nothing to release
        logger.debug("no GNU OpenMP runtime found", exc_info=True)
        return None
