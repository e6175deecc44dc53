"""Bytes the tensor-parallel executor writes to each rank's pipe per step (``encode_call``).

The scheduler's ``SchedulerOutput`` carries a request's prompt once
(``NewRequestData``) and diffs afterwards (``CachedRequestData``: id, start
position, new block ids). This replays prefill and steady decode for
``--num-requests`` requests through the real scheduler (the model runner is
replaced by an instant one: only the plan is measured) and compares each
decode step with what resending every request's whole state would cost.

    python -m benchmarks.step_bytes [--num-requests 64] [--prompt-len 512] [--decode-steps 256]
"""

from __future__ import annotations

import argparse
import statistics

from benchmarks.scheduler_bench import instant_runner_output
from pagedserve.engine.config import CacheConfig, SchedulerConfig
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.core.scheduler_output import NewRequestData
from pagedserve.engine.executor.multiproc import encode_call
from pagedserve.engine.request import Request
from pagedserve.engine.sampling_params import SamplingParams


def measure(num_requests: int = 64, prompt_len: int = 512, decode_steps: int = 256,
            block_size: int = 16) -> dict[str, float]:
    """Pickled bytes per step: ``prefill_total`` (all prefill steps), ``decode_median``/``decode_max``
    (steady decode of ``num_requests``) and ``full_state_median`` (every running request resent whole)."""
    max_len = prompt_len + decode_steps + 16
    blocks = num_requests * (-(-max_len // block_size)) + 1
    scheduler = Scheduler(SchedulerConfig(num_requests, 8192, max_len), CacheConfig(blocks, block_size, True))
    params = SamplingParams(temperature=0.7, top_p=0.9, max_tokens=decode_steps + 8, ignore_eos=True)
    for i in range(num_requests):
        scheduler.add_request(Request(f"cmpl-{i:032x}", [(i * 7 + k) % 49000 + 1 for k in range(prompt_len)],
                                      params, None, block_size))
    prefill_total = 0
    while scheduler.waiting:
        so = scheduler.schedule()
        prefill_total += len(encode_call("execute_model", so))
        scheduler.update_from_output(so, instant_runner_output(so))
    decode, full_state = [], []
    for _ in range(decode_steps):
        so = scheduler.schedule()
        assert len(so.num_scheduled_tokens) == num_requests and not so.scheduled_new_reqs
        decode.append(len(encode_call("execute_model", so)))
        whole = [NewRequestData.from_request(r, list(scheduler.kv_cache_manager.get_block_ids(r.request_id)))
                 for r in scheduler.running]
        for data, request in zip(whole, scheduler.running, strict=True):
            data.prompt_token_ids = request.all_token_ids
        full_state.append(len(encode_call("execute_model", whole, so.num_scheduled_tokens)))
        scheduler.update_from_output(so, instant_runner_output(so))
    return {"prefill_total": prefill_total, "decode_median": statistics.median(decode), "decode_max": max(decode),
            "full_state_median": statistics.median(full_state)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--decode-steps", type=int, default=256)
    args = parser.parse_args(argv)
    r = measure(args.num_requests, args.prompt_len, args.decode_steps)
    print(f"{args.num_requests} requests, {args.prompt_len}-token prompts: prefill {r['prefill_total'] / 1024:.0f} KiB "
          f"in all; decode step median {r['decode_median']:.0f} B (max {r['decode_max']:.0f} B, "
          f"{r['decode_median'] / args.num_requests:.0f} B per request); whole state resent every step: "
          f"{r['full_state_median'] / 1024:.0f} KiB ({r['full_state_median'] / r['decode_median']:.0f}x)")


if __name__ == "__main__":
    main()
