"""Attention kernels: the Triton paged-attention backend against the torch reference backend.

Realistic shapes (decodes with contexts up to 4096, prefill chunks of 512
after context; 32 query heads, 8 KV heads, head_dim 128), each step in bf16
and fp32: the largest absolute difference between the backends (and, in bf16,
of each against an fp32 run of the reference), and each backend's time per
call through its public ``forward``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from benchmarks.gpu.context import free_memory
from benchmarks.gpu.markdown import table
from benchmarks.roofline import DTYPES

if TYPE_CHECKING:
    from benchmarks.gpu.context import CheckContext

NAME = "attention_kernels"
TITLE = "Triton attention kernels against the torch reference"


@dataclass(frozen=True)
class KernelSizes:
    """Shapes of the attention steps the section runs."""

    heads: tuple[int, int, int] = (32, 8, 128)  # query heads, KV heads, head_dim
    num_decodes: int = 64
    max_context: int = 4096
    chunk_contexts: tuple[int, ...] = (512, 1024, 2048, 3072)
    chunk_len: int = 512
    block_size: int = 16
    iters: int = 20


FULL = KernelSizes()
QUICK = KernelSizes(heads=(4, 2, 64), num_decodes=4, max_context=64, chunk_contexts=(16,), chunk_len=32, iters=2)


def kernel_cases(sizes: KernelSizes) -> dict[str, tuple[list[int], list[int]]]:
    """Case name -> (context lengths, query lengths) of the attention steps the section runs."""
    n = sizes.num_decodes
    decode_contexts = np.linspace(0, sizes.max_context - 1, n).astype(int).tolist()
    chunks = list(sizes.chunk_contexts)
    return {
        f"decode x{n}, ctx 1-{sizes.max_context}": (decode_contexts, [1] * n),
        f"mixed: {n} decodes + {len(chunks)} chunks of {sizes.chunk_len}":
            (decode_contexts + chunks, [1] * n + [sizes.chunk_len] * len(chunks)),
    }


def time_ms(fn: Callable[[], object], device: str, iters: int, warmup: int = 3) -> float:
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
class _AttentionStep:
    """A random attention step: inputs, a fully written cache and the runner's common metadata."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    kv_cache: torch.Tensor
    metadata: Any


def _attention_step(sizes: KernelSizes, context_lens: list[int], query_lens: list[int], dtype: torch.dtype,
                    device: str, seed: int = 0) -> _AttentionStep:
    """Each request's blocks drawn at random from one cache, so neighbours are not contiguous."""
    from benchmarks.step_metadata import build_metadata

    num_heads, num_kv_heads, head_dim = sizes.heads
    block_size = sizes.block_size
    gen = np.random.default_rng(seed)
    blocks_per_req = [-(-(c + q) // block_size) for c, q in zip(context_lens, query_lens, strict=True)]
    ids = gen.permutation(np.arange(1, sum(blocks_per_req) + 1))
    bounds = np.cumsum([0] + blocks_per_req)
    tables = [ids[bounds[i]:bounds[i + 1]].tolist() for i in range(len(blocks_per_req))]
    metadata = build_metadata(tables, context_lens, query_lens, block_size, device)
    torch.manual_seed(seed)
    num_tokens = sum(query_lens)
    return _AttentionStep(
        query=torch.randn(num_tokens, num_heads, head_dim, device=device, dtype=dtype),
        key=torch.randn(num_tokens, num_kv_heads, head_dim, device=device, dtype=dtype),
        value=torch.randn(num_tokens, num_kv_heads, head_dim, device=device, dtype=dtype),
        kv_cache=torch.randn(2, sum(blocks_per_req) + 1, block_size, num_kv_heads, head_dim, device=device,
                             dtype=dtype),
        metadata=metadata)


def _kernel_case(case: str, context_lens: list[int], query_lens: list[int], dtype_name: str, sizes: KernelSizes,
                 device: str) -> dict[str, Any]:
    """Errors and times of both backends on one step; bf16 errors are also measured against fp32."""
    from pagedserve.engine.model.attention import get_attention_backend

    step = _attention_step(sizes, context_lens, query_lens, DTYPES[dtype_name], device)
    scale = sizes.heads[2] ** -0.5
    tensors = (step.query, step.key, step.value, step.kv_cache)
    triton_backend, torch_backend = (get_attention_backend(name, sizes.block_size) for name in ("triton", "torch"))
    # Each backend reads the metadata it builds from the runner's common layout, as in the engine.
    triton_metadata, torch_metadata = (b.build_metadata(step.metadata) for b in (triton_backend, torch_backend))

    def run_triton() -> torch.Tensor:
        return triton_backend.forward(*tensors, triton_metadata, scale)

    def run_torch() -> torch.Tensor:
        return torch_backend.forward(*tensors, torch_metadata, scale)

    out_triton, out_torch = run_triton().float(), run_torch().float()
    row: dict[str, Any] = {"case": case, "dtype": dtype_name, "num_tokens": sum(query_lens),
                           "max_abs_err_triton_vs_torch": (out_triton - out_torch).abs().max().item()}
    if dtype_name != "float32":
        ref = torch_backend.forward(*(t.float() for t in tensors), torch_metadata, scale)
        row["max_abs_err_triton_vs_fp32"] = (out_triton - ref).abs().max().item()
        row["max_abs_err_torch_vs_fp32"] = (out_torch - ref).abs().max().item()
    row["triton_ms"] = time_ms(run_triton, device, sizes.iters)
    row["torch_ms"] = time_ms(run_torch, device, sizes.iters)
    row["speedup"] = row["torch_ms"] / row["triton_ms"]
    return row


def run(ctx: CheckContext) -> dict[str, Any]:
    """Every case of ``kernel_cases`` in bf16 and fp32."""
    sizes = QUICK if ctx.quick else FULL
    cases = []
    for case, (context_lens, query_lens) in kernel_cases(sizes).items():
        for dtype_name in ("bfloat16", "float32"):
            row = _kernel_case(case, context_lens, query_lens, dtype_name, sizes, ctx.device)
            free_memory()
            cases.append(row)
            ctx.say(f"[{NAME}] {case} {dtype_name}: max err {row['max_abs_err_triton_vs_torch']:.3g}, "
                    f"triton {row['triton_ms']:.3f} ms, torch {row['torch_ms']:.3f} ms")
    num_heads, num_kv_heads, head_dim = sizes.heads
    return {"num_heads": num_heads, "num_kv_heads": num_kv_heads, "head_dim": head_dim,
            "block_size": sizes.block_size, "cases": cases}


def markdown(data: dict[str, Any]) -> list[str]:
    """One row per case and dtype: errors, both backends' times and the speed-up."""
    rows = [[c["case"], c["dtype"], c["num_tokens"], c["max_abs_err_triton_vs_torch"],
             c.get("max_abs_err_triton_vs_fp32"), c.get("max_abs_err_torch_vs_fp32"), c["triton_ms"],
             c["torch_ms"], c["speedup"]] for c in data.get("cases", [])]
    return table(["case", "dtype", "tokens", "max err triton-torch", "triton err vs fp32", "torch err vs fp32",
                  "triton ms", "torch ms", "speedup"], rows)
