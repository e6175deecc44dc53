"""The sampler's forward on a decode batch of B = 64 rows over SmolLM2's vocabulary (V = 49,152).

Three cases: greedy only; every feature (penalties, logit bias, top-k, top-p, min-p, seeded rows,
logprobs) on peaked logits, whose nucleus of ~10 tokens the partial top-k settles; and the same on flat
logits, whose nucleus of ~25k tokens sends the top-p rows to a full sort. Per case: the wall time
(median and minimum of ``--repeats`` calls, after one warm-up) and the minimum process CPU time,
which the other processes of a shared machine disturb less.

    python -m benchmarks.sampler_speed [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.step_metadata import make_metadata
from pagedserve.engine.worker.sampler import Sampler
from pagedserve.engine.worker.sampling_metadata import SamplingMetadata

BATCH_SIZE = 64
VOCAB_SIZE = 49_152


def cases() -> dict[str, tuple[torch.Tensor, SamplingMetadata]]:
    """``name -> (logits [B, V] float32, metadata)`` of the three cases (module docstring), seeded."""
    gen = torch.Generator().manual_seed(6)
    prompts = torch.randint(0, VOCAB_SIZE, (BATCH_SIZE, 512), generator=gen).tolist()
    outputs = torch.randint(0, VOCAB_SIZE, (BATCH_SIZE, 256), generator=gen).tolist()
    greedy_only = make_metadata(BATCH_SIZE, temperature=0.0, vocab_size=VOCAB_SIZE)
    all_features = make_metadata(
        BATCH_SIZE, temperature=[0.0, 0.8] * (BATCH_SIZE // 2), top_k=[50, 0] * (BATCH_SIZE // 2),
        top_p=0.9, min_p=0.05, generators={row: torch.Generator().manual_seed(row) for row in range(16)},
        presence=0.5, frequency=0.3, repetition=1.1, prompt_token_ids=prompts,
        output_token_ids=outputs, vocab_size=VOCAB_SIZE,
        logit_bias=[{t: 1.0 for t in range(10)}] * BATCH_SIZE, max_num_logprobs=5)
    peaked = 5 * torch.randn(BATCH_SIZE, VOCAB_SIZE, generator=gen)
    flat = torch.randn(BATCH_SIZE, VOCAB_SIZE, generator=gen)
    return {"greedy only": (peaked, greedy_only), "all features, peaked logits": (peaked, all_features),
            "all features, flat logits": (flat, all_features)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per case")
    args = parser.parse_args(argv)
    sampler = Sampler()
    print(f"| sampler forward, B={BATCH_SIZE} V={VOCAB_SIZE} | wall median ms | wall min ms | process CPU min ms |")
    print("|---|---|---|---|")
    for name, (logits, metadata) in cases().items():
        sampler(logits, metadata)  # warm-up
        wall, cpu = [], []
        for _ in range(args.repeats):
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            sampler(logits, metadata)
            wall.append(time.perf_counter() - start_wall)
            cpu.append(time.process_time() - start_cpu)
        print(f"| {name} | {1e3 * statistics.median(wall):.1f} | {1e3 * min(wall):.1f} | {1e3 * min(cpu):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
