"""Structured output: JSON schemas, regexes, choices and grammars through the real server and the OpenAI SDK,
the scheduler's handling of grammars (a fake manager, to test its bookkeeping), and the grammar compiler.

Every constrained output that finished with ``stop`` is checked against its constraint (``jsonschema``,
``re.fullmatch``, membership); greedy and sampled (``n > 1``, temperature above 1) alike.
"""

from __future__ import annotations

import asyncio
import json
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import jsonschema
import openai
import pydantic
import pytest

from pagedserve.engine.config import CacheConfig, SchedulerConfig
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.scheduler_output import GrammarOutput, SchedulerOutput
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.request import Request
from pagedserve.engine.sampling_params import SamplingParams, StructuredOutputsParams
from pagedserve.engine.structured_output import compiler as compiler_module
from pagedserve.engine.structured_output.compiler import GrammarCompiler, grammar_text
from tests.conftest import Served
from tests.fake_runner import FakeModelRunner, step

ASK_PERSON = [{"role": "user", "content": "Describe a fictional person as JSON."}]

#: The schema features the issue lists, each with bounded strings so that outputs finish.
SCHEMAS: dict[str, dict[str, Any]] = {
    "nested_object": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 12},
                       "address": {"type": "object",
                                   "properties": {"city": {"type": "string", "maxLength": 12},
                                                  "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                                   "required": ["city", "zip"], "additionalProperties": False}},
        "required": ["name", "address"], "additionalProperties": False},
    "array_bounds_and_enum": {
        "type": "object",
        "properties": {"colors": {"type": "array", "minItems": 2, "maxItems": 3,
                                  "items": {"enum": ["red", "green", "blue"]}}},
        "required": ["colors"], "additionalProperties": False},
    "numbers_with_bounds": {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 18, "maximum": 99},
                       "score": {"type": "number", "minimum": 0, "maximum": 1}},
        "required": ["age", "score"], "additionalProperties": False},
    "anyof_null_and_refs": {
        "$defs": {"pet": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog"]},
                                                            "nickname": {"anyOf": [{"type": "string", "maxLength": 8},
                                                                                   {"type": "null"}]}},
                          "required": ["kind", "nickname"], "additionalProperties": False}},
        "type": "object",
        "properties": {"pet": {"$ref": "#/$defs/pet"}},
        "required": ["pet"], "additionalProperties": False},
}


def _chat(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model=client.models.list().data[0].id, **kwargs)


def _json_schema_format(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def _check_json(text: str, finish_reason: str, schema: dict[str, Any]) -> None:
    if finish_reason == "length":
        return  # cut by max_tokens: a prefix of a valid output, not checkable as a whole
    assert finish_reason == "stop", finish_reason
    jsonschema.validate(json.loads(text), schema)


# --------------------------------------------------------------------------- through the server


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_greedy_and_sampled_outputs_validate(openai_client: openai.OpenAI, served: Served,
                                                         name: str) -> None:
    schema = SCHEMAS[name]
    greedy = _chat(openai_client, messages=ASK_PERSON, response_format=_json_schema_format(schema),
                   temperature=0, max_tokens=120)
    assert greedy.choices[0].finish_reason == "stop"
    _check_json(greedy.choices[0].message.content, "stop", schema)
    # JSON whitespace is fixed (", " and ": ", nothing else): no runaway newlines or spaces.
    text = greedy.choices[0].message.content
    assert text == json.dumps(json.loads(text), ensure_ascii=False)
    sampled = _chat(openai_client, messages=ASK_PERSON, response_format=_json_schema_format(schema),
                    temperature=1.8, top_p=1.0, n=3, seed=7, max_tokens=120)
    assert len(sampled.choices) == 3
    for choice in sampled.choices:
        _check_json(choice.message.content, choice.finish_reason, schema)
    assert sum(choice.finish_reason == "stop" for choice in sampled.choices) >= 2
    assert served.engine.get_stats().kv_cache_usage == 0.0  # every block freed


def test_structured_outputs_regex_choice_grammar_and_legacy_fields(openai_client: openai.OpenAI) -> None:
    phone = r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}"
    cases = [
        ({"structured_outputs": {"regex": phone}}, lambda text: re.fullmatch(phone, text)),
        ({"guided_regex": phone}, lambda text: re.fullmatch(phone, text)),
        ({"structured_outputs": {"choice": ["sunny", "rainy", "snowy"]}}, lambda text: text in
         {"sunny", "rainy", "snowy"}),
        ({"guided_choice": ["yes", "no"]}, lambda text: text in {"yes", "no"}),
        ({"structured_outputs": {"grammar": 'start: "The " ANIMAL " says " SOUND\nANIMAL: "cat" | "dog"\n'
                                            'SOUND: "meow" | "woof"'}},
         lambda text: re.fullmatch(r"The (cat|dog) says (meow|woof)", text)),
        ({"guided_grammar": 'root ::= "x" [0-9] [0-9]'}, lambda text: re.fullmatch(r"x[0-9]{2}", text)),
    ]
    for body, check in cases:
        for temperature in (0.0, 1.5):
            response = _chat(openai_client, messages=[{"role": "user", "content": "Answer."}], max_tokens=30,
                             temperature=temperature, seed=1, extra_body=body)
            choice = response.choices[0]
            assert choice.finish_reason == "stop" and check(choice.message.content), (body, choice)


def test_completions_take_every_constraint(openai_client: openai.OpenAI) -> None:
    model = openai_client.models.list().data[0].id
    response = openai_client.completions.create(
        model=model, prompt=["The weather today is", "My favourite colour is"], max_tokens=40, temperature=0,
        n=2, extra_body={"response_format": {"type": "json_object"}})
    assert len(response.choices) == 4
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(json.loads(choice.text), dict)
    choice = openai_client.completions.create(model=model, prompt="Pick:", max_tokens=5, temperature=0,
                                              extra_body={"guided_choice": ["left", "right"]}).choices[0]
    assert choice.text in {"left", "right"}


def test_parse_with_a_pydantic_model(openai_client: openai.OpenAI) -> None:
    class City(pydantic.BaseModel):
        name: str = pydantic.Field(max_length=20)
        country: str = pydantic.Field(max_length=20)
        population_millions: float = pydantic.Field(ge=0, le=40)

    class Answer(pydantic.BaseModel):
        cities: list[City] = pydantic.Field(min_length=1, max_length=2)

    completion = openai_client.chat.completions.parse(
        model=openai_client.models.list().data[0].id, messages=[{"role": "user", "content": "Name big cities."}],
        response_format=Answer, temperature=0, max_tokens=150)
    message = completion.choices[0].message
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(message.parsed, Answer) and 1 <= len(message.parsed.cities) <= 2


def test_streamed_constrained_output_concatenates_to_the_whole_one(openai_client: openai.OpenAI) -> None:
    schema = SCHEMAS["numbers_with_bounds"]
    kwargs = {"messages": ASK_PERSON, "response_format": _json_schema_format(schema), "temperature": 0,
              "max_tokens": 60}
    whole = _chat(openai_client, **kwargs).choices[0].message.content
    pieces = [chunk.choices[0].delta.content or "" for chunk in _chat(openai_client, stream=True, **kwargs)
              if chunk.choices]
    assert "".join(pieces) == whole
    jsonschema.validate(json.loads(whole), schema)


def test_max_tokens_cut_is_length(openai_client: openai.OpenAI, served: Served) -> None:
    choice = _chat(openai_client, messages=ASK_PERSON, response_format=_json_schema_format(SCHEMAS["nested_object"]),
                   temperature=0, max_tokens=4).choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content.startswith("{")
    assert served.engine.get_stats().kv_cache_usage == 0.0


def test_free_requests_in_a_mixed_batch_equal_their_solo_outputs(openai_client: openai.OpenAI) -> None:
    prompts = ["Write a haiku about rain.", "What is the capital of France?", "Count to five."]

    def free(prompt: str) -> str:
        return _chat(openai_client, messages=[{"role": "user", "content": prompt}], temperature=0,
                     max_tokens=24).choices[0].message.content

    def constrained(index: int) -> str:
        schema = SCHEMAS[sorted(SCHEMAS)[index % len(SCHEMAS)]]
        return _chat(openai_client, messages=ASK_PERSON, response_format=_json_schema_format(schema),
                     temperature=0, max_tokens=60).choices[0].message.content

    solo = [free(prompt) for prompt in prompts]
    with ThreadPoolExecutor(max_workers=8) as pool:
        constrained_futures = [pool.submit(constrained, i) for i in range(5)]
        mixed = list(pool.map(free, prompts))
        for future in constrained_futures:
            future.result()
    assert mixed == solo


def test_bad_constraints_are_refused_before_the_engine_and_it_stays_healthy(client: httpx.Client,
                                                                            served: Served) -> None:
    bad = [({"response_format": _json_schema_format({"type": "object", "not": {"required": ["a"]}})},
            "response_format.json_schema.schema", "not"),
           ({"guided_json": {"type": "string", "format": "no-such-format"}}, "guided_json", "no-such-format"),
           ({"structured_outputs": {"regex": "(a"}}, "structured_outputs.regex", "unclosed group"),
           ({"structured_outputs": {"grammar": "start: ("}}, "structured_outputs.grammar", "")]
    submitted_before = served.engine._num_submitted
    for body, param, feature in bad:
        response = client.post("/v1/chat/completions", json={"messages": ASK_PERSON, **body})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param and feature in error["message"], error
    assert served.engine._num_submitted == submitted_before  # nothing was sent to the engine
    assert client.get("/health").status_code == 200
    assert client.post("/v1/chat/completions", json={"messages": ASK_PERSON, "max_tokens": 2}).status_code == 200


# --------------------------------------------------------------------------- the scheduler's bookkeeping


class _FakeGrammars:
    """A manager whose grammars become ready when the test says, accepting any token; it records calls."""

    def __init__(self) -> None:
        self.status: dict[str, str | None] = {}
        self.accepted: dict[str, list[int]] = {}
        self.refuse: set[str] = set()
        self.terminate_after: dict[str, int] = {}
        self.bitmask_rows: list[list[str]] = []

    def add_request(self, request: Request) -> None:
        self.status.setdefault(request.request_id, "pending")
        self.accepted[request.request_id] = []

    def grammar_error(self, request_id: str) -> str | None:
        status = self.status[request_id]
        return status if status not in (None, "pending") else None

    def grammar_ready(self, request_id: str) -> bool:
        return self.status[request_id] is None

    def wait_for_grammars(self, timeout_s: float) -> None:
        pass

    def grammar_bitmask(self, requests: dict[str, Request], so: SchedulerOutput) -> GrammarOutput | None:
        rows = [r for r in so.num_scheduled_tokens if r in self.accepted]
        self.bitmask_rows.append(rows)
        return None

    def accept_tokens(self, request_id: str, token_ids: list[int]) -> str | None:
        self.accepted[request_id] += token_ids
        return "refused sampled token" if request_id in self.refuse else None

    def is_terminated(self, request_id: str) -> bool:
        return len(self.accepted[request_id]) >= self.terminate_after.get(request_id, 10**9)

    def remove_request(self, request_id: str) -> None:
        self.accepted.pop(request_id)


def _scheduler(grammars: _FakeGrammars, num_blocks: int = 32) -> tuple[Scheduler, FakeModelRunner]:
    scheduler = Scheduler(SchedulerConfig(8, 256, 512, 0), CacheConfig(num_blocks, 16, True),
                          structured_output_manager=grammars)
    return scheduler, FakeModelRunner(num_blocks, 16)


def _request(request_id: str, constrained: bool, max_tokens: int = 4) -> Request:
    constraint = StructuredOutputsParams(regex="[a-z]+") if constrained else None
    return Request(request_id, [1, 2, 3, 4, 5], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                               structured_outputs=constraint), None, 16)


def test_a_request_waits_in_the_queue_for_its_grammar_keeping_its_place() -> None:
    grammars = _FakeGrammars()
    scheduler, runner = _scheduler(grammars)
    scheduler.add_request(_request("constrained", True))
    scheduler.add_request(_request("free", False))
    so, _ = step(scheduler, runner)
    assert list(so.num_scheduled_tokens) == ["free"]
    assert [r.request_id for r in scheduler.waiting] == ["constrained"]
    scheduler.add_request(_request("later", False))
    grammars.status["constrained"] = None
    so, _ = step(scheduler, runner)
    # Admitted ahead of the request that arrived after it.
    assert [r.req_id for r in so.scheduled_new_reqs] == ["constrained", "later"]
    while scheduler.has_requests():
        step(scheduler, runner)
    assert grammars.accepted == {}  # removed when finished
    assert scheduler.kv_cache_manager.usage == 0.0


def test_a_grammar_that_fails_fails_its_request_alone() -> None:
    grammars = _FakeGrammars()
    scheduler, runner = _scheduler(grammars)
    grammars.status["bad"] = "invalid grammar: boom"
    scheduler.add_request(_request("bad", True))
    scheduler.add_request(_request("free", False))
    _, outputs = step(scheduler, runner)
    failed = [o for o in outputs if o.request_id == "bad"]
    assert failed and failed[0].error == "invalid grammar: boom" and failed[0].finished
    while scheduler.has_requests():
        step(scheduler, runner)
    assert "bad" not in scheduler.requests and scheduler.kv_cache_manager.usage == 0.0


def test_sampled_tokens_advance_the_grammar_which_can_finish_or_fail_the_request() -> None:
    grammars = _FakeGrammars()
    scheduler, runner = _scheduler(grammars)
    for request_id in ("done", "refused", "free"):
        grammars.status[request_id] = None
        scheduler.add_request(_request(request_id, request_id != "free", max_tokens=6))
    grammars.terminate_after["done"] = 2
    grammars.refuse.add("refused")
    outputs: dict[str, list] = {}
    while scheduler.has_requests():
        _, step_outputs = step(scheduler, runner)
        for output in step_outputs:
            outputs.setdefault(output.request_id, []).append(output)
    done = outputs["done"]
    assert sum(len(o.new_token_ids) for o in done) == 2 and done[-1].finish_reason.value == "stop"
    refused = outputs["refused"][-1]
    assert refused.error == "refused sampled token" and refused.error_param == "structured_outputs"
    assert sum(len(o.new_token_ids) for o in outputs["free"]) == 6
    # The bitmask is asked for the constrained rows only.
    assert all("free" not in rows for rows in grammars.bitmask_rows)


def test_a_constrained_request_without_a_manager_is_refused() -> None:
    scheduler = Scheduler(SchedulerConfig(8, 256, 512, 0), CacheConfig(32, 16, True))
    with pytest.raises(ValueError, match="structured output"):
        scheduler.add_request(_request("x", True))


# --------------------------------------------------------------------------- the compiler


def test_compiler_caches_by_grammar_text_and_compiles_off_the_calling_thread(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    compiler = served.engine.processor.grammars
    threads: list[str] = []
    build = compiler._build

    def recording_build(text: str, kind: str) -> Any:
        threads.append(threading.current_thread().name)
        return build(text, kind)

    monkeypatch.setattr(compiler, "_build", recording_build)
    schema = {"type": "object", "properties": {"unique_to_this_test": {"type": "integer"}}}
    first = compiler.compile(StructuredOutputsParams(json=schema))
    again = compiler.compile(StructuredOutputsParams(json=json.dumps(schema)))
    assert first is again
    first.result()
    assert len(threads) == 1 and threads[0].startswith("grammar")


def test_compiler_cache_is_bounded(served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiler_module, "MAX_CACHED_GRAMMARS", 3)
    compiler = GrammarCompiler(served.engine.tokenizer, served.engine.client.core.config.model_config.vocab_size)
    futures: list[Future] = [compiler.compile(StructuredOutputsParams(choice=[str(i)])) for i in range(5)]
    assert len(compiler._cache) == 3
    for future in futures:
        future.result()
    compiler.shutdown()


def test_property_order_is_kept_in_the_grammar() -> None:
    ordered = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "integer"}}}
    assert grammar_text(StructuredOutputsParams(json=ordered)).index('"b"') < \
        grammar_text(StructuredOutputsParams(json=ordered)).index('"a"')


@pytest.mark.parametrize("fields", [{}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"json": "{bad"},
                                    {"json": 5}])
def test_structured_outputs_params_need_exactly_one_valid_constraint(fields: dict[str, Any]) -> None:
    with pytest.raises(InvalidRequestError) as info:
        StructuredOutputsParams(**fields)
    assert info.value.param == "structured_outputs"


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_preempted_constrained_requests_resume_their_grammar(async_scheduling: bool) -> None:
    """Requests preempted by recompute keep their grammar state: their greedy output is the same as
    when they run alone, and still inside the grammar. With async scheduling a step's masks are made after
    the previous step's tokens reached the grammar (a stale mask would let a token out of the grammar)."""
    from pagedserve.engine.llm import LLM

    schema = SCHEMAS["array_bounds_and_enum"]
    params = SamplingParams(temperature=0, max_tokens=40, structured_outputs=StructuredOutputsParams(json=schema))
    llm = LLM(max_model_len=256, num_gpu_blocks_override=10, block_size=16, max_num_seqs=4,
              async_scheduling=async_scheduling)
    prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": f"List colours, take {i}."}],
                                                 tokenize=False, add_generation_prompt=True) for i in range(4)]
    solo = [llm.generate(p, params, use_tqdm=False)[0].outputs[0].text for p in prompts]
    preemptions = llm.engine_core.scheduler.num_preemptions
    together = [o.outputs[0].text for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.engine_core.scheduler.num_preemptions > preemptions
    assert together == solo
    for text in together:
        jsonschema.validate(json.loads(text), schema)


def test_a_client_gone_while_its_grammar_compiles_leaves_the_compilation_to_the_others(
        served: Served, monkeypatch: pytest.MonkeyPatch) -> None:
    """Cancelling ``check_async`` (a disconnect) must not cancel the shared, cached compilation."""
    compiler = served.engine.processor.grammars
    building, release = threading.Event(), threading.Event()
    build = compiler._build

    def slow_build(text: str, kind: str) -> Any:
        building.set()
        release.wait(timeout=60)
        return build(text, kind)

    monkeypatch.setattr(compiler, "_build", slow_build)
    params = StructuredOutputsParams(choice=["cancelled", "while", "compiling"])

    async def disconnect_then_retry() -> None:
        waiting = asyncio.ensure_future(compiler.check_async(params))
        assert await asyncio.to_thread(building.wait, 60), "the compilation did not start"
        waiting.cancel()
        release.set()
        await compiler.check_async(params)  # the same compilation, not cancelled

    asyncio.run(disconnect_then_retry())
    assert not compiler.compile(params).cancelled()


def test_a_grammar_completed_on_the_last_allowed_token_is_a_stop(openai_client: openai.OpenAI,
                                                                 served: Served) -> None:
    assert len(served.engine.tokenizer.encode("yes", add_special_tokens=False)) == 1
    choice = _chat(openai_client, messages=[{"role": "user", "content": "Yes or no?"}], temperature=0, max_tokens=1,
                   extra_body={"guided_choice": ["yes", "no"]}).choices[0]
    assert choice.message.content in {"yes", "no"} and choice.finish_reason == "stop"


def test_json_schema_must_be_an_object() -> None:
    for schema in (True, "false"):
        with pytest.raises(InvalidRequestError, match="JSON schema object"):
            StructuredOutputsParams(json=schema)


def test_a_grammar_that_outgrows_llguidance_s_limits_while_generating_is_a_400(client: httpx.Client,
                                                                            served: Served) -> None:
    """A grammar of 5,000 alternatives compiles, but llguidance's parser refuses it after the first token (a
    row of more than 2000 items): the request fails alone, as the client's error, with llguidance's message
    (not its parser's state dump, which is logged). A choice list that long is refused before compiling."""
    alternatives = " | ".join(f'"c{i}"' for i in range(5_000))
    body = {"messages": ASK_PERSON, "max_tokens": 8, "temperature": 0,
            "structured_outputs": {"grammar": f"start: {alternatives}"}}
    response = client.post("/v1/chat/completions", json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "structured_outputs.grammar" and "max is 2000" in error["message"]
    assert "<state>" not in error["message"] and "\n" not in error["message"]
    assert client.post("/v1/chat/completions", json={"messages": ASK_PERSON, "max_tokens": 2}).status_code == 200
    assert served.engine.get_stats().kv_cache_usage == 0.0
