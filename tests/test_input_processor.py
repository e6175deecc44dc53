"""``InputProcessor``: every rule a request must meet, each raising ``InvalidRequestError`` naming its field.

The tokenizer is the embedded SmolLM2's (with its chat template); the model's
limits are set here, small: 64 tokens of context, a 20-token vocabulary
window at the top, 20 logprobs, and a KV cache of 48 or 1008 tokens.
"""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace
from typing import Any

import pytest
from transformers import AutoTokenizer

from pagedserve.engine.config import CacheConfig, ModelConfig
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.engine.model.loader import gguf_cache_folder, resolve_model_path
from pagedserve.engine.sampling_params import SamplingParams

MAX_MODEL_LEN = 64
VOCAB_SIZE = 49152
HELLO = [{"role": "user", "content": "Hello!"}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(gguf_cache_folder(resolve_model_path(None)).path)


def model_config(generation_defaults: dict[str, Any] | None = None, eos_token_id: int | None = 2) -> ModelConfig:
    return ModelConfig(path="unused", served_model_name="test", hf_config=SimpleNamespace(eos_token_id=eos_token_id),
                       max_model_len=MAX_MODEL_LEN, vocab_size=VOCAB_SIZE,
                       generation_defaults=generation_defaults or {})


def make_processor(tokenizer: Any, num_blocks: int = 64, **model: Any) -> InputProcessor:
    return InputProcessor(model_config(**model), tokenizer, CacheConfig(num_blocks, block_size=16), max_logprobs=20)


@pytest.fixture(scope="module")
def processor(tokenizer) -> InputProcessor:
    return make_processor(tokenizer)


def test_a_text_prompt_is_tokenized_and_kept(processor: InputProcessor, tokenizer) -> None:
    request = processor.process("Hello there", SamplingParams(max_tokens=5))
    assert request.prompt == "Hello there" and request.prompt_token_ids == tokenizer.encode("Hello there")
    assert request.sampling_params.max_tokens == 5 and request.eos_token_id == tokenizer.eos_token_id


def test_token_ids_are_taken_as_given(processor: InputProcessor) -> None:
    request = processor.process([5, 6, 7], SamplingParams(max_tokens=5, temperature=0.0))
    assert request.prompt is None and request.prompt_token_ids == [5, 6, 7]
    assert request.sampling_params == SamplingParams(max_tokens=5, temperature=0.0)


def test_open_max_tokens_takes_the_room_left_capped_by_the_default(tokenizer) -> None:
    processor = make_processor(tokenizer)
    assert processor.process([1] * 10, SamplingParams(max_tokens=None)).sampling_params.max_tokens == 54
    assert processor.process([1] * 10, SamplingParams(max_tokens=None), 5).sampling_params.max_tokens == 5
    assert processor.process([1] * 61, SamplingParams(max_tokens=None), 5).sampling_params.max_tokens == 3
    assert processor.process([1] * 10, SamplingParams(max_tokens=40), 5).sampling_params.max_tokens == 40


@pytest.mark.parametrize(("prompt", "params", "param", "message"), [
    ("", {}, "prompt", "The prompt is empty; it must contain at least one token."),
    ([], {}, "prompt", "The prompt is empty; it must contain at least one token."),
    ([1] * 64, {}, "prompt", "This model's maximum context length is 64 tokens. However, your request has 64 "
                             "input tokens. Please reduce the length of the input messages."),
    ([1] * 10, {"max_tokens": 60}, "max_tokens", "This model's maximum context length is 64 tokens. However, you "
     "requested 70 tokens (10 in the messages, 60 in the completion). Please reduce the length of the messages "
     "or completion."),
    ([1, VOCAB_SIZE], {}, "prompt", f"prompt token ids must be in [0, {VOCAB_SIZE})"),
    ([-1], {}, "prompt", f"prompt token ids must be in [0, {VOCAB_SIZE})"),
    ([1], {"stop_token_ids": [VOCAB_SIZE]}, "stop_token_ids", f"stop_token_ids token ids must be in [0, {VOCAB_SIZE})"),
    ([1], {"logit_bias": {VOCAB_SIZE: 1.0}}, "logit_bias", f"logit_bias token ids must be in [0, {VOCAB_SIZE})"),
    ([1], {"logprobs": 21}, "logprobs", "logprobs must be <= 20 (max_logprobs), got 21"),
    ([1], {"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be <= 20 (max_logprobs), got 21"),
    ([1] * 60, {"max_tokens": None, "min_tokens": 10}, "min_tokens", "min_tokens must be <= max_tokens (4), got 10"),
])
def test_each_rule_names_its_field(processor: InputProcessor, prompt: Any, params: dict[str, Any], param: str,
                                   message: str) -> None:
    with pytest.raises(InvalidRequestError, match=re.escape(message)) as raised:
        processor.process(prompt, SamplingParams(**{"max_tokens": 4, **params}))
    assert raised.value.param == param and raised.value.message == message


def test_a_request_that_can_outgrow_the_kv_cache_is_refused_as_a_whole(tokenizer) -> None:
    small = make_processor(tokenizer, num_blocks=4)  # 3 usable blocks of 16: 48 tokens
    assert small.process([1] * 10, SamplingParams(max_tokens=38)).sampling_params.max_tokens == 38
    with pytest.raises(InvalidRequestError) as raised:
        small.process([1] * 10, SamplingParams(max_tokens=39))
    assert raised.value.param == "max_tokens"
    assert raised.value.message == "a request of up to 49 tokens needs more KV cache than the engine has (48 tokens)"
    with pytest.raises(InvalidRequestError, match="up to 64 tokens") as raised:
        small.process([1] * 10, SamplingParams(max_tokens=None))
    assert raised.value.param == "prompt"  # an open max_tokens is all the room the prompt leaves


def test_chat_messages_render_with_the_models_template(processor: InputProcessor, tokenizer) -> None:
    expected = tokenizer.apply_chat_template(HELLO, add_generation_prompt=True, tokenize=True, return_dict=True)
    assert processor.render_chat(HELLO) == list(expected["input_ids"])
    assert len(processor.render_chat(HELLO, add_generation_prompt=False)) < len(expected["input_ids"])


def test_chat_errors_name_messages(processor: InputProcessor, tokenizer) -> None:
    with pytest.raises(InvalidRequestError, match="messages must not be empty") as raised:
        processor.render_chat([])
    assert raised.value.param == "messages"
    no_template = copy.deepcopy(tokenizer)
    no_template.chat_template = None
    with pytest.raises(InvalidRequestError) as raised:
        make_processor(no_template).render_chat(HELLO)
    assert raised.value.param == "messages"
    assert raised.value.message == ("The chat template cannot render these messages: the model's tokenizer has no "
                                    "chat template")


def test_eos_comes_from_the_tokenizer_else_the_model_config() -> None:
    assert make_processor(SimpleNamespace(eos_token_id=7), eos_token_id=2).eos_token_id == 7
    assert make_processor(SimpleNamespace(eos_token_id=None), eos_token_id=2).eos_token_id == 2
    assert make_processor(SimpleNamespace(eos_token_id=None), eos_token_id=None).eos_token_id is None


def test_engine_core_requests_carry_the_prompt_eos_and_arrival(processor: InputProcessor) -> None:
    request = processor.process([5, 6], SamplingParams(max_tokens=3, n=2))
    children = [("0_r", SamplingParams(max_tokens=3)), ("1_r", SamplingParams(max_tokens=3, seed=1))]
    core_requests = request.engine_core_requests(children, arrival_time=12.5)
    assert [(r.request_id, r.prompt_token_ids, r.sampling_params, r.eos_token_id, r.arrival_time)
            for r in core_requests] == [(child_id, [5, 6], params, request.eos_token_id, 12.5)
                                        for child_id, params in children]


def test_message_naming_renames_only_a_leading_param() -> None:
    error = InvalidRequestError("logprobs must be <= 20 (max_logprobs), got 21", "logprobs")
    assert error.message_naming("top_logprobs") == "top_logprobs must be <= 20 (max_logprobs), got 21"
    context = InvalidRequestError("This model's maximum context length is 64 tokens.", "max_tokens")
    assert context.message_naming("max_completion_tokens") == context.message
