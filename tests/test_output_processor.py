"""OutputProcessor: children of n > 1, the three output kinds, stop-string aborts, logprobs."""

from __future__ import annotations

import pytest

from pagedserve.engine.output_processor import OutputProcessor, RequestOutputKind
from pagedserve.engine.outputs import CompletionOutput, EngineCoreOutput, FinishReason, RequestOutput, TokenLogprobs
from pagedserve.engine.sampling_params import SamplingParams

# The module-scoped ``tokenizer`` fixture and ``encode`` helper of the detokenizer tests.
from tests.test_detokenizer import encode, tokenizer_fixture  # noqa: F401

PROMPT = "<|im_start|>user\nGreet me<|im_end|>\n<|im_start|>assistant\n"
# One completion per child; the engine emits one token per child per step.
TEXTS = ["Hello world, how are you?", "Bonjour à tous 🎉!", "你好，世界"]


def run(processor: OutputProcessor, child_tokens: dict[str, list[int]],
        finish_reason: FinishReason = FinishReason.LENGTH) -> list[RequestOutput]:
    """Steps the children one token at a time, finishing each with its last token.

    Returns every RequestOutput produced, in order.
    """
    outputs: list[RequestOutput] = []
    for step in range(max(len(ids) for ids in child_tokens.values())):
        step_outputs = [
            EngineCoreOutput(request_id=child_id, new_token_ids=[ids[step]],
                             finish_reason=finish_reason if step == len(ids) - 1 else None)
            for child_id, ids in child_tokens.items() if step < len(ids)
        ]
        outputs.extend(processor.process_outputs(step_outputs).request_outputs)
    return outputs


def add(processor: OutputProcessor, tokenizer, kind: RequestOutputKind, request_id: str = "req",
        **params) -> list[tuple[str, SamplingParams]]:
    prompt_token_ids = encode(tokenizer, PROMPT)
    return processor.add_request(request_id, PROMPT, prompt_token_ids, SamplingParams(**params), kind)


def completions_of(outputs: list[RequestOutput], index: int) -> list[CompletionOutput]:
    return [c for o in outputs for c in o.outputs if c.index == index]


def full_text(completions: list[CompletionOutput], kind: RequestOutputKind) -> str:
    """The text a client ends up with from its completions of one index."""
    return "".join(c.text for c in completions) if kind is RequestOutputKind.DELTA else completions[-1].text


def test_n1_delta_streams_new_text_and_tokens(tokenizer):
    processor = OutputProcessor(tokenizer)
    assert [cid for cid, _ in add(processor, tokenizer, RequestOutputKind.DELTA)] == ["req"]
    ids = encode(tokenizer, TEXTS[1])
    outputs = run(processor, {"req": ids})
    assert len(outputs) == len(ids)
    assert all(o.request_id == "req" and o.prompt == PROMPT for o in outputs)
    assert [o.finished for o in outputs] == [False] * (len(ids) - 1) + [True]
    assert "".join(o.outputs[0].text for o in outputs) == TEXTS[1]
    assert [t for o in outputs for t in o.outputs[0].token_ids] == ids
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert not processor.has_unfinished_requests()


def test_n1_cumulative_carries_everything_so_far(tokenizer):
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, RequestOutputKind.CUMULATIVE)
    ids = encode(tokenizer, TEXTS[0])
    outputs = run(processor, {"req": ids})
    assert [o.outputs[0].token_ids for o in outputs] == [ids[:k] for k in range(1, len(ids) + 1)]
    assert [o.outputs[0].text for o in outputs] == [tokenizer.decode(ids[:k]) for k in range(1, len(ids) + 1)]


def test_n1_final_only_reports_once(tokenizer):
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, RequestOutputKind.FINAL_ONLY)
    ids = encode(tokenizer, TEXTS[2])
    [output] = run(processor, {"req": ids})
    assert output.finished
    assert output.outputs[0].text == TEXTS[2]
    assert output.outputs[0].token_ids == ids


def test_children_get_indexed_ids_and_consecutive_seeds(tokenizer):
    processor = OutputProcessor(tokenizer)
    children = add(processor, tokenizer, RequestOutputKind.DELTA, n=3, seed=7, temperature=0.8)
    assert [cid for cid, _ in children] == ["0_req", "1_req", "2_req"]
    assert [(p.n, p.seed, p.temperature) for _, p in children] == [(1, 7, 0.8), (1, 8, 0.8), (1, 9, 0.8)]
    unseeded = add(processor, tokenizer, RequestOutputKind.DELTA, request_id="other", n=2)
    assert [p.seed for _, p in unseeded] == [None, None]
    assert processor.get_num_unfinished_requests() == 2


def test_clashing_request_id_raises(tokenizer):
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, RequestOutputKind.DELTA, n=2)
    with pytest.raises(ValueError, match="request_id"):
        add(processor, tokenizer, RequestOutputKind.DELTA)
    with pytest.raises(ValueError, match="request_id"):
        add(processor, tokenizer, RequestOutputKind.DELTA, request_id="0_req")


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_n3_streams_each_advancing_child_under_the_parent_id(tokenizer, kind):
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, kind, n=3)
    child_tokens = {f"{i}_req": encode(tokenizer, text) for i, text in enumerate(TEXTS)}
    outputs = run(processor, child_tokens)
    assert all(o.request_id == "req" for o in outputs)
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    for index, text in enumerate(TEXTS):
        mine = completions_of(outputs, index)
        assert len(mine) == len(child_tokens[f"{index}_req"])
        assert full_text(mine, kind) == text
        assert mine[-1].finish_reason == "length"
    # Steps where every child advanced carry one completion per child, by index.
    assert [c.index for c in outputs[0].outputs] == [0, 1, 2]


def test_n3_final_only_waits_for_every_child(tokenizer):
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, RequestOutputKind.FINAL_ONLY, n=3)
    child_tokens = {f"{i}_req": encode(tokenizer, text) for i, text in enumerate(TEXTS)}
    # Child 2 finishes first, child 1 last: the order of completions is still by index.
    child_tokens = dict(reversed(child_tokens.items()))
    [output] = run(processor, child_tokens)
    assert output.request_id == "req" and output.finished
    assert [c.index for c in output.outputs] == [0, 1, 2]
    assert [c.text for c in output.outputs] == TEXTS
    assert [c.token_ids for c in output.outputs] == [encode(tokenizer, t) for t in TEXTS]
    assert not processor.has_unfinished_requests()


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_stop_string_finishes_child_and_asks_for_abort_once(tokenizer, kind):
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, kind, n=2, stop=[" how"])
    ids = encode(tokenizer, TEXTS[0])  # Hello| world|,| how| are| ...
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    steps = [
        [EngineCoreOutput("0_req", [ids[0]]), EngineCoreOutput("1_req", [ids[0]])],
        # Child 1 ends on a stop token in the engine core.
        [EngineCoreOutput("0_req", [ids[1]]),
         EngineCoreOutput("1_req", [im_end], finish_reason=FinishReason.STOP, stop_reason=im_end)],
        [EngineCoreOutput("0_req", [ids[2]])],
        [EngineCoreOutput("0_req", [ids[3]])],  # " how": the stop string
        [EngineCoreOutput("0_req", [ids[4]])],  # already in flight when the abort was sent
    ]
    processed = [processor.process_outputs(step) for step in steps]
    assert [p.reqs_to_abort for p in processed] == [[], [], [], ["0_req"], []]
    request_outputs = [o for p in processed for o in p.request_outputs]
    assert request_outputs[-1].finished and not processor.has_unfinished_requests()
    child0, child1 = completions_of(request_outputs, 0), completions_of(request_outputs, 1)
    assert (child0[-1].finish_reason, child0[-1].stop_reason) == ("stop", " how")
    assert (child1[-1].finish_reason, child1[-1].stop_reason) == ("stop", im_end)
    assert full_text(child0, kind) == "Hello world,"
    assert full_text(child1, kind) == "Hello"


def test_stop_string_in_a_finishing_output_needs_no_abort(tokenizer):
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, RequestOutputKind.FINAL_ONLY, stop=["world"])
    processed = processor.process_outputs([EngineCoreOutput(
        "req", encode(tokenizer, TEXTS[0]), finish_reason=FinishReason.LENGTH)])
    assert processed.reqs_to_abort == []
    [completion] = processed.request_outputs[0].outputs
    assert (completion.text, completion.finish_reason, completion.stop_reason) == ("Hello ", "stop", "world")


def test_engine_abort_finishes_with_abort_reason(tokenizer):
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, RequestOutputKind.DELTA)
    processor.process_outputs([EngineCoreOutput("req", encode(tokenizer, "Hi"))])
    [output] = processor.process_outputs(
        [EngineCoreOutput("req", [], finish_reason=FinishReason.ABORT)]).request_outputs
    assert output.finished and output.outputs[0].finish_reason == "abort"
    assert output.outputs[0].text == "" and output.outputs[0].token_ids == []


def logprobs_of(token_id: int, logprob: float) -> TokenLogprobs:
    return TokenLogprobs(token_ids=[token_id, 99], logprobs=[logprob, -5.0], rank=1)


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
def test_logprobs_accumulate_with_cumulative_logprob(tokenizer, kind):
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, kind, logprobs=1)
    ids = encode(tokenizer, "Hello world, how")
    values = [-0.5, -1.25, -0.125, -2.0]
    outputs = [processor.process_outputs([EngineCoreOutput(
        "req", [token_id], new_logprobs=[logprobs_of(token_id, value)],
        finish_reason=FinishReason.LENGTH if step == len(ids) - 1 else None)]).request_outputs[0]
        for step, (token_id, value) in enumerate(zip(ids, values, strict=True))]
    completions = [o.outputs[0] for o in outputs]
    assert [c.cumulative_logprob for c in completions] == [-0.5, -1.75, -1.875, -3.875]
    if kind is RequestOutputKind.DELTA:
        assert [[lp.logprobs[0] for lp in c.logprobs] for c in completions] == [[v] for v in values]
    else:
        assert [lp.logprobs[0] for lp in completions[-1].logprobs] == values
        assert [lp.token_ids[0] for lp in completions[-1].logprobs] == ids


def test_no_logprobs_when_not_asked(tokenizer):
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, RequestOutputKind.FINAL_ONLY)
    [output] = run(processor, {"req": encode(tokenizer, "Hi")})
    assert output.outputs[0].logprobs is None and output.outputs[0].cumulative_logprob is None


def test_prompt_logprobs_and_cached_tokens_pass_through(tokenizer):
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, RequestOutputKind.DELTA, prompt_logprobs=0)
    prompt_logprobs = [None, logprobs_of(5, -3.0), logprobs_of(6, -1.0)]
    ids = encode(tokenizer, "Hello world")
    first = processor.process_outputs([EngineCoreOutput(
        "req", [ids[0]], num_cached_tokens=16, new_prompt_logprobs=prompt_logprobs)]).request_outputs[0]
    second = processor.process_outputs([EngineCoreOutput(
        "req", [ids[1]], num_cached_tokens=16, finish_reason=FinishReason.LENGTH)]).request_outputs[0]
    assert first.prompt_logprobs == prompt_logprobs and second.prompt_logprobs is None
    assert first.num_cached_tokens == second.num_cached_tokens == 16


def test_only_child_0_computes_prompt_logprobs(tokenizer):
    """Regression (issue 26): every child computed the prompt's logprobs (and so got no prefix-cache hits),
    though one set is returned."""
    processor = OutputProcessor(tokenizer)
    children = add(processor, tokenizer, RequestOutputKind.FINAL_ONLY, n=3, prompt_logprobs=2, logprobs=1)
    assert [params.prompt_logprobs for _, params in children] == [2, None, None]
    assert [params.logprobs for _, params in children] == [1, 1, 1]


def test_delta_holds_siblings_until_child_0_has_the_whole_prompt_logprobs(tokenizer):
    """A sibling hitting child 0's cached blocks may sample while child 0 is still prefilling (chunks of
    long_prefill_token_threshold): its output waits, so that the first one carries all the prompt's logprobs."""
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, RequestOutputKind.DELTA, n=2, prompt_logprobs=0)
    num_prompt = len(encode(tokenizer, PROMPT))
    first_half = [None] + [logprobs_of(5, -1.0)] * (num_prompt // 2 - 1)
    rest = [logprobs_of(6, -2.0)] * (num_prompt - len(first_half))
    ids = encode(tokenizer, "Hello world")
    held = processor.process_outputs([EngineCoreOutput("0_req", [], new_prompt_logprobs=first_half),
                                      EngineCoreOutput("1_req", [ids[0]])])
    assert held.request_outputs == []
    [output] = processor.process_outputs([EngineCoreOutput("0_req", [ids[1]], new_prompt_logprobs=rest),
                                          EngineCoreOutput("1_req", [ids[1]])]).request_outputs
    assert output.prompt_logprobs == first_half + rest
    assert [(c.index, c.token_ids) for c in output.outputs] == [(0, [ids[1]]), (1, [ids[0], ids[1]])]
    [later] = processor.process_outputs([EngineCoreOutput("1_req", [ids[0]])]).request_outputs
    assert later.prompt_logprobs is None and [c.token_ids for c in later.outputs] == [[ids[0]]]


def test_abort_requests_forgets_parent_and_children(tokenizer):
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, RequestOutputKind.DELTA, n=3)
    add(processor, tokenizer, RequestOutputKind.DELTA, request_id="kept")
    ids = encode(tokenizer, "Hi")
    processor.process_outputs([EngineCoreOutput("1_req", ids, finish_reason=FinishReason.LENGTH)])
    # Child 1 already finished: only the children still running need an engine abort.
    assert processor.abort_requests(["req", "unknown"]) == ["0_req", "2_req"]
    assert processor.get_num_unfinished_requests() == 1
    late = processor.process_outputs([EngineCoreOutput("0_req", ids), EngineCoreOutput("kept", ids)])
    assert [o.request_id for o in late.request_outputs] == ["kept"]
    assert processor.abort_requests(["kept"]) == ["kept"]
    assert not processor.has_unfinished_requests()
    # The ids can be used again.
    add(processor, tokenizer, RequestOutputKind.DELTA, n=3)


def test_abort_by_child_id_forgets_the_whole_parent(tokenizer):
    processor = OutputProcessor(tokenizer)
    add(processor, tokenizer, RequestOutputKind.DELTA, n=2)
    assert processor.abort_requests(["1_req"]) == ["0_req", "1_req"]
    assert not processor.has_unfinished_requests()
