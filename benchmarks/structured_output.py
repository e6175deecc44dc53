"""Added latency of structured output: TPOT free vs JSON-schema constrained, and grammar compile time.

Serving: the same chat requests (same random prompts, same ``max_tokens``, greedy, ``ignore_eos``)
are sent to one pagedserve server at a fixed concurrency, once free and once with a
``response_format`` json_schema (``ORDER_SCHEMA``: nested objects, an array of 4 to 12 ``$ref``
items, enums, patterns, ``anyOf`` with null, bounded numbers). Runs alternate free / constrained,
then constrained / free (ABBA), so a drift of the shared machine's load hits both alike; the ratio
is computed within this one invocation, from every request of every round of each mode pooled.

Fairness: the server it starts has prefix caching off, since every run sends the same prompts (a
server given with ``--base-url`` should have it off too). With ``ignore_eos`` a constrained request
still stops when its grammar completes. The schema is chosen so that it cannot complete within the
default 128 tokens: its shortest instance (4 line items, every key forced, empty strings, nulls) is
270 tokens with SmolLM2's tokenizer. So both modes generate exactly ``max_tokens`` per request, in
batches of the same size, and the headline figure, TPOT p50 (per output token, after the first),
compares like with like; the report says whether every request got ``max_tokens``
(``equal_output_tokens``). Output tok/s is reported too. The grammar is compiled by a warm-up
request first, so the measured runs time the per-step mask work, not the one-off compile (measured
apart, below).

Compile: in-process, through the engine's ``GrammarCompiler`` (the server's code path): the
time from ``compile(params)`` to the future's result, per schema of ``SCHEMAS``, each compile cold:
every repeat carries its own ``$comment``, so its grammar text (the cache key) is new. The
llguidance tokenizer, built once on first use, is timed separately. "First mask" is the first
bitmask computed from the fresh matcher (llguidance builds its lexer lazily; this is the rest of
the cold cost a request pays before its first token).

Goals (issue 14): TPOT overhead <= 10 %, compile p50 < 50 ms.

    python -m benchmarks.structured_output --result-json benchmarks/results/structured-output.json
    python -m benchmarks.structured_output --base-url http://127.0.0.1:8000  # a server already running
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import shlex
import sys
import tempfile
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

import httpx
import numpy as np
from pydantic import BaseModel, Field

from benchmarks.roofline import cpu_model, num_threads
from benchmarks.run_all import HOST, WARMUP_SEED, ServerProcess, free_port
from pagedserve.server.bench.dataset import SyntheticRequest, Tokenizer, parse_len_range, sample_requests
from pagedserve.server.bench.serve import ServeOptions, api_root, benchmark, fetch_first_model
from pagedserve.server.bench.summary import RequestResult, compute_metrics

TPOT_OVERHEAD_GOAL = 0.10
COMPILE_P50_GOAL_MS = 50.0

_ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string", "maxLength": 80},
        "city": {"type": "string", "maxLength": 40},
        "postal_code": {"type": "string", "pattern": "^[0-9]{5}(-[0-9]{4})?$"},
        "country": {"type": "string", "enum": ["US", "CA", "GB", "DE", "FR", "JP"]},
    },
    "required": ["street", "city", "postal_code", "country"],
    "additionalProperties": False,
}

#: The schema of the constrained serving run: an order extracted from text.
ORDER_SCHEMA: dict[str, Any] = {
    "$defs": {
        "address": _ADDRESS,
        "line_item": {
            "type": "object",
            "properties": {
                "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                "description": {"type": "string", "maxLength": 120},
                "quantity": {"type": "integer", "minimum": 1, "maximum": 1000},
                "unit_price": {"type": "number", "minimum": 0, "maximum": 100000},
                "discount": {"anyOf": [{"type": "number", "minimum": 0, "maximum": 1}, {"type": "null"}]},
                "category": {"type": "string", "enum": ["hardware", "software", "service", "other"]},
            },
            "required": ["sku", "description", "quantity", "unit_price", "discount", "category"],
            "additionalProperties": False,
        },
    },
    "type": "object",
    "properties": {
        "order_id": {"type": "string", "pattern": "^ORD-[0-9]{6}$"},
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "minLength": 1, "maxLength": 80},
                "email": {"anyOf": [{"type": "string", "pattern": "^[a-z0-9._]+@[a-z0-9-]+\\.[a-z]{2,6}$"},
                                    {"type": "null"}]},
                "shipping_address": {"$ref": "#/$defs/address"},
                "billing_address": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
            },
            "required": ["name", "email", "shipping_address", "billing_address"],
            "additionalProperties": False,
        },
        "items": {"type": "array", "items": {"$ref": "#/$defs/line_item"}, "minItems": 4, "maxItems": 12},
        "status": {"type": "string", "enum": ["pending", "paid", "shipped", "delivered", "cancelled"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 5},
        "total": {"type": "number", "minimum": 0},
        "notes": {"anyOf": [{"type": "string", "maxLength": 500}, {"type": "null"}]},
    },
    "required": ["order_id", "customer", "items", "status", "priority", "total", "notes"],
    "additionalProperties": False,
}

#: An OpenAI function's ``parameters``, strict-mode style (every key required, nullable as a type list).
FUNCTION_PARAMETERS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "origin": {"type": "string", "description": "IATA airport code", "pattern": "^[A-Z]{3}$"},
        "destination": {"type": "string", "description": "IATA airport code", "pattern": "^[A-Z]{3}$"},
        "departure_date": {"type": "string", "format": "date"},
        "return_date": {"type": ["string", "null"], "format": "date"},
        "passengers": {
            "type": "object",
            "properties": {"adults": {"type": "integer", "minimum": 1, "maximum": 9},
                           "children": {"type": "integer", "minimum": 0, "maximum": 8},
                           "infants": {"type": "integer", "minimum": 0, "maximum": 4}},
            "required": ["adults", "children", "infants"],
            "additionalProperties": False,
        },
        "cabin": {"type": "string", "enum": ["economy", "premium_economy", "business", "first"]},
        "max_stops": {"type": ["integer", "null"], "minimum": 0, "maximum": 3},
        "airlines": {"type": "array", "items": {"type": "string", "pattern": "^[A-Z0-9]{2}$"}, "maxItems": 5},
    },
    "required": ["origin", "destination", "departure_date", "return_date", "passengers", "cabin",
                 "max_stops", "airlines"],
    "additionalProperties": False,
}


class Address(BaseModel):
    street: str
    city: str
    postal_code: str = Field(pattern=r"^[0-9]{5}(-[0-9]{4})?$")
    country: Literal["US", "CA", "GB", "DE", "FR", "JP"]


class Contact(BaseModel):
    name: str = Field(min_length=1, max_length=80)
    role: Literal["ceo", "cto", "sales", "support", "other"]
    email: str | None = None
    phone: str | None = Field(default=None, pattern=r"^\+?[0-9 ()-]{7,20}$")


class Office(BaseModel):
    address: Address
    employees: int = Field(ge=1, le=1_000_000)
    opened: int = Field(ge=1800, le=2030)


class Company(BaseModel):
    """What ``chat.completions.parse(response_format=Company)`` would send: nested models as $defs."""

    name: str
    industry: Literal["software", "hardware", "retail", "finance", "health", "energy", "other"]
    founded: int = Field(ge=1800, le=2030)
    headquarters: Address
    offices: list[Office] = Field(max_length=10)
    contacts: list[Contact] = Field(min_length=1, max_length=5)
    revenue_musd: float | None = Field(default=None, ge=0)
    public: bool
    tags: list[str] = Field(default_factory=list, max_length=8)


CALENDAR_EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "format": "uuid"},
        "title": {"type": "string", "minLength": 1, "maxLength": 120},
        "start": {"type": "string", "format": "date-time"},
        "end": {"type": "string", "format": "date-time"},
        "location": {"anyOf": [{"type": "string"}, {"type": "null"}]},
        "organizer": {"type": "string", "format": "email"},
        "attendees": {"type": "array", "minItems": 1, "maxItems": 20, "items": {
            "type": "object",
            "properties": {"email": {"type": "string", "format": "email"},
                           "response": {"enum": ["accepted", "declined", "tentative", "none"]},
                           "optional": {"type": "boolean"}},
            "required": ["email", "response"],
            "additionalProperties": False}},
        "recurrence": {"anyOf": [{"type": "null"}, {
            "type": "object",
            "properties": {"freq": {"enum": ["daily", "weekly", "monthly", "yearly"]},
                           "interval": {"type": "integer", "minimum": 1, "maximum": 52},
                           "until": {"type": ["string", "null"], "format": "date"}},
            "required": ["freq", "interval", "until"],
            "additionalProperties": False}]},
        "url": {"type": "string", "format": "uri"},
    },
    "required": ["id", "title", "start", "end", "location", "organizer", "attendees", "recurrence"],
    "additionalProperties": False,
}

#: A recursive schema: a comment thread, replies referring back to the comment definition.
COMMENT_TREE_SCHEMA: dict[str, Any] = {
    "$defs": {"comment": {
        "type": "object",
        "properties": {
            "author": {"type": "string", "pattern": "^@[a-z0-9_]{3,15}$"},
            "text": {"type": "string", "maxLength": 280},
            "score": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "sentiment": {"enum": ["positive", "neutral", "negative"]},
            "replies": {"type": "array", "items": {"$ref": "#/$defs/comment"}, "maxItems": 5},
        },
        "required": ["author", "text", "score", "sentiment", "replies"],
        "additionalProperties": False,
    }},
    "type": "object",
    "properties": {"thread_id": {"type": "integer", "minimum": 1},
                   "comments": {"type": "array", "items": {"$ref": "#/$defs/comment"}, "minItems": 1}},
    "required": ["thread_id", "comments"],
    "additionalProperties": False,
}

#: The schemas whose compile time is measured; the first is the serving run's.
SCHEMAS: dict[str, dict[str, Any]] = {
    "order": ORDER_SCHEMA,
    "function_parameters": FUNCTION_PARAMETERS_SCHEMA,
    "pydantic_company": Company.model_json_schema(),
    "calendar_event": CALENDAR_EVENT_SCHEMA,
    "comment_tree": COMMENT_TREE_SCHEMA,
}


def response_format(name: str, schema: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's ``response_format`` for ``schema``, as the SDK sends it."""
    return {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}


# ---------------------------------------------------------------------------------------------------
# Grammar compile time


def measure_compile(tokenizer: Any, vocab_size: int, schemas: dict[str, dict[str, Any]],
                    repeats: int) -> dict[str, Any]:
    """Time cold compiles of ``schemas`` (``repeats`` each) through a fresh ``GrammarCompiler``.

    Returns:
        ``tokenizer_build_ms``, ``p50_ms``/``p99_ms``/``max_ms`` over every compile,
        ``first_mask_p50_ms``/``first_mask_p99_ms``, and per schema its ``schema_bytes``,
        ``cold_ms`` (its first compile), ``p50_ms``, ``max_ms`` and ``first_mask_p50_ms``.
    Raises:
        pagedserve.engine.errors.InvalidRequestError: a schema llguidance refuses.
    """
    from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

    from pagedserve.engine.sampling_params import StructuredOutputsParams
    from pagedserve.engine.structured_output import GrammarCompiler

    compiler = GrammarCompiler(tokenizer, vocab_size)
    try:
        start = time.perf_counter()
        _ = compiler.ll_tokenizer
        tokenizer_build_s = time.perf_counter() - start
        bitmask = allocate_token_bitmask(1, vocab_size)
        all_compile_s: list[float] = []
        all_mask_s: list[float] = []
        per_schema = []
        for name, schema in schemas.items():
            compile_s, mask_s = [], []
            for repeat in range(repeats):
                # A new grammar text each time: the compiler's cache cannot answer.
                params = StructuredOutputsParams(json={"$comment": f"{name} #{repeat}", **schema})
                start = time.perf_counter()
                matcher = compiler.compile(params).result()
                compile_s.append(time.perf_counter() - start)
                matcher = matcher.deep_copy()  # as the engine does; the template stays untouched
                start = time.perf_counter()
                fill_next_token_bitmask(matcher, bitmask, 0)
                mask_s.append(time.perf_counter() - start)
            per_schema.append({"name": name, "schema_bytes": len(json.dumps(schema)),
                               "cold_ms": 1000 * compile_s[0], "p50_ms": _percentile_ms(compile_s, 50),
                               "max_ms": 1000 * max(compile_s), "first_mask_p50_ms": _percentile_ms(mask_s, 50)})
            all_compile_s += compile_s
            all_mask_s += mask_s
    finally:
        compiler.shutdown()
    return {"repeats": repeats, "num_compiles": len(all_compile_s),
            "tokenizer_build_ms": 1000 * tokenizer_build_s,
            "p50_ms": _percentile_ms(all_compile_s, 50), "p99_ms": _percentile_ms(all_compile_s, 99),
            "max_ms": 1000 * max(all_compile_s),
            "first_mask_p50_ms": _percentile_ms(all_mask_s, 50), "first_mask_p99_ms": _percentile_ms(all_mask_s, 99),
            "schemas": per_schema}


def _percentile_ms(values_s: list[float], percentile: float) -> float:
    return float(np.percentile(np.asarray(values_s) * 1000.0, percentile))


# ---------------------------------------------------------------------------------------------------
# Serving: TPOT free vs constrained

#: The metrics of ``compute_metrics`` kept per run in the report.
_KEPT_METRICS = ("completed", "failed", "duration_s", "total_output_tokens", "mean_output_tokens",
                 "output_throughput", "p50_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "p50_tpot_ms", "p99_tpot_ms",
                 "p50_itl_ms", "p50_e2el_ms")


def _kept(metrics: dict[str, Any]) -> dict[str, Any]:
    return {key: metrics[key] for key in _KEPT_METRICS}


def check_constraint_applied(base_url: str, model: str, schema_name: str, schema: dict[str, Any]) -> str:
    """One short non-streamed constrained request; returns its text (a server ignoring
    ``response_format`` would answer free text, and the comparison would be void)."""
    body = {"model": model, "max_tokens": 12, "temperature": 0.0,
            "messages": [{"role": "user", "content": "Give the order as JSON."}],
            "response_format": response_format(schema_name, schema)}
    response = httpx.post(api_root(base_url) + "/v1/chat/completions", json=body, timeout=300.0)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"] or ""


def measure_serving(base_url: str, model: str, requests: list[SyntheticRequest], concurrency: int,
                    schema_name: str, schema: dict[str, Any], rounds: int, tokenizer: Tokenizer | None,
                    show_progress: bool = False) -> dict[str, Any]:
    """Send ``requests`` free and constrained by ``schema``, ``rounds`` times each, in ABBA order.

    Returns:
        ``free`` and ``constrained``: metrics over every request of that mode (durations summed);
        ``runs``: each run's metrics in the order they ran; ``tpot_p50_ratio`` (constrained / free),
        ``output_throughput_ratio``, ``equal_output_tokens`` (every request of both modes got
        ``max_tokens``), ``constrained_short_requests`` and ``constraint_applied``.
    """
    free = ServeOptions(base_url=base_url, model=model, endpoint="chat", max_concurrency=concurrency,
                        ignore_eos=True, show_progress=False)
    modes = {"free": free,
             "constrained": replace(free, extra_body={"response_format": response_format(schema_name, schema)})}
    text = check_constraint_applied(base_url, model, schema_name, schema)
    # Warm-up: one short request per mode (the constrained one compiles the grammar and builds
    # the server's llguidance tokenizer), with its own seed so it primes no prefix cache.
    warmup = sample_requests(tokenizer, 1, (32, 32), (4, 4), seed=WARMUP_SEED) if tokenizer else [
        SyntheticRequest("Hello there.", 3, 4)]
    for options in modes.values():
        asyncio.run(benchmark(warmup, options, tokenizer))

    runs: list[dict[str, Any]] = []
    pooled: dict[str, tuple[list[RequestResult], float]] = {mode: ([], 0.0) for mode in modes}
    for index in range(rounds):
        order = ("free", "constrained") if index % 2 == 0 else ("constrained", "free")
        for mode in order:
            options = replace(modes[mode], show_progress=show_progress)
            metrics, results = asyncio.run(benchmark(requests, options, tokenizer))
            runs.append({"mode": mode, "round": index + 1, **_kept(metrics),
                         "errors": sorted({r.error for r in results if r.error})[:3]})
            done, duration = pooled[mode]
            pooled[mode] = (done + results, duration + metrics["duration_s"])
    report = {mode: _kept(compute_metrics(results, duration)) for mode, (results, duration) in pooled.items()}
    expected = [r.output_len for r in requests] * rounds
    out_lens = {mode: [r.output_tokens for r in results] for mode, (results, _) in pooled.items()}
    return {
        **report,
        "runs": runs,
        "tpot_p50_ratio": _ratio(report["constrained"]["p50_tpot_ms"], report["free"]["p50_tpot_ms"]),
        "output_throughput_ratio": _ratio(report["constrained"]["output_throughput"],
                                          report["free"]["output_throughput"]),
        "equal_output_tokens": out_lens["free"] == expected and out_lens["constrained"] == expected,
        "constrained_short_requests": sum(n < e for n, e in zip(out_lens["constrained"], expected, strict=True)),
        # The first property is forced: the output opens with it.
        "constraint_applied": text.startswith('{"' + next(iter(schema["properties"])) + '":'),
        "constrained_sample": text,
    }


def _ratio(numerator: float, denominator: float) -> float:
    return numerator / denominator if denominator else float("nan")


# ---------------------------------------------------------------------------------------------------
# Report


def markdown_report(report: dict[str, Any]) -> str:
    """The two tables (serving, compile) and the goals, as Markdown."""
    cfg, serving, comp = report["config"], report["serving"], report["compile"]
    lines = [f"# Structured output benchmark, {report['date']}", "",
             f"Machine: {report['machine']['cpu']}, {report['machine']['cores']} cores, "
             f"Python {report['machine']['python']}.", ""]
    if serving is not None:
        order = " ".join("F" if run["mode"] == "free" else "C" for run in serving["runs"])
        low, high = cfg["input_len"]
        lines += [
            f"## Added latency: {cfg['num_prompts']} chat requests, concurrency {cfg['max_concurrency']}, "
            f"input {low}–{high} tokens, output {cfg['output_len']} tokens, greedy, ignore_eos; "
            f"{cfg['rounds']} round(s), run order {order}; constrained = response_format json_schema "
            f"`{cfg['schema']}`", "",
            "| mode | ok/failed | output tokens | out tok/s | TTFT p50 ms | TPOT p50 ms | TPOT mean ms "
            "| TPOT p99 ms | ITL p50 ms |",
            "|" + "---|" * 9,
        ]
        for mode in ("free", "constrained"):
            m = serving[mode]
            lines.append(f"| {mode} | {m['completed']}/{m['failed']} | {m['total_output_tokens']} "
                         f"| {m['output_throughput']:.1f} | {m['p50_ttft_ms']:.0f} | {m['p50_tpot_ms']:.2f} "
                         f"| {m['mean_tpot_ms']:.2f} | {m['p99_tpot_ms']:.2f} | {m['p50_itl_ms']:.2f} |")
        f, c = serving["free"], serving["constrained"]
        ratios = [f"{_ratio(c[key], f[key]):.3f}" for key in ("p50_ttft_ms", "p50_tpot_ms", "mean_tpot_ms",
                                                                "p99_tpot_ms", "p50_itl_ms")]
        ratios[1] = f"**{ratios[1]}**"
        runs = "; ".join(f"{run['mode']} {run['p50_tpot_ms']:.2f} ms / {run['output_throughput']:.1f} tok/s"
                         for run in serving["runs"])
        full = "yes" if serving["equal_output_tokens"] else "no"
        lines += [f"| constrained / free | | | {serving['output_throughput_ratio']:.3f} | {' | '.join(ratios)} |", "",
                  f"TPOT p50 and out tok/s per run, in order: {runs}.",
                  f"Every request generated max_tokens in both modes: {full} "
                  f"({serving['constrained_short_requests']} constrained request(s) short); constraint applied: "
                  f"{'yes' if serving['constraint_applied'] else 'NO'}.", ""]
    lines += [
        f"## Grammar compile (llguidance via GrammarCompiler, in-process, cold, {comp['repeats']} per schema)", "",
        f"llguidance tokenizer build (first use, once per server): {comp['tokenizer_build_ms']:.0f} ms.", "",
        "| schema | bytes | cold ms | p50 ms | max ms | first mask p50 ms |",
        "|" + "---|" * 6,
        *[f"| {s['name']} | {s['schema_bytes']} | {s['cold_ms']:.2f} | {s['p50_ms']:.2f} | {s['max_ms']:.2f} "
          f"| {s['first_mask_p50_ms']:.2f} |" for s in comp["schemas"]],
        f"| **all ({comp['num_compiles']} compiles)** | | | **p50 {comp['p50_ms']:.2f} / p99 {comp['p99_ms']:.2f}** "
        f"| {comp['max_ms']:.2f} | {comp['first_mask_p50_ms']:.2f} (p99 {comp['first_mask_p99_ms']:.2f}) |", "",
        "Goals: " + "; ".join(f"{name.replace('_', ' ')} {g['goal']}: {g['value']}, {'met' if g['met'] else 'MISSED'}"
                              for name, g in report["goals"].items()) + ".",
    ]
    return "\n".join(lines) + "\n"


def goals(serving: dict[str, Any] | None, comp: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Issue 14's goals: name -> ``{"goal", "value", "met"}`` (the TPOT one only with a serving run)."""
    met: dict[str, dict[str, Any]] = {}
    if serving is not None:
        overhead = serving["tpot_p50_ratio"] - 1
        met["tpot_overhead"] = {"goal": f"<= {100 * TPOT_OVERHEAD_GOAL:.0f}%", "value": f"{100 * overhead:+.1f}%",
                                "met": bool(overhead <= TPOT_OVERHEAD_GOAL)}
    met["compile_p50"] = {"goal": f"< {COMPILE_P50_GOAL_MS:.0f} ms", "value": f"{comp['p50_ms']:.2f} ms",
                          "met": bool(comp["p50_ms"] < COMPILE_P50_GOAL_MS)}
    return met


# ---------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     epilog="Extra `pagedserve serve` arguments go after --, e.g. "
                                            "-- --dtype bfloat16 (only when this starts the server).")
    parser.add_argument("--base-url", default=None,
                        help="a running server to measure; default: start `python -m pagedserve serve` here")
    parser.add_argument("--model", default="",
                        help="the model served (and whose tokenizer is used); default: the embedded SmolLM2")
    parser.add_argument("--num-prompts", type=int, default=64, help="requests per run")
    parser.add_argument("--max-concurrency", type=int, default=16, help="requests in flight at most")
    parser.add_argument("--input-len", type=parse_len_range, default=(64, 256),
                        help="prompt tokens, N or MIN:MAX (uniform)")
    parser.add_argument("--output-len", type=int, default=128,
                        help="max_tokens of every request (ignore_eos); keep it under the schema's "
                             "shortest instance (270 tokens), so that no grammar completes (and stops its request) "
                             "before max_tokens")
    parser.add_argument("--rounds", type=int, default=2,
                        help="free+constrained pairs, alternating order (F C, C F, ...)")
    parser.add_argument("--num-schemas", type=int, default=len(SCHEMAS),
                        help=f"compile the first N of: {', '.join(SCHEMAS)}")
    parser.add_argument("--compile-repeats", type=int, default=5, help="cold compiles per schema")
    parser.add_argument("--no-serving", action="store_true", help="measure grammar compile time only")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument("--startup-timeout", type=float, default=300.0, help="seconds to wait for the server")
    parser.add_argument("--result-json", type=Path, default=None, help="write the report here")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    parser.add_argument("server_args", nargs="*", help="extra `pagedserve serve` arguments (after --)")
    args = parser.parse_args(argv)
    if not 1 <= args.num_schemas <= len(SCHEMAS):
        parser.error(f"--num-schemas must be in [1, {len(SCHEMAS)}]")
    if min(args.num_prompts, args.max_concurrency, args.rounds, args.compile_repeats, args.output_len) < 1:
        parser.error("counts and lengths must be positive")
    return args


def load_model_tokenizer(model: str) -> tuple[Any, int]:
    """The model's tokenizer and logits width, found as the engine finds them."""
    from pagedserve.engine.config import EngineArgs
    from pagedserve.engine.engine_factory import resolve_model_config
    from pagedserve.engine.model.loader import ModelSource, load_tokenizer

    config = resolve_model_config(EngineArgs(model=model))
    return load_tokenizer(ModelSource(config.path, None, config.served_model_name)), config.vocab_size


def main(argv: list[str] | None = None) -> int:
    """Measure compile time, then serving (starting a server unless ``--base-url``); print Markdown.

    Returns:
        0 when every request of both modes completed, else 1.
    """
    args = parse_args(argv)
    tokenizer, vocab_size = load_model_tokenizer(args.model)
    schemas = dict(list(SCHEMAS.items())[:args.num_schemas])
    # Compile first, while no server shares the CPU.
    print(f"compiling {len(schemas)} schemas x {args.compile_repeats}", file=sys.stderr, flush=True)
    comp = measure_compile(tokenizer, vocab_size, schemas, args.compile_repeats)

    serving = None
    if not args.no_serving:
        requests = sample_requests(tokenizer, args.num_prompts, args.input_len,
                                   (args.output_len, args.output_len), args.seed)
        server = None
        base_url = args.base_url
        if base_url is None:
            port = free_port()
            # Prefix caching off: each run sends the same prompts, so with it every run after the first
            # would skip its prefills (measured: the first free run then looked 10-20% slower).
            command = [sys.executable, "-m", "pagedserve", "serve", "--host", HOST, "--port", str(port),
                       "--no-enable-prefix-caching", *(["--model", args.model] if args.model else []),
                       *args.server_args]
            log_dir = Path(tempfile.mkdtemp(prefix="pagedserve-so-bench-"))
            print(f"starting {shlex.join(command)} (log in {log_dir})", file=sys.stderr, flush=True)
            server = ServerProcess("pagedserve", command, port, log_dir)
            base_url = server.base_url
        try:
            if server is not None and (why := server.wait_ready(args.startup_timeout)) is not None:
                print(f"error: the server did not start: {why}: {server.log_tail()}", file=sys.stderr)
                return 1
            model = asyncio.run(fetch_first_model(base_url))
            name = next(iter(SCHEMAS))
            serving = measure_serving(base_url, model, requests, args.max_concurrency, name, SCHEMAS[name],
                                      args.rounds, tokenizer, show_progress=not args.no_progress)
        finally:
            if server is not None:
                server.stop()

    report = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": {"cpu": cpu_model(), "cores": num_threads(), "python": platform.python_version()},
        "config": {"base_url": args.base_url, "model": args.model, "server_args": args.server_args,
                   "num_prompts": args.num_prompts, "max_concurrency": args.max_concurrency,
                   "input_len": list(args.input_len), "output_len": args.output_len, "rounds": args.rounds,
                   "seed": args.seed, "schema": next(iter(SCHEMAS)), "compile_repeats": args.compile_repeats},
        "serving": serving,
        "compile": comp,
        "goals": goals(serving, comp),
    }
    print(markdown_report(report))
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(report, indent=2))
    if serving is None:
        return 0
    return 0 if serving["free"]["failed"] == serving["constrained"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
