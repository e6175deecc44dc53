"""Error of ``--quantization`` gguf, int8 and int4 against the unquantized model, on a fixed text.

The text is the standard library's ``pydoc_data.topics`` (the ``topics`` dict
behind ``help()``: Python's language reference in plain text), its values
joined in sorted key order until the SmolLM2 tokenizer gives at least
``--min-tokens`` tokens, of which the first ``--min-tokens`` rounded up to
whole windows are kept. They are cut into windows of ``--window`` tokens, each
run from an empty KV cache through the engine's own model (``load_model``,
the model runner's path without its scheduler). For every position of every
window the next-token distribution is compared with that of the reference,
the embedded SmolLM2 in float32 as the engine loads it without
``--quantization`` (the GGUF dequantized): mean KL(reference || quantized) in
nats, top-1 agreement (same argmax), each model's perplexity on the text, and
where the argmax differs, how far apart the reference's logits of the two
tokens were (the "flipped gap": p99 and max; a greedy comparison's near-tie
tolerance must cover it).

Each quantized model runs two ways, as the engine does:

* ``prefill``: the whole window in one step, every product the weight
  dequantized and a float GEMM (``quant_kernels.quantized_linear`` above a few
  rows; the CUDA path always): the error of the weights alone.
* ``decode``: the window fed ``KERNEL_MAX_ROWS`` tokens a step (as many as a
  decode batch the C kernel takes) through the C kernel, which also quantizes
  the activations to int8 per block of 32 (as llama.cpp does): the error a
  decode step has on the CPU.

bfloat16 without quantization is listed too, as a scale: the error the
engine's bf16 mode has by its rounding alone.

It measures error, not speed: torch runs ``--threads`` threads (default 1,
which keeps OpenMP's barriers from stalling on a CPU shared with other work).

    python -m benchmarks.quant_error [--window 1024] [--min-tokens 20000] [--dtypes float32,bfloat16]
        [--threads 1] [--result-json benchmarks/results/quant-error.json]
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from pagedserve.engine.model.attention import AttentionMetadata
from pagedserve.engine.model.linear_methods import QuantizedLinearMethod
from pagedserve.engine.model.loader import (
    gguf_cache_folder,
    load_hf_config,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model_path,
    weight_bytes,
)
from pagedserve.engine.model.quant_kernels import KERNEL_MAX_ROWS
from pagedserve.engine.model.registry import CausalLM
from pagedserve.engine.worker.block_table import slot_mapping

BLOCK_SIZE = 16
SCHEMES = ("gguf", "int8", "int4")
DEFAULT_RESULT = Path(__file__).parent / "results" / "quant-error.json"


def topics_text_ids(tokenizer, min_tokens: int) -> list[int]:
    """Token ids of ``pydoc_data.topics``' values joined in sorted key order, ``min_tokens`` or more.

    Raises:
        ValueError: when all the topics give fewer than ``min_tokens`` tokens.
    """
    from pydoc_data.topics import topics

    parts, count = [], 0
    for key in sorted(topics):
        parts.append(topics[key])
        count += len(tokenizer.encode(topics[key], add_special_tokens=False))
        if count >= min_tokens:
            break
    ids = tokenizer.encode("\n".join(parts), add_special_tokens=False)
    if len(ids) < min_tokens:
        raise ValueError(f"pydoc_data.topics gives {len(ids)} tokens, fewer than --min-tokens {min_tokens}")
    return ids


@torch.inference_mode()
def window_logits(model: CausalLM, ids: list[int], step_tokens: int | None = None) -> torch.Tensor:
    """``[len(ids), vocab]`` float32 logits of every position of ``ids``, from an empty KV cache.

    Args:
        model: a loaded model.
        ids: the window's tokens.
        step_tokens: tokens per forward step (a chunked prefill); None = all at once.
    """
    step = step_tokens or len(ids)
    num_blocks = -(-len(ids) // BLOCK_SIZE) + 1
    norm = next(p for p in model.parameters() if p.is_floating_point())  # in the activations' dtype
    kv_caches = [torch.zeros(2, num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim, dtype=norm.dtype,
                             device=norm.device) for _ in range(model.num_layers)]
    block_table, logits = np.arange(1, num_blocks, dtype=np.int32)[None], []
    for start in range(0, len(ids), step):
        positions = np.arange(start, min(start + step, len(ids)))
        metadata = model.attn_backend.build_metadata(_step_metadata(block_table, positions, norm.device))
        hidden = model(torch.tensor(ids[start:start + len(positions)], device=norm.device),
                       torch.from_numpy(positions).to(norm.device), kv_caches, metadata)
        logits.append(model.compute_logits(hidden).float())
    return torch.cat(logits)


def _step_metadata(block_table: np.ndarray, positions: np.ndarray, device: torch.device) -> AttentionMetadata:
    """A step of one sequence running ``positions`` (consecutive, after ``positions[0]`` cached tokens)."""
    num_tokens, seq_len = len(positions), int(positions[-1]) + 1
    query_start_loc, seq_lens = np.array([0, num_tokens], dtype=np.int32), np.array([seq_len], dtype=np.int32)
    slots = slot_mapping(block_table, BLOCK_SIZE, np.zeros(num_tokens, dtype=np.int64), positions)
    return AttentionMetadata(
        num_actual_tokens=num_tokens, query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(seq_lens).to(device), block_table=torch.from_numpy(block_table).to(device),
        slot_mapping=torch.from_numpy(slots).to(device), max_query_len=num_tokens, max_seq_len=seq_len,
        query_start_loc_cpu=query_start_loc, seq_lens_cpu=seq_lens)


def use_kernel(model: CausalLM, on: bool) -> None:
    """Run ``model``'s quantized layers through the C kernel (``on``, the CPU default) or dequantize + GEMM."""
    for module in model.modules():
        method = getattr(module, "linear_method", None)
        if isinstance(method, QuantizedLinearMethod):
            method.use_kernel = on


@dataclass
class Divergence:
    """Sums over positions, so windows add up; ``summary`` turns them into means."""

    positions: int = 0
    kl_sum: float = 0.0
    top1_same: int = 0
    nll_sum: float = 0.0
    # Where the argmax differs: the reference's logit of its top-1 minus its logit of ours. A greedy
    # comparison that allows divergences at gaps up to g (a near-tie) passes when g covers these.
    flipped_gaps: list[float] = field(default_factory=list)

    def add(self, reference: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        """Add positions: ``reference`` and ``logits`` ``[T, vocab]``, ``targets`` ``[T]`` the next tokens."""
        ref_logp, logp = reference.log_softmax(-1), logits.log_softmax(-1)
        ref_top, top = reference.argmax(-1), logits.argmax(-1)
        flipped = (ref_top != top).nonzero().flatten()
        self.positions += len(targets)
        self.kl_sum += float((ref_logp.exp() * (ref_logp - logp)).sum(-1).sum())
        self.top1_same += len(targets) - len(flipped)
        self.nll_sum += float(-logp.gather(1, targets[:, None]).sum())
        self.flipped_gaps += (reference[flipped, ref_top[flipped]] - reference[flipped, top[flipped]]).tolist()

    def merge(self, other: Divergence) -> None:
        """Add ``other``'s positions to these."""
        self.positions += other.positions
        self.kl_sum += other.kl_sum
        self.top1_same += other.top1_same
        self.nll_sum += other.nll_sum
        self.flipped_gaps += other.flipped_gaps

    def summary(self) -> dict[str, float]:
        """``mean_kl`` (nats per token), ``top1_agreement`` (fraction), ``perplexity``, and where the argmax
        differs, the reference's logit of its top-1 minus its logit of ours: ``flipped_gap_p99`` (nearest
        rank) and ``flipped_gap_max`` (0 where the argmax never differs)."""
        gaps = sorted(self.flipped_gaps) or [0.0]
        # KL is >= 0; two identical distributions can sum to -1e-10 in float32.
        return {"mean_kl": max(0.0, self.kl_sum / self.positions), "top1_agreement": self.top1_same / self.positions,
                "perplexity": float(torch.tensor(self.nll_sum / self.positions).exp()),
                "flipped_gap_p99": gaps[math.ceil(0.99 * len(gaps)) - 1], "flipped_gap_max": gaps[-1]}


def divergence(reference: torch.Tensor, logits: torch.Tensor, ids: list[int]) -> Divergence:
    """The ``Divergence`` of one window's logits (``[len(ids), vocab]`` each) over its positions but the last."""
    result = Divergence()
    result.add(reference[:-1], logits[:-1], torch.tensor(ids[1:], device=reference.device))
    return result


@dataclass(frozen=True)
class Variant:
    """One row of the report: a model and how it runs."""

    name: str
    dtype: str
    quantization: str | None
    path: str  # "prefill" (the window at once) or "decode" (KERNEL_MAX_ROWS tokens a step)


def variants(dtypes: list[str]) -> list[Variant]:
    rows = [Variant("bfloat16", "bfloat16", None, "prefill")]
    for dtype in dtypes:
        for scheme in SCHEMES:
            rows += [Variant(f"{scheme} {dtype} {path}", dtype, scheme, path) for path in ("prefill", "decode")]
    return rows


def run(window: int, min_tokens: int, dtypes: list[str]) -> dict:
    """Load every model once, run every window through each, return the report."""
    source = resolve_model_path(None)
    folder = gguf_cache_folder(source)
    hf_config, tokenizer = load_hf_config(folder), load_tokenizer(folder)
    ids = topics_text_ids(tokenizer, min_tokens)[:-(-min_tokens // window) * window]
    windows = [ids[i:i + window] for i in range(0, len(ids) - 1, window)]
    cpu = torch.device("cpu")
    models: dict[tuple[str, str | None], CausalLM] = {}
    for dtype, quantization in {("float32", None)} | {(v.dtype, v.quantization) for v in variants(dtypes)}:
        models[dtype, quantization] = load_model(source if quantization == "gguf" else folder, hf_config,
                                                 resolve_dtype(dtype, cpu), cpu, attn_backend="cpu",
                                                 quantization=quantization)
    rows = variants(dtypes)
    totals = {v: Divergence() for v in rows}
    reference_total = Divergence()
    seconds = {v: 0.0 for v in rows}
    for number, part in enumerate(windows, 1):
        reference = window_logits(models["float32", None], part)
        reference_total.add(reference[:-1], reference[:-1], torch.tensor(part[1:]))
        for v in rows:
            start = time.perf_counter()
            model = models[v.dtype, v.quantization]
            use_kernel(model, v.path == "decode")
            logits = window_logits(model, part, KERNEL_MAX_ROWS if v.path == "decode" else None)
            seconds[v] += time.perf_counter() - start
            totals[v].merge(divergence(reference, logits, part))
        print(f"window {number}/{len(windows)} done", file=sys.stderr, flush=True)
    return {
        "text": f"pydoc_data.topics (Python {platform.python_version()}), values in sorted key order",
        "tokens": len(ids), "window": window, "positions": reference_total.positions,
        "decode_step_tokens": KERNEL_MAX_ROWS, "reference": "SmolLM2-135M-Instruct, float32, no quantization",
        "reference_perplexity": reference_total.summary()["perplexity"],
        "reference_weight_bytes": weight_bytes(models["float32", None]),
        "rows": [asdict(v) | totals[v].summary() | {"weight_bytes": weight_bytes(models[v.dtype, v.quantization]),
                                                    "seconds": round(seconds[v], 1)} for v in rows],
    }


def markdown(report: dict) -> str:
    """The report as the table of docs/quantization.md."""
    lines = ["| model | activations | path | mean KL (nats/token) | top-1 agreement | flipped gap p99 / max "
             "| perplexity | weights MiB |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |",
             f"| float32 (reference) | float32 | prefill | 0 | 1 | – | {report['reference_perplexity']:.3f} | "
             f"{report['reference_weight_bytes'] / 2**20:.0f} |"]
    for row in report["rows"]:
        lines.append(f"| {row['quantization'] or 'bfloat16'} | {row['dtype']} | {row['path']} | {row['mean_kl']:.5f} "
                     f"| {row['top1_agreement']:.4f} | {row['flipped_gap_p99']:.3f} / {row['flipped_gap_max']:.3f} "
                     f"| {row['perplexity']:.3f} | {row['weight_bytes'] / 2**20:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--window", type=int, default=1024, help="tokens per window (default 1024)")
    parser.add_argument("--min-tokens", type=int, default=20_000, help="tokens of text at least (default 20000)")
    parser.add_argument("--dtypes", default="float32", help="activation dtypes of the quantized models, "
                        "comma-separated (default float32)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--result-json", type=Path, default=DEFAULT_RESULT, help=f"default {DEFAULT_RESULT}")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = run(args.window, args.min_tokens, args.dtypes.split(","))
    args.result_json.write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
