"""Time to answer one long prompt (``max_tokens`` 1): the CPU prefill kernel against the torch path.

For each dtype, each ``--max-num-batched-tokens`` and each attention backend,
``torch`` (prefill chunks gathered into a workspace, SDPA with an explicit
causal mask) and ``cpu`` (``csrc/paged_prefill_attention.c`` reading the paged
KV in place), a spawned process loads the embedded SmolLM2-135M and times
``LLM.generate`` of one random-token prompt of each ``--prompt-lens`` length
with ``max_tokens`` 1: the whole prefill, chunked by the step budget, plus one
sampled token. No step decodes, so the two backends differ only in prefill
attention. Prefix caching is off, so a repeat recomputes everything. Each time
is the median of ``--repeats`` runs. A process per backend, because a fast
path timed in the process that just ran the torch one came out up to 1.8x
slower (fp32, 8k tokens: 35.6 s against 20.3 s alone).

    python -m benchmarks.long_prefill [--prompt-lens 2048,8000] [--dtypes float32,bfloat16]
        [--max-num-batched-tokens 2048] [--backends torch,cpu] [--repeats 3] [--threads N] [--result-json PATH]

``--backends cpu`` skips the slow torch path (to compare step budgets, say).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

BACKENDS = ("torch", "cpu")  # the old path first: the baseline of each ratio


def parse_ints(text: str) -> list[int]:
    """``"512,2048"`` -> ``[512, 2048]``.

    Raises:
        ValueError: on an empty list or a value below 1.
    """
    values = [int(part) for part in text.split(",") if part.strip()]
    if not values or min(values) < 1:
        raise ValueError(f"expected comma-separated integers >= 1, got {text!r}")
    return values


def random_prompt(length: int, vocab_size: int, seed: int) -> list[int]:
    """``length`` token ids drawn uniformly from ``[0, vocab_size)``."""
    rng = random.Random(seed)
    return [rng.randrange(vocab_size) for _ in range(length)]


def time_prompts(dtype: str, max_num_batched_tokens: int, prompt_lens: list[int], backend: str, repeats: int,
                 threads: int | None) -> dict[int, list[float]]:
    """Seconds of each run: prompt length -> ``repeats`` times (runs in a spawned process)."""
    from pagedserve.engine.llm import LLM
    from pagedserve.engine.sampling_params import SamplingParams

    if threads is not None:
        torch.set_num_threads(threads)
    llm = LLM(dtype=dtype, attention_backend=backend, max_model_len=max(prompt_lens) + 1,
              max_num_batched_tokens=max_num_batched_tokens, enable_prefix_caching=False)
    vocab_size = llm.engine_core.config.model_config.hf_config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate(random_prompt(64, vocab_size, seed=-1), params, use_tqdm=False)  # builds the kernels
    times: dict[int, list[float]] = {n: [] for n in prompt_lens}
    for repeat in range(repeats):
        for n in prompt_lens:
            prompt = random_prompt(n, vocab_size, seed=repeat)
            start = time.perf_counter()
            llm.generate(prompt, params, use_tqdm=False)
            times[n].append(time.perf_counter() - start)
    return times


def markdown(results: list[dict]) -> str:
    """The results as a Markdown table: medians in seconds, torch / cpu, and cpu bf16 / cpu fp32."""
    cpu_f32 = {(r["max_num_batched_tokens"], r["prompt_len"]): r.get("cpu_s") for r in results
               if r["dtype"] == "float32"}
    lines = ["| prompt tokens | dtype | max_num_batched_tokens | torch path (s) | prefill kernel (s) | speed-up "
             "| kernel vs its fp32 |", "|---|---|---|---|---|---|---|"]
    for r in results:
        torch_s, cpu_s = r.get("torch_s"), r.get("cpu_s")
        f32 = cpu_f32.get((r["max_num_batched_tokens"], r["prompt_len"]))
        lines.append(f"| {r['prompt_len']} | {r['dtype']} | {r['max_num_batched_tokens']} | {_seconds(torch_s)} "
                     f"| {_seconds(cpu_s)} | {_ratio(torch_s, cpu_s)} | {_ratio(cpu_s, f32)} |")
    return "\n".join(lines)


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _ratio(numerator: float | None, denominator: float | None) -> str:
    return "-" if numerator is None or denominator is None else f"{numerator / denominator:.2f}x"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-lens", type=parse_ints, default=[2048, 8000], help="tokens, comma-separated")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated")
    parser.add_argument("--max-num-batched-tokens", type=parse_ints, default=[2048],
                        help="step budgets to compare, comma-separated")
    parser.add_argument("--backends", default=",".join(BACKENDS), help="attention backends, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--result-json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    backends = args.backends.split(",")
    if not set(backends) <= set(BACKENDS):
        parser.error(f"--backends must be among {','.join(BACKENDS)}, got {args.backends!r}")

    results = []
    context = multiprocessing.get_context("spawn")
    for dtype in args.dtypes.split(","):
        for budget in args.max_num_batched_tokens:
            times = {}
            for backend in backends:
                # A fresh process per run: no allocator state or warm cache carries over.
                with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
                    times[backend] = pool.submit(time_prompts, dtype, budget, args.prompt_lens, backend,
                                                 args.repeats, args.threads).result()
            for n in args.prompt_lens:
                result = {"prompt_len": n, "dtype": dtype, "max_num_batched_tokens": budget}
                for backend in backends:
                    result[f"{backend}_s"] = statistics.median(times[backend][n])
                    result[f"{backend}_runs_s"] = times[backend][n]
                results.append(result)
                print(markdown([result]).splitlines()[-1], flush=True)
    print(markdown(results))
    if args.result_json:
        args.result_json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
