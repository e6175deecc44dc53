"""Issue 26: what ``stop``, ``stop_token_ids`` and ``logit_bias`` cost a request per token stays bounded.

A client could send 100,000 stop strings, 2,000,000 stop token ids or a bias over the whole vocabulary
with ``n: 128``; each was copied per completion and scanned for every token (the stop strings on the
event loop), stalling every other client for tens of seconds. Now: the lists have limits refused with a
400 naming the field, the ``n`` completions share one checked copy, a stop string is looked for only
where a new character ends one, stop token ids are a set, and the bias is one tensor op per step.
Durations are measured by hand, not here (no timing in tests).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pagedserve.engine.detokenizer import StopStrings
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.output_processor import OutputProcessor, RequestOutputKind
from pagedserve.engine.sampling_params import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from pagedserve.engine.worker.input_batch import CachedRequestState, InputBatch
from pagedserve.engine.worker.sample_ops import process_logits
from tests.conftest import Served

PLAIN = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
USER = [{"role": "user", "content": "Hi"}]


def post(client: httpx.Client, path: str, body: dict[str, Any]) -> httpx.Response:
    return client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


# --------------------------------------------------------------------------- limits, refused at the door

TOO_MANY = [
    ("stop", [f"stop {i}" for i in range(MAX_STOP_STRINGS + 1)]),
    ("stop", ["x" * (MAX_STOP_STRING_CHARS + 1)]),
    ("stop_token_ids", [7] * (MAX_STOP_TOKEN_IDS + 1)),
]


@pytest.mark.parametrize("path,base", [("/v1/completions", {"prompt": "Hi", "max_tokens": 1}),
                                       ("/v1/chat/completions", {"messages": USER, "max_tokens": 1})])
@pytest.mark.parametrize("field,value", TOO_MANY)
def test_oversized_stop_lists_are_a_400_naming_the_field(client, served: Served, path, base, field, value):
    response = post(client, path, {**base, field: value, "n": 4})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert len(error["message"]) < 200  # the list is not echoed back
    assert client.get("/health").status_code == 200
    assert served.engine.get_stats().kv_cache_usage == 0.0


def test_the_largest_allowed_lists_are_served(client):
    body = {**PLAIN, "n": 2, "stop": ["y" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
            "stop_token_ids": list(range(1, MAX_STOP_TOKEN_IDS + 1))}
    response = post(client, "/v1/completions", body)
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"]) == 2


def test_sampling_params_refuse_oversized_stop_lists_before_reading_them():
    for field, value in TOO_MANY:
        with pytest.raises(InvalidRequestError, match=f"^{field}") as raised:
            SamplingParams(**{field: value})
        assert raised.value.param == field


# --------------------------------------------------------------------------- one checked copy, shared by n

def test_stop_token_ids_are_a_set_without_duplicates():
    params = SamplingParams(stop_token_ids=[7, 9] * (MAX_STOP_TOKEN_IDS // 2))
    assert params.stop_token_ids == frozenset({7, 9}) and isinstance(params.stop_token_ids, frozenset)


def test_n_completions_share_the_requests_lists_instead_of_copying_them(served: Served):
    params = SamplingParams(n=4, seed=10, stop=["###"], stop_token_ids=[7, 8], logit_bias={3: 1.0, 5: -2.0},
                            prompt_logprobs=1)
    processor = OutputProcessor(served.engine.tokenizer)
    children = processor.add_request("req", None, [1, 2, 3], params, RequestOutputKind.DELTA)
    child_params = [p for _, p in children]
    assert [p.n for p in child_params] == [1] * 4 and [p.seed for p in child_params] == [10, 11, 12, 13]
    assert [p.prompt_logprobs for p in child_params] == [1, None, None, None]
    for child in child_params:
        assert child.stop is params.stop and child.stop_token_ids is params.stop_token_ids
        assert child.logit_bias is params.logit_bias and child.logit_bias_arrays is params.logit_bias_arrays


# --------------------------------------------------------------------------- logit_bias: tensors, not dicts

class _UnreadableDict(dict):
    """A dict whose entries can be counted but not read: the per-step path must not read them."""

    def _refuse(self, *args: Any) -> Any:
        raise AssertionError("logit_bias read per step")

    keys = values = items = __iter__ = __getitem__ = _refuse


def test_a_step_applies_logit_bias_from_the_arrays_built_at_admission():
    """The dict is read once, when ``SamplingParams`` is made; every step after that is tensor ops only."""
    params = SamplingParams(logit_bias={0: 1.5, 9: -100.0})
    params.logit_bias = _UnreadableDict(params.logit_bias)
    batch = InputBatch(max_num_reqs=2, max_model_len=8, max_num_blocks_per_req=2, block_size=4, vocab_size=10,
                       device=torch.device("cpu"))
    batch.add_request(CachedRequestState("r", [1, 2], params, None, [1], 0))
    biased = process_logits(torch.zeros(1, 10), batch.make_sampling_metadata(np.arange(1)))
    expected = torch.zeros(1, 10)
    expected[0, 0], expected[0, 9] = 1.5, -100.0
    assert torch.equal(biased, expected)


def test_logit_bias_over_the_whole_vocabulary_with_n(client, served: Served):
    """Every token id biased, one of them far above the rest: each of the n greedy completions is that
    token repeated."""
    [token] = served.engine.tokenizer.encode(" cat", add_special_tokens=False)
    bias = {str(i): 0.5 for i in range(served.engine.processor.model_config.vocab_size)} | {str(token): 100}
    response = post(client, "/v1/completions", {**PLAIN, "max_tokens": 3, "n": 3, "logit_bias": bias})
    assert response.status_code == 200, response.text
    assert [c["text"] for c in response.json()["choices"]] == [" cat cat cat"] * 3


# --------------------------------------------------------------------------- stop strings: same matches

def reference_find(stops: list[str], text: str, start: int) -> tuple[str, int] | None:
    """The match a character-by-character stream hits first: the earliest end after ``text[:start]``,
    and of the strings ending there the longest (one ``find`` per string, as the detokenizer did)."""
    best = None
    for stop in stops:
        begin = text.find(stop, max(0, start - len(stop) + 1))
        if begin != -1 and (best is None or (begin + len(stop), begin) < best[:2]):
            best = (begin + len(stop), begin, stop)
    return None if best is None else (best[2], best[1])


@given(stops=st.lists(st.text("abc", min_size=1, max_size=4), min_size=1, max_size=8),
       text=st.text("abc", max_size=30), data=st.data())
def test_stop_strings_find_what_one_find_per_string_found(stops, text, data):
    start = data.draw(st.integers(0, len(text)))
    assert StopStrings(stops).find(text, start) == reference_find(stops, text, start)


def test_a_stop_string_among_the_most_allowed_cuts_every_completion(client):
    text = post(client, "/v1/completions", PLAIN).json()["choices"][0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    stops = [f"{i:04d}" + "z" * (MAX_STOP_STRING_CHARS - 4) for i in range(MAX_STOP_STRINGS - 1)] + [stop]
    choices = post(client, "/v1/completions", {**PLAIN, "n": 3, "stop": stops}).json()["choices"]
    assert [(c["text"], c["finish_reason"]) for c in choices] == [(text[:text.index(stop)], "stop")] * 3


def test_the_api_doc_states_the_limits():
    readme = " ".join((Path(__file__).parent.parent / "docs" / "api.md").read_text().split())
    assert (f"`stop` at most {MAX_STOP_STRINGS} strings of at most {MAX_STOP_STRING_CHARS:,} characters each"
            in readme)
    assert f"`stop_token_ids` at most {MAX_STOP_TOKEN_IDS:,} ids" in readme
