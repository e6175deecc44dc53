"""The GPU check script (``benchmarks/gpu_check.sh``): its pure helpers, and a CPU dry run of greedy parity.

The dry run runs the shell script with fastapi, uvicorn, gguf and
sse_starlette made unimportable, as on the GPU machine it is written for.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from benchmarks import gpu_check
from benchmarks.gpu import attention_kernels, decode_throughput, greedy_parity
from benchmarks.gpu.attention_kernels import kernel_cases
from benchmarks.gpu.decode_throughput import LLAMA_3_2_1B, decode_roofline_s, decode_weight_bytes, kv_bytes_per_token
from benchmarks.gpu.greedy_parity import (
    GAP_TOLERANCE,
    compare_greedy,
    first_divergence,
    greedy_verdict,
    near_tie_tolerance,
)
from benchmarks.gpu.report import goals, render_markdown, write_summary
from benchmarks.gpu_check import parse_sections
from benchmarks.step_profile import ATTENTION_ROW, PHASE_REGIONS, REST_ROW, STEP_REGION

pytestmark = pytest.mark.infra

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu_check.sh"
# Imported first thing by Python: the packages the GPU machine lacks cannot be imported.
BLOCK_SERVER_PACKAGES = """
import importlib.abc, sys

class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"fastapi", "uvicorn", "gguf", "sse_starlette"}:
            raise ImportError(f"{name} is blocked: the GPU machine does not have it")
        return None

sys.meta_path.insert(0, _Blocked())
"""


def test_llama_3_2_1b_decode_reads_its_published_parameter_count() -> None:
    # 1,235,814,400 parameters (tied embeddings counted once), 2 bytes each in bf16.
    assert decode_weight_bytes(LLAMA_3_2_1B, 2) == 2 * 1_235_814_400
    assert kv_bytes_per_token(LLAMA_3_2_1B, 2) == 2 * 16 * 8 * 64 * 2


def test_decode_roofline_adds_every_requests_context() -> None:
    weights = decode_weight_bytes(LLAMA_3_2_1B, 2)
    assert decode_roofline_s(LLAMA_3_2_1B, 2, []) == pytest.approx(weights / 4.8e12)
    expected = (weights + 32768 * 256 * 512) / 4.8e12
    assert decode_roofline_s(LLAMA_3_2_1B, 2, [512] * 256) == pytest.approx(expected)
    assert decode_roofline_s(LLAMA_3_2_1B, 2, [512] * 256, bandwidth=2.4e12) == pytest.approx(2 * expected)
    with pytest.raises(ValueError, match="bandwidth"):
        decode_roofline_s(LLAMA_3_2_1B, 2, [1], bandwidth=0)


def test_first_divergence_is_the_first_differing_index_or_the_shorter_length() -> None:
    assert first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert first_divergence([1, 2], [1, 2, 3]) == 2


def test_divergence_reports_the_reference_logit_gap_at_that_step() -> None:
    logits = np.zeros((3, 5))
    logits[1] = [0.0, 1.0, 2.0, 1.95, -1.0]  # reference picks 2; runner-up 3 is 0.05 behind
    result = compare_greedy([4, 3, 0], [4, 2, 0], logits)
    assert result["identical"] is False
    assert result["top_logit"] == 2.0
    assert result["first_divergence"] == 1
    assert (result["engine_token"], result["ref_token"]) == (3, 2)
    assert result["logit_gap"] == pytest.approx(0.05)
    assert result["engine_token_deficit"] == pytest.approx(0.05)
    assert compare_greedy([4, 2, 0], [4, 2, 0], logits) == {"identical": True, "first_divergence": None,
                                                           "num_tokens": 3}


def test_near_ties_pass_and_clear_divergences_fail() -> None:
    near_tie = {"identical": False, "logit_gap": GAP_TOLERANCE["bfloat16"] / 2}
    clear = {"identical": False, "logit_gap": 1.0}
    identical = {"identical": True}
    assert greedy_verdict([identical, near_tie], "bfloat16") == "pass"
    assert greedy_verdict([identical, clear], "bfloat16") == "FAIL"
    assert greedy_verdict([near_tie], "float32") == "FAIL"


def test_a_two_ulp_gap_of_large_bf16_logits_is_a_near_tie() -> None:
    """bf16 logits in [16, 32) are 0.125 apart: two steps there are a tie (each side rounds its two top
    logits), three are not (two steps seen on SmolLM2 in a batch on a CPU with AMX)."""
    assert near_tie_tolerance("bfloat16", 20.0) == 0.25
    assert near_tie_tolerance("bfloat16", 0.5) == GAP_TOLERANCE["bfloat16"]
    two_steps = {"identical": False, "logit_gap": 0.25, "top_logit": 20.0}
    three_steps = {"identical": False, "logit_gap": 0.375, "top_logit": 20.0}
    assert greedy_verdict([two_steps], "bfloat16") == "pass"
    assert greedy_verdict([three_steps], "bfloat16") == "FAIL"
    assert greedy_verdict([two_steps], "float32") == "FAIL"


def test_sections_are_parsed_in_check_order() -> None:
    assert parse_sections("decode_steps, greedy_parity") == ["greedy_parity", "decode_steps"]
    assert parse_sections("greedy_parity,attention_kernels,throughput,decode_steps") == [
        "greedy_parity", "attention_kernels", "throughput", "decode_steps"]
    with pytest.raises(ValueError, match="unknown sections"):
        parse_sections("greedy_parity,a")


def test_kernel_cases_are_decodes_then_decodes_with_prefill_chunks() -> None:
    (decode, (decode_ctx, decode_q)), (mixed, (mixed_ctx, mixed_q)) = kernel_cases(attention_kernels.QUICK).items()
    assert decode == "decode x4, ctx 1-64" and decode_ctx == [0, 21, 42, 63] and decode_q == [1] * 4
    assert mixed == "mixed: 4 decodes + 1 chunks of 32"
    assert mixed_ctx == decode_ctx + [16] and mixed_q == [1] * 4 + [32]


def _breakdown(ms: float, attention: bool) -> dict:
    return {STEP_REGION: ms * 1.1, "model_runner.forward": ms * 0.7, **({ATTENTION_ROW: ms * 0.2} if attention else {}),
            "model_runner.sample": ms * 0.1, REST_ROW: ms * 0.3}


def _results() -> dict:
    decode = [{"mode": mode, "batch": batch, "tokens_per_step": batch, "mean_context": 520.0, "step_ms": ms,
               "roofline_ms": 2.0, "ratio_to_roofline": ms / 2.0, "profiled_step_ms": ms * 1.1,
               "runner_ms": ms * 0.8, "breakdown_ms": _breakdown(ms, attention=mode == "eager")}
              for mode, batch, ms in (("eager", 1, 6.0), ("cuda_graphs", 1, 2.0), ("cuda_graphs", 256, 3.0))]
    greedy = [{"model": "llama", "dtype": "bfloat16", "backend": "triton", "verdict": "pass",
               "prompts": [{"prompt_len": 3, "identical": True, "first_divergence": None, "num_tokens": 16},
                           {"prompt_len": 200, "identical": False, "first_divergence": 9, "num_tokens": 16,
                            "logit_gap": 0.02}]}]
    return {
        "meta": {"device": "cuda", "quick": False, "device_name": "NVIDIA H200", "torch": "2.11", "elapsed_s": 1.0},
        "sections": {
            "greedy_parity": {"status": "ok", "elapsed_s": 1.0, "data": {"runs": greedy}, "notes": []},
            "attention_kernels": {"status": "error", "elapsed_s": 0.5, "data": {}, "notes": [],
                                  "error": "Traceback ...\nValueError: unknown attention backend 'triton'\n"},
            "decode_steps": {"status": "ok", "elapsed_s": 2.0, "data": {"runs": decode}, "notes": ["engine log: -"]},
        },
    }


def test_goals_state_the_issues_targets_with_the_measured_figures() -> None:
    assert goals(_results()["sections"]) == [
        "Greedy parity: pass (1 model/dtype runs)",
        "Decode at batch 256 within 2x of the roofline: yes (1.50x)",
        "CUDA graphs at batch 1 at least 2x faster than eager: yes (3.00x)",
    ]
    assert goals({}) == ["No goal was measured in this run."]


def test_summary_writes_json_and_markdown_with_errors_and_divergences(tmp_path: Path) -> None:
    json_path, md_path = write_summary(_results(), tmp_path / "results")
    assert json_path.name == "gpu_check_cuda.json" and md_path.name == "gpu_check_cuda.md"
    assert json.loads(json_path.read_text())["sections"]["attention_kernels"]["status"] == "error"
    markdown = md_path.read_text()
    assert markdown == render_markdown(_results())
    assert "## Greedy parity with transformers on tiny models (`greedy_parity`)" in markdown
    assert "| llama | bfloat16 | triton | 1/2 | #1 (len 200): step 9, gap 0.020 | pass |" in markdown
    assert "ValueError: unknown attention backend 'triton'" in markdown
    assert "| cuda_graphs | 256 | 256 | 520.000 | 3.000 | 2.000 | 1.500 | 3.300 | 2.400 |" in markdown
    # The breakdown: one column per run, attention only where its regions were recorded (not in graph replays).
    assert "| region | eager b1 | cuda_graphs b1 | cuda_graphs b256 |" in markdown
    assert "| model_runner.forward | 4.200 | 1.400 | 2.100 |" in markdown
    assert f"| {ATTENTION_ROW.strip()} | 1.200 | - | - |" in markdown


def test_a_section_that_raises_is_recorded_and_the_next_one_still_runs(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(ctx: gpu_check.CheckContext) -> dict:
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(greedy_parity, "run", broken)
    monkeypatch.setattr(attention_kernels, "run", lambda ctx: {"cases": []})
    results = gpu_check.run_check("cpu", ["greedy_parity", "attention_kernels"], quick=True, out=tmp_path)
    assert results["sections"]["greedy_parity"]["status"] == "error"
    assert "RuntimeError: kernel exploded" in results["sections"]["greedy_parity"]["error"]
    assert results["sections"]["attention_kernels"]["status"] == "ok"
    saved = json.loads((tmp_path / "gpu_check_cpu.json").read_text())
    assert [saved["sections"][s]["status"] for s in ("greedy_parity", "attention_kernels")] == ["error", "ok"]
    assert "RuntimeError: kernel exploded" in (tmp_path / "gpu_check_cpu.md").read_text()


@pytest.mark.timeout(300)
def test_cpu_dry_run_of_decode_steps_reads_every_engine_region(tmp_path: Path) -> None:
    """The decode section on a CPU: the quick model's steps, timed, then broken down by the engine's regions."""
    if importlib.util.find_spec("tokenizers") is None:
        pytest.skip("needs the tokenizers package")
    results = gpu_check.run_check("cpu", ["decode_steps"], quick=True, out=tmp_path)
    section = results["sections"]["decode_steps"]
    assert section["status"] == "ok", section.get("error")
    runs = section["data"]["runs"]
    batches = decode_throughput.QUICK.decode_batches
    assert [(r["mode"], r["batch"]) for r in runs] == [(m, b) for m in ("eager", "cuda_graphs") for b in batches]
    for run in runs:
        assert run["tokens_per_step"] == run["batch"]
        assert list(run["breakdown_ms"]) == [STEP_REGION, *PHASE_REGIONS[:4], ATTENTION_ROW, *PHASE_REGIONS[4:],
                                             REST_ROW]
        assert 0 < run["runner_ms"] < run["profiled_step_ms"] == run["breakdown_ms"][STEP_REGION]
    assert "| region | eager b1 |" in (tmp_path / "gpu_check_cpu.md").read_text()


def _script_env(tmp_path: Path) -> dict[str, str]:
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(BLOCK_SERVER_PACKAGES)
    return {**os.environ, "PYTHON": sys.executable, "PYTHONPATH": str(blocker), "HF_HUB_OFFLINE": "1"}


@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the note printed where there is no CUDA device")
def test_script_without_cuda_prints_a_note_and_succeeds(tmp_path: Path) -> None:
    done = subprocess.run(["bash", str(SCRIPT), "--out", str(tmp_path)], env=_script_env(tmp_path),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0
    assert "no CUDA device" in done.stdout and len(done.stdout.strip().splitlines()) == 1
    assert not list(tmp_path.glob("gpu_check_*"))


@pytest.mark.timeout(120)
@pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
def test_cpu_dry_run_of_greedy_parity_passes_without_server_packages(tmp_path: Path) -> None:
    if importlib.util.find_spec("tokenizers") is None:
        pytest.skip("needs the tokenizers package")
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(SCRIPT), "--device", "cpu", "--quick", "--sections", "greedy_parity", "--models", "llama",
         "--out", str(out)],
        env=_script_env(tmp_path), capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "gpu_check_cpu.json").read_text())
    section = results["sections"]["greedy_parity"]
    assert section["status"] == "ok", section.get("error")
    runs = {run["dtype"]: run for run in section["data"]["runs"]}
    assert set(runs) == {"bfloat16", "float32"}
    assert all(c["identical"] for c in runs["float32"]["prompts"]), runs["float32"]
    assert runs["bfloat16"]["verdict"] == "pass", runs["bfloat16"]
    markdown = (out / "gpu_check_cpu.md").read_text()
    assert "## Greedy parity with transformers on tiny models (`greedy_parity`)" in markdown
    assert "Greedy parity: pass" in done.stdout


def test_an_unknown_section_is_a_usage_error_listing_the_names(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--device", "cpu", "--sections", "a"])
    assert exit_info.value.code == 2
    assert "choose from greedy_parity,attention_kernels,throughput,decode_steps" in capsys.readouterr().err


def test_tensor_parallel_goal_says_why_it_was_not_measured_on_one_device() -> None:
    from benchmarks.gpu import tensor_parallel

    skipped = {"status": "ok", "data": {"runs": []}, "notes": ["skipped: 1 CUDA device lent, size 2 needs two"]}
    assert tensor_parallel.goals(skipped) == [
        "Tensor parallel size 2: not measured (skipped: 1 CUDA device lent, size 2 needs two)"]
    measured = {"status": "ok", "data": {"runs": [
        {"dtype": "float32", "identical": 5, "prompts": 5, "verdict": "pass"},
        {"dtype": "bfloat16", "identical": 3, "prompts": 5, "verdict": "near-ties?"}]}}
    assert tensor_parallel.goals(measured) == [
        "Tensor parallel size 2: fp32 pass; float32 5/5 identical, bfloat16 3/5 identical"]
