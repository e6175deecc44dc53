"""Multi-LoRA decode speed: 16 requests in one batch over 4 adapters against 16 on the base model, in one engine.

The embedded SmolLM2 is served with ``enable_lora`` (4 slots); 4 random PEFT adapters of rank ``--rank`` on every
projection are made for it first. Each round runs the base batch and the adapter batch (``--prompt-len`` random
tokens, ``--max-tokens`` greedy tokens each, ``ignore_eos``), alternating which goes first; the figure is each
one's median output tokens/s and their ratio. Then an adapter's load time as a request sees it: a one-token
request with an adapter the engine has not read, less the same request again.

    python -m benchmarks.lora_speed [--rounds 3] [--rank 16] [--prompt-len 64] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.tiny_models import random_lora_adapter
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.lora.peft import TARGET_MODULES
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.model.loader import gguf_cache_folder, resolve_model_path


def tokens_per_second(llm: LLM, prompts: list[list[int]], params: SamplingParams,
                      loras: list[LoRARequest | None]) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    base = gguf_cache_folder(resolve_model_path(None)).path
    with tempfile.TemporaryDirectory() as tmp:
        folders = [random_lora_adapter(base, Path(tmp) / f"adapter-{i}", rank=args.rank, targets=list(TARGET_MODULES),
                                       seed=i, scale=0.02) for i in range(5)]
        llm = LLM(None, enable_lora=True, max_loras=4, max_lora_rank=args.rank, max_num_seqs=16,
                  enable_prefix_caching=False)
        loras = [LoRARequest(f"adapter-{i}", i + 1, str(folder)) for i, folder in enumerate(folders)]
        rng = np.random.default_rng(0)
        prompts = [rng.integers(100, 40000, size=args.prompt_len).tolist() for _ in range(16)]
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        mixed = [loras[i % 4] for i in range(16)]
        tokens_per_second(llm, prompts[:2], params, mixed[:2])  # warm-up: reads the first adapters
        results: dict[str, list[float]] = {"base": [], "4 adapters": []}
        for round_index in range(args.rounds):
            order = [("base", [None] * 16), ("4 adapters", mixed)]
            for name, batch_loras in order if round_index % 2 == 0 else order[::-1]:
                results[name].append(tokens_per_second(llm, prompts, params, batch_loras))
        one = SamplingParams(temperature=0.0, max_tokens=1)
        read = [time.perf_counter()]
        for _ in range(2):  # the first reads the adapter, the second finds it in a slot
            llm.generate(prompts[:1], one, use_tqdm=False, lora_request=loras[4])
            read.append(time.perf_counter())
    base_tps, lora_tps = statistics.median(results["base"]), statistics.median(results["4 adapters"])
    print(f"16 requests x {args.max_tokens} tokens, prompts of {args.prompt_len}, rank {args.rank}, "
          f"{args.rounds} rounds (median):")
    print(f"  base model:  {base_tps:7.1f} output tok/s   {[round(x, 1) for x in results['base']]}")
    print(f"  4 adapters:  {lora_tps:7.1f} output tok/s   {[round(x, 1) for x in results['4 adapters']]}")
    print(f"  adapters / base: {lora_tps / base_tps:.2f}")
    print(f"adapter load as a request sees it: {1000 * ((read[1] - read[0]) - (read[2] - read[1])):.0f} ms "
          f"(a 1-token request: {1000 * (read[1] - read[0]):.0f} ms with a new adapter, "
          f"{1000 * (read[2] - read[1]):.0f} ms again)")


if __name__ == "__main__":
    main()
