"""The GPU check script (``benchmarks/gpu_check.sh``): its pure helpers, and a CPU dry run of section a.

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
from benchmarks.gpu_check import (
    GAP_TOLERANCE,
    LLAMA_3_2_1B,
    compare_greedy,
    decode_roofline_s,
    decode_weight_bytes,
    first_divergence,
    goals,
    greedy_verdict,
    kv_bytes_per_token,
    near_tie_tolerance,
    parse_sections,
    render_markdown,
    write_summary,
)

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
    assert parse_sections("d, a") == ["a", "d"]
    assert parse_sections("a,b,c,d") == ["a", "b", "c", "d"]
    with pytest.raises(ValueError, match="unknown sections"):
        parse_sections("a,e")


def _results() -> dict:
    decode = [{"mode": mode, "batch": batch, "tokens_per_step": batch, "mean_context": 520.0, "step_ms": ms,
               "runner_ms": ms * 0.8, "roofline_ms": 2.0, "ratio_to_roofline": ms / 2.0}
              for mode, batch, ms in (("eager", 1, 6.0), ("cuda_graphs", 1, 2.0), ("cuda_graphs", 256, 3.0))]
    greedy = [{"model": "llama", "dtype": "bfloat16", "backend": "TritonAttentionBackend", "verdict": "pass",
               "prompts": [{"prompt_len": 3, "identical": True, "first_divergence": None, "num_tokens": 16},
                           {"prompt_len": 200, "identical": False, "first_divergence": 9, "num_tokens": 16,
                            "logit_gap": 0.02}]}]
    return {
        "meta": {"device": "cuda", "quick": False, "device_name": "NVIDIA H200", "torch": "2.11", "elapsed_s": 1.0},
        "sections": {
            "a": {"status": "ok", "elapsed_s": 1.0, "data": {"runs": greedy}, "notes": []},
            "b": {"status": "error", "elapsed_s": 0.5, "data": {}, "notes": [],
                  "error": "Traceback ...\nValueError: unknown attention backend 'triton'\n"},
            "d": {"status": "ok", "elapsed_s": 2.0, "data": {"runs": decode}, "notes": ["engine log: -"]},
        },
    }


def test_goals_state_the_issues_targets_with_the_measured_figures() -> None:
    assert goals(_results()["sections"]) == [
        "Greedy equivalence: pass (1 model/dtype runs)",
        "Decode at batch 256 within 2x of the roofline: yes (1.50x)",
        "CUDA graphs at batch 1 at least 2x faster than eager: yes (3.00x)",
    ]
    assert goals({}) == ["No goal was measured in this run."]


def test_summary_writes_json_and_markdown_with_errors_and_divergences(tmp_path: Path) -> None:
    json_path, md_path = write_summary(_results(), tmp_path / "results")
    assert json_path.name == "gpu_check_cuda.json" and md_path.name == "gpu_check_cuda.md"
    assert json.loads(json_path.read_text())["sections"]["b"]["status"] == "error"
    markdown = md_path.read_text()
    assert markdown == render_markdown(_results())
    assert "| llama | bfloat16 | TritonAttentionBackend | 1/2 | #1 (len 200): step 9, gap 0.020 | pass |" in markdown
    assert "ValueError: unknown attention backend 'triton'" in markdown
    assert "| cuda_graphs | 256 | 256 | 520.000 | 3.000 | 2.400 | 2.000 | 1.500 |" in markdown


def test_a_section_that_raises_is_recorded_and_the_next_one_still_runs(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(ctx: gpu_check.CheckContext) -> dict:
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(gpu_check, "section_greedy", broken)
    monkeypatch.setattr(gpu_check, "section_kernel", lambda ctx: {"cases": []})
    results = gpu_check.run_check("cpu", ["a", "b"], quick=True, out=tmp_path)
    assert results["sections"]["a"]["status"] == "error"
    assert "RuntimeError: kernel exploded" in results["sections"]["a"]["error"]
    assert results["sections"]["b"]["status"] == "ok"
    saved = json.loads((tmp_path / "gpu_check_cpu.json").read_text())
    assert [saved["sections"][s]["status"] for s in ("a", "b")] == ["error", "ok"]
    assert "RuntimeError: kernel exploded" in (tmp_path / "gpu_check_cpu.md").read_text()


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
def test_cpu_dry_run_of_greedy_section_passes_without_server_packages(tmp_path: Path) -> None:
    if importlib.util.find_spec("tokenizers") is None:
        pytest.skip("needs the tokenizers package")
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(SCRIPT), "--device", "cpu", "--quick", "--sections", "a", "--models", "llama", "--out", str(out)],
        env=_script_env(tmp_path), capture_output=True, text=True, timeout=110)
    assert done.returncode == 0, done.stdout + done.stderr
    results = json.loads((out / "gpu_check_cpu.json").read_text())
    section = results["sections"]["a"]
    assert section["status"] == "ok", section.get("error")
    runs = {run["dtype"]: run for run in section["data"]["runs"]}
    assert set(runs) == {"bfloat16", "float32"}
    assert all(c["identical"] for c in runs["float32"]["prompts"]), runs["float32"]
    assert runs["bfloat16"]["verdict"] == "pass", runs["bfloat16"]
    assert "## (a) Greedy equivalence vs transformers" in (out / "gpu_check_cpu.md").read_text()
    assert "Greedy equivalence: pass" in done.stdout
