"""KV blocks one long request holds on a model whose every layer attends within a sliding window, against the
same model with full attention (``KVCacheManager``'s sliding-window freeing).

A tiny random-weight Mistral (every layer windowed, as Mistral 7B v0.1 and Phi-3-mini-4k) runs one prompt of
``--prompt-len`` random tokens (chunks of ``--chunk`` tokens) and ``--max-tokens`` greedy tokens on the engine
core; after each step the blocks the request holds are read from the KV cache manager. Printed as a Markdown
table: the most blocks held, and those held at the end, with and without the window.

    python -m benchmarks.sliding_window_blocks [--prompt-len 8192] [--window 1024] [--chunk 2048]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.tiny_models import tiny_hf_model
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.engine_core import EngineCore
from pagedserve.engine.engine_factory import resolve_engine_config
from pagedserve.engine.request import EngineCoreRequest
from pagedserve.engine.sampling_params import SamplingParams


def blocks_held(folder: str, prompt_len: int, max_tokens: int, chunk: int) -> tuple[int, int]:
    """(most blocks the request held after any step, blocks held after its last step)."""
    args = EngineArgs(model=folder, max_model_len=prompt_len + max_tokens, max_num_batched_tokens=chunk,
                      kv_cache_memory_bytes="512MiB")
    core = EngineCore(resolve_engine_config(args))
    try:
        prompt = np.random.default_rng(0).integers(3, 256, prompt_len).tolist()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        core.add_request(EngineCoreRequest("r", prompt, params, eos_token_id=None, arrival_time=0.0))
        kv, most, last = core.scheduler.kv_cache_manager, 0, 0
        while core.has_unfinished_requests():
            core.step()
            if held := kv.num_blocks_of("r"):  # 0 once finished
                most, last = max(most, held), held
        return most, last
    finally:
        core.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-len", type=int, default=8192)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--chunk", type=int, default=2048)
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name, window in (("full attention", None), (f"sliding window {args.window}", args.window)):
            path = Path(folder) / name.replace(" ", "-")
            tiny_hf_model("mistral", path, tie_word_embeddings=False, sliding_window=window,
                          max_position_embeddings=args.prompt_len + args.max_tokens)
            rows.append((name, *blocks_held(str(path), args.prompt_len, args.max_tokens, args.chunk)))
    print(f"one request: {args.prompt_len}-token prompt in chunks of {args.chunk}, {args.max_tokens} tokens out, "
          "blocks of 16 tokens\n")
    print("| attention | most blocks held | blocks held at the end |\n|---|---|---|")
    for name, most, last in rows:
        print(f"| {name} | {most} | {last} |")


if __name__ == "__main__":
    main()
