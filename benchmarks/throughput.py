"""Offline throughput: our ``LLM.generate`` against transformers ``generate`` on the same prompts.

One run measures, on the embedded SmolLM2-135M in ``--dtype`` (float32 unless
told; both engines), greedy, every output exactly ``--output-len`` tokens long
(``ignore_eos``):

1. output tokens/s of ``LLM.generate`` over all prompts at once;
2. transformers ``generate`` one prompt at a time, on ``--hf-sequential-prompts``
   of the prompts picked evenly over their lengths; its tokens/s stands for the
   whole set (it is too slow to run all of them);
3. transformers batched ``generate`` (left padding, ``--hf-batch-size`` rows per call);
4. single-request decode tokens/s, ours against transformers, from the times at
   which each output token appears (our ``EngineCore.step()`` loop, a
   transformers streamer): ``output_len - 1`` tokens after the first, so
   prefill is excluded; neither side detokenizes.

Each phase runs in its own spawned process, so its peak RSS is its own and no
phase inherits another's allocator state. ``--threads`` sets torch's thread
count in every phase (on a CPU shared with other work, fewer threads than cores
keeps OpenMP threads from waiting on descheduled peers). The run prints a
Markdown table and can write JSON. ``--profile`` adds a torch.profiler trace of
a few decode steps of our engine with all ``--num-prompts`` requests decoding,
and prints where the time of one step goes, by the regions the engine marks
(``benchmarks.step_profile``).

    python -m benchmarks.throughput [--num-prompts 64 --input-len 64:512 --output-len 128]
        [--hf-sequential-prompts 8] [--hf-batch-size 64] [--threads N] [--profile] [--quick]
        [--result-json PATH]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks.core_requests import CoreRequests
from benchmarks.roofline import DTYPES, cpu_model, num_threads
from benchmarks.step_profile import ATTENTION_ROW, STEP_REGION, profile_steps
from pagedserve.server.bench.dataset import Tokenizer, parse_len_range, sample_requests

#: Goals of issue 3: ours / baseline at least this much.
GOALS = {"batched": 1.0, "sequential": 5.0, "single_decode": 0.9}
MAX_NUM_SEQS = 64
#: Prompts and new tokens of the warm-up call each phase makes before timing.
WARMUP_PROMPTS = 2
WARMUP_TOKENS = 4
#: Engine steps run after every request has left prefill and before the profiler starts; also timed unprofiled.
PROFILE_WARMUP_STEPS = 3


@dataclass(frozen=True)
class BenchConfig:
    """Sizes of one run; lengths in tokens.

    Raises:
        ValueError: on a size out of range, naming the field.
    """

    num_prompts: int = 64
    input_len: tuple[int, int] = (64, 512)  # inclusive range
    output_len: int = 128
    hf_sequential_prompts: int = 8
    hf_batch_size: int = 64
    single_prompt_len: int = 128
    profile_steps: int = 5
    max_num_batched_tokens: int = 2048
    kv_cache_memory: str = "2GiB"  # holds every prompt plus its output at once: no preemption
    seed: int = 0
    threads: int | None = None  # torch threads in every phase; None = torch's default
    dtype: str = "float32"  # of both engines' weights and activations

    def __post_init__(self) -> None:
        for name, low in (("num_prompts", 1), ("output_len", 2), ("hf_sequential_prompts", 1), ("hf_batch_size", 1),
                          ("single_prompt_len", 1), ("profile_steps", 1), ("threads", 1)):
            if getattr(self, name) is not None and getattr(self, name) < low:
                raise ValueError(f"{name} must be >= {low}, got {getattr(self, name)}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.hf_sequential_prompts > self.num_prompts:
            raise ValueError(f"hf_sequential_prompts must be <= num_prompts ({self.num_prompts}), "
                             f"got {self.hf_sequential_prompts}")

    @property
    def profile_max_tokens(self) -> int:
        """Output tokens of each profiled request: enough to still be decoding while the profiler runs."""
        return self.output_len + PROFILE_WARMUP_STEPS + self.profile_steps

    @property
    def max_model_len(self) -> int:
        """Longest sequence any phase runs, in tokens."""
        return max(self.input_len[1], self.single_prompt_len) + self.profile_max_tokens


QUICK = BenchConfig(num_prompts=2, input_len=(16, 32), output_len=4, hf_sequential_prompts=2, hf_batch_size=2,
                    single_prompt_len=16, profile_steps=1, kv_cache_memory="256MiB")


@dataclass(frozen=True)
class Prompts:
    """Token-id prompts, identical for every phase."""

    batch: list[list[int]]  # the throughput prompts
    single: list[int]  # the single-request prompt
    warmup: list[list[int]]  # short prompts sharing no prefix with the others


# ---------------------------------------------------------------------------------------------- pure helpers


def spread_subset(lengths: Sequence[int], count: int) -> list[int]:
    """Indices of ``count`` prompts spread evenly over the length distribution, in ascending index order.

    The k-th pick is the prompt at quantile ``(k + 0.5) / count`` of the lengths, so the
    subset's mean length tracks the whole set's.

    Raises:
        ValueError: when ``count`` is not in ``[1, len(lengths)]``.
    """
    if not 1 <= count <= len(lengths):
        raise ValueError(f"count must be in [1, {len(lengths)}], got {count}")
    by_length = sorted(range(len(lengths)), key=lambda i: (lengths[i], i))
    return sorted(by_length[int((k + 0.5) * len(lengths) / count)] for k in range(count))


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token-id prompts into one batch.

    Returns:
        ``input_ids`` and ``attention_mask``, both ``[len(prompts), longest]`` int64; the mask is 0 on padding.

    Raises:
        ValueError: when ``prompts`` is empty or holds an empty prompt.
    """
    if not prompts or not all(prompts):
        raise ValueError("prompts must be a non-empty list of non-empty prompts")
    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.int64)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.int64)
    for row, prompt in enumerate(prompts):
        input_ids[row, width - len(prompt):] = torch.tensor(prompt, dtype=torch.int64)
        attention_mask[row, width - len(prompt):] = 1
    return input_ids, attention_mask


def decode_tok_per_s(token_times_s: Sequence[float]) -> float:
    """Decode rate of one request: the tokens after the first over the time since the first (prefill excluded).

    Args:
        token_times_s: when each output token appeared, seconds on one clock, ascending.

    Raises:
        ValueError: with fewer than 2 tokens or no time between the first and the last.
    """
    if len(token_times_s) < 2 or token_times_s[-1] <= token_times_s[0]:
        raise ValueError(f"need >= 2 ascending token times, got {list(token_times_s)}")
    return (len(token_times_s) - 1) / (token_times_s[-1] - token_times_s[0])


def split_steps(steps: Sequence[tuple[float, int, int]]) -> dict[str, float | int]:
    """Split engine steps into those that ran prompt tokens and decode-only ones.

    Args:
        steps: per step, (seconds, tokens scheduled, tokens sampled); a step is decode-only when every
            scheduled token was the last of its request, i.e. as many were sampled as scheduled. Steps that
            schedule nothing (the one that lets the worker drop finished requests) count in neither kind.

    Returns:
        Seconds and step counts of each kind, and the mean decode batch (requests per decode-only step).
    """
    decode = [(s, sampled) for s, scheduled, sampled in steps if scheduled == sampled > 0]
    prefill_s = [s for s, scheduled, sampled in steps if scheduled != sampled]
    return {"prefill_steps": len(prefill_s), "prefill_s": sum(prefill_s), "decode_steps": len(decode),
            "decode_s": sum(s for s, _ in decode),
            "mean_decode_batch": statistics.mean(n for _, n in decode) if decode else 0.0}


def comparisons(phases: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per goal: our rate, the baseline's, their ratio and whether the goal is met.

    Args:
        phases: phase name -> its result; needs ``engine``, ``hf_sequential``, ``hf_batched``
            (``output_tok_per_s``) and ``engine_single``, ``hf_single`` (``decode_tok_per_s``).
    """
    pairs = {
        "batched": ("engine", "hf_batched", "output_tok_per_s"),
        "sequential": ("engine", "hf_sequential", "output_tok_per_s"),
        "single_decode": ("engine_single", "hf_single", "decode_tok_per_s"),
    }
    rows = []
    for goal, (ours, baseline, key) in pairs.items():
        ratio = phases[ours][key] / phases[baseline][key]
        rows.append({"goal": goal, "ours": phases[ours][key], "baseline": phases[baseline][key], "ratio": ratio,
                     "target": GOALS[goal], "met": ratio >= GOALS[goal]})
    return rows


def peak_rss_mib() -> float:
    """Peak resident set size of this process, MiB (``ru_maxrss`` is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def markdown_report(report: dict[str, Any]) -> str:
    """The result tables, as Markdown."""
    cfg, phases = report["config"], report["phases"]
    low, high = cfg["input_len"]
    titles = {
        "batched": f"vs transformers batched `generate` (batch {cfg['hf_batch_size']}, left padding), output tok/s",
        "sequential": f"vs transformers one prompt at a time, output tok/s (from {cfg['hf_sequential_prompts']} "
                      f"of {cfg['num_prompts']} prompts)",
        "single_decode": f"single request, decode tok/s ({cfg['single_prompt_len']}-token prompt, prefill excluded)",
    }
    machine = report["machine"]
    threads = sorted({p["torch_threads"] for p in phases.values()})
    lines = [f"{cfg['num_prompts']} prompts of {low}-{high} tokens, {cfg['output_len']} output tokens each, "
             f"greedy, {cfg.get('dtype', 'float32')}; {machine['cpu']}, {machine['cpu_cores']} cores, "
             f"torch threads {threads}, "
             f"torch {machine['torch']}, transformers {machine['transformers']}.", "",
             "| Measurement | Ours | transformers | Ratio | Goal | Met |", "|---|---:|---:|---:|---:|---|"]
    lines += [f"| {titles[r['goal']]} | {r['ours']:.1f} | {r['baseline']:.1f} | {r['ratio']:.2f}x "
              f"| >= {r['target']}x | {'yes' if r['met'] else 'NO'} |" for r in report["comparisons"]]
    lines += ["", "| Phase | Timed s | Output tokens | Peak RSS MiB | torch threads |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {name} | {p['seconds']:.2f} | {p['output_tokens']} | {p['peak_rss_mib']:.0f} | {p['torch_threads']} |"
              for name, p in phases.items()]
    lines += ["", *[f"- {note}" for note in report["notes"]]]
    return "\n".join(lines)


def profile_report(profile: dict[str, Any]) -> str:
    """Where one decode step's time goes: the engine's labelled regions, then the top ops."""
    step_ms = profile["breakdown_ms"][STEP_REGION]
    lines = [f"Profile: {profile['steps']} decode steps, {profile['decoding_requests']} requests decoding; "
             f"unprofiled step {profile['step_ms']:.1f} ms, profiled {step_ms:.1f} ms.", "",
             "| Region | ms / step | share of step |", "|---|---:|---:|"]
    lines += [f"| {label} | {ms:.2f} | {ms / step_ms:.0%} |" for label, ms in profile["breakdown_ms"].items()]
    lines += [""]
    if ATTENTION_ROW not in profile["breakdown_ms"]:
        lines += ["No attention region was recorded: the backend marks none, the fused decode ran all layers in "
                  "one native call (PAGEDSERVE_FUSED_DECODE=0 runs them one by one), or a replayed CUDA graph ran "
                  "the forward without its per-layer Python.", ""]
    lines += ["Work outside torch ops (e.g. a C kernel called through ctypes) shows as self time of the region "
              "that runs it.", "", "Top ops by self CPU time:", "```", profile["top_ops"].rstrip(), "```"]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- prompts


def model_folder() -> str:
    """The HF folder the embedded SmolLM2 GGUF is converted into (both engines load it)."""
    from pagedserve.engine.model.loader import gguf_cache_folder, resolve_model_path

    return gguf_cache_folder(resolve_model_path(None)).path


def build_prompts(cfg: BenchConfig, tokenizer: Tokenizer) -> Prompts:
    """Draw the prompts from ``server/bench/dataset.py`` (seeds ``seed``, ``seed + 1``, ``seed + 2``) as token ids."""
    def draw(num: int, lengths: tuple[int, int], seed: int) -> list[list[int]]:
        requests = sample_requests(tokenizer, num, lengths, (cfg.output_len, cfg.output_len), seed)
        return [tokenizer.encode(r.prompt, add_special_tokens=False) for r in requests]

    single_len = (cfg.single_prompt_len, cfg.single_prompt_len)
    return Prompts(batch=draw(cfg.num_prompts, cfg.input_len, cfg.seed),
                   single=draw(1, single_len, cfg.seed + 1)[0],
                   warmup=draw(WARMUP_PROMPTS, (cfg.input_len[0], cfg.input_len[0]), cfg.seed + 2))


# ---------------------------------------------------------------------------------------------- phases


def _greedy(max_tokens: int) -> Any:
    from pagedserve.engine import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _load_llm(cfg: BenchConfig) -> tuple[Any, float]:
    """Our ``LLM`` on the embedded model, and its load time in seconds."""
    from pagedserve.engine import LLM

    start = time.perf_counter()
    llm = LLM(max_model_len=cfg.max_model_len, kv_cache_memory_bytes=cfg.kv_cache_memory, max_num_seqs=MAX_NUM_SEQS,
              max_num_batched_tokens=cfg.max_num_batched_tokens, dtype=cfg.dtype)
    return llm, time.perf_counter() - start


def _load_hf(cfg: BenchConfig) -> tuple[Any, float]:
    """The transformers model (``cfg.dtype``, eval, EOS disabled), and its load time in seconds."""
    from transformers import AutoModelForCausalLM

    start = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_folder(), dtype=DTYPES[cfg.dtype]).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: every output is max_new_tokens long
    return model, time.perf_counter() - start


class _TokenClock:
    """A transformers streamer that notes when each ``put`` arrives; the first ``put`` is the prompt."""

    def __init__(self) -> None:
        self.times_s: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times_s.append(time.perf_counter())

    def end(self) -> None:
        pass


def _hf_generate(model: Any, input_ids: torch.Tensor, attention_mask: torch.Tensor, new_tokens: int,
                 streamer: _TokenClock | None = None) -> torch.Tensor:
    """Greedy ``generate``; returns the ``[batch, new_tokens]`` new token ids.

    Raises:
        RuntimeError: when transformers stopped early.
    """
    with torch.inference_mode():
        out = model.generate(input_ids=input_ids, attention_mask=attention_mask, max_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=model.config.pad_token_id or 0, streamer=streamer)
    generated = out[:, input_ids.shape[1]:]
    if generated.shape[1] != new_tokens:
        raise RuntimeError(f"transformers generated {generated.shape[1]} tokens instead of {new_tokens}")
    return generated


def _hf_one(model: Any, prompt: Sequence[int], new_tokens: int, streamer: _TokenClock | None = None) -> list[int]:
    input_ids = torch.tensor([prompt], dtype=torch.int64)
    return _hf_generate(model, input_ids, torch.ones_like(input_ids), new_tokens, streamer)[0].tolist()


def _rate(seconds: float, output_tokens: int, **extra: Any) -> dict[str, Any]:
    return {"seconds": seconds, "output_tokens": output_tokens, "output_tok_per_s": output_tokens / seconds, **extra}


def _single_result(start_s: float, token_times_s: list[float], load_s: float) -> dict[str, Any]:
    """A single-request run's result from its start and the arrival time of each output token (seconds)."""
    return {"seconds": token_times_s[-1] - start_s, "output_tokens": len(token_times_s),
            "first_token_s": token_times_s[0] - start_s, "decode_tok_per_s": decode_tok_per_s(token_times_s),
            "load_s": load_s}


@contextlib.contextmanager
def recorded_steps(core: Any, log: list[tuple[float, int, int]]) -> Iterator[None]:
    """Append (seconds, tokens scheduled, tokens sampled) of every ``core.step()`` to ``log`` while the block runs."""
    original = core.step

    def step() -> Any:
        scheduled_before = core.make_stats().num_scheduled_tokens
        start = time.perf_counter()
        outputs = original()
        seconds = time.perf_counter() - start
        log.append((seconds, core.make_stats().num_scheduled_tokens - scheduled_before,
                    sum(len(o.new_token_ids) for o in outputs)))
        return outputs

    core.step = step
    try:
        yield
    finally:
        del core.step  # the class's method shows through again


def engine_phase(cfg: BenchConfig, prompts: Prompts) -> dict[str, Any]:
    """Our ``LLM.generate`` on all prompts at once, with the time its engine steps took by kind."""
    llm, load_s = _load_llm(cfg)
    llm.generate(prompts.warmup, _greedy(WARMUP_TOKENS), use_tqdm=False)
    steps: list[tuple[float, int, int]] = []
    with recorded_steps(llm.engine_core, steps):
        start = time.perf_counter()
        outputs = llm.generate(prompts.batch, _greedy(cfg.output_len), use_tqdm=False)
        seconds = time.perf_counter() - start
    token_ids = [list(o.outputs[0].token_ids) for o in outputs]
    return _rate(seconds, sum(map(len, token_ids)), load_s=load_s, token_ids=token_ids,
                 num_preemptions=llm.engine_core.make_stats().num_preemptions,
                 outside_steps_s=seconds - sum(s for s, _, _ in steps), **split_steps(steps))


def engine_single_phase(cfg: BenchConfig, prompts: Prompts) -> dict[str, Any]:
    """Our single-request decode rate, timing each ``EngineCore.step()`` that yields the request's next token."""
    llm, load_s = _load_llm(cfg)
    llm.generate(prompts.warmup, _greedy(WARMUP_TOKENS), use_tqdm=False)
    single = CoreRequests(llm, [prompts.single], _greedy(cfg.output_len), "single")
    token_times_s = []
    start = time.perf_counter()
    while llm.engine_core.has_unfinished_requests():
        token_times_s += [time.perf_counter()] * single.step()
    return _single_result(start, token_times_s, load_s)


def hf_sequential_phase(cfg: BenchConfig, prompts: Prompts) -> dict[str, Any]:
    """transformers ``generate`` one prompt at a time over a length-spread subset of the prompts."""
    model, load_s = _load_hf(cfg)
    _hf_one(model, prompts.warmup[0], WARMUP_TOKENS)
    indices = spread_subset([len(p) for p in prompts.batch], cfg.hf_sequential_prompts)
    start = time.perf_counter()
    token_ids = {i: _hf_one(model, prompts.batch[i], cfg.output_len) for i in indices}
    seconds = time.perf_counter() - start
    return _rate(seconds, len(indices) * cfg.output_len, load_s=load_s, prompt_indices=indices,
                 subset_mean_prompt_len=statistics.mean(len(prompts.batch[i]) for i in indices), token_ids=token_ids)


def hf_batched_phase(cfg: BenchConfig, prompts: Prompts) -> dict[str, Any]:
    """transformers batched ``generate``, ``hf_batch_size`` left-padded prompts per call."""
    model, load_s = _load_hf(cfg)
    pad_id = model.config.pad_token_id or 0
    _hf_generate(model, *left_pad(prompts.warmup, pad_id), WARMUP_TOKENS)
    start = time.perf_counter()
    for first in range(0, len(prompts.batch), cfg.hf_batch_size):
        _hf_generate(model, *left_pad(prompts.batch[first:first + cfg.hf_batch_size], pad_id), cfg.output_len)
    seconds = time.perf_counter() - start
    return _rate(seconds, len(prompts.batch) * cfg.output_len, load_s=load_s,
                 attn_implementation=model.config._attn_implementation)


def hf_single_phase(cfg: BenchConfig, prompts: Prompts) -> dict[str, Any]:
    """transformers' single-request decode rate."""
    model, load_s = _load_hf(cfg)
    _hf_one(model, prompts.warmup[0], WARMUP_TOKENS)
    clock = _TokenClock()
    _hf_one(model, prompts.single, cfg.output_len, clock)
    return _single_result(clock.times_s[0], clock.times_s[1:], load_s)


def engine_profile_phase(cfg: BenchConfig, prompts: Prompts) -> dict[str, Any]:
    """torch.profiler over ``profile_steps`` engine steps once every prompt has left prefill."""
    llm, _ = _load_llm(cfg)
    llm.generate(prompts.warmup, _greedy(WARMUP_TOKENS), use_tqdm=False)
    requests = CoreRequests(llm, prompts.batch, _greedy(cfg.profile_max_tokens), "profile")
    requests.step_until_decoding()
    start = time.perf_counter()
    for _ in range(PROFILE_WARMUP_STEPS):
        requests.step()
    step_ms = (time.perf_counter() - start) / PROFILE_WARMUP_STEPS * 1e3
    profile = profile_steps(requests.step, cfg.profile_steps)
    return {"seconds": step_ms * PROFILE_WARMUP_STEPS / 1e3, "output_tokens": sum(profile.sampled),
            "steps": cfg.profile_steps, "decoding_requests": min(profile.sampled), "step_ms": step_ms,
            "breakdown_ms": profile.breakdown_ms, "top_ops": profile.top_ops}


PHASES: dict[str, Callable[[BenchConfig, Prompts], dict[str, Any]]] = {
    "engine": engine_phase,
    "engine_single": engine_single_phase,
    "hf_sequential": hf_sequential_phase,
    "hf_batched": hf_batched_phase,
    "hf_single": hf_single_phase,
    "engine_profile": engine_profile_phase,
}


def _phase_child(name: str, cfg: BenchConfig, prompts: Prompts) -> dict[str, Any]:
    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    result = PHASES[name](cfg, prompts)
    return {**result, "peak_rss_mib": peak_rss_mib(), "torch_threads": torch.get_num_threads()}


def run_phase(name: str, cfg: BenchConfig, prompts: Prompts) -> dict[str, Any]:
    """Run one phase in a fresh process and return its result (with its peak RSS).

    The process is forked from a fork server that has imported this module (torch, transformers) once,
    so each phase pays for its own model and memory, not for the imports again."""
    print(f"[throughput] phase {name} ...", file=sys.stderr, flush=True)
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["benchmarks.throughput"])
    with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
        return pool.submit(_phase_child, name, cfg, prompts).result()


# ---------------------------------------------------------------------------------------------- the run


def _notes(cfg: BenchConfig, prompts: Prompts, phases: dict[str, dict[str, Any]]) -> list[str]:
    sequential, engine = phases["hf_sequential"], phases["engine"]
    ours = engine["token_ids"]
    same = sum(ours[i] == tokens for i, tokens in sequential["token_ids"].items())
    return [
        f"transformers one-at-a-time ran {cfg.hf_sequential_prompts} of {cfg.num_prompts} prompts (indices "
        f"{sequential['prompt_indices']}, mean {sequential['subset_mean_prompt_len']:.0f} tokens against "
        f"{statistics.mean(map(len, prompts.batch)):.0f} for all); its tok/s is extrapolated to the whole set.",
        f"Greedy outputs identical to transformers on {same} of {len(sequential['token_ids'])} of those prompts.",
        f"Our LLM.generate: {engine['prefill_s']:.1f} s in {engine['prefill_steps']} steps with prompt tokens, "
        f"{engine['decode_s']:.1f} s in {engine['decode_steps']} decode-only steps "
        f"({engine['decode_s'] / max(engine['decode_steps'], 1) * 1e3:.0f} ms each, mean batch "
        f"{engine['mean_decode_batch']:.1f}), {engine['outside_steps_s']:.2f} s outside EngineCore.step "
        "(output processing, detokenization).",
        f"Our engine: max_num_seqs {MAX_NUM_SEQS}, max_num_batched_tokens {cfg.max_num_batched_tokens}, "
        f"KV cache {cfg.kv_cache_memory} (allocated up front, so inside our peak RSS), "
        f"{engine['num_preemptions']} preemptions.",
        f"Single request: first token after {phases['engine_single']['first_token_s'] * 1e3:.0f} ms (ours) and "
        f"{phases['hf_single']['first_token_s'] * 1e3:.0f} ms (transformers); decode tok/s counts the "
        f"{cfg.output_len - 1} tokens after it.",
        f"transformers attention: {phases['hf_batched']['attn_implementation']}; each phase ran in its own process "
        f"after a {WARMUP_TOKENS}-token warm-up call.",
    ]


def run_benchmark(cfg: BenchConfig, profile: bool) -> dict[str, Any]:
    """Build the prompts, run every phase, and assemble the JSON-ready report (without the token ids)."""
    import transformers

    prompts = build_prompts(cfg, transformers.AutoTokenizer.from_pretrained(model_folder()))
    names = [n for n in PHASES if profile or n != "engine_profile"]
    phases = {name: run_phase(name, cfg, prompts) for name in names}
    notes = _notes(cfg, prompts, phases)
    return {
        "config": asdict(cfg),
        "machine": {"cpu": cpu_model(), "cpu_cores": num_threads(), "python": platform.python_version(),
                    "torch": torch.__version__, "transformers": transformers.__version__},
        "comparisons": comparisons(phases),
        "notes": notes,
        "phases": {name: {k: v for k, v in p.items() if k != "token_ids"} for name, p in phases.items()},
    }


def parse_args(argv: list[str] | None) -> tuple[BenchConfig, argparse.Namespace]:
    """The run's config (``--quick`` sizes, then any explicit flag) and the other options."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-prompts", type=int)
    parser.add_argument("--input-len", type=parse_len_range, help="MIN:MAX prompt tokens (default 64:512)")
    parser.add_argument("--output-len", type=int, help="output tokens per prompt (default 128)")
    parser.add_argument("--hf-sequential-prompts", type=int, help="prompts transformers runs one at a time (8)")
    parser.add_argument("--hf-batch-size", type=int, help="rows per transformers batched generate call (64)")
    parser.add_argument("--single-prompt-len", type=int, help="tokens of the single-request prompt (128)")
    parser.add_argument("--kv-cache-memory", help="our engine's KV cache size (2GiB)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--threads", type=int, help="torch threads in every phase (default: torch's choice)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), help="of both engines (default float32)")
    parser.add_argument("--quick", action="store_true", help="2 prompts x 4 tokens: a smoke test")
    parser.add_argument("--profile", action="store_true", help="also profile decode steps of our engine")
    parser.add_argument("--result-json", type=Path, help="write the report here as JSON")
    args = parser.parse_args(argv)
    explicit = {f.name: getattr(args, f.name) for f in fields(BenchConfig)
                if getattr(args, f.name, None) is not None}
    return replace(QUICK if args.quick else BenchConfig(), **explicit), args


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg, args = parse_args(argv)
    report = run_benchmark(cfg, args.profile)
    print(markdown_report(report))
    if args.profile:
        print()
        print(profile_report(report["phases"]["engine_profile"]))
    if args.result_json:
        args.result_json.parent.mkdir(parents=True, exist_ok=True)
        args.result_json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
