"""A beam's length-normalised score (HF's sum / length ** length_penalty) stays a float at
any penalty: it was an OverflowError at 700 and a ZeroDivisionError at -700 (issue 31)."""
from __future__ import annotations

import math

import pytest

from tllm.sampling.beam import _length_normalized


@pytest.mark.parametrize("score,length,penalty", [
    (-3.0, 10, 1.0), (-3.0, 7, 0.5), (-3.0, 1, 700.0), (-12.5, 300, -2.0), (0.0, 5, 3.0)])
def test_usual_penalties_are_hf_arithmetic(score, length, penalty):
    assert _length_normalized(score, length, penalty) == score / length ** penalty


@pytest.mark.parametrize("score,length,penalty,expected", [
    (-3.0, 10, 700.0, 0.0), (-3.0, 10, 1e308, 0.0),
    (-3.0, 10, -700.0, -math.inf), (0.0, 10, -700.0, 0.0), (2.0, 10, -700.0, math.inf)])
def test_extreme_penalties_give_floats_not_errors(score, length, penalty, expected):
    assert _length_normalized(score, length, penalty) == expected
