"""Microbenchmark of the scheduler's bookkeeping: ``schedule()`` + ``update_from_output()``
for 256 running decode requests, with a model runner that returns tokens instantly.

    python -m benchmarks.scheduler_bench [--num-requests 256] [--steps 2000]
"""

from __future__ import annotations

import argparse
import statistics
import time

from pagedserve.engine.config import CacheConfig, SchedulerConfig
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.outputs import ModelRunnerOutput
from pagedserve.engine.request import Request
from pagedserve.engine.sampling_params import SamplingParams


def instant_runner_output(so) -> ModelRunnerOutput:
    req_ids = list(so.num_scheduled_tokens)
    return ModelRunnerOutput(req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
                             sampled_token_ids=[[7]] * len(req_ids))


def measure(num_requests: int = 256, steps: int = 2000, prompt_len: int = 128, block_size: int = 16
            ) -> list[float]:
    """Seconds per decode step (schedule + update_from_output), one sample per step."""
    max_len = prompt_len + steps + 16
    blocks = num_requests * (-(-max_len // block_size)) + 1
    scheduler = Scheduler(SchedulerConfig(num_requests, 8192, max_len), CacheConfig(blocks, block_size, True))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(num_requests):
        scheduler.add_request(Request(str(i), [(i + k) % 1000 + 1 for k in range(prompt_len)], params, None,
                                      block_size))
    while scheduler.waiting:  # prefill everything first; only decode steps are timed
        so = scheduler.schedule()
        scheduler.update_from_output(so, instant_runner_output(so))
    samples = []
    for _ in range(steps):
        start = time.perf_counter()
        so = scheduler.schedule()
        scheduler.update_from_output(so, instant_runner_output(so))
        samples.append(time.perf_counter() - start)
        assert len(so.num_scheduled_tokens) == num_requests
    return samples


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    args = parser.parse_args(argv)
    samples = measure(args.num_requests, args.steps)
    print(f"{args.num_requests} running decode requests, {args.steps} steps: "
          f"median {statistics.median(samples) * 1e6:.0f} us/step, "
          f"p90 {sorted(samples)[int(0.9 * len(samples))] * 1e6:.0f} us/step")


if __name__ == "__main__":
    main()
