"""The structured-output benchmark, briefly, against the test server: both runs complete, the JSON has its shape."""

from __future__ import annotations

import json
from pathlib import Path

import llguidance
from jsonschema import Draft202012Validator

from benchmarks import structured_output
from pagedserve.engine.sampling_params import StructuredOutputsParams
from pagedserve.engine.structured_output.compiler import grammar_text


def test_every_schema_is_valid_and_accepted_by_llguidance() -> None:
    for name, schema in structured_output.SCHEMAS.items():
        Draft202012Validator.check_schema(schema)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar_text(StructuredOutputsParams(json=schema)))
        assert not is_error and not messages, (name, messages)
    assert "$defs" in structured_output.SCHEMAS["pydantic_company"]  # nested models become $refs


def test_a_tiny_run_completes_every_request_and_writes_the_report(served, tmp_path: Path, capsys) -> None:
    out = tmp_path / "so.json"
    code = structured_output.main([
        "--base-url", served.url, "--num-prompts", "4", "--max-concurrency", "2", "--input-len", "8:16",
        "--output-len", "6", "--rounds", "1", "--num-schemas", "3", "--compile-repeats", "1",
        "--no-progress", "--result-json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    serving, compile_ = report["serving"], report["compile"]
    for mode in ("free", "constrained"):
        assert (serving[mode]["completed"], serving[mode]["failed"]) == (4, 0)
        assert serving[mode]["total_output_tokens"] == 4 * 6
        assert serving[mode]["p50_tpot_ms"] > 0 and serving[mode]["output_throughput"] > 0
    assert [run["mode"] for run in serving["runs"]] == ["free", "constrained"]
    assert serving["equal_output_tokens"] and serving["constraint_applied"]
    assert serving["tpot_p50_ratio"] > 0
    assert [s["name"] for s in compile_["schemas"]] == list(structured_output.SCHEMAS)[:3]
    assert compile_["num_compiles"] == 3 and compile_["tokenizer_build_ms"] > 0
    assert 0 < compile_["p50_ms"] <= compile_["p99_ms"] <= compile_["max_ms"]
    assert set(report["goals"]) == {"tpot_overhead", "compile_p50"}
    assert all(isinstance(goal["met"], bool) for goal in report["goals"].values())
    printed = capsys.readouterr().out
    assert "| constrained / free |" in printed and "| **all (3 compiles)** |" in printed
