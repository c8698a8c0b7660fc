from __future__ import annotations

import math

import pytest

from services.protocol.sampling_params import MAX_STOP_STRINGS, SamplingParams


def test_defaults_match_vllm() -> None:
    p = SamplingParams()
    assert (p.n, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 1.0, 1.0, 0, 0.0)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.0, 0.0, 1.0)
    assert (p.seed, p.max_tokens, p.min_tokens, p.logprobs) == (None, 16, 0, None)
    assert (p.stop, p.stop_token_ids) == ([], [])
    assert (p.ignore_eos, p.skip_special_tokens, p.include_stop_str_in_output) == (
        False,
        True,
        False,
    )
    assert not p.greedy


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n": 0}, "n"),
        ({"n": 1.5}, "n"),
        ({"n": True}, "n"),
        ({"temperature": -1}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"temperature": "1"}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": 2.0}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"presence_penalty": -2.5}, "presence_penalty"),
        ({"frequency_penalty": 2.01}, "frequency_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": "16"}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": 1.0}, "seed"),
        ({"seed": "7"}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["ok", 3]}, "stop"),
        ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"stop_token_ids": ["2"]}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"skip_special_tokens": None}, "skip_special_tokens"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
    ],
)
def test_bad_field_raises_value_error_naming_it(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        SamplingParams(**kwargs)


def test_message_shows_the_bound_and_the_value() -> None:
    with pytest.raises(ValueError, match=r"^temperature must be >= 0, got -1$"):
        SamplingParams(temperature=-1)


def test_edges_of_ranges_are_accepted() -> None:
    SamplingParams(top_p=1.0, min_p=1.0, presence_penalty=-2, frequency_penalty=2)
    SamplingParams(logprobs=0, seed=-(2**63), min_tokens=16, max_tokens=16)
    SamplingParams(logprobs=20, seed=2**64 - 1, stop=["x"] * MAX_STOP_STRINGS)


def test_top_k_minus_one_means_off() -> None:
    assert SamplingParams(top_k=-1).top_k == 0


def test_stop_accepts_a_single_string_and_copies_lists() -> None:
    assert SamplingParams(stop="\n\n").stop == ["\n\n"]
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    mine = ["END"]
    p = SamplingParams(stop=mine, stop_token_ids=(2, 3))
    mine.append("later")
    assert (p.stop, p.stop_token_ids) == (["END"], [2, 3])


def test_max_tokens_none_means_up_to_the_context() -> None:
    assert SamplingParams(max_tokens=None, min_tokens=1000).max_tokens is None


def test_greedy_clears_truncation() -> None:
    p = SamplingParams(temperature=0, top_p=0.5, top_k=3, min_p=0.2)
    assert p.greedy
    assert (p.top_p, p.top_k, p.min_p) == (1.0, 0, 0.0)


def test_tiny_temperature_is_raised_like_vllm() -> None:
    assert SamplingParams(temperature=1e-30).temperature == pytest.approx(1e-2)


def test_fields_are_keyword_only() -> None:
    with pytest.raises(TypeError):
        SamplingParams(2)  # type: ignore[misc]
