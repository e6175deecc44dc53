"""A fault in one request's own data fails that request alone; the engine goes on with the others.

Each test injects a fault into one request (id ``bad``) at one stage of the step (its worker
state, its row in the persistent batch, its row's inputs, its sampling, the scheduler's
accounting of its tokens), while other requests (greedy and seeded) run beside it. The faulty
request must end with an error, its KV blocks freed and no worker state left; the others'
tokens must equal a run without it; and the engine must serve new requests afterwards. A fault
in the forward pass, which no request can be blamed for, still stops the engine
(``test_server_errors.py``).
"""

from __future__ import annotations

import asyncio

import pytest
from transformers import AutoTokenizer

from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core_client import InprocClient
from pagedserve.engine.engine_core import EngineCore
from pagedserve.engine.engine_factory import resolve_engine_config
from pagedserve.engine.errors import RequestFailedError
from pagedserve.engine.input_processor import InputProcessor
from pagedserve.engine.model.loader import gguf_cache_folder, resolve_model_path
from pagedserve.engine.outputs import FinishReason
from pagedserve.engine.request import EngineCoreRequest
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.worker import model_runner
from pagedserve.engine.worker.input_batch import InputBatch
from pagedserve.engine.worker.model_runner import ModelRunner
from pagedserve.engine.worker.sampler import Sampler

PROMPTS = {"a": [3, 14, 15, 92, 65], "b": [35, 89, 79, 32, 38, 46, 26, 43], "c": [7, 1]}
PARAMS = {
    "a": SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    "b": SamplingParams(temperature=1.0, seed=1234, max_tokens=12, ignore_eos=True),
    "c": SamplingParams(temperature=0.8, top_k=20, seed=99, max_tokens=12, ignore_eos=True),
}
BAD_PROMPT = [11, 12, 13, 14, 15, 16]
#: A harmless bias the sampling fault below uses to recognise the faulty request's row.
MARKER = {5: 0.0}


def make_core(folder: str, async_scheduling: bool = False) -> EngineCore:
    return EngineCore(resolve_engine_config(EngineArgs(model=folder, max_model_len=128, kv_cache_memory_bytes="4MiB",
                                                        async_scheduling=async_scheduling)))


def add(core: EngineCore, req_id: str, prompt: list[int], params: SamplingParams) -> None:
    core.add_request(EngineCoreRequest(req_id, prompt, params, eos_token_id=None, arrival_time=0.0))


def run(core: EngineCore, bad_params: SamplingParams | None = None, bad_at_step: int = 2
        ) -> tuple[dict[str, list[int]], dict[str, str]]:
    """Run the requests of ``PROMPTS`` to the end, adding ``bad`` at step ``bad_at_step`` (while the
    others decode) when ``bad_params`` is given. Returns tokens by request id and errors by request id."""
    for req_id, prompt in PROMPTS.items():
        add(core, req_id, prompt, PARAMS[req_id])
    tokens: dict[str, list[int]] = {}
    errors: dict[str, str] = {}
    step = 0
    while core.has_unfinished_requests():
        if step == bad_at_step and bad_params is not None:
            add(core, "bad", BAD_PROMPT, bad_params)
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.error is not None:
                assert output.finish_reason is FinishReason.ERROR
                errors[output.request_id] = output.error
        step += 1
    return tokens, errors


@pytest.fixture(scope="module")
def reference(tiny_llama_folder) -> dict[str, list[int]]:
    tokens, errors = run(make_core(tiny_llama_folder))
    assert not errors and all(len(t) == 12 for t in tokens.values())
    return tokens


def assert_isolated(core: EngineCore, tokens: dict[str, list[int]], errors: dict[str, str],
                    reference: dict[str, list[int]], message: str) -> None:
    """``bad`` failed with ``message`` and left nothing behind; the others ran as without it;
    the engine still serves."""
    assert list(errors) == ["bad"] and message in errors["bad"]
    assert {r: tokens[r] for r in PROMPTS} == reference
    runner = core.executor.worker.model_runner
    assert "bad" not in runner.requests and "bad" not in runner.input_batch.req_id_to_index
    assert not core.scheduler.requests and core.make_stats().kv_cache_usage == 0
    add(core, "after", PROMPTS["a"], PARAMS["a"])
    after, after_errors = {}, {}
    while core.has_unfinished_requests():
        for output in core.step():
            after.setdefault(output.request_id, []).extend(output.new_token_ids)
            after_errors[output.request_id] = output.error
    assert after == {"after": reference["a"]} and after_errors == {"after": None}
    assert not runner.requests and runner.input_batch.num_reqs == 0 and core.make_stats().kv_cache_usage == 0


# The requests the end-to-end tests below make fail carry this seed.
FAULTY_SEED = 12345


def fail_for_bad(original, message: str, key_of, bad="bad"):
    """Wrap ``original`` to raise ``RuntimeError(message)`` when ``key_of(*args)`` equals ``bad`` (by default
    the request id ``"bad"``)."""
    def wrapper(*args, **kwargs):
        if key_of(*args, **kwargs) == bad:
            raise RuntimeError(message)
        return original(*args, **kwargs)
    return wrapper


def test_fault_creating_worker_state(tiny_llama_folder, reference, monkeypatch):
    monkeypatch.setattr(model_runner, "CachedRequestState", fail_for_bad(
        model_runner.CachedRequestState, "state injected", lambda req_id, *args, **kwargs: req_id))
    core = make_core(tiny_llama_folder)
    tokens, errors = run(core, SamplingParams(temperature=0.0, max_tokens=5))
    assert_isolated(core, tokens, errors, reference, "state injected")


def test_seed_the_generator_cannot_take(tiny_llama_folder, reference):
    """A real trigger: ``torch.Generator.manual_seed`` overflows on a seed past its range."""
    core = make_core(tiny_llama_folder)
    params = SamplingParams(temperature=1.0, max_tokens=5)
    params.seed = 2**80  # past SamplingParams' own check, as a frontend bug would let it
    tokens, errors = run(core, params)
    assert_isolated(core, tokens, errors, reference, "")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_fault_inserting_into_persistent_batch(tiny_llama_folder, reference, monkeypatch, async_scheduling):
    monkeypatch.setattr(InputBatch, "add_request", fail_for_bad(
        InputBatch.add_request, "insert injected", lambda self, state: state.req_id))
    core = make_core(tiny_llama_folder, async_scheduling)
    tokens, errors = run(core, SamplingParams(temperature=0.0, max_tokens=5))
    assert_isolated(core, tokens, errors, reference, "insert injected")


def test_fault_in_row_inputs(tiny_llama_folder, reference, monkeypatch):
    """The row of ``bad`` claims fewer KV blocks than its tokens need (a bookkeeping fault)."""
    update_states = ModelRunner._update_states

    def corrupting_update_states(self, so):
        update_states(self, so)
        row = self.input_batch.req_id_to_index.get("bad")
        if row is not None:
            self.input_batch.block_table.num_blocks_per_row[row] = 0

    monkeypatch.setattr(ModelRunner, "_update_states", corrupting_update_states)
    core = make_core(tiny_llama_folder)
    tokens, errors = run(core, SamplingParams(temperature=0.0, max_tokens=5))
    assert_isolated(core, tokens, errors, reference, "inconsistent row")


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_a_worker_holding_another_count_of_output_tokens_fails_that_request(tiny_llama_folder, reference,
                                                                            monkeypatch, async_scheduling):
    """``CachedRequestData.num_output_tokens`` is the length of the worker's copy of a request's output (with
    async scheduling, the token it sampled in the step in flight included); a request whose copy differs
    (a bookkeeping fault) fails alone instead of running on a context the scheduler does not know."""
    make_output = Scheduler._make_output

    def miscounting_make_output(self, plan):
        output = make_output(self, plan)
        cached = output.scheduled_cached_reqs
        if "bad" in cached.req_ids:
            cached.num_output_tokens[cached.req_ids.index("bad")] += 1
        return output

    monkeypatch.setattr(Scheduler, "_make_output", miscounting_make_output)
    core = make_core(tiny_llama_folder, async_scheduling)
    tokens, errors = run(core, SamplingParams(temperature=0.0, max_tokens=5))
    assert_isolated(core, tokens, errors, reference, "the worker holds 1 output tokens of the request, "
                                                     "the scheduler counts 2")


def test_bad_logit_bias_fails_as_its_row_enters_the_batch(tiny_llama_folder, reference):
    """A real trigger: a ``logit_bias`` token id outside the vocabulary raises in ``InputBatch.add_request``."""
    core = make_core(tiny_llama_folder)
    tokens, errors = run(core, SamplingParams(temperature=0.0, max_tokens=5, logit_bias={10**6: 1.0}))
    assert_isolated(core, tokens, errors, reference, "logit_bias")


def test_fault_after_the_draws_keeps_seeded_rows_reproducible(tiny_llama_folder, reference, monkeypatch):
    """The batched sampler raises after every row drew (seeded generators advanced): the retry row by
    row rewinds them, so the seeded requests beside the faulty one sample as without it."""
    forward = Sampler.forward

    def failing_after_draws(self, logits, metadata):
        result = forward(self, logits, metadata)
        if metadata.logit_bias is not None:  # only the faulty request has a bias
            raise RuntimeError("sample injected")
        return result

    monkeypatch.setattr(Sampler, "forward", failing_after_draws)
    core = make_core(tiny_llama_folder)
    tokens, errors = run(core, SamplingParams(temperature=1.0, seed=5, max_tokens=5, logit_bias=MARKER))
    assert_isolated(core, tokens, errors, reference, "sample injected")


def test_fault_in_scheduler_accounting(tiny_llama_folder, reference, monkeypatch):
    monkeypatch.setattr(Scheduler, "_check_stop", fail_for_bad(
        Scheduler._check_stop, "update injected", lambda self, request, token_id: request.request_id))
    core = make_core(tiny_llama_folder)
    tokens, errors = run(core, SamplingParams(temperature=0.0, max_tokens=5))
    assert_isolated(core, tokens, errors, reference, "update injected")


def test_async_scheduling_an_abort_in_flight_frees_the_request_and_leaves_the_others(tiny_llama_folder, reference):
    core = make_core(tiny_llama_folder, async_scheduling=True)
    for req_id, prompt in PROMPTS.items():
        add(core, req_id, prompt, PARAMS[req_id])
    tokens: dict[str, list[int]] = {}
    for step in range(100):
        if not core.has_unfinished_requests():
            break
        if step == 3:
            assert core._in_flight is not None and "b" in core._in_flight.scheduler_output.num_scheduled_tokens
            core.abort_requests(["b"])
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    assert {r: tokens[r] for r in ("a", "c")} == {r: reference[r] for r in ("a", "c")}
    assert tokens["b"] == reference["b"][:len(tokens["b"])] and len(tokens["b"]) < len(reference["b"])
    runner = core.executor.worker.model_runner
    assert not runner.requests and not core.scheduler.requests and core.make_stats().kv_cache_usage == 0


def test_async_scheduling_a_forward_fault_stops_the_engine_and_nothing_runs_after_it(tiny_llama_folder, monkeypatch):
    """A fault no request can be blamed for ends the engine. The forward pass planned behind it is already
    queued on the worker thread: it must not run on the broken worker."""
    execute_model = ModelRunner.execute_model
    calls = []

    def failing_third_step(self, scheduler_output):
        calls.append(None)
        if len(calls) == 3:
            raise RuntimeError("device fault")
        return execute_model(self, scheduler_output)

    monkeypatch.setattr(ModelRunner, "execute_model", failing_third_step)
    core = make_core(tiny_llama_folder, async_scheduling=True)
    for req_id, prompt in PROMPTS.items():
        add(core, req_id, prompt, PARAMS[req_id])
    with pytest.raises(RuntimeError, match="device fault"):
        while core.has_unfinished_requests():
            core.step()
    core.shutdown()  # waits for the worker thread's queue
    assert len(calls) == 3


def test_every_request_failing_leaves_the_engine_serving(tiny_llama_folder, reference, monkeypatch):
    """A step whose only scheduled request fails runs no forward pass and reports the failure."""
    core = make_core(tiny_llama_folder)
    monkeypatch.setattr(InputBatch, "add_request", fail_for_bad(
        InputBatch.add_request, "insert injected", lambda self, state: state.req_id))
    add(core, "bad", BAD_PROMPT, SamplingParams(temperature=0.0, max_tokens=5))
    outputs = core.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("bad", FinishReason.ERROR)]
    while core.has_unfinished_requests():
        core.step()
    tokens, errors = run(core)
    assert tokens == reference and not errors and core.make_stats().kv_cache_usage == 0


def test_async_llm_fails_one_stream_and_completes_the_other(tiny_llama_folder, reference, monkeypatch):
    """Through ``AsyncLLM``: the faulty request's client gets ``RequestFailedError`` while another
    request streams to completion beside it, and the engine keeps serving."""
    monkeypatch.setattr(InputBatch, "add_request", fail_for_bad(
        InputBatch.add_request, "insert injected", lambda self, state: state.req_id))
    tokenizer = AutoTokenizer.from_pretrained(gguf_cache_folder(resolve_model_path(None)).path)

    async def collect(engine: AsyncLLM, processor: InputProcessor, req_id: str, prompt: list[int],
                      params: SamplingParams) -> list[int]:
        token_ids: list[int] = []
        async for output in engine.generate(processor.process(prompt, params), req_id):
            token_ids += output.outputs[0].token_ids
        return token_ids

    async def main() -> None:
        core = make_core(tiny_llama_folder)
        processor = InputProcessor(core.config.model_config, tokenizer, core.config.cache_config, max_logprobs=20)
        engine = AsyncLLM(InprocClient(core), processor, None, asyncio.get_running_loop())
        good = asyncio.ensure_future(collect(engine, processor, "a", PROMPTS["a"], PARAMS["a"]))
        await asyncio.sleep(0)
        with pytest.raises(RequestFailedError, match="insert injected"):
            await collect(engine, processor, "bad", BAD_PROMPT, SamplingParams(temperature=0.0, max_tokens=5))
        assert await good == reference["a"]
        assert engine.check_health()
        assert await collect(engine, processor, "later", PROMPTS["b"], PARAMS["b"]) == reference["b"]
        await engine.shutdown(timeout_s=5)

    asyncio.run(main())


def test_the_server_answers_a_failed_request_with_a_500_and_serves_the_others(serve_fresh_engine, monkeypatch):
    """Through HTTP: the failed request gets OpenAI's error body with a 500 while another client's
    completion is served."""
    import httpx

    monkeypatch.setattr(InputBatch, "add_request", fail_for_bad(
        InputBatch.add_request, "insert injected", lambda self, state: state.sampling_params.seed, bad=FAULTY_SEED))
    served = serve_fresh_engine(max_model_len=256, kv_cache_memory_bytes="16MiB")
    body = {"prompt": "Hello", "max_tokens": 4, "temperature": 0.0}
    with httpx.Client(base_url=served.url, timeout=60) as client:
        failed = client.post("/v1/completions", json=body | {"seed": FAULTY_SEED})
        assert failed.status_code == 500
        assert failed.json()["error"]["code"] == "request_failed"
        assert "insert injected" in failed.json()["error"]["message"]
        # Failed before its first token, a stream is answered as a plain request would be.
        streamed = client.post("/v1/completions", json=body | {"seed": FAULTY_SEED, "stream": True})
        assert streamed.status_code == 500 and streamed.json()["error"]["code"] == "request_failed"
        ok = client.post("/v1/completions", json=body)
        assert ok.status_code == 200 and ok.json()["choices"][0]["finish_reason"] == "length"


def test_llm_raises_for_a_failed_request_and_serves_the_next_call(monkeypatch):
    """Offline: ``generate`` returns all or nothing, so a failed request is an error for the call; the
    other requests are aborted and the engine serves the next call."""
    from pagedserve.engine import LLM

    monkeypatch.setattr(InputBatch, "add_request", fail_for_bad(
        InputBatch.add_request, "insert injected", lambda self, state: state.sampling_params.seed, bad=FAULTY_SEED))
    llm = LLM(max_model_len=256, kv_cache_memory_bytes="16MiB")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    with pytest.raises(RequestFailedError, match=r"request \d+ failed: RuntimeError\('insert injected'\)"):
        llm.generate(["Hello", "Hi"], [params, SamplingParams(temperature=0.0, max_tokens=4, seed=FAULTY_SEED)],
                     use_tqdm=False)
    assert not llm.engine_core.has_unfinished_requests() and not llm.output_processor.has_unfinished_requests()
    assert llm.engine_core.make_stats().kv_cache_usage == 0.0
    assert len(llm.generate(["Hello"], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
