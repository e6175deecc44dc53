"""Scheduler and KV cache bookkeeping against a fake model runner (docs/architecture.md, "The scheduler side")."""

from __future__ import annotations

import pathlib
import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedserve.engine.config import CacheConfig, SchedulerConfig
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.request import Request, RequestStatus
from pagedserve.engine.sampling_params import SamplingParams
from tests.fake_runner import FakeModelRunner, Pipeline, reference_tokens, step

BLOCK_SIZE = 16
VOCAB = 50


def make(num_blocks=64, max_num_seqs=16, max_num_batched_tokens=256, max_model_len=1024, threshold=0,
         caching=True, async_scheduling=False):
    sched = Scheduler(SchedulerConfig(max_num_seqs, max_num_batched_tokens, max_model_len, threshold,
                                      async_scheduling),
                      CacheConfig(num_blocks, BLOCK_SIZE, caching))
    return sched, FakeModelRunner(num_blocks, BLOCK_SIZE, VOCAB)


def req(rid, prompt, max_tokens=8, eos=None, **kw):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw), eos, BLOCK_SIZE)


def run_all(sched, runner, max_steps=10_000, check=None):
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    for _ in range(max_steps):
        if not sched.has_requests():
            break
        so, outs = step(sched, runner)
        if check:
            check(sched, so)
        for o in outs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finish[o.request_id] = o.finish_reason.value
    assert not sched.has_requests()
    return outputs, finish


def test_seed_timeline_five_token_prompt():
    sched, runner = make()
    sched.add_request(req("r", [1, 2, 3, 4, 5], max_tokens=3))

    so0 = sched.schedule()
    assert [n.req_id for n in so0.scheduled_new_reqs] == ["r"]
    assert so0.scheduled_new_reqs[0].num_computed_tokens == 0
    assert so0.num_scheduled_tokens == {"r": 5} and so0.total_num_scheduled_tokens == 5
    assert sched.requests["r"].num_computed_tokens == 5  # optimistic advance before the forward
    outs = sched.update_from_output(so0, runner.execute_model(so0))
    assert len(outs[0].new_token_ids) == 1 and sched.requests["r"].num_tokens == 6

    so1 = sched.schedule()
    assert so1.scheduled_new_reqs == []
    assert so1.scheduled_cached_reqs.req_ids == ["r"]
    assert so1.scheduled_cached_reqs.num_computed_tokens == [5]
    assert so1.num_scheduled_tokens == {"r": 1}
    assert so1.scheduled_cached_reqs.new_block_ids == [None]  # 6 tokens still fit in block 1
    assert sched.requests["r"].num_computed_tokens == 6
    sched.update_from_output(so1, runner.execute_model(so1))

    so2 = sched.schedule()
    assert so2.scheduled_cached_reqs.num_computed_tokens == [6]
    outs = sched.update_from_output(so2, runner.execute_model(so2))
    assert outs[0].finish_reason.value == "length"
    so3 = sched.schedule()  # cleanup-only step
    assert so3.total_num_scheduled_tokens == 0 and so3.finished_req_ids == {"r"}
    assert sched.kv_cache_manager.usage == 0.0


def test_chunked_prefill_runs_in_32_token_chunks_while_other_request_decodes():
    sched, runner = make(threshold=32)
    sched.add_request(req("dec", [7, 8, 9], max_tokens=20))
    step(sched, runner)  # "dec" prefilled, now decoding
    sched.add_request(req("long", range(100), max_tokens=2))
    chunks, dec_steps = [], 0
    for _ in range(4):
        so, outs = step(sched, runner)
        chunks.append(so.num_scheduled_tokens["long"])
        dec_steps += so.num_scheduled_tokens.get("dec", 0)
        sampled_long = [o for o in outs if o.request_id == "long"]
        if len(chunks) < 4:
            assert sampled_long == []  # a partial prefill samples nothing
        else:
            assert len(sampled_long[0].new_token_ids) == 1
    assert chunks == [32, 32, 32, 4]
    assert dec_steps == 4


def test_budgets_hold_every_step():
    sched, runner = make(max_num_seqs=3, max_num_batched_tokens=40)
    for i in range(8):
        sched.add_request(req(f"r{i}", range(i * 7 + 5), max_tokens=6))

    def check(s, so):
        assert so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values()) <= 40
        assert len(s.running) <= 3

    outputs, _ = run_all(sched, runner, check=check)
    assert len(outputs) == 8


def test_prefix_cache_hit_starts_second_request_at_shared_prefix():
    sched, runner = make()
    prefix = list(range(100, 148))  # 48 tokens = 3 blocks
    sched.add_request(req("a", prefix + [1, 2, 3], max_tokens=2))
    step(sched, runner)
    sched.add_request(req("b", prefix + [4, 5], max_tokens=2))
    so, _ = step(sched, runner)
    new_b = so.scheduled_new_reqs[0]
    assert new_b.req_id == "b" and new_b.num_computed_tokens == 48
    assert so.num_scheduled_tokens["b"] == 2
    kv = sched.kv_cache_manager
    assert kv.prefix_cache_hits == 48 and kv.prefix_cache_queries == 51 + 50
    assert sched.requests["b"].num_cached_tokens == 48


def test_last_prompt_token_is_always_recomputed():
    sched, runner = make()
    prompt = list(range(32))  # exactly two full blocks
    sched.add_request(req("a", prompt, max_tokens=1))
    run_all(sched, runner)
    sched.add_request(req("b", prompt, max_tokens=1))
    so = sched.schedule()
    assert so.scheduled_new_reqs[0].num_computed_tokens == 16
    assert so.num_scheduled_tokens["b"] == 16


def test_freed_prefix_is_reused_then_evicted_lru_first():
    sched, runner = make(num_blocks=9)  # 8 usable blocks
    sched.add_request(req("a", range(0, 33), max_tokens=1))  # 3 blocks, 2 full and cached
    sched.add_request(req("b", range(200, 233), max_tokens=1))
    run_all(sched, runner)
    kv = sched.kv_cache_manager
    assert kv.usage == 0.0
    # Free queue now: 2 never-used blocks, then a's blocks tail first, then b's.
    sched.add_request(req("c", range(500, 530), max_tokens=1))  # 2 blocks: the never-used ones
    sched.add_request(req("d", range(600, 630), max_tokens=1))  # 2 blocks: a's tail (uncached) and 2nd block
    run_all(sched, runner)
    hit = {name: kv.get_computed_blocks(req(name, prompt))[1]
           for name, prompt in (("a2", range(0, 33)), ("b2", range(200, 233)))}
    # a was freed before b, so a is evicted first; its root block, freed last, survives.
    assert hit == {"a2": 16, "b2": 32}


def test_preempted_request_resumes_with_full_block_list_and_same_tokens():
    prompts = {f"r{i}": list(range(i * 40, i * 40 + 30)) for i in range(4)}
    # 4 requests of up to 30 + 40 = 70 tokens need 5 blocks each; 12 usable blocks force preemption.
    sched, runner = make(num_blocks=13)
    for rid, p in prompts.items():
        sched.add_request(req(rid, p, max_tokens=40))
    resumed_seen = {}

    def check(s, so):
        cached = so.scheduled_cached_reqs
        for i, rid in enumerate(cached.req_ids):
            if rid in cached.resumed_req_ids:
                resumed_seen[rid] = True
                assert cached.new_block_ids[i] == s.kv_cache_manager.get_block_ids(rid)
                assert rid in cached.all_token_ids
                tokens = cached.all_token_ids[rid]
                assert tokens == s.requests[rid].all_token_ids[:len(tokens)]  # checked after the step's append
                assert len(tokens) == cached.num_computed_tokens[i] + so.num_scheduled_tokens[rid]

    outputs, _ = run_all(sched, runner, check=check)
    assert sched.num_preemptions > 0 and resumed_seen
    for rid, p in prompts.items():
        assert outputs[rid] == reference_tokens(p, 40, VOCAB)


def test_latest_arrival_is_preempted_first():
    sched, runner = make(num_blocks=7)  # 6 usable blocks
    sched.add_request(req("old", range(30), max_tokens=40))
    sched.add_request(req("new", range(100, 130), max_tokens=40))
    preempted = []
    for _ in range(30):
        so, _ = step(sched, runner)
        preempted += list(so.preempted_req_ids)
        if preempted:
            break
    assert preempted == ["new"]
    assert sched.waiting[0].request_id == "new" and sched.waiting[0].status == RequestStatus.PREEMPTED
    assert sched.waiting[0].num_computed_tokens == 0


def test_abort_frees_blocks_at_once_and_reports_once():
    sched, runner = make()
    sched.add_request(req("x", range(40), max_tokens=50))
    sched.add_request(req("y", range(50, 60), max_tokens=50))
    step(sched, runner)
    before = sched.kv_cache_manager.block_pool.get_num_free_blocks()
    sched.finish_requests("x", RequestStatus.FINISHED_ABORTED)
    assert sched.kv_cache_manager.block_pool.get_num_free_blocks() == before + 3
    so1, _ = step(sched, runner)
    assert so1.finished_req_ids == {"x"} and "x" not in so1.num_scheduled_tokens
    so2, _ = step(sched, runner)
    assert so2.finished_req_ids == set()


def test_abort_of_waiting_request_and_cleanup_only_step():
    sched, runner = make()
    sched.add_request(req("w", range(10)))
    sched.finish_requests(["w", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert sched.has_requests()  # the worker must still hear about it
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == 0 and so.finished_req_ids == {"w"}
    assert not sched.has_requests()


def test_stop_conditions():
    eos = reference_tokens([1, 2, 3], 5, VOCAB)[2]
    sched, runner = make()
    sched.add_request(req("eos", [1, 2, 3], max_tokens=10, eos=eos))
    sched.add_request(req("ign", [1, 2, 3], max_tokens=5, eos=eos, ignore_eos=True))
    sched.add_request(req("min", [1, 2, 3], max_tokens=6, eos=eos, min_tokens=4))
    stop_tok = reference_tokens([1, 2, 3], 5, VOCAB)[1]
    sched.add_request(req("stop", [1, 2, 3], max_tokens=10, stop_token_ids=[stop_tok]))
    outputs, finish = run_all(sched, runner)
    assert len(outputs["eos"]) == 3 and finish["eos"] == "stop"
    assert len(outputs["ign"]) == 5 and finish["ign"] == "length"
    assert len(outputs["min"]) == 6 and finish["min"] == "length"
    assert len(outputs["stop"]) == 2 and finish["stop"] == "stop"


def test_max_model_len_caps_output():
    sched, runner = make(max_model_len=20)
    sched.add_request(req("r", range(15), max_tokens=100))
    outputs, finish = run_all(sched, runner)
    assert len(outputs["r"]) == 5 and finish["r"] == "length"


def test_scheduler_side_imports_no_torch():
    # Every module of pagedserve.engine.core, in a fresh interpreter.
    code = ("import importlib, pkgutil, sys, pagedserve.engine.core as core\n"
            "for m in pkgutil.iter_modules(core.__path__): importlib.import_module(core.__name__ + '.' + m.name)\n"
            "print(sorted(m for m in ('torch', 'numpy') if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                            cwd=pathlib.Path(__file__).parent.parent)
    assert result.stdout.strip() == "[]"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    reqs=st.lists(st.tuples(st.integers(1, 70), st.integers(1, 20), st.integers(0, 30), st.booleans(),
                            st.integers(0, 3)), min_size=1, max_size=12),
    num_blocks=st.integers(8, 40),
    budget=st.integers(8, 96),
    max_num_seqs=st.integers(1, 6),
    threshold=st.sampled_from([0, 8, 24]),
    caching=st.booleans(),
    async_scheduling=st.booleans(),
)
def test_random_workload_keeps_invariants(reqs, num_blocks, budget, max_num_seqs, threshold, caching,
                                          async_scheduling):
    sched, runner = make(num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                         threshold=threshold, caching=caching, async_scheduling=async_scheduling)
    pipeline = Pipeline(sched, runner) if async_scheduling else None
    pending = []
    for i, (plen, max_tokens, arrival, abort, shared) in enumerate(reqs):
        prompt = [shared] * min(plen, 20) + [(i * 13 + k) % VOCAB for k in range(max(0, plen - 20))]
        if (plen + max_tokens + BLOCK_SIZE - 1) // BLOCK_SIZE > num_blocks - 1:
            continue
        pending.append((arrival, f"r{i}", prompt, max_tokens, abort))
    pending.sort()
    pool = sched.kv_cache_manager.block_pool
    initial_free = pool.get_num_free_blocks()
    outputs: dict[str, list[int]] = {}
    aborted = set()
    for t in range(5000):
        for arrival, rid, prompt, max_tokens, abort in pending:
            if arrival == t:
                sched.add_request(req(rid, prompt, max_tokens=max_tokens))
            if abort and arrival + 3 == t and rid in sched.requests:
                sched.finish_requests(rid, RequestStatus.FINISHED_ABORTED)
                aborted.add(rid)
        if t > 40 and not (pipeline.busy() if pipeline else sched.has_requests()):
            break
        so, outs = pipeline.step() if pipeline else step(sched, runner)
        assert so is None or so.total_num_scheduled_tokens == sum(so.num_scheduled_tokens.values()) <= budget
        assert len(sched.running) <= max_num_seqs
        owners: dict[int, int] = {}
        for blocks in sched.kv_cache_manager.req_to_blocks.values():
            for b in blocks:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
        free_ids = {b.block_id for b in pool.free_block_queue}
        assert not free_ids & owners.keys()
        for block in pool.blocks[1:]:
            assert block.ref_cnt == owners.get(block.block_id, 0)
        # The step records' count of reusable free blocks, kept incrementally, equals a recount.
        assert pool.num_cached_free_blocks == sum(b.ref_cnt == 0 and b.block_hash is not None for b in pool.blocks)
        for o in outs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
    assert not sched.has_requests()
    assert pool.get_num_free_blocks() == initial_free
    for _, rid, prompt, max_tokens, _ in pending:
        if rid not in aborted:
            assert outputs[rid] == reference_tokens(prompt, max_tokens, VOCAB)


def test_drafts_are_dropped_before_another_request_is_preempted_for_them():
    sched, runner = make(num_blocks=5)  # 4 usable blocks of 16 tokens
    sched.add_request(req("old", range(31), max_tokens=20))  # 31 + 1 tokens: blocks 1-2, full
    sched.add_request(req("new", range(100, 131), max_tokens=20))  # blocks 3-4
    step(sched, runner)
    old = sched.requests["old"]
    assert old.num_computed_tokens == 31 and sched.kv_cache_manager.block_pool.get_num_free_blocks() == 0
    old.spec_token_ids = [1, 2, 3]  # would need a fifth block
    so = sched.schedule()
    assert not so.preempted_req_ids and so.scheduled_spec_decode_tokens == {}
    assert so.num_scheduled_tokens == {"old": 1, "new": 1}


# ---------------------------------------------------------------------- async scheduling


def run_pipelined(sched, runner):
    """Run every request to the end with async scheduling; returns tokens and finish reasons by request, and
    the plans."""
    pipeline = Pipeline(sched, runner)
    outputs: dict[str, list[int]] = {}
    finish: dict[str, str] = {}
    plans = []
    while pipeline.busy():
        so, outs = pipeline.step()
        plans.append(so)
        for o in outs:
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
            if o.finished:
                finish[o.request_id] = o.finish_reason.value
    return outputs, finish, plans


def test_async_scheduling_plans_the_token_in_flight_as_a_placeholder():
    sched, runner = make(async_scheduling=True)
    prompt = list(range(5))
    expected = reference_tokens(prompt, 3, VOCAB)
    sched.add_request(req("a", prompt, max_tokens=3))
    a = sched.requests["a"]
    pipeline = Pipeline(sched, runner)

    so, outs = pipeline.step()  # the prompt; its first token is sampled in flight
    assert so.num_scheduled_tokens == {"a": 5} and outs == []
    assert (a.num_computed_tokens, a.num_output_placeholders, a.num_output_tokens) == (5, 1, 0)

    so, outs = pipeline.step()  # planned before that token is known: it runs the placeholder
    assert so.num_scheduled_tokens == {"a": 1}
    assert so.scheduled_cached_reqs.num_computed_tokens == [5]
    assert so.scheduled_cached_reqs.num_output_tokens == [1]  # the worker holds the token it sampled
    assert [o.new_token_ids for o in outs] == [expected[:1]]
    assert (a.num_computed_tokens, a.num_output_placeholders, a.num_output_tokens) == (6, 1, 1)

    so, outs = pipeline.step()
    assert so.num_scheduled_tokens == {"a": 1} and [o.new_token_ids for o in outs] == [expected[1:2]]

    so, outs = pipeline.step()  # the token in flight is the 3rd of max_tokens 3: nothing more is planned
    assert so is None
    assert [(o.new_token_ids, o.finish_reason.value) for o in outs] == [(expected[2:], "length")]
    assert a.num_output_placeholders == 0

    while pipeline.busy():  # the worker is told to drop the request
        so, outs = pipeline.step()
        assert outs == [] and (so is None or so.finished_req_ids == {"a"})
    assert sched.kv_cache_manager.usage == 0


def test_async_scheduling_hides_the_token_after_a_stop():
    """A request that stops at step N has run one more token in step N + 1 (planned before the stop was
    known); nobody sees it."""
    prompt = list(range(7))
    expected = reference_tokens(prompt, 8, VOCAB)
    eos = expected[1]
    assert eos not in expected[:1]
    sched, runner = make(async_scheduling=True)
    sched.add_request(req("a", prompt, max_tokens=8, eos=eos))
    outputs, finish, plans = run_pipelined(sched, runner)
    assert outputs == {"a": expected[:2]} and finish == {"a": "stop"}
    assert [so.num_scheduled_tokens.get("a") for so in plans if so is not None] == [7, 1, 1, None]
    sync_sched, sync_runner = make()
    sync_sched.add_request(req("a", prompt, max_tokens=8, eos=eos))
    assert run_all(sync_sched, sync_runner) == (outputs, finish)


def test_async_scheduling_a_request_preempted_with_its_token_in_flight_gets_it_and_may_stop_in_the_queue():
    """3 usable blocks of 16 tokens: ``b`` (16-token prompt) takes its second block at step 1; at step 2 ``a``
    needs its second one, and ``b``, the latest arrival, is preempted while step 1 samples its 2nd token.
    That token is ``b``'s EOS: ``b`` finishes in the waiting queue."""
    prompt_a, prompt_b = [1] * 15, [2] * 16
    expected_a = reference_tokens(prompt_a, 4, VOCAB)
    expected_b = reference_tokens(prompt_b, 8, VOCAB)
    assert expected_b[0] != expected_b[1]
    sched, runner = make(num_blocks=4, async_scheduling=True)
    sched.add_request(req("a", prompt_a, max_tokens=4))
    sched.add_request(req("b", prompt_b, max_tokens=8, eos=expected_b[1]))
    outputs, finish, plans = run_pipelined(sched, runner)
    assert plans[2].preempted_req_ids == {"b"}
    assert outputs == {"a": expected_a, "b": expected_b[:2]}
    assert finish == {"a": "length", "b": "stop"}
    assert not sched.waiting and not sched.requests and sched.kv_cache_manager.usage == 0


def test_async_scheduling_and_the_synchronous_scheduler_give_the_same_tokens():
    """Prefix caching, chunked prefill, preemption and stops, the two ways."""
    def run(async_scheduling):
        sched, runner = make(num_blocks=12, max_num_seqs=4, max_num_batched_tokens=40, threshold=24,
                             async_scheduling=async_scheduling)
        for i in range(8):
            prompt = [5] * 20 + [(i * 7 + k) % VOCAB for k in range(10 + 3 * i)]
            eos = reference_tokens(prompt, 12, VOCAB)[5] if i % 3 == 0 else None
            sched.add_request(req(f"r{i}", prompt, max_tokens=12, eos=eos))
        result = run_pipelined(sched, runner)[:2] if async_scheduling else run_all(sched, runner)
        assert sched.num_preemptions > 0 and sched.kv_cache_manager.prefix_cache_hits > 0
        return result

    assert run(True) == run(False)
