"""One-shot device check: is the engine correct and fast on an H100/H200?

Sections, each recorded on its own so that one failure leaves the others
running (their modules under ``benchmarks/gpu/`` say what they measure):

- ``greedy_parity``: greedy outputs identical to transformers' on tiny llama,
  qwen2, qwen3 and mistral models, bf16 and fp32, up to near-ties of the logits;
- ``attention_kernels``: the Triton paged-attention backend against the torch
  reference on realistic shapes, error and kernel time;
- ``throughput``: offline throughput of a random-weight model with
  Llama-3.2-1B's shape in bf16, eager and with CUDA graphs;
- ``decode_steps``: decode step time at batch 1, 64 and 256 on that model,
  against the roofline, and where the step's time goes by the engine's regions;
- ``tensor_parallel``: greedy outputs at tensor-parallel size 2 against size 1
  (skipped, with a note, below two CUDA devices);
- ``lora``: two adapters and the base model in one batch against transformers +
  PEFT, the Triton LoRA kernel against torch's products, and multi-LoRA speed.

The check imports only engine modules that need neither fastapi, uvicorn nor
gguf, so it runs on a machine whose Python has torch, triton, transformers,
llguidance and peft, with pagedserve importable (``pip install -e . --no-deps``).
It writes ``gpu_check_<device>.json`` and ``gpu_check_<device>.md`` to
``--out`` (rewritten after every part, so a killed run leaves what it had).

    benchmarks/gpu_check.sh                              # the whole check, on CUDA (about 2 min on an H200)
    benchmarks/gpu_check.sh --device cpu --quick --sections greedy_parity   # a dry run with small sizes
"""

from __future__ import annotations

import argparse
import importlib.metadata
import logging
import os
import platform
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu import attention_kernels, decode_throughput, greedy_parity, lora, tensor_parallel
from benchmarks.gpu.context import CheckContext, LogRecorder
from benchmarks.gpu.report import SECTIONS, goals, write_summary


def parse_sections(text: str) -> list[str]:
    """``"decode_steps, greedy_parity"`` -> ``["greedy_parity", "decode_steps"]``: check order.

    Raises:
        ValueError: on an unknown section name.
    """
    names = {s.strip().lower() for s in text.split(",") if s.strip()}
    unknown = names - set(SECTIONS)
    if unknown:
        raise ValueError(f"unknown sections {sorted(unknown)}; choose from {','.join(SECTIONS)}")
    return [s for s in SECTIONS if s in names]


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


def run_check(device: str, sections: list[str], quick: bool, out: Path,
              models: tuple[str, ...] = greedy_parity.TINY_MODELS, time_budget_s: float = 300.0) -> dict[str, Any]:
    """Run the chosen sections (names of ``SECTIONS``) and write the summary; returns the results dict."""
    results: dict[str, Any] = {
        "meta": {"device": device, "quick": quick, "sections": sections, "argv": sys.argv[1:],
                 "started": datetime.now(UTC).isoformat(timespec="seconds"), "_t0": time.perf_counter(),
                 "roofline_bandwidth_bytes_per_s": decode_throughput.H200_BANDWIDTH, **_versions(device)},
        "sections": {},
    }
    recorder = LogRecorder()
    engine_logger = logging.getLogger("pagedserve.engine")
    engine_logger.setLevel(logging.INFO)
    engine_logger.addHandler(recorder)
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        ctx = CheckContext(device, quick, models, Path(tmp), out, time.monotonic() + time_budget_s, results,
                           write_summary, recorder)
        for module in (greedy_parity, attention_kernels):
            if module.NAME in sections:
                ctx.run_section(module.NAME, module.run)
        on_engine = [s for s in (decode_throughput.THROUGHPUT, decode_throughput.DECODE) if s in sections]
        if on_engine:
            decode_throughput.run(ctx, on_engine)
        if tensor_parallel.NAME in sections:
            ctx.run_section(tensor_parallel.NAME, tensor_parallel.run)
        if lora.NAME in sections:
            ctx.run_section(lora.NAME, lora.run)
    engine_logger.removeHandler(recorder)
    ctx.save()
    results["meta"].pop("_t0")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu = dry run (Triton through its interpreter)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {','.join(SECTIONS)}")
    parser.add_argument("--quick", action="store_true", help="small sizes everywhere (dry runs)")
    parser.add_argument("--models", default=",".join(greedy_parity.TINY_MODELS),
                        help=f"tiny architectures of {greedy_parity.NAME}")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    parser.add_argument("--time-budget", type=float, default=300.0,
                        help="seconds after which remaining parts are skipped (the check must end within 6 min)")
    args = parser.parse_args(argv)
    try:
        sections = parse_sections(args.sections)
    except ValueError as error:
        parser.error(str(error))
    models = tuple(m.strip() for m in args.models.split(",") if m.strip())
    unknown = set(models) - set(greedy_parity.TINY_MODELS)
    if unknown:
        parser.error(f"unknown --models {sorted(unknown)}; choose from {','.join(greedy_parity.TINY_MODELS)}")
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
