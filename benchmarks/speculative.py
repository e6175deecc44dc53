"""Prompt-lookup speculative decoding: the same requests with and without ``--speculative-config``.

Two kinds of prompts, each at concurrency 1 and 16, every request exactly ``--output-len`` tokens long
(``ignore_eos``):

- grounded: a chat (the model's chat template) whose user message holds a passage of Python's reference
  manual (``pydoc_data.topics``, installed with CPython) and asks for it back with one word changed; the
  answer copies long runs of the prompt, which prompt lookup is for. Greedy, so both engines emit the
  same tokens (speculation never changes greedy output) and only the time differs;
- random: random-token prompts (``pagedserve.server.bench.dataset.sample_requests``) continued as completions, sampled
  at temperature ``RANDOM_TEMPERATURE`` (seeded per request): n-grams match by chance only, and the
  drafts that follow a chance match are mostly rejected; what speculation costs when it does not pay
  (the goal: under 3%). Greedy decoding is no such case here: from random prompts the small model falls
  into loops, which prompt lookup predicts perfectly.

The engine runs in this process (``engine.LLM``), its core stepped by a closed loop that keeps
``concurrency`` requests in flight, as ``server/bench/serve.py --max-concurrency`` does over HTTP, without
the HTTP: a request's tokens arrive when the step that made them returns. Both engines (one plain, one
with ``--speculative-config``) are loaded once, without prefix caching so that every repeat prefills
alike, and warmed up; each scenario runs on one, then the other, ``--repeats`` times. Reported: the
medians of each engine's runs, and the median of the ratios of the paired runs (one on each engine,
back to back), which drifts less with the load of a shared machine than the ratio of the medians.
Per run: output tokens/s, TPOT p50 (``pagedserve.server.bench.summary``), and from the engine's counters the
acceptance rate (accepted / drafted tokens) and the mean acceptance length (1 + accepted / drafts:
tokens per request step that verified drafts), and the two costs speculation adds whether or not it
pays: the share of the run's time spent in the drafter's lookups (timed around ``propose``) and the
draft tokens verified per output token. These two bound the slowdown of a run where drafts are rejected
more precisely than the difference of two wall-clock times on a shared machine can. Results go to
``benchmarks/results/speculative-<date>.{json,md}``.

    python -m benchmarks.speculative [--output-len 96] [--num-prompts-c1 4] [--repeats 1]
        [--speculative-config JSON] [--quick]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve.server.bench.dataset import sample_requests
from pagedserve.server.bench.summary import RequestResult, compute_metrics, result_from_timestamps

REPO_ROOT = Path(__file__).resolve().parent.parent
NGRAM_CONFIG = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
CONCURRENCIES = (1, 16)
#: Goal: speculation slows the random (non-grounded) scenarios by less than this (1 - tok/s ratio).
MAX_SLOWDOWN = 0.03
RANDOM_TEMPERATURE = 1.0


@dataclass(frozen=True)
class BenchConfig:
    """Sizes of one run; lengths in tokens."""

    output_len: int = 96
    passage_len: int = 256       # grounded: passage tokens in the prompt
    random_input_len: int = 256  # random: prompt tokens
    num_prompts_c1: int = 4      # requests at concurrency 1 (concurrency 16 runs 16)
    repeats: int = 1
    speculative_config: dict[str, Any] = field(default_factory=lambda: dict(NGRAM_CONFIG))

    def __post_init__(self) -> None:
        for name in ("output_len", "passage_len", "random_input_len", "num_prompts_c1", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")

    @property
    def max_model_len(self) -> int:
        # The grounded prompt holds the passage, the instruction and the template's tokens.
        return max(self.passage_len + 128, self.random_input_len + 16) + self.output_len


def grounded_chats(tokenizer: Any, num_prompts: int, passage_len: int) -> list[list[dict[str, str]]]:
    """One chat per prompt: a ``passage_len``-token passage from the start of a ``pydoc_data.topics`` topic (the
    i-th of those that long, in name order) and a request to repeat it with its first long word in capitals."""
    from pydoc_data.topics import topics

    passages = []
    for name in sorted(topics):
        ids = tokenizer.encode(topics[name], add_special_tokens=False)
        if len(ids) >= passage_len:
            passages.append(tokenizer.decode(ids[:passage_len]))
        if len(passages) == num_prompts:
            break
    if len(passages) < num_prompts:
        raise ValueError(f"only {len(passages)} pydoc topics have {passage_len} tokens, {num_prompts} wanted")
    chats = []
    for passage in passages:
        word = next(w for w in passage.split() if w.isalpha() and len(w) >= 6)
        instruction = f'Repeat the text above exactly, word for word, but write "{word.upper()}" instead of "{word}".'
        chats.append([{"role": "user", "content": f"{passage}\n\n{instruction}"}])
    return chats


def scenario_prompts(llm: Any, kind: str, num_prompts: int, cfg: BenchConfig) -> list[list[int]]:
    """Token-id prompts of a scenario: ``grounded`` chats rendered by the chat template, or ``random`` text."""
    if kind == "grounded":
        return [llm.processor.render_chat(chat, True)
                for chat in grounded_chats(llm.get_tokenizer(), num_prompts, cfg.passage_len)]
    requests = sample_requests(llm.get_tokenizer(), num_prompts, (cfg.random_input_len, cfg.random_input_len),
                               (cfg.output_len, cfg.output_len), seed=11)
    return [llm.get_tokenizer().encode(r.prompt, add_special_tokens=False) for r in requests]


class TimedProposer:
    """Wraps a ``DraftProposer``, adding up the seconds its ``propose`` calls take."""

    def __init__(self, proposer: Any) -> None:
        self.proposer = proposer
        self.num_speculative_tokens = proposer.num_speculative_tokens
        self.seconds = 0.0

    def propose(self, token_ids: Sequence[int]) -> Sequence[int]:
        start_s = time.perf_counter()
        try:
            return self.proposer.propose(token_ids)
        finally:
            self.seconds += time.perf_counter() - start_s


@dataclass
class _InFlight:
    sent_s: float
    prompt_len: int
    arrivals_s: list[float] = field(default_factory=list)
    num_tokens: int = 0


def run_closed_loop(llm: Any, prompts: Sequence[Sequence[int]], params: Sequence[Any], concurrency: int,
                    tag: str) -> tuple[list[RequestResult], float]:
    """Run every prompt (with its ``SamplingParams``) through ``llm.engine_core``, at most ``concurrency`` at a
    time, each new one added as soon as one finishes. Returns the per-request results and the run's duration
    in seconds."""
    core = llm.engine_core
    pending = deque(enumerate(prompts))
    in_flight: dict[str, _InFlight] = {}
    results = []
    start_s = time.perf_counter()
    while pending or in_flight:
        while pending and len(in_flight) < concurrency:
            index, prompt = pending.popleft()
            request_id = f"{tag}-{index}"
            request = llm.processor.process(list(prompt), params[index])
            for core_request in request.engine_core_requests([(request_id, request.sampling_params)], time.time()):
                core.add_request(core_request)
            in_flight[request_id] = _InFlight(time.perf_counter(), len(prompt))
        outputs = core.step()
        now_s = time.perf_counter()
        for output in outputs:
            state = in_flight[output.request_id]
            if output.new_token_ids:
                state.arrivals_s.append(now_s)
                state.num_tokens += len(output.new_token_ids)
            if output.finished:
                del in_flight[output.request_id]
                results.append(result_from_timestamps(state.sent_s, state.arrivals_s, now_s, state.prompt_len,
                                                      state.num_tokens))
    duration_s = time.perf_counter() - start_s
    while core.has_unfinished_requests():  # the worker drops the finished requests' state
        core.step()
    return results, duration_s


def measure(llm: Any, prompts: Sequence[Sequence[int]], params: Sequence[Any], concurrency: int,
            tag: str) -> dict[str, Any]:
    """One run: output tok/s, TPOT p50, and the speculative decoding counters and costs over the run."""
    stats_before = llm.engine_core.make_stats()
    drafter = llm.engine_core.scheduler.drafter
    propose_s_before = drafter.seconds if drafter is not None else 0.0
    results, duration_s = run_closed_loop(llm, prompts, params, concurrency, tag)
    metrics = compute_metrics(results, duration_s)
    record = {"output_tok_s": metrics["output_throughput"], "tpot_p50_ms": metrics["p50_tpot_ms"],
              "duration_s": duration_s, "output_tokens": metrics["total_output_tokens"]}
    stats = llm.engine_core.make_stats()
    if drafter is not None:
        spec = stats.spec_decoding.minus(stats_before.spec_decoding)
        accepted = spec.num_accepted_tokens
        record |= {"drafts": spec.num_drafts, "draft_tokens": spec.num_draft_tokens, "accepted_tokens": accepted,
                   "acceptance_rate": accepted / spec.num_draft_tokens if spec.num_draft_tokens else 0.0,
                   "mean_acceptance_length": 1 + accepted / spec.num_drafts if spec.num_drafts else 1.0,
                   "propose_time_share": (drafter.seconds - propose_s_before) / duration_s,
                   "draft_tokens_per_output_token": spec.num_draft_tokens / metrics["total_output_tokens"]}
    return record


def _median_record(records: list[dict[str, Any]]) -> dict[str, Any]:
    return {key: statistics.median(r[key] for r in records) for key in records[0]}


def run_benchmark(cfg: BenchConfig) -> dict[str, Any]:
    """Load both engines, run every scenario on each (alternating, ``repeats`` times), return the report."""
    from pagedserve.engine import LLM, SamplingParams

    engine_args = dict(max_model_len=cfg.max_model_len, kv_cache_memory_bytes="512MiB", max_num_seqs=16,
                       enable_prefix_caching=False)
    llms = {"off": LLM(**engine_args), "ngram": LLM(**engine_args, speculative_config=cfg.speculative_config)}
    scheduler = llms["ngram"].engine_core.scheduler
    scheduler.drafter = TimedProposer(scheduler.drafter)
    warmup = [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * 2
    for name, llm in llms.items():
        run_closed_loop(llm, scenario_prompts(llm, "random", 2, cfg), warmup, 2, f"warmup-{name}")
    rows = []
    for kind in ("grounded", "random"):
        for concurrency in CONCURRENCIES:
            num_prompts = cfg.num_prompts_c1 if concurrency == 1 else concurrency
            prompts = scenario_prompts(llms["off"], kind, num_prompts, cfg)
            params = [SamplingParams(temperature=0.0 if kind == "grounded" else RANDOM_TEMPERATURE, seed=index,
                                     max_tokens=cfg.output_len, ignore_eos=True) for index in range(num_prompts)]
            runs: dict[str, list[dict[str, Any]]] = {name: [] for name in llms}
            for repeat in range(cfg.repeats):
                for name, llm in llms.items():
                    runs[name].append(measure(llm, prompts, params, concurrency, f"{kind}-{concurrency}-{repeat}"))
                    print(f"{kind} c={concurrency} {name} #{repeat}: {runs[name][-1]}", flush=True)
            pairs = list(zip(runs["off"], runs["ngram"], strict=True))
            rows.append({"scenario": kind, "concurrency": concurrency, "num_prompts": num_prompts,
                         "off": _median_record(runs["off"]), "ngram": _median_record(runs["ngram"]), "runs": runs,
                         "tok_s_ratio": statistics.median(n["output_tok_s"] / o["output_tok_s"] for o, n in pairs),
                         "tpot_p50_ratio": statistics.median(n["tpot_p50_ms"] / o["tpot_p50_ms"] for o, n in pairs)})
    return {"config": {"output_len": cfg.output_len, "passage_len": cfg.passage_len,
                       "random_input_len": cfg.random_input_len, "num_prompts_c1": cfg.num_prompts_c1,
                       "repeats": cfg.repeats, "speculative_config": cfg.speculative_config, "engine_args": engine_args,
                       "random_temperature": RANDOM_TEMPERATURE,
                       "date": datetime.datetime.now().isoformat(timespec="seconds")},
            "rows": rows}


def markdown_report(report: dict[str, Any]) -> str:
    """The report's table: one row per scenario, without and with speculation side by side."""
    lines = [f"`--speculative-config '{json.dumps(report['config']['speculative_config'])}'`, "
             f"{report['config']['output_len']} output tokens per request (grounded: greedy; random: temperature "
             f"{report['config']['random_temperature']}), medians of {report['config']['repeats']} run(s) each; "
             "ratio = median of the paired runs' ratios (ngram / off).", "",
             "| scenario | concurrency | prompts | out tok/s off | out tok/s ngram | ratio | TPOT p50 ms off | "
             "TPOT p50 ms ngram | ratio | acceptance rate | mean acceptance length | lookup time | "
             "drafts per token |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["rows"]:
        off, ngram = row["off"], row["ngram"]
        lines.append(
            f"| {row['scenario']} | {row['concurrency']} | {row['num_prompts']} | {off['output_tok_s']:.1f} | "
            f"{ngram['output_tok_s']:.1f} | {row['tok_s_ratio']:.2f}x | {off['tpot_p50_ms']:.1f} | "
            f"{ngram['tpot_p50_ms']:.1f} | {row['tpot_p50_ratio']:.2f}x | {100 * ngram['acceptance_rate']:.0f}% | "
            f"{ngram['mean_acceptance_length']:.2f} | {100 * ngram['propose_time_share']:.2f}% | "
            f"{ngram['draft_tokens_per_output_token']:.3f} |")
    slowdowns = [1 - row["tok_s_ratio"] for row in report["rows"] if row["scenario"] == "random"]
    lines += ["", f"Random prompts: largest slowdown {100 * max(slowdowns):.1f}% "
                  f"(goal < {100 * MAX_SLOWDOWN:.0f}%; negative = faster). Lookup time: the share of the run spent "
                  "in the drafter; drafts per token: draft tokens verified per output token."]
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, argparse.Namespace]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-len", type=int, default=BenchConfig.output_len)
    parser.add_argument("--passage-len", type=int, default=BenchConfig.passage_len)
    parser.add_argument("--random-input-len", type=int, default=BenchConfig.random_input_len)
    parser.add_argument("--num-prompts-c1", type=int, default=BenchConfig.num_prompts_c1)
    parser.add_argument("--repeats", type=int, default=BenchConfig.repeats)
    parser.add_argument("--speculative-config", type=json.loads, default=NGRAM_CONFIG,
                        help="the engine's --speculative-config, as JSON")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test, meaningless numbers)")
    parser.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    args = parser.parse_args(argv)
    cfg = BenchConfig(args.output_len, args.passage_len, args.random_input_len, args.num_prompts_c1, args.repeats,
                      args.speculative_config)
    if args.quick:
        cfg = BenchConfig(output_len=8, passage_len=48, random_input_len=32, num_prompts_c1=1, repeats=1,
                          speculative_config=args.speculative_config)
    return cfg, args


def main(argv: list[str] | None = None) -> int:
    cfg, args = parse_args(argv)
    report = run_benchmark(cfg)
    markdown = markdown_report(report)
    print(markdown)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"speculative-{datetime.datetime.now().strftime('%Y%m%d-%H%M%S')}"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=2))
    stem.with_suffix(".md").write_text(markdown)
    print(f"wrote {stem}.json and .md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
