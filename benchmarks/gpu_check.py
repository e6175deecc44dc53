"""One-shot device check for issue 7: is the engine correct and fast on an H100/H200?

Four sections, each run in its own ``try`` so that one failure is recorded
and the others still run:

a. greedy equivalence: tiny random-weight llama (llama3 rope scaling), qwen2,
   qwen3 and mistral checkpoints, run by ``engine.LLM`` on a batch of prompts
   of 3..200 tokens with chunked prefill, against transformers'
   ``generate(do_sample=False)`` in the same dtype on the same device: the
   first 16 tokens must be identical, or the report gives the first
   divergence and the reference's logit gap (top-1 minus top-2) there.
   bf16 and fp32 (fp32 is expected to match exactly);
b. the Triton paged-attention backend against the torch reference backend on
   realistic shapes (decodes with contexts up to 4096, prefill chunks of 512
   after context; 32 query heads, 8 KV heads, head_dim 128): max abs error
   and kernel time;
c. offline throughput of a random-weight model with Llama-3.2-1B's shape in
   bf16 (256 prompts of 128-1024 tokens, 256 out, ignore_eos), eager and with
   CUDA graphs;
d. decode step time at batch 1, 64 and 256 (context ~512) on that model,
   against the roofline (weight bytes + KV bytes read per step) / 4.8 TB/s.

The check imports only engine modules that need neither fastapi, uvicorn nor
gguf, so it runs on a machine whose Python has torch, triton and transformers
alone. It writes ``gpu_check_<device>.json`` and ``gpu_check_<device>.md`` to
``--out`` (rewritten after every section, so a killed run leaves what it had).

    benchmarks/gpu_check.sh                                   # the whole check, on CUDA (< 6 min on an H200)
    benchmarks/gpu_check.sh --device cpu --quick --sections a # a dry run with small sizes
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import json
import logging
import math
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from benchmarks.roofline import DTYPES, ModelShape

SECTIONS = {
    "a": "Greedy equivalence vs transformers",
    "b": "Triton attention vs torch reference",
    "c": "Offline throughput, Llama-3.2-1B shape",
    "d": "Decode step time vs roofline, Llama-3.2-1B shape",
}
#: H200 HBM3e bandwidth, bytes/s (the issue's roofline).
H200_BANDWIDTH = 4.8e12
#: Llama-3.2-1B: hidden 2048, intermediate 8192, 32 heads, 8 KV heads, head_dim 64, vocab 128256, 16 layers.
LLAMA_3_2_1B = ModelShape(hidden_size=2048, intermediate_size=8192, num_heads=32, num_kv_heads=8, head_dim=64,
                          vocab_size=128256, num_layers=16)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
#: Largest reference logit gap (top-1 minus top-2) at which a divergence still counts as a near-tie.
GAP_TOLERANCE = {"bfloat16": 0.1, "float32": 1e-3}
TINY_MODELS = ("llama", "qwen2", "qwen3", "mistral")
# Tokens 0, 1, 2 are <unk>, <s>, </s> in the check's tokenizer; prompts use the others.
_FIRST_PLAIN_TOKEN = 3


@dataclass(frozen=True)
class Sizes:
    """Every size the check uses; ``FULL`` for the device, ``QUICK`` for dry runs."""

    # (a) greedy equivalence
    greedy_prompt_lens: tuple[int, ...] = (3, 5, 8, 16, 17, 31, 64, 100, 129, 200)
    greedy_max_tokens: int = 16
    greedy_chunk: int = 32  # long_prefill_token_threshold
    greedy_step_tokens: int = 96  # max_num_batched_tokens
    # (b) attention kernel
    kernel_heads: tuple[int, int, int] = (32, 8, 128)  # query heads, KV heads, head_dim
    kernel_num_decodes: int = 64
    kernel_max_context: int = 4096
    kernel_chunk_contexts: tuple[int, ...] = (512, 1024, 2048, 3072)
    kernel_chunk_len: int = 512
    kernel_block_size: int = 16
    kernel_iters: int = 20
    # (c) throughput and (d) decode steps
    shape: ModelShape = LLAMA_3_2_1B
    num_prompts: int = 256
    prompt_len_range: tuple[int, int] = (128, 1024)
    output_len: int = 256
    max_num_batched_tokens: int = 8192
    decode_batches: tuple[int, ...] = (1, 64, 256)
    decode_context: int = 512
    decode_steps: int = 20


FULL = Sizes()
QUICK = Sizes(
    greedy_prompt_lens=(3, 17, 40), greedy_chunk=16, greedy_step_tokens=32,
    kernel_heads=(4, 2, 64), kernel_num_decodes=4, kernel_max_context=64, kernel_chunk_contexts=(16,),
    kernel_chunk_len=32, kernel_iters=2,
    shape=ModelShape(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32,
                     vocab_size=4096, num_layers=2),
    num_prompts=8, prompt_len_range=(16, 64), output_len=8, max_num_batched_tokens=128,
    decode_batches=(1, 4), decode_context=32, decode_steps=3,
)


# ---------------------------------------------------------------------------------------------- pure helpers


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


def decode_roofline_s(shape: ModelShape, dtype_bytes: int, context_lens: Sequence[int],
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


def parse_sections(text: str) -> list[str]:
    """``"a,c"`` -> ``["a", "c"]`` in check order.

    Raises:
        ValueError: on an unknown section name.
    """
    names = {s.strip().lower() for s in text.split(",") if s.strip()}
    unknown = names - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    return [s for s in SECTIONS if s in names]


# ---------------------------------------------------------------------------------------------- summary


def _fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}g}" if abs(value) < 1e-2 or abs(value) >= 1e4 else f"{value:.{digits}f}"
    return str(value)


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_fmt(v) for v in row) + " |" for row in rows]
    return lines


def _markdown_a(data: dict[str, Any]) -> list[str]:
    rows = []
    for run in data.get("runs", []):
        diverged = [f"#{i} (len {c['prompt_len']}): step {c['first_divergence']}, gap {_fmt(c.get('logit_gap'))}"
                    for i, c in enumerate(run["prompts"]) if not c["identical"]]
        identical = sum(c["identical"] for c in run["prompts"])
        rows.append([run["model"], run["dtype"], run.get("backend"), f"{identical}/{len(run['prompts'])}",
                     "; ".join(diverged) or "-", run["verdict"]])
    lines = _table(["model", "dtype", "attention", "identical", "divergences", "verdict"], rows)
    tolerance = ", ".join(f"{v} in {k}" for k, v in GAP_TOLERANCE.items())
    return lines + ["", f"A divergence passes as a near-tie when the reference's top-1 minus top-2 logit gap there "
                        f"is at most {tolerance}."]


def _markdown_b(data: dict[str, Any]) -> list[str]:
    rows = [[c["case"], c["dtype"], c["num_tokens"], c["max_abs_err_triton_vs_torch"],
             c.get("max_abs_err_triton_vs_fp32"), c.get("max_abs_err_torch_vs_fp32"), c["triton_ms"],
             c["torch_ms"], c["speedup"]] for c in data.get("cases", [])]
    return _table(["case", "dtype", "tokens", "max err triton-torch", "triton err vs fp32", "torch err vs fp32",
                   "triton ms", "torch ms", "speedup"], rows)


def _markdown_c(data: dict[str, Any]) -> list[str]:
    rows = [[r["mode"], r["num_prompts"], r["prompt_tokens"], r["output_tokens"], r["total_s"],
             r["output_tok_per_s"], r["total_tok_per_s"]] for r in data.get("runs", [])]
    return _table(["mode", "prompts", "prompt tokens", "output tokens", "total s", "output tok/s", "total tok/s"],
                  rows)


def _markdown_d(data: dict[str, Any]) -> list[str]:
    rows = [[r["mode"], r["batch"], r["tokens_per_step"], r["mean_context"], r["step_ms"], r["runner_ms"],
             r["roofline_ms"], r["ratio_to_roofline"]] for r in data.get("runs", [])]
    return _table(["mode", "batch", "tokens/step", "mean context", "step ms", "of which runner ms", "roofline ms",
                   "step / roofline"], rows)


_MARKDOWN = {"a": _markdown_a, "b": _markdown_b, "c": _markdown_c, "d": _markdown_d}


def goals(sections: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's goals, each as a line saying what was measured (or that it was not)."""
    lines = []
    runs_a = sections.get("a", {}).get("data", {}).get("runs", [])
    if runs_a:
        failed = [f"{r['model']}/{r['dtype']}" for r in runs_a if r["verdict"] != "pass"]
        failed += ["runs that raised (see (a))"] if sections["a"]["status"] == "error" else []
        lines.append(f"Greedy equivalence: {'FAIL: ' + ', '.join(failed) if failed else 'pass'} "
                     f"({len(runs_a)} model/dtype runs)")
    runs_d = {(r["mode"], r["batch"]): r for r in sections.get("d", {}).get("data", {}).get("runs", [])}
    widest = max((b for _, b in runs_d), default=None)
    graphs = runs_d.get(("cuda_graphs", widest))
    if graphs is not None:
        ok = graphs["ratio_to_roofline"] <= 2.0
        lines.append(f"Decode at batch {widest} within 2x of the roofline: {'yes' if ok else 'NO'} "
                     f"({graphs['ratio_to_roofline']:.2f}x)")
    eager, graphs_1 = runs_d.get(("eager", 1)), runs_d.get(("cuda_graphs", 1))
    if eager is not None and graphs_1 is not None:
        speedup = eager["step_ms"] / graphs_1["step_ms"]
        lines.append(f"CUDA graphs at batch 1 at least 2x faster than eager: {'yes' if speedup >= 2 else 'NO'} "
                     f"({speedup:.2f}x)")
    return lines or ["No goal was measured in this run."]


def render_markdown(results: dict[str, Any]) -> str:
    """The Markdown summary of a results dict (as ``run_check`` builds it)."""
    meta = results["meta"]
    lines = [f"# GPU check ({meta['device']}{', quick' if meta.get('quick') else ''})", "",
             f"{meta.get('device_name', '?')}; torch {meta.get('torch')}, triton {meta.get('triton')}, "
             f"transformers {meta.get('transformers')}; started {meta.get('started')}, "
             f"{_fmt(meta.get('elapsed_s'))} s.", "", "## Goals", ""]
    if meta["device"] != "cuda":
        lines += ["- Dry run off CUDA: times and goals below say nothing about a GPU."]
    lines += [f"- {line}" for line in goals(results["sections"])]
    for name, section in results["sections"].items():
        lines += ["", f"## ({name}) {SECTIONS[name]}", "",
                  f"Status: **{section['status']}** in {_fmt(section.get('elapsed_s'))} s.", ""]
        if section.get("error"):
            lines += ["```", section["error"].rstrip(), "```", ""]
        if section.get("data"):
            lines += _MARKDOWN[name](section["data"])
        if section.get("notes"):
            lines += [""] + [f"- {note}" for note in section["notes"]]
    return "\n".join(lines) + "\n"


def write_summary(results: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write ``gpu_check_<device>.json`` and ``.md`` into ``out`` (created); returns both paths."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_check_{results['meta']['device']}"
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    md_path.write_text(render_markdown(results))
    return json_path, md_path


# ---------------------------------------------------------------------------------------------- fixtures


def build_tokenizer(vocab_size: int) -> Any:
    """A whitespace word-level tokenizer over ``<unk> <s> </s> t3 t4 ...``: id i <-> word ``t{i}``.

    Built in code (the check machine has no gguf and no hub access); big
    enough vocabularies (128256 words) take under a second.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(_FIRST_PLAIN_TOKEN, vocab_size)]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>", pad_token="<unk>")


def random_prompts(rng: np.random.Generator, lengths: Sequence[int], vocab_size: int) -> list[list[int]]:
    """One prompt of random plain-token ids per length."""
    return [rng.integers(_FIRST_PLAIN_TOKEN, vocab_size, size=int(n)).tolist() for n in lengths]


def save_random_model(shape: ModelShape, folder: Path, dtype: torch.dtype, device: str) -> float:
    """Write a random-weight Llama (llama3 rope, tied embeddings) of ``shape`` and a tokenizer to ``folder``.

    Weights are drawn by transformers' own initialiser directly on ``device``.

    Returns:
        Seconds it took.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    start = time.perf_counter()
    config = AutoConfig.for_model(
        "llama", vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size, num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads, head_dim=shape.head_dim,
        max_position_embeddings=131072, tie_word_embeddings=True, rope_parameters=dict(LLAMA3_ROPE),
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(folder)
    build_tokenizer(shape.vocab_size).save_pretrained(folder)
    del model
    _free_memory()
    return time.perf_counter() - start


def _free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def _attention_backend(llm: Any) -> str:
    """Class name of the attention backend the engine's model runs with."""
    for module in llm.engine_core.model_runner.model.modules():
        backend = getattr(module, "backend", None)
        if backend is not None:
            return type(backend).__name__
    return "?"


class _LogRecorder(logging.Handler):
    """Keeps the engine's INFO messages (memory sizing, graph capture time) for the report."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(f"{record.name}: {record.getMessage()}")

    @contextlib.contextmanager
    def capture(self, into: list[str]) -> Iterator[None]:
        start = len(self.messages)
        try:
            yield
        finally:
            into.extend(self.messages[start:])


# ---------------------------------------------------------------------------------------------- (a)


def _reference_generate(folder: Path, prompts: list[list[int]], max_tokens: int, dtype: torch.dtype,
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
    _free_memory()
    return outputs


def _greedy_run(ctx: CheckContext, model_type: str, folder: Path, dtype_name: str) -> dict[str, Any]:
    """One tiny model in one dtype: the engine's and transformers' greedy outputs, compared prompt by prompt."""
    from engine import LLM, SamplingParams

    sizes = ctx.sizes
    prompts = random_prompts(np.random.default_rng(7), sizes.greedy_prompt_lens, 256)
    llm = LLM(str(folder), device=ctx.device, dtype=dtype_name, max_model_len=256, max_num_seqs=16,
              max_num_batched_tokens=sizes.greedy_step_tokens, long_prefill_token_threshold=sizes.greedy_chunk,
              kv_cache_memory_bytes="256MiB", seed=0)
    backend = _attention_backend(llm)
    params = SamplingParams(temperature=0.0, max_tokens=sizes.greedy_max_tokens, ignore_eos=True)
    engine_out = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    _free_memory()
    reference = _reference_generate(folder, prompts, sizes.greedy_max_tokens, DTYPES[dtype_name], ctx.device)
    comparisons = [{"prompt_len": len(p), **compare_greedy(e, r, logits)}
                   for p, e, (r, logits) in zip(prompts, engine_out, reference, strict=True)]
    verdict = greedy_verdict(comparisons, dtype_name)
    ctx.say(f"(a) {model_type:8s} {dtype_name:9s} {backend}: "
            f"{sum(c['identical'] for c in comparisons)}/{len(comparisons)} identical -> {verdict}")
    return {"model": model_type, "dtype": dtype_name, "backend": backend, "verdict": verdict,
            "prompts": comparisons}


def section_greedy(ctx: CheckContext) -> dict[str, Any]:
    """(a) engine vs transformers, greedy, per tiny architecture and dtype; a failing run leaves the others."""
    from tests.model_fixtures import tiny_hf_model

    sizes = ctx.sizes
    runs: list[dict[str, Any]] = []
    data = {"prompt_lens": list(sizes.greedy_prompt_lens), "max_tokens": sizes.greedy_max_tokens,
            "long_prefill_token_threshold": sizes.greedy_chunk, "runs": runs}
    ctx.section("a")["data"] = data  # saved after every run, so an interrupted check keeps them

    def save(model_type: str, folder: Path) -> None:
        tiny_hf_model(model_type, folder, tie_word_embeddings=model_type in ("llama", "qwen3"))
        build_tokenizer(256).save_pretrained(folder)

    for model_type in ctx.models:
        folder = ctx.tmp / f"tiny-{model_type}"
        if not ctx.run_part("a", lambda m=model_type, f=folder: save(m, f)):
            continue
        for dtype_name in ("bfloat16", "float32"):
            if ctx.out_of_time():
                ctx.note("a", f"{model_type}/{dtype_name} skipped: time budget")
                continue
            ctx.run_part("a", lambda m=model_type, f=folder, d=dtype_name: runs.append(_greedy_run(ctx, m, f, d)))
            ctx.save()
    return data


# ---------------------------------------------------------------------------------------------- (b)


def _time_ms(fn: Callable[[], object], device: str, iters: int, warmup: int = 3) -> float:
    """Mean time of ``fn`` in ms (CUDA events on CUDA, wall clock elsewhere) after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    if device != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) * 1e3 / iters
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters


@dataclass
class _KernelStep:
    """A random attention step: inputs, a fully written cache and the metadata."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: Any


def _kernel_step(sizes: Sizes, context_lens: list[int], query_lens: list[int], dtype: torch.dtype,
                 device: str, seed: int = 0) -> _KernelStep:
    from tests.model_fixtures import build_metadata

    num_heads, num_kv_heads, head_dim = sizes.kernel_heads
    block_size = sizes.kernel_block_size
    gen = np.random.default_rng(seed)
    blocks_per_req = [-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens, strict=True)]
    ids = gen.permutation(np.arange(1, sum(blocks_per_req) + 1))
    bounds = np.cumsum([0] + blocks_per_req)
    tables = [ids[bounds[i]:bounds[i + 1]].tolist() for i in range(len(blocks_per_req))]
    metadata = build_metadata(tables, context_lens, query_lens, block_size, device)
    torch.manual_seed(seed)
    num_tokens = sum(query_lens)
    return _KernelStep(
        query=torch.randn(num_tokens, num_heads, head_dim, device=device, dtype=dtype),
        key=torch.randn(num_tokens, num_kv_heads, head_dim, device=device, dtype=dtype),
        value=torch.randn(num_tokens, num_kv_heads, head_dim, device=device, dtype=dtype),
        kv_cache=torch.randn(2, sum(blocks_per_req) + 1, block_size, num_kv_heads, head_dim, device=device,
                             dtype=dtype),
        metadata=metadata)


def kernel_cases(sizes: Sizes) -> dict[str, tuple[list[int], list[int]]]:
    """Case name -> (context lengths, query lengths) of the attention steps section (b) runs."""
    n = sizes.kernel_num_decodes
    decode_contexts = np.linspace(0, sizes.kernel_max_context - 1, n).astype(int).tolist()
    chunks = list(sizes.kernel_chunk_contexts)
    return {
        f"decode x{n}, ctx 1-{sizes.kernel_max_context}": (decode_contexts, [1] * n),
        f"mixed: {n} decodes + {len(chunks)} chunks of {sizes.kernel_chunk_len}":
            (decode_contexts + chunks, [1] * n + [sizes.kernel_chunk_len] * len(chunks)),
    }


def _kernel_case(case: str, context_lens: list[int], query_lens: list[int], dtype_name: str, sizes: Sizes,
                 device: str) -> dict[str, Any]:
    """Errors and times of both backends on one step; bf16 errors are also measured against fp32."""
    from engine.model.attention import get_attention_backend

    step = _kernel_step(sizes, context_lens, query_lens, DTYPES[dtype_name], device)
    args = (step.query, step.key, step.value, step.kv_cache, step.metadata, sizes.kernel_heads[2] ** -0.5)
    triton_backend, torch_backend = get_attention_backend("triton"), get_attention_backend("torch")
    out_triton = triton_backend.forward(*args).float()
    out_torch = torch_backend.forward(*args).float()
    row: dict[str, Any] = {"case": case, "dtype": dtype_name, "num_tokens": sum(query_lens),
                           "max_abs_err_triton_vs_torch": (out_triton - out_torch).abs().max().item()}
    if dtype_name != "float32":
        ref = get_attention_backend("torch").forward(*(t.float() for t in args[:4]), *args[4:])
        row["max_abs_err_triton_vs_fp32"] = (out_triton - ref).abs().max().item()
        row["max_abs_err_torch_vs_fp32"] = (out_torch - ref).abs().max().item()
    row["triton_ms"] = _time_ms(lambda: triton_backend.forward(*args), device, sizes.kernel_iters)
    row["torch_ms"] = _time_ms(lambda: torch_backend.forward(*args), device, sizes.kernel_iters)
    row["speedup"] = row["torch_ms"] / row["triton_ms"]
    return row


def section_kernel(ctx: CheckContext) -> dict[str, Any]:
    """(b) the Triton backend against the torch backend, error and time."""
    sizes = ctx.sizes
    cases = []
    for case, (context_lens, query_lens) in kernel_cases(sizes).items():
        for dtype_name in ("bfloat16", "float32"):
            row = _kernel_case(case, context_lens, query_lens, dtype_name, sizes, ctx.device)
            _free_memory()
            cases.append(row)
            ctx.say(f"(b) {case} {dtype_name}: max err {row['max_abs_err_triton_vs_torch']:.3g}, "
                    f"triton {row['triton_ms']:.3f} ms, torch {row['torch_ms']:.3f} ms")
    num_heads, num_kv_heads, head_dim = sizes.kernel_heads
    return {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
            "block_size": sizes.kernel_block_size, "cases": cases}


# ---------------------------------------------------------------------------------------------- (c), (d)


def _throughput(llm: Any, sizes: Sizes, mode: str) -> dict[str, Any]:
    from engine import SamplingParams

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


@contextlib.contextmanager
def _timed_calls(obj: Any, name: str, seconds: list[float]) -> Iterator[None]:
    """Append the wall time of every call of ``obj.<name>`` to ``seconds`` while the block runs."""
    original = getattr(obj, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        result = original(*args, **kwargs)
        seconds.append(time.perf_counter() - start)
        return result

    setattr(obj, name, timed)
    try:
        yield
    finally:
        delattr(obj, name)  # the class's method shows through again


def _decode_steps(llm: Any, sizes: Sizes, batch: int, mode: str, device: str, dtype_bytes: int
                  ) -> dict[str, Any]:
    """Time engine steps while ``batch`` requests, all past their prefill, decode together.

    ``runner_ms`` is the share of a step spent in ``ModelRunner.execute_model``
    (input preparation, forward, sampling, up to the copy of the sampled ids);
    the rest is scheduling and output handling.
    """
    from engine import SamplingParams

    core = llm.engine_core
    warmup = 3
    prefill_steps = -(-batch * sizes.decode_context // sizes.max_num_batched_tokens) + 1
    params = SamplingParams(temperature=0.0, max_tokens=prefill_steps + warmup + sizes.decode_steps + 2,
                            ignore_eos=True)
    prompts = random_prompts(np.random.default_rng(batch), [sizes.decode_context] * batch, sizes.shape.vocab_size)
    num_tokens = {f"decode-{mode}-{batch}-{i}": sizes.decode_context for i in range(batch)}
    for request_id, prompt in zip(num_tokens, prompts, strict=True):
        core.add_request(request_id, prompt, params)

    def step() -> int:
        outputs = core.step()
        for output in outputs:
            num_tokens[output.request_id] += len(output.new_token_ids)
        return sum(len(o.new_token_ids) for o in outputs)

    while min(num_tokens.values()) == sizes.decode_context:  # until no request is left in prefill
        step()
    for _ in range(warmup):
        step()
    # Timed step k computes each request's last sampled token and so attends to all its n + k known tokens.
    mean_context = float(np.mean(list(num_tokens.values()))) + (sizes.decode_steps - 1) / 2
    runner_s: list[float] = []
    _sync(device)
    start = time.perf_counter()
    with _timed_calls(core.model_runner, "execute_model", runner_s):
        sampled = sum(step() for _ in range(sizes.decode_steps))
    _sync(device)
    step_s = (time.perf_counter() - start) / sizes.decode_steps
    core.abort_requests(list(num_tokens))
    while core.has_unfinished_requests():
        core.step()
    roofline_s = decode_roofline_s(sizes.shape, dtype_bytes, [mean_context] * batch)
    return {"mode": mode, "batch": batch, "tokens_per_step": sampled / sizes.decode_steps,
            "mean_context": mean_context, "step_ms": step_s * 1e3, "runner_ms": float(np.mean(runner_s)) * 1e3,
            "roofline_ms": roofline_s * 1e3, "ratio_to_roofline": step_s / roofline_s}


def section_one_b(ctx: CheckContext, sections: list[str]) -> None:
    """(c) and (d): one engine per mode (eager, CUDA graphs) on the random 1B-shape model serves both."""
    from engine import LLM

    sizes = ctx.sizes
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
    # On CUDA the engine sizes its KV cache itself (profiling forward + gpu_memory_utilization, issue 7 point 1).
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
        ctx.note(sections[0], f"{mode}: engine ready in {load_s:.1f} s ({_attention_backend(llm)}); "
                 f"engine log: {' | '.join(log) or '-'}")
        if "c" in sections:
            ctx.run_part("c", lambda llm=llm, mode=mode: ctx.add_run("c", _throughput(llm, sizes, mode)))
        if "d" in sections:
            for batch in sizes.decode_batches:
                ctx.run_part("d", lambda llm=llm, mode=mode, batch=batch: ctx.add_run(
                    "d", _decode_steps(llm, sizes, batch, mode, ctx.device, 2)))
        del llm
        _free_memory()
    for name in sections:
        ctx.end(name)


# ---------------------------------------------------------------------------------------------- driver


@dataclass
class CheckContext:
    """What the sections share: sizes, device, scratch folder, the results and the time budget."""

    device: str
    sizes: Sizes
    models: tuple[str, ...]
    tmp: Path
    out: Path
    deadline: float
    results: dict[str, Any]
    recorder: _LogRecorder = field(default_factory=_LogRecorder)
    _started: dict[str, float] = field(default_factory=dict)

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def say(self, line: str) -> None:
        print(line, flush=True)

    def section(self, name: str) -> dict[str, Any]:
        return self.results["sections"].setdefault(name, {"status": "pending", "data": {}, "notes": []})

    def begin(self, name: str) -> None:
        self._started[name] = time.perf_counter()
        self.section(name)["status"] = "running"
        self.say(f"({name}) {SECTIONS[name]} ...")

    def end(self, name: str) -> None:
        section = self.section(name)
        if section["status"] == "running":
            section["status"] = "ok"
        section["elapsed_s"] = time.perf_counter() - self._started[name]
        self.save()

    def record_error(self, name: str, prefix: str = "") -> None:
        """Add the exception being handled to the section's error and mark it failed."""
        section = self.section(name)
        section["status"] = "error"
        section["error"] = (section.get("error") or "") + prefix + traceback.format_exc()
        self.say(f"({name}) error: {prefix}{traceback.format_exc().strip().splitlines()[-1]}")

    def fail(self, name: str, prefix: str = "") -> None:
        """Record the exception being handled and close the section."""
        self.record_error(name, prefix)
        self.end(name)

    def note(self, name: str, text: str) -> None:
        self.section(name)["notes"].append(text)

    def add_run(self, name: str, run: dict[str, Any]) -> None:
        self.section(name)["data"].setdefault("runs", []).append(run)
        self.say(f"({name}) " + ", ".join(f"{k} {_fmt(v)}" for k, v in run.items()))
        self.save()

    def run_part(self, name: str, fn: Callable[[], object]) -> bool:
        """Run one part of a section; an exception marks the section as failed but lets later parts run.

        Returns:
            Whether the part succeeded.
        """
        try:
            fn()
        except Exception:
            self.record_error(name)
            return False
        return True

    def run_section(self, name: str, fn: Callable[[CheckContext], dict[str, Any]]) -> None:
        self.begin(name)
        if self.out_of_time():
            self.section(name)["status"] = "skipped"
            self.note(name, "time budget spent before this section")
        else:
            try:
                self.section(name)["data"] = fn(self)
            except Exception:
                self.fail(name)
                return
        self.end(name)

    def save(self) -> None:
        self.results["meta"]["elapsed_s"] = time.perf_counter() - self.results["meta"]["_t0"]
        write_summary({**self.results, "meta": {k: v for k, v in self.results["meta"].items() if k != "_t0"}},
                      self.out)


def _versions(device: str) -> dict[str, Any]:
    meta: dict[str, Any] = {"torch": torch.__version__, "python": platform.python_version()}
    for package in ("triton", "transformers"):
        # Read from the metadata: importing triton here would fix TRITON_INTERPRET for the whole process.
        try:
            meta[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            meta[package] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        meta.update(device_name=props.name, cuda=torch.version.cuda, gpu_memory_gib=props.total_memory / 2**30,
                    allow_tf32=torch.backends.cuda.matmul.allow_tf32)
    else:
        meta["device_name"] = platform.processor() or platform.machine()
    return meta


def run_check(device: str, sections: list[str], quick: bool, out: Path, models: tuple[str, ...] = TINY_MODELS,
              time_budget_s: float = 300.0) -> dict[str, Any]:
    """Run the chosen sections and write the summary; returns the results dict."""
    sizes = QUICK if quick else FULL
    results: dict[str, Any] = {
        "meta": {"device": device, "quick": quick, "sections": sections, "argv": sys.argv[1:],
                 "started": datetime.now(UTC).isoformat(timespec="seconds"), "_t0": time.perf_counter(),
                 "roofline_bandwidth_bytes_per_s": H200_BANDWIDTH, **_versions(device)},
        "sections": {},
    }
    recorder = _LogRecorder()
    engine_logger = logging.getLogger("engine")
    engine_logger.setLevel(logging.INFO)
    engine_logger.addHandler(recorder)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        ctx = CheckContext(device, sizes, models, Path(tmp), out, time.monotonic() + time_budget_s, results,
                           recorder)
        if "a" in sections:
            ctx.run_section("a", section_greedy)
        if "b" in sections:
            ctx.run_section("b", section_kernel)
        one_b = [s for s in ("c", "d") if s in sections]
        if one_b:
            section_one_b(ctx, one_b)
    engine_logger.removeHandler(recorder)
    ctx.save()
    results["meta"].pop("_t0")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu = dry run (Triton through its interpreter)")
    parser.add_argument("--sections", default="a,b,c,d", help="comma list of a,b,c,d")
    parser.add_argument("--quick", action="store_true", help="small sizes everywhere (dry runs)")
    parser.add_argument("--models", default=",".join(TINY_MODELS), help="tiny architectures of section a")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--time-budget", type=float, default=300.0,
                        help="seconds after which remaining parts are skipped (the check must end within 6 min)")
    args = parser.parse_args(argv)
    sections = parse_sections(args.sections)
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    unknown = set(models) - set(TINY_MODELS)
    if unknown:
        parser.error(f"unknown --models {sorted(unknown)}; choose from {','.join(TINY_MODELS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; nothing measured (use --device cpu for a dry run).")
        return 0
    if args.device == "cpu":
        # triton.jit reads this when the kernels are decorated, i.e. at the engine's first import below.
        os.environ.setdefault("TRITON_INTERPRET", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    console = logging.StreamHandler()
    console.setLevel(logging.WARNING)
    logging.basicConfig(level=logging.WARNING, handlers=[console])
    results = run_check(args.device, sections, args.quick, args.out, models, args.time_budget)
    json_path, md_path = args.out / f"gpu_check_{args.device}.json", args.out / f"gpu_check_{args.device}.md"
    if args.device != "cuda":
        print("Dry run off CUDA: the times and goals below say nothing about a GPU.")
    print("\n".join(goals(results["sections"])))
    statuses = ", ".join(f"{name}={section['status']}" for name, section in results["sections"].items())
    print(f"gpu_check: {statuses}; "
          f"wrote {json_path} and {md_path} in {results['meta']['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
