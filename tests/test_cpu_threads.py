"""Releasing the caller's OpenMP teams: torch keeps working in every thread afterwards, and
the loop thread of an engine built on the CPU computes the same tokens."""
from __future__ import annotations

import threading

import torch

from tllm.cpu_threads import release_caller_openmp_threads


def test_release_leaves_torch_working_in_any_thread():
    x = torch.randn(512, 512)
    expected = x @ x                                  # a parallel region in this thread
    assert release_caller_openmp_threads() in (True, False)
    assert torch.equal(x @ x, expected)               # the team is made again
    out = {}
    thread = threading.Thread(target=lambda: out.setdefault("y", x @ x))
    thread.start()
    thread.join()
    assert torch.equal(out["y"], expected)
