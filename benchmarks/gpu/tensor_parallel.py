"""Tensor parallelism on the device: greedy outputs at size 2 against size 1, on a tiny model.

The tiny Llama of ``greedy_parity`` (4 heads, 2 KV heads) runs through
``engine.LLM`` at ``tensor_parallel_size`` 1 and 2 (one process per device,
NCCL on CUDA; gloo on the CPU dry run), in bf16 and fp32, on the same prompts
with chunked prefill. fp32 must be identical; bf16 may diverge where the two
all-reduce orders round a near-tie differently, so its count is reported only.
Skipped, with a note, on a machine with fewer than two CUDA devices.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from benchmarks.gpu.context import free_memory
from benchmarks.gpu.fixtures import build_tokenizer, random_prompts
from benchmarks.gpu.greedy_parity import TINY_VOCAB, first_divergence
from benchmarks.gpu.markdown import table

if TYPE_CHECKING:
    from benchmarks.gpu.context import CheckContext

NAME = "tensor_parallel"
TITLE = "Tensor parallelism: size 2 against size 1"
PROMPT_LENS = (3, 17, 40, 100, 200)
MAX_TOKENS = 16


def _generate(ctx: CheckContext, folder: Path, dtype_name: str, size: int, prompts: list[list[int]]
              ) -> list[list[int]]:
    from pagedserve.engine import LLM, SamplingParams

    llm = LLM(str(folder), device=ctx.device, dtype=dtype_name, max_model_len=256, max_num_batched_tokens=64,
              long_prefill_token_threshold=32, kv_cache_memory_bytes="64MiB", tensor_parallel_size=size, seed=0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.engine_core.shutdown()
    del llm
    free_memory()
    return tokens


def run(ctx: CheckContext) -> dict[str, Any]:
    """Both dtypes at sizes 1 and 2; the section is skipped with a note below two CUDA devices."""
    from benchmarks.tiny_models import tiny_hf_model

    runs: list[dict[str, Any]] = []
    data: dict[str, Any] = {"prompt_lens": list(PROMPT_LENS), "max_tokens": MAX_TOKENS, "runs": runs}
    ctx.section(NAME)["data"] = data
    if ctx.device == "cuda" and torch.cuda.device_count() < 2:
        ctx.note(NAME, f"skipped: {torch.cuda.device_count()} CUDA device lent, size 2 needs two")
        return data
    folder = ctx.tmp / "tiny-llama-tp"
    tiny_hf_model("llama", folder, tie_word_embeddings=True)
    build_tokenizer(TINY_VOCAB).save_pretrained(folder)
    prompts = random_prompts(np.random.default_rng(11), PROMPT_LENS, TINY_VOCAB)
    for dtype_name in ("float32", "bfloat16"):
        def compare(d: str = dtype_name) -> None:
            single, split = (_generate(ctx, folder, d, size, prompts) for size in (1, 2))
            divergences = [first_divergence(a, b) for a, b in zip(split, single, strict=True)]
            identical = sum(i is None for i in divergences)
            verdict = "pass" if identical == len(prompts) else ("FAIL" if d == "float32" else "near-ties?")
            runs.append({"dtype": d, "identical": identical, "prompts": len(prompts),
                         "first_divergences": divergences, "verdict": verdict})
            ctx.say(f"[{NAME}] {d:9s}: {identical}/{len(prompts)} identical at size 2 -> {verdict}")
        ctx.run_part(NAME, compare)
        ctx.save()
    return data


def markdown(data: dict[str, Any]) -> list[str]:
    rows = [[r["dtype"], f"{r['identical']}/{r['prompts']}", str(r["first_divergences"]), r["verdict"]]
            for r in data.get("runs", [])]
    return table(["dtype", "identical", "first divergence per prompt", "verdict"], rows) if rows else []


def goals(section: dict[str, Any]) -> list[str]:
    """The size-2 goal: fp32 identical to size 1 (or why it was not measured)."""
    if not section:
        return []
    runs = section.get("data", {}).get("runs", [])
    if not runs:
        notes = "; ".join(section.get("notes", [])) or section.get("status", "not run")
        return [f"Tensor parallel size 2: not measured ({notes})"]
    fp32 = [r for r in runs if r["dtype"] == "float32"]
    verdict = fp32[0]["verdict"] if fp32 else "fp32 not run"
    return [f"Tensor parallel size 2: fp32 {verdict}; "
            + ", ".join(f"{r['dtype']} {r['identical']}/{r['prompts']} identical" for r in runs)]
