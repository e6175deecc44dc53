"""Decode speed of a mixture of experts against dense models of the same shape, offline (``LLM``), CPU.

Three random-weight Qwen3 models with the same attention (hidden 512, 8 layers, 8 query and 2 KV heads):

* ``moe``: Qwen3-MoE, 16 experts of 256 features, 2 per token (Qwen3-30B-A3B's 128 of 768, 8 per token,
  scaled down);
* ``dense-active``: a dense MLP of 512 features, the multiply-adds a token runs in ``moe``;
* ``dense-total``: a dense MLP of 4,096 features, the weights ``moe`` holds.

Each runs ``--requests`` prompts of 32 random tokens to ``--max-tokens`` greedy tokens at once, float32,
``--rounds`` times with the models interleaved; output tokens per second (median and spread) and the ratio
of ``moe`` to each dense model, per round, are printed as a Markdown table.

    python -m benchmarks.moe_speed [--requests 16] [--max-tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from benchmarks.tiny_models import tiny_hf_model
from pagedserve.engine import LLM, SamplingParams

SHAPE = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
             head_dim=64, max_position_embeddings=512)
MODELS = {
    "moe": ("qwen3_moe", dict(num_experts=16, num_experts_per_tok=2, moe_intermediate_size=256)),
    "dense-active": ("qwen3", dict(intermediate_size=512)),
    "dense-total": ("qwen3", dict(intermediate_size=16 * 256)),
}


def build(folder: Path) -> dict[str, str]:
    """Each model's checkpoint folder under ``folder``."""
    paths = {}
    for name, (model_type, sizes) in MODELS.items():
        paths[name] = str(folder / name)
        tiny_hf_model(model_type, Path(paths[name]), tie_word_embeddings=False, **(SHAPE | sizes))
    return paths


def output_tokens_per_s(path: str, requests: int, max_tokens: int) -> float:
    """Output tokens per second of ``requests`` greedy requests run together (after a warm-up request)."""
    llm = LLM(path, max_model_len=512, kv_cache_memory_bytes="256MiB")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, SHAPE["vocab_size"], 32).tolist() for _ in range(requests)]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    del llm
    gc.collect()
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        paths = build(Path(folder))
        from transformers import AutoTokenizer  # any tokenizer serves: the prompts are token ids

        from pagedserve.engine.model.loader import gguf_cache_folder, resolve_model_path
        tokenizer = AutoTokenizer.from_pretrained(gguf_cache_folder(resolve_model_path(None)).path)
        for path in paths.values():
            tokenizer.save_pretrained(path)
        rounds = [{name: output_tokens_per_s(path, args.requests, args.max_tokens) for name, path in paths.items()}
                  for _ in range(args.rounds)]
    print(f"{args.requests} requests x {args.max_tokens} tokens, float32, {args.rounds} rounds interleaved\n")
    print("| model | output tok/s (median, min-max) | moe / this (median of rounds) |\n|---|---|---|")
    for name in MODELS:
        speeds = [r[name] for r in rounds]
        ratio = statistics.median(r["moe"] / r[name] for r in rounds)
        print(f"| {name} | {statistics.median(speeds):.1f} ({min(speeds):.1f}-{max(speeds):.1f}) | {ratio:.2f} |")


if __name__ == "__main__":
    main()
