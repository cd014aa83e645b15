"""SamplingParams: defaults, normalisation, and a ValueError naming the field for every
out-of-range value."""
from __future__ import annotations

import re

import pytest

from tllm.sampling_params import SamplingParams


def test_defaults_are_valid_and_disable_every_filter():
    params = SamplingParams()
    assert not params.is_greedy
    assert (params.top_k, params.top_p, params.min_p) == (-1, 1.0, 0.0)
    assert params.stop_strings == [] and params.stop_token_ids == []


def test_temperature_zero_is_greedy():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=0).is_greedy
    assert not SamplingParams(temperature=1e-3).is_greedy


def test_top_k_zero_normalises_to_disabled():
    assert SamplingParams(top_k=0).top_k == -1
    assert SamplingParams(top_k=-1).top_k == -1
    assert SamplingParams(top_k=7).top_k == 7


def test_stop_is_normalised_to_a_list_of_strings():
    assert SamplingParams(stop="x").stop_strings == ["x"]
    assert SamplingParams(stop=["a", "bc"]).stop_strings == ["a", "bc"]
    assert SamplingParams(stop=("a",)).stop_strings == ["a"]
    assert SamplingParams(stop=None).stop_strings == []
    assert SamplingParams(stop_token_ids=None).stop_token_ids == []
    assert SamplingParams(stop_token_ids=(3, 0)).stop_token_ids == [3, 0]


@pytest.mark.parametrize("kwargs", [
    dict(temperature=0.0), dict(temperature=5.0),
    dict(top_p=1e-6), dict(top_p=1.0), dict(top_p=1),
    dict(top_k=-1), dict(top_k=1), dict(top_k=100000),
    dict(min_p=0.0), dict(min_p=1.0), dict(min_p=1),
    dict(repetition_penalty=1e-3), dict(repetition_penalty=3.0),
    dict(presence_penalty=-2.0), dict(presence_penalty=2.0),
    dict(frequency_penalty=-2), dict(frequency_penalty=2.0),
    dict(n=1), dict(n=8), dict(max_tokens=1), dict(max_tokens=None, min_tokens=50),
    dict(min_tokens=5, max_tokens=5), dict(logprobs=0), dict(logprobs=20),
    dict(prompt_logprobs=0), dict(seed=0), dict(seed=-3),
    dict(stop=[]), dict(stop_token_ids=[0, 2]),
], ids=repr)
def test_boundary_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


@pytest.mark.parametrize("field, kwargs", [
    ("temperature", dict(temperature=-0.1)),
    ("temperature", dict(temperature=-1)),
    ("temperature", dict(temperature=float("nan"))),
    ("temperature", dict(temperature="1.0")),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=0)),
    ("top_p", dict(top_p=1.01)),
    ("top_p", dict(top_p=-0.5)),
    ("top_k", dict(top_k=-2)),
    ("top_k", dict(top_k=-100)),
    ("top_k", dict(top_k=2.5)),
    ("min_p", dict(min_p=-0.01)),
    ("min_p", dict(min_p=1.5)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("repetition_penalty", dict(repetition_penalty=-1.0)),
    ("presence_penalty", dict(presence_penalty=2.1)),
    ("presence_penalty", dict(presence_penalty=-2.5)),
    ("frequency_penalty", dict(frequency_penalty=2.01)),
    ("frequency_penalty", dict(frequency_penalty=-3)),
    ("n", dict(n=0)),
    ("n", dict(n=-1)),
    ("n", dict(n=1.5)),
    ("n", dict(n=True)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-5)),
    ("max_tokens", dict(max_tokens=2.0)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=6, max_tokens=5)),
    ("logprobs", dict(logprobs=-1)),
    ("prompt_logprobs", dict(prompt_logprobs=-2)),
    ("seed", dict(seed=1.5)),
    ("stop", dict(stop="")),
    ("stop", dict(stop=["ok", ""])),
    ("stop", dict(stop=[1])),
    ("stop", dict(stop=123)),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("stop_token_ids", dict(stop_token_ids=[3, -7])),
    ("stop_token_ids", dict(stop_token_ids=["3"])),
    ("stop_token_ids", dict(stop_token_ids=5)),
], ids=lambda v: v if isinstance(v, str) else repr(v))
def test_out_of_range_values_raise_naming_the_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"\b{re.escape(field)}\b"):
        SamplingParams(**kwargs)


def test_min_tokens_error_also_names_max_tokens():
    with pytest.raises(ValueError, match=r"min_tokens.*max_tokens"):
        SamplingParams(min_tokens=10, max_tokens=3)


@pytest.mark.parametrize("penalty", [700, -700, 50.5, float("inf"), float("-inf")])
def test_length_penalty_is_bounded(penalty):
    """Issue 31: 700 overflowed (OverflowError) and -700 divided by zero in beam scoring."""
    with pytest.raises(ValueError, match=r"SamplingParams\.length_penalty must be a number "
                                         r"in \[-50\.0, 50\.0\]"):
        SamplingParams(use_beam_search=True, best_of=2, temperature=0, length_penalty=penalty)


@pytest.mark.parametrize("penalty", [-50, -1.0, 0, 2.0, 50.0])
def test_length_penalty_within_the_bounds_is_accepted(penalty):
    SamplingParams(use_beam_search=True, best_of=2, temperature=0, length_penalty=penalty)


@pytest.mark.parametrize("text", ["[" * 100_000, '{"a": ' + "1" * 5000 + "}"],
                         ids=["deep nesting", "a 5,000-digit integer"])
def test_guided_json_text_json_cannot_hold_is_a_value_error(text):
    from tllm.sampling_params import GuidedDecodingParams
    with pytest.raises(ValueError, match="GuidedDecodingParams.json is not valid JSON"):
        GuidedDecodingParams(json=text)
