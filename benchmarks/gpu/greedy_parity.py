"""Greedy parity: the engine's greedy outputs against transformers' on tiny random-weight models.

Tiny llama (llama3 rope scaling), qwen2, qwen3 and mistral checkpoints, run by
``engine.LLM`` on a batch of prompts of 3..200 tokens with chunked prefill,
against transformers' ``generate(do_sample=False)`` in the same dtype on the
same device: the first 16 tokens must be identical, or the prompt diverges at
a near-tie of the reference's logits (``near_tie_tolerance``); the report gives
the first divergence and the reference's logit gap (top-1 minus top-2) there.
bf16 and fp32 (fp32 is expected to match exactly).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from benchmarks.gpu.context import attention_backend, free_memory
from benchmarks.gpu.fixtures import build_tokenizer, random_prompts
from benchmarks.gpu.markdown import fmt, table
from benchmarks.roofline import DTYPES

if TYPE_CHECKING:
    from benchmarks.gpu.context import CheckContext

NAME = "greedy_parity"
TITLE = "Greedy parity with transformers on tiny models"
#: Largest reference logit gap (top-1 minus top-2) at which a divergence still counts as a near-tie.
GAP_TOLERANCE = {"bfloat16": 0.1, "float32": 1e-3}
TINY_MODELS = ("llama", "qwen2", "qwen3", "mistral")
#: Vocabulary of the tiny models (``benchmarks.tiny_models.tiny_hf_model``).
TINY_VOCAB = 256


@dataclass(frozen=True)
class GreedySizes:
    """Prompts and engine limits of the parity runs."""

    prompt_lens: tuple[int, ...] = (3, 5, 8, 16, 17, 31, 64, 100, 129, 200)
    max_tokens: int = 16
    chunk: int = 32  # long_prefill_token_threshold
    step_tokens: int = 96  # max_num_batched_tokens, at least max_num_seqs
    max_num_seqs: int = 16


FULL = GreedySizes()
QUICK = GreedySizes(prompt_lens=(3, 17, 40), chunk=16, step_tokens=32)


# ---------------------------------------------------------------------------------------------- judging


def first_divergence(engine_tokens: Sequence[int], ref_tokens: Sequence[int]) -> int | None:
    """Index of the first position where the two token lists differ (a length mismatch counts), or None."""
    for i, (a, b) in enumerate(zip(engine_tokens, ref_tokens, strict=False)):
        if a != b:
            return i
    return None if len(engine_tokens) == len(ref_tokens) else min(len(engine_tokens), len(ref_tokens))


def compare_greedy(engine_tokens: Sequence[int], ref_tokens: Sequence[int],
                   ref_logits: Sequence[Sequence[float]] | np.ndarray) -> dict[str, Any]:
    """Compare one prompt's greedy outputs.

    Args:
        engine_tokens: the engine's output ids.
        ref_tokens: the reference's output ids.
        ref_logits: ``[steps, vocab]`` the reference's logits at each output step.

    Returns:
        ``identical``, ``first_divergence`` (None when identical), and at the
        divergence: both tokens, ``logit_gap`` (reference top-1 minus top-2
        logit) and ``engine_token_deficit`` (reference logit of its token minus
        that of the engine's token; equals the gap when the engine took the runner-up).
    """
    index = first_divergence(engine_tokens, ref_tokens)
    result: dict[str, Any] = {"identical": index is None, "first_divergence": index, "num_tokens": len(ref_tokens)}
    if index is None or index >= min(len(engine_tokens), len(ref_tokens), len(ref_logits)):
        return result
    logits = np.asarray(ref_logits[index], dtype=np.float64)
    top2 = np.sort(logits)[-2:]
    result.update(engine_token=int(engine_tokens[index]), ref_token=int(ref_tokens[index]),
                  logit_gap=float(top2[1] - top2[0]), top_logit=float(top2[1]),
                  engine_token_deficit=float(logits[ref_tokens[index]] - logits[engine_tokens[index]]))
    return result


def near_tie_tolerance(dtype: str, top_logit: float) -> float:
    """Largest top-1 minus top-2 gap that is still a near-tie: ``GAP_TOLERANCE[dtype]``, or two units in
    the last place of ``dtype`` at the top logit's magnitude when that is larger. Each implementation
    rounds its two top logits to ``dtype`` (half a unit each), so its gap is off by up to one unit from
    the one it computed, the reference's and the engine's alike: two correct bf16 implementations can
    pick different tokens where the reference's gap is two units (bf16 logits near 20 are 0.125 apart;
    0.25 seen on SmolLM2 in a batch on a CPU with AMX, whose GEMMs sum in another order)."""
    ulp = torch.finfo(DTYPES[dtype]).eps * 2.0 ** math.floor(math.log2(max(abs(top_logit), 1e-30)))
    return max(GAP_TOLERANCE[dtype], 2 * ulp)


def greedy_verdict(comparisons: Sequence[dict[str, Any]], dtype: str) -> str:
    """``pass`` when every prompt is identical or diverges at a near-tie (``near_tie_tolerance``)."""
    for c in comparisons:
        if c["identical"]:
            continue
        if "logit_gap" not in c or c["logit_gap"] > near_tie_tolerance(dtype, c.get("top_logit", 0.0)):
            return "FAIL"
    return "pass"


# ---------------------------------------------------------------------------------------------- runs


def reference_generate(folder: Path, prompts: list[list[int]], max_tokens: int, dtype: torch.dtype,
                        device: str) -> list[tuple[list[int], np.ndarray]]:
    """transformers' greedy outputs and ``[steps, vocab]`` raw logits per prompt, one prompt at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True, pad_token_id=0)
        tokens = out.sequences[0, len(prompt):].tolist()
        logits = torch.stack(out.logits)[:, 0].float().cpu().numpy()
        outputs.append((tokens, logits))
    del model
    free_memory()
    return outputs


def _parity_run(ctx: CheckContext, sizes: GreedySizes, model_type: str, folder: Path, dtype_name: str
                ) -> dict[str, Any]:
    """One tiny model in one dtype: the engine's and transformers' greedy outputs, compared prompt by prompt."""
    from pagedserve.engine import LLM, SamplingParams

    prompts = random_prompts(np.random.default_rng(7), sizes.prompt_lens, TINY_VOCAB)
    llm = LLM(str(folder), device=ctx.device, dtype=dtype_name, max_model_len=256, max_num_seqs=sizes.max_num_seqs,
              max_num_batched_tokens=sizes.step_tokens, long_prefill_token_threshold=sizes.chunk,
              kv_cache_memory_bytes="256MiB", seed=0)
    backend = attention_backend(llm)
    params = SamplingParams(temperature=0.0, max_tokens=sizes.max_tokens, ignore_eos=True)
    engine_out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    free_memory()
    reference = reference_generate(folder, prompts, sizes.max_tokens, DTYPES[dtype_name], ctx.device)
    comparisons = [{"prompt_len": len(p), **compare_greedy(e, r, logits)}
                   for p, e, (r, logits) in zip(prompts, engine_out, reference, strict=True)]
    verdict = greedy_verdict(comparisons, dtype_name)
    ctx.say(f"[{NAME}] {model_type:8s} {dtype_name:9s} {backend}: "
            f"{sum(c['identical'] for c in comparisons)}/{len(comparisons)} identical -> {verdict}")
    return {"model": model_type, "dtype": dtype_name, "backend": backend, "verdict": verdict,
            "prompts": comparisons}


def run(ctx: CheckContext) -> dict[str, Any]:
    """Every tiny architecture of ``ctx.models`` in bf16 and fp32; a failing run leaves the others."""
    from benchmarks.tiny_models import tiny_hf_model

    sizes = QUICK if ctx.quick else FULL
    runs: list[dict[str, Any]] = []
    data = {"prompt_lens": list(sizes.prompt_lens), "max_tokens": sizes.max_tokens,
            "long_prefill_token_threshold": sizes.chunk, "runs": runs}
    ctx.section(NAME)["data"] = data  # saved after every run, so an interrupted check keeps them

    def save(model_type: str, folder: Path) -> None:
        tiny_hf_model(model_type, folder, tie_word_embeddings=model_type in ("llama", "qwen3"))
        build_tokenizer(TINY_VOCAB).save_pretrained(folder)

    for model_type in ctx.models:
        folder = ctx.tmp / f"tiny-{model_type}"
        if not ctx.run_part(NAME, lambda m=model_type, f=folder: save(m, f)):
            continue
        for dtype_name in ("bfloat16", "float32"):
            if ctx.out_of_time():
                ctx.note(NAME, f"{model_type}/{dtype_name} skipped: time budget")
                continue
            ctx.run_part(NAME, lambda m=model_type, f=folder, d=dtype_name: runs.append(
                _parity_run(ctx, sizes, m, f, d)))
            ctx.save()
    return data


# ---------------------------------------------------------------------------------------------- report


def markdown(data: dict[str, Any]) -> list[str]:
    """One row per model and dtype: prompts identical, each divergence with its logit gap, the verdict."""
    rows = []
    for result in data.get("runs", []):
        prompts = result["prompts"]
        diverged = [f"#{i} (len {c['prompt_len']}): step {c['first_divergence']}, gap {fmt(c.get('logit_gap'))}"
                    for i, c in enumerate(prompts) if not c["identical"]]
        identical = sum(c["identical"] for c in prompts)
        rows.append([result["model"], result["dtype"], result.get("backend"), f"{identical}/{len(prompts)}",
                     "; ".join(diverged) or "-", result["verdict"]])
    lines = table(["model", "dtype", "attention", "identical", "divergences", "verdict"], rows)
    tolerance = ", ".join(f"{v} in {k}" for k, v in GAP_TOLERANCE.items())
    return lines + ["", f"A divergence passes as a near-tie when the reference's top-1 minus top-2 logit gap there "
                        f"is at most {tolerance}, or two units in the last place at the top logit when larger."]


def goals(section: dict[str, Any]) -> list[str]:
    """The parity goal, when a run was measured."""
    runs = section.get("data", {}).get("runs", [])
    if not runs:
        return []
    failed = [f"{r['model']}/{r['dtype']}" for r in runs if r["verdict"] != "pass"]
    failed += [f"runs that raised (see {NAME})"] if section["status"] == "error" else []
    return [f"Greedy parity: {'FAIL: ' + ', '.join(failed) if failed else 'pass'} ({len(runs)} model/dtype runs)"]
