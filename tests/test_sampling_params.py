"""``SamplingParams`` validation: every bad value names its parameter (in the message and as
``InvalidRequestError.param``) and range."""

from __future__ import annotations

import pytest

from pagedserve.engine.config import EngineArgs, parse_size
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value,message", [
    ("n", 0, "n must be >= 1"),
    ("temperature", -0.1, "temperature must be >= 0"),
    ("top_p", 0.0, "top_p must be in (0, 1]"),
    ("top_k", -2, "top_k must be"),
    ("min_p", 1.5, "min_p must be in [0, 1]"),
    ("max_tokens", 0, "max_tokens must be >= 1"),
    ("min_tokens", -1, "min_tokens must be >= 0"),
    ("presence_penalty", 2.5, "presence_penalty must be in [-2, 2]"),
    ("frequency_penalty", -3, "frequency_penalty must be in [-2, 2]"),
    ("repetition_penalty", 0.0, "repetition_penalty must be > 0"),
    ("logit_bias", {5: 101.0}, "logit_bias must be"),
    ("logprobs", -1, "logprobs must be >= 0"),
    ("prompt_logprobs", -1, "prompt_logprobs must be >= 0"),
    ("stop", [""], "stop must be non-empty strings"),
    ("stop_token_ids", [-1], "stop_token_ids must be"),
])
def test_invalid_values_name_the_parameter(field, value, message):
    with pytest.raises(InvalidRequestError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")) as raised:
        SamplingParams(**{field: value})
    assert isinstance(raised.value, ValueError) and raised.value.param == field


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(InvalidRequestError, match="min_tokens must be <= max_tokens") as raised:
        SamplingParams(min_tokens=5, max_tokens=4)
    assert raised.value.param == "min_tokens"


def test_normalisation():
    params = SamplingParams(stop="###", top_k=-1, logit_bias={"7": 1})
    assert params.stop == ["###"] and params.top_k == 0 and params.logit_bias == {7: 1.0}
    assert SamplingParams(temperature=0).is_greedy and not SamplingParams().is_greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties and not SamplingParams().has_penalties


@pytest.mark.parametrize("text,expected", [("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("1024", 1024),
                                           (3, 3), ("1.5 KiB", 1536)])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


def test_engine_args_validation():
    with pytest.raises(ValueError, match="dtype must be one of"):
        EngineArgs(dtype="int3")
    with pytest.raises(ValueError, match="max_num_seqs must be >= 1"):
        EngineArgs(max_num_seqs=0)
    with pytest.raises(ValueError, match="invalid size"):
        EngineArgs(kv_cache_memory_bytes="lots")
    assert EngineArgs(kv_cache_memory_bytes="1GiB").kv_cache_memory_bytes == 2**30
