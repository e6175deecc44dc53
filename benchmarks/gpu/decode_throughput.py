"""Throughput and decode steps of a random-weight model with Llama-3.2-1B's shape in bf16.

One engine per mode (eager, CUDA graphs) serves two sections:

- ``throughput``: offline ``LLM.generate`` of 256 prompts of 128-1024 tokens,
  256 output tokens each (``ignore_eos``);
- ``decode_steps``: engine step time at batch 1, 64 and 256 (context ~512),
  against the roofline (weight bytes + KV bytes read per step) / 4.8 TB/s,
  and where a step's time goes, read from the regions the engine marks
  (``benchmarks.step_profile``) over as many steps again under the profiler.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from benchmarks.core_requests import CoreRequests
from benchmarks.gpu.context import attention_backend, free_memory, sync
from benchmarks.gpu.fixtures import random_prompts, save_random_model
from benchmarks.gpu.markdown import table
from benchmarks.roofline import ModelShape
from benchmarks.step_profile import PHASE_REGIONS, STEP_REGION, profile_steps

if TYPE_CHECKING:
    from benchmarks.gpu.context import CheckContext

THROUGHPUT = "throughput"
THROUGHPUT_TITLE = "Offline throughput, Llama-3.2-1B shape"
DECODE = "decode_steps"
DECODE_TITLE = "Decode step time and breakdown against the roofline, Llama-3.2-1B shape"
#: H200 HBM3e bandwidth, bytes/s (the issue's roofline).
H200_BANDWIDTH = 4.8e12
#: Llama-3.2-1B: hidden 2048, intermediate 8192, 32 heads, 8 KV heads, head_dim 64, vocab 128256, 16 layers.
LLAMA_3_2_1B = ModelShape(hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=8, head_dim=64,
                          vocab_size=128256, num_layers=16)
#: The step's regions that run in the model runner; the last one ends with the sampled ids' copy to the host.
RUNNER_REGIONS = tuple(name for name in PHASE_REGIONS if name.startswith("model_runner."))
#: Bytes of one bf16 weight or cache element.
BF16_BYTES = 2
#: Decode steps run after the prefill and before the timed ones.
DECODE_WARMUP_STEPS = 3


@dataclass(frozen=True)
class DecodeSizes:
    """The model, the throughput run and the decode batches."""

    shape: ModelShape = LLAMA_3_2_1B
    num_prompts: int = 256
    prompt_len_range: tuple[int, int] = (128, 1024)
    output_len: int = 256
    max_num_batched_tokens: int = 8192  # at least max(num_prompts, max(decode_batches)): the engine's max_num_seqs
    decode_batches: tuple[int, ...] = (1, 64, 256)
    decode_context: int = 512
    decode_steps: int = 20  # timed, then as many profiled


FULL = DecodeSizes()
QUICK = DecodeSizes(
    shape=ModelShape(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32,
                     vocab_size=4096, num_layers=2),
    num_prompts=8, prompt_len_range=(16, 64), output_len=8, max_num_batched_tokens=128,
    decode_batches=(1, 4), decode_context=32, decode_steps=3,
)


# ---------------------------------------------------------------------------------------------- roofline


def decode_weight_bytes(shape: ModelShape, dtype_bytes: int) -> int:
    """Bytes of weights one decode step reads: every projection, norm and the LM head.

    The embedding is a lookup of a few rows (negligible); with tied
    embeddings its matrix is read once, as the LM head.
    """
    per_layer = sum(k * n for k, n in shape.layer_gemms()) + 2 * shape.hidden_size
    params = shape.num_layers * per_layer + shape.hidden_size + shape.vocab_size * shape.hidden_size
    return params * dtype_bytes


def kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    """Bytes of keys and values one token holds across all layers."""
    return 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * dtype_bytes


def decode_roofline_s(shape: ModelShape, dtype_bytes: int, context_lens: Sequence[float],
                      bandwidth: float = H200_BANDWIDTH) -> float:
    """Shortest time of one decode step reading all weights and every request's context, in seconds.

    Args:
        shape: the model.
        dtype_bytes: bytes per weight and cache element.
        context_lens: tokens each request of the batch attends to.
        bandwidth: memory bandwidth, bytes/s.

    Raises:
        ValueError: when ``bandwidth <= 0``.
    """
    if bandwidth <= 0:
        raise ValueError(f"bandwidth must be > 0, got {bandwidth}")
    total = decode_weight_bytes(shape, dtype_bytes) + kv_bytes_per_token(shape, dtype_bytes) * sum(context_lens)
    return total / bandwidth


# ---------------------------------------------------------------------------------------------- runs


def _throughput(llm: Any, sizes: DecodeSizes, mode: str) -> dict[str, Any]:
    from pagedserve.engine import SamplingParams

    rng = np.random.default_rng(11)
    low, high = sizes.prompt_len_range
    prompts = random_prompts(rng, rng.integers(low, high + 1, size=sizes.num_prompts), sizes.shape.vocab_size)
    # The first launches compile the Triton kernels; other prompts, so the prefix cache gains nothing.
    warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm.generate(random_prompts(rng, [low] * 4, sizes.shape.vocab_size), warm, use_tqdm=False)
    params = SamplingParams(temperature=0.0, max_tokens=sizes.output_len, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    total_s = time.perf_counter() - start
    prompt_tokens = sum(len(p) for p in prompts)
    output_tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"mode": mode, "num_prompts": len(prompts), "prompt_tokens": prompt_tokens,
            "output_tokens": output_tokens, "total_s": total_s, "output_tok_per_s": output_tokens / total_s,
            "total_tok_per_s": (prompt_tokens + output_tokens) / total_s}


def _decode_steps(llm: Any, sizes: DecodeSizes, batch: int, mode: str, device: str) -> dict[str, Any]:
    """Time engine steps while ``batch`` requests, all past their prefill, decode together; then profile as many.

    ``step_ms`` comes from the unprofiled steps and is what the roofline judges:
    the profiler adds host time to every op. The breakdown comes from the
    profiled steps after them (``profiled_step_ms``); ``runner_ms`` is their time
    in the model runner's regions, which end with the copy of the sampled ids to
    the host and so include the device's work; the rest is scheduling and output
    handling.
    """
    from pagedserve.engine import SamplingParams

    # A request may sample while later ones still prefill: room for that, the warm-up, timed and profiled steps.
    prefill_steps = -(-batch * sizes.decode_context // sizes.max_num_batched_tokens) + 1
    params = SamplingParams(temperature=0.0, ignore_eos=True,
                            max_tokens=prefill_steps + DECODE_WARMUP_STEPS + 2 * sizes.decode_steps + 2)
    prompts = random_prompts(np.random.default_rng(batch), [sizes.decode_context] * batch, sizes.shape.vocab_size)
    requests = CoreRequests(llm, prompts, params, f"decode-{mode}-{batch}")
    requests.step_until_decoding()
    for _ in range(DECODE_WARMUP_STEPS):
        requests.step()
    # Timed step k computes each request's last sampled token and so attends to all its n + k known tokens.
    mean_context = (sizes.decode_context + float(np.mean(list(requests.generated.values())))
                    + (sizes.decode_steps - 1) / 2)
    sync(device)
    start = time.perf_counter()
    sampled = sum(requests.step() for _ in range(sizes.decode_steps))
    sync(device)
    step_s = (time.perf_counter() - start) / sizes.decode_steps
    breakdown = profile_steps(requests.step, sizes.decode_steps).breakdown_ms
    requests.finish()
    roofline_s = decode_roofline_s(sizes.shape, BF16_BYTES, [mean_context] * batch)
    return {"mode": mode, "batch": batch, "tokens_per_step": sampled / sizes.decode_steps,
            "mean_context": mean_context, "step_ms": step_s * 1e3, "roofline_ms": roofline_s * 1e3,
            "ratio_to_roofline": step_s / roofline_s, "profiled_step_ms": breakdown[STEP_REGION],
            "runner_ms": sum(breakdown[name] for name in RUNNER_REGIONS), "breakdown_ms": breakdown}


def run(ctx: CheckContext, sections: list[str]) -> None:
    """The chosen sections of ``THROUGHPUT`` and ``DECODE``, on one engine per mode; each part that raises
    is recorded in its section and the others still run."""
    from pagedserve.engine import LLM

    sizes = QUICK if ctx.quick else FULL
    folder = ctx.tmp / "random-1b"
    for name in sections:
        ctx.begin(name)
    try:
        seconds = save_random_model(sizes.shape, folder, torch.bfloat16, ctx.device)
        ctx.note(sections[0], f"random bf16 model of shape {asdict(sizes.shape)} built and saved in {seconds:.1f} s")
    except Exception:
        for name in sections:
            ctx.fail(name)
        return
    max_num_seqs = max(sizes.num_prompts, max(sizes.decode_batches))
    max_model_len = sizes.prompt_len_range[1] + sizes.output_len + 16
    # On CUDA the engine sizes its KV cache itself (profiling forward + gpu_memory_utilization).
    kv_args = ({"gpu_memory_utilization": 0.6} if ctx.device == "cuda"
               else {"num_gpu_blocks_override": max_num_seqs * -(-max_model_len // 16) + 1})
    for mode, eager in (("eager", True), ("cuda_graphs", False)):
        if ctx.out_of_time():
            for name in sections:
                ctx.note(name, f"{mode} skipped: time budget")
            continue
        log: list[str] = []
        try:
            with ctx.recorder.capture(log):
                start = time.perf_counter()
                llm = LLM(str(folder), device=ctx.device, dtype="bfloat16", enforce_eager=eager,
                          max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=sizes.max_num_batched_tokens, seed=0, **kv_args)
                load_s = time.perf_counter() - start
        except Exception:
            for name in sections:
                ctx.fail(name, prefix=f"{mode} engine: ")
            continue
        ctx.note(sections[0], f"{mode}: engine ready in {load_s:.1f} s ({attention_backend(llm)} attention); "
                 f"engine log: {' | '.join(log) or '-'}")
        if THROUGHPUT in sections:
            ctx.run_part(THROUGHPUT, lambda llm=llm, mode=mode: ctx.add_run(THROUGHPUT, _throughput(llm, sizes, mode)))
        if DECODE in sections:
            for batch in sizes.decode_batches:
                ctx.run_part(DECODE, lambda llm=llm, mode=mode, batch=batch: ctx.add_run(
                    DECODE, _decode_steps(llm, sizes, batch, mode, ctx.device)))
        del llm
        free_memory()
    for name in sections:
        ctx.end(name)


# ---------------------------------------------------------------------------------------------- report


def throughput_markdown(data: dict[str, Any]) -> list[str]:
    """One row per mode: tokens, time and rates."""
    rows = [[r["mode"], r["num_prompts"], r["prompt_tokens"], r["output_tokens"], r["total_s"],
             r["output_tok_per_s"], r["total_tok_per_s"]] for r in data.get("runs", [])]
    return table(["mode", "prompts", "prompt tokens", "output tokens", "total s", "output tok/s", "total tok/s"],
                 rows)


def decode_markdown(data: dict[str, Any]) -> list[str]:
    """Step time against the roofline per mode and batch, then each region's ms per profiled step."""
    runs = data.get("runs", [])
    lines = table(["mode", "batch", "tokens/step", "mean context", "step ms", "roofline ms", "step / roofline",
                   "profiled step ms", "of which runner ms"],
                  [[r["mode"], r["batch"], r["tokens_per_step"], r["mean_context"], r["step_ms"], r["roofline_ms"],
                    r["ratio_to_roofline"], r["profiled_step_ms"], r["runner_ms"]] for r in runs])
    regions = list(dict.fromkeys(name for r in runs for name in r["breakdown_ms"]))
    if regions:
        lines += ["", "Milliseconds per profiled step in each region the engine marks (host time: the device's "
                  "work shows where the host waits for it, in model_runner.sample; a replayed CUDA graph records "
                  "no attention region):", ""]
        lines += table(["region", *(f"{r['mode']} b{r['batch']}" for r in runs)],
                       [[name.strip(), *(r["breakdown_ms"].get(name) for r in runs)] for name in regions])
    return lines


def decode_goals(section: dict[str, Any]) -> list[str]:
    """The roofline and CUDA graph goals, each with the measured figure, where measured."""
    runs = {(r["mode"], r["batch"]): r for r in section.get("data", {}).get("runs", [])}
    lines = []
    widest = max((b for _, b in runs), default=None)
    graphs = runs.get(("cuda_graphs", widest))
    if graphs is not None:
        ok = graphs["ratio_to_roofline"] <= 2.0
        lines.append(f"Decode at batch {widest} within 2x of the roofline: {'yes' if ok else 'NO'} "
                     f"({graphs['ratio_to_roofline']:.2f}x)")
    eager, graphs_1 = runs.get(("eager", 1)), runs.get(("cuda_graphs", 1))
    if eager is not None and graphs_1 is not None:
        speedup = eager["step_ms"] / graphs_1["step_ms"]
        lines.append(f"CUDA graphs at batch 1 at least 2x faster than eager: {'yes' if speedup >= 2 else 'NO'} "
                     f"({speedup:.2f}x)")
    return lines
