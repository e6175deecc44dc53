"""``benchmarks.throughput``: its pure helpers, and the whole run at ``--quick`` sizes on the embedded model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from benchmarks import throughput
from benchmarks.step_profile import ATTENTION_ROW, PHASE_REGIONS, REST_ROW, STEP_REGION
from benchmarks.throughput import (
    QUICK,
    BenchConfig,
    comparisons,
    decode_tok_per_s,
    left_pad,
    markdown_report,
    parse_args,
    profile_report,
    split_steps,
    spread_subset,
)
from pagedserve.engine.model import fused_decode


def test_spread_subset_picks_prompts_across_the_length_range() -> None:
    lengths = [500, 64, 300, 100, 200, 400, 80, 450]
    picked = spread_subset(lengths, 4)
    assert picked == sorted(picked)
    assert sorted(lengths[i] for i in picked) == [80, 200, 400, 500]
    assert spread_subset(lengths, len(lengths)) == list(range(len(lengths)))
    with pytest.raises(ValueError, match="count"):
        spread_subset(lengths, 0)


def test_left_pad_puts_padding_and_zero_mask_on_the_left() -> None:
    input_ids, attention_mask = left_pad([[5, 6, 7], [8]], pad_id=2)
    assert input_ids.tolist() == [[5, 6, 7], [2, 2, 8]]
    assert attention_mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    assert input_ids.dtype == attention_mask.dtype == torch.int64
    with pytest.raises(ValueError, match="non-empty"):
        left_pad([[1], []], pad_id=0)


def test_decode_rate_excludes_the_first_token() -> None:
    # First token at 1.0 s (after prefill), then 4 more 0.5 s apart: 4 tokens in 2 s.
    assert decode_tok_per_s([1.0, 1.5, 2.0, 2.5, 3.0]) == pytest.approx(2.0)
    with pytest.raises(ValueError, match="ascending"):
        decode_tok_per_s([1.0])


def test_steps_split_into_prefill_and_decode_only() -> None:
    # (seconds, scheduled, sampled): a full prefill chunk, a mixed step, two decode-only steps of 4, an empty step.
    split = split_steps([(1.0, 2048, 0), (0.5, 100, 5), (0.2, 4, 4), (0.3, 4, 4), (0.01, 0, 0)])
    assert split == {"prefill_steps": 2, "prefill_s": 1.5, "decode_steps": 2, "decode_s": 0.5,
                     "mean_decode_batch": 4}


def test_config_validates_sizes_by_name() -> None:
    with pytest.raises(ValueError, match="output_len"):
        BenchConfig(output_len=1)
    with pytest.raises(ValueError, match="hf_sequential_prompts"):
        BenchConfig(num_prompts=4, hf_sequential_prompts=5)
    assert BenchConfig().max_model_len >= 512 + BenchConfig().profile_max_tokens


def test_quick_sizes_yield_to_explicit_flags() -> None:
    cfg, args = parse_args(["--quick", "--output-len", "6", "--input-len", "8:9"])
    assert (cfg.num_prompts, cfg.output_len, cfg.input_len) == (QUICK.num_prompts, 6, (8, 9))
    assert parse_args([])[0] == BenchConfig()


def _phases(ours: float, batched: float, sequential: float, single: tuple[float, float]) -> dict:
    common = {"seconds": 1.0, "output_tokens": 8, "peak_rss_mib": 100.0, "torch_threads": 2}
    return {
        "engine": {**common, "output_tok_per_s": ours},
        "hf_batched": {**common, "output_tok_per_s": batched},
        "hf_sequential": {**common, "output_tok_per_s": sequential},
        "engine_single": {**common, "decode_tok_per_s": single[0]},
        "hf_single": {**common, "decode_tok_per_s": single[1]},
    }


def test_comparisons_check_each_goal() -> None:
    rows = {r["goal"]: r for r in comparisons(_phases(100.0, 50.0, 25.0, (9.0, 10.0)))}
    assert rows["batched"]["ratio"] == pytest.approx(2.0) and rows["batched"]["met"]
    assert rows["sequential"]["ratio"] == pytest.approx(4.0) and not rows["sequential"]["met"]  # goal 5x
    assert rows["single_decode"]["ratio"] == pytest.approx(0.9) and rows["single_decode"]["met"]  # goal 0.9x


def test_markdown_report_has_a_row_per_goal_and_phase() -> None:
    phases = _phases(100.0, 50.0, 25.0, (9.0, 10.0))
    report = {"config": {**vars(BenchConfig()), "input_len": [64, 512]}, "phases": phases,
              "machine": {"cpu": "cpu", "cpu_cores": 2, "torch": "t", "transformers": "x"},
              "comparisons": comparisons(phases), "notes": ["a note"]}
    text = markdown_report(report)
    assert "| 2.00x | >= 1.0x | yes |" in text and "| 4.00x | >= 5.0x | NO |" in text
    assert all(f"| {name} |" in text for name in phases) and "- a note" in text


def test_profile_report_shares_are_of_the_step() -> None:
    profile = {"steps": 5, "decoding_requests": 64, "step_ms": 10.0, "top_ops": "table",
               "breakdown_ms": {STEP_REGION: 8.0, "model_runner.forward": 6.0, ATTENTION_ROW: 2.0, REST_ROW: 2.0}}
    text = profile_report(profile)
    assert "| model_runner.forward | 6.00 | 75% |" in text and f"| {ATTENTION_ROW} | 2.00 | 25% |" in text
    assert "table" in text and "No attention region" not in text


def test_profile_report_says_when_no_attention_region_was_recorded() -> None:
    profile = {"steps": 5, "decoding_requests": 64, "step_ms": 10.0, "top_ops": "table",
               "breakdown_ms": {STEP_REGION: 8.0, "model_runner.forward": 6.0, REST_ROW: 2.0}}
    assert "No attention region was recorded" in profile_report(profile)


@pytest.mark.slow
def test_quick_run_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    result = tmp_path / "quick.json"
    assert throughput.main(["--quick", "--threads", "1", "--profile", "--result-json", str(result)]) == 0
    report = json.loads(result.read_text())
    assert {r["goal"] for r in report["comparisons"]} == {"batched", "sequential", "single_decode"}
    assert report["phases"]["engine"]["output_tokens"] == QUICK.num_prompts * QUICK.output_len
    assert all(p["peak_rss_mib"] > 0 and p["torch_threads"] == 1 for p in report["phases"].values())
    engine = report["phases"]["engine"]
    assert engine["prefill_steps"] >= 1 and engine["decode_steps"] >= QUICK.output_len - 1
    profile = report["phases"]["engine_profile"]
    assert profile["decoding_requests"] == QUICK.num_prompts
    # Every region the engine marks was read. This run's decode steps (two float32 rows) take the fused decode
    # call wherever its kernel builds, and it runs all layers in one call, with no per-layer attention region.
    if fused_decode.load_kernel() is None:
        assert list(profile["breakdown_ms"]) == [STEP_REGION, *PHASE_REGIONS[:4], ATTENTION_ROW,
                                                 *PHASE_REGIONS[4:], REST_ROW]
        assert 0 < profile["breakdown_ms"][ATTENTION_ROW] < profile["breakdown_ms"]["model_runner.forward"]
    else:
        assert list(profile["breakdown_ms"]) == [STEP_REGION, *PHASE_REGIONS, REST_ROW]
        assert "the fused decode" in profile_report(profile)
    assert "Greedy outputs identical to transformers on 2 of 2" in " ".join(report["notes"])
    assert "| Measurement |" in capsys.readouterr().out
