"""SamplingParams validation: every invalid value raises SamplingParamsError naming its field and range."""

from __future__ import annotations

import pytest

from pagoda.errors import InvalidRequestError
from pagoda.sampling_params import MAX_LOGPROBS, MAX_N, SamplingParams, SamplingParamsError

INVALID = [
    ("n", dict(n=0), "[1, 128]"),
    ("n", dict(n=MAX_N + 1), "[1, 128]"),
    ("n", dict(n=2.0), "integer"),
    ("temperature", dict(temperature=-0.1), ">= 0"),
    ("temperature", dict(temperature=float("inf")), "finite"),
    ("top_k", dict(top_k=-2), ">= -1"),
    ("top_p", dict(top_p=0.0), "(0, 1]"),
    ("min_p", dict(min_p=1.5), "[0, 1]"),
    ("presence_penalty", dict(presence_penalty=2.5), "[-2, 2]"),
    ("frequency_penalty", dict(frequency_penalty=-2.01), "[-2, 2]"),
    ("frequency_penalty", dict(frequency_penalty=float("nan")), "[-2, 2]"),
    ("repetition_penalty", dict(repetition_penalty=0.0), "> 0"),
    ("repetition_penalty", dict(repetition_penalty=float("inf")), "> 0"),
    ("logit_bias", dict(logit_bias={5: 101.0}), "[-100, 100]"),
    ("logit_bias", dict(logit_bias={-1: 1.0}), "non-negative"),
    ("logit_bias", dict(logit_bias={"x": 1.0}), "non-negative"),
    ("logit_bias", dict(logit_bias=[1, 2]), "dict"),
    ("allowed_token_ids", dict(allowed_token_ids=[]), "non-empty"),
    ("allowed_token_ids", dict(allowed_token_ids=[3, -1]), "non-negative"),
    ("bad_words", dict(bad_words=["ok", " "]), "non-blank"),
    ("seed", dict(seed=2**63), "[-2**63, 2**63)"),
    ("logprobs", dict(logprobs=MAX_LOGPROBS + 1), "[0, 20]"),
    ("logprobs", dict(logprobs=-1), "[0, 20]"),
    ("prompt_logprobs", dict(prompt_logprobs=21), "[0, 20]"),
    ("min_tokens", dict(min_tokens=5, max_tokens=4), "<= max_tokens"),
    ("min_tokens", dict(min_tokens=-1), ">= 0"),
    ("min_tokens", dict(min_tokens=2.0), "integer"),
    ("stop_token_ids", dict(stop_token_ids=[-3]), "non-negative"),
]


@pytest.mark.parametrize(("field", "settings", "limit"), INVALID, ids=[f"{f}={s[f]!r}" for f, s, _ in INVALID])
def test_invalid_values_name_the_field_and_its_range(field: str, settings: dict, limit: str) -> None:
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(**settings)
    assert isinstance(info.value, InvalidRequestError)
    assert info.value.param == field
    assert field in str(info.value) and limit in str(info.value)


def test_valid_extremes_are_accepted_and_json_keys_become_token_ids() -> None:
    params = SamplingParams(
        n=MAX_N,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=0.01,
        logit_bias={"50256": -100, 7: 100.0},
        logprobs=0,
        prompt_logprobs=MAX_LOGPROBS,
        seed=-(2**63),
    )
    assert params.logit_bias == {50256: -100, 7: 100.0}
    assert params.uses_penalties and not SamplingParams().uses_penalties
    clone = params.clone()
    clone.bad_words_token_ids.append([1])
    assert params.bad_words_token_ids == []


def test_min_tokens_up_to_max_tokens_or_without_one_is_accepted() -> None:
    assert SamplingParams(min_tokens=4, max_tokens=4).min_tokens == 4
    assert SamplingParams(min_tokens=10**6, max_tokens=None).min_tokens == 10**6
