"""State checkpoints saved inside a prefill segment, through the Triton conv and scan
kernels (the mixer's two passes; tests/kv_cache/test_state_checkpoints.py runs the torch
path)."""
import pytest

pytest.importorskip("triton")

from tests.kv_cache.test_state_checkpoints import check_saves_inside_segments  # noqa: E402


def test_saves_inside_segments_triton(device):
    check_saves_inside_segments(use_triton=True, device=device)
