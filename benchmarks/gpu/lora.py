"""Multi-LoRA on the device: parity with transformers + PEFT, the Triton kernel against torch's, and speed.

- parity: a tiny Llama and two PEFT adapters (rank 8 on every projection; rank 4 rsLoRA on q, v and down). The
  engine runs the base model and both adapters in one batch (``max_loras`` 2, chunked prefill), against
  transformers with each adapter merged into the weights, in the same dtype on the same device. fp32 must be
  identical; bf16 may part at near-ties (``greedy_parity``'s judging).
- kernel: ``LoRALayer.add_to`` through the Triton kernel (two launches) against torch's per-slot products, on
  a fused layer of Llama-3.2-1B's ``gate_up_proj`` (2048 -> 2 x 8192), rank 16, 4 adapters over 64 decode
  tokens and over 4 prefills of 512 tokens: error against an fp32 product and the time of each.
- speed: a random Llama-3.2-1B-shape model in bf16 serving 64 requests (128-token prompts, 128 output tokens)
  over 4 random rank-16 adapters, against the same 64 on the base model, interleaved; and an adapter's load
  time as a request sees it (a one-token request with an adapter never read, less the same request again).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from benchmarks.gpu.context import attention_backend, free_memory, sync
from benchmarks.gpu.fixtures import build_tokenizer, random_prompts, save_random_model
from benchmarks.gpu.greedy_parity import TINY_VOCAB, compare_greedy, greedy_verdict, reference_generate
from benchmarks.gpu.markdown import table
from benchmarks.roofline import DTYPES

if TYPE_CHECKING:
    from benchmarks.gpu.context import CheckContext

NAME = "lora"
TITLE = "Multi-LoRA: parity with transformers + PEFT, the Triton kernel, speed"
PROMPT_LENS = (3, 9, 20, 33, 41, 50, 100, 150)
#: Each prompt's adapter: the base model and both adapters in every step.
NAMES = ("base", "a", "b", "a", "base", "b", "b", "a")
MAX_TOKENS = 16
SPEED_REQUESTS, SPEED_PROMPT, SPEED_OUTPUT, SPEED_RANK = 64, 128, 128, 16


def _tiny(ctx: CheckContext) -> tuple[Path, dict[str, Path]]:
    from benchmarks.tiny_models import random_lora_adapter, tiny_hf_model

    base = ctx.tmp / "tiny-llama-lora"
    tiny_hf_model("llama", base, tie_word_embeddings=False)
    build_tokenizer(TINY_VOCAB).save_pretrained(base)
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    return base, {"a": random_lora_adapter(base, ctx.tmp / "lora-a", rank=8, targets=every, seed=1),
                  "b": random_lora_adapter(base, ctx.tmp / "lora-b", rank=4, targets=["q_proj", "v_proj", "down_proj"],
                                           seed=2, rslora=True)}


def _merged(base: Path, adapter: Path, folder: Path) -> Path:
    """``base`` with ``adapter`` merged into its weights, saved to ``folder`` (the reference model)."""
    import peft
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder


def _parity(ctx: CheckContext, base: Path, adapters: dict[str, Path], references: dict[str, Path],
            dtype_name: str) -> dict[str, Any]:
    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.engine.lora.request import LoRARequest

    prompts = random_prompts(np.random.default_rng(5), PROMPT_LENS, TINY_VOCAB)
    loras = {"base": None, **{name: LoRARequest(name, i + 1, str(path)) for i, (name, path) in
                              enumerate(adapters.items())}}
    llm = LLM(str(base), device=ctx.device, dtype=dtype_name, max_model_len=256, max_num_batched_tokens=64,
              long_prefill_token_threshold=32, kv_cache_memory_bytes="64MiB", enable_lora=True, max_loras=2,
              max_lora_rank=8, seed=0)
    backend = attention_backend(llm)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=[loras[n] for n in NAMES])
    engine_tokens = [o.outputs[0].token_ids for o in outputs]
    llm.engine_core.shutdown()
    del llm
    free_memory()
    comparisons = []
    for name, folder in references.items():
        rows = [i for i, n in enumerate(NAMES) if n == name]
        reference = reference_generate(folder, [prompts[i] for i in rows], MAX_TOKENS, DTYPES[dtype_name],
                                        ctx.device)
        comparisons += [{"adapter": name, "prompt_len": len(prompts[i]), **compare_greedy(engine_tokens[i], r, lg)}
                        for i, (r, lg) in zip(rows, reference, strict=True)]
    verdict = greedy_verdict(comparisons, dtype_name)
    ctx.say(f"[{NAME}] parity {dtype_name} {backend}: {sum(c['identical'] for c in comparisons)}/{len(comparisons)} "
            f"identical -> {verdict}")
    return {"dtype": dtype_name, "backend": backend, "verdict": verdict, "prompts": comparisons}


def _time_ms(fn: Any, device: str, reps: int = 20) -> float:
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def _kernel(ctx: CheckContext) -> list[dict[str, Any]]:
    from pagedserve.engine.model.lora import LoRALayer, LoRAMapping

    device, rows = torch.device(ctx.device), []
    hidden, intermediate, rank = (64, 128, 16) if ctx.quick else (2048, 8192, 16)
    decode, prefill = (16, 32) if ctx.quick else (64, 512)
    for dtype in (torch.bfloat16, torch.float32):
        torch.manual_seed(0)
        mapping = LoRAMapping()
        layer = LoRALayer(mapping, 4, rank, hidden, [intermediate, intermediate], dtype, device)
        for slot in range(4):
            for part in range(2):
                layer.set_part(slot, part, torch.randn(rank, hidden, device=device).to(dtype) / hidden ** 0.5,
                               torch.randn(intermediate, rank, device=device).to(dtype) / rank ** 0.5)
        for label, token_slots in [(f"decode, {decode} tokens", np.arange(decode) % 4),
                                   (f"prefill, 4 x {prefill}", np.repeat(np.arange(4), prefill))]:
            x = torch.randn(len(token_slots), hidden, device=device).to(dtype)
            out = torch.zeros(len(token_slots), 2 * intermediate, device=device, dtype=dtype)
            index = torch.from_numpy(token_slots).to(device)
            exact = torch.einsum("tr,tor->to", torch.einsum("ti,tri->tr", x.float(), layer.a[index].float()),
                                 layer.b[index].float())
            row = {"dtype": str(dtype).removeprefix("torch."), "tokens": label}
            for kernel in ("triton", "torch"):
                mapping.update(token_slots, device, segments=kernel == "triton")
                result = layer.add_to(x, out.clone()).float()
                row[f"{kernel}_rel_err"] = float((result - exact).norm() / exact.norm())
                scratch = out.clone()  # add_to adds in place
                row[f"{kernel}_ms"] = _time_ms(lambda lay=layer, x=x, s=scratch: lay.add_to(x, s), ctx.device,
                                               reps=2 if ctx.quick else 20)
            rows.append(row)
            ctx.say(f"[{NAME}] kernel {row}")
    return rows


def _write_adapter(folder: Path, hf_config: Any, rank: int, seed: int) -> Path:
    """A rank-``rank`` PEFT adapter on every projection with random weights, written without PEFT (fast at 1B)."""
    from safetensors.torch import save_file

    from pagedserve.engine.lora.peft import TARGET_MODULES, module_shapes

    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(hf_config.num_hidden_layers):
        for kind, (out_features, in_features) in module_shapes(hf_config).items():
            block = "self_attn" if kind in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{kind}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.02
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in tensors.items()},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": rank, "target_modules": list(TARGET_MODULES),
         "bias": "none", "task_type": "CAUSAL_LM"}))
    return folder


def _speed(ctx: CheckContext) -> dict[str, Any]:
    from transformers import AutoConfig

    from benchmarks.gpu.decode_throughput import LLAMA_3_2_1B
    from benchmarks.roofline import ModelShape
    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.engine.lora.request import LoRARequest

    shape = (ModelShape(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=2, head_dim=32,
                        vocab_size=512, num_layers=2) if ctx.quick else LLAMA_3_2_1B)
    requests, output = (8, 8) if ctx.quick else (SPEED_REQUESTS, SPEED_OUTPUT)
    folder = ctx.tmp / "lora-speed-model"
    save_random_model(shape, folder, torch.bfloat16, ctx.device)
    hf_config = AutoConfig.from_pretrained(folder)
    loras = [LoRARequest(f"adapter-{i}", i + 1, str(_write_adapter(ctx.tmp / f"speed-adapter-{i}", hf_config,
                                                                   SPEED_RANK, i))) for i in range(5)]
    llm = LLM(str(folder), device=ctx.device, dtype="bfloat16", max_model_len=1024, enable_lora=True, max_loras=4,
              max_lora_rank=SPEED_RANK, max_num_seqs=requests, enable_prefix_caching=False, seed=0)
    prompts = random_prompts(np.random.default_rng(3), [SPEED_PROMPT] * requests, shape.vocab_size)
    params = SamplingParams(temperature=0.0, max_tokens=output, ignore_eos=True)
    mixed = [loras[i % 4] for i in range(requests)]
    cuda_graphs = llm.engine_core.executor.worker.model_runner.cuda_graphs is not None

    def tokens_per_s(batch_loras: list[Any]) -> float:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=batch_loras)
        return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.perf_counter() - start)

    tokens_per_s(mixed)  # warm-up: reads the four adapters, compiles the kernels
    tokens_per_s([None] * requests)
    runs: dict[str, list[float]] = {"base": [], "4 adapters": []}
    for round_index in range(3):
        order = [("base", [None] * requests), ("4 adapters", mixed)]
        for name, batch in order if round_index % 2 == 0 else order[::-1]:
            runs[name].append(tokens_per_s(batch))
    one = SamplingParams(temperature=0.0, max_tokens=1)
    marks = [time.perf_counter()]
    for _ in range(2):  # the first reads the adapter, the second finds it in a slot
        llm.generate(prompts[:1], one, use_tqdm=False, lora_request=loras[4])
        marks.append(time.perf_counter())
    llm.engine_core.shutdown()
    base, adapters = statistics.median(runs["base"]), statistics.median(runs["4 adapters"])
    data = {"cuda_graphs": cuda_graphs, "requests": requests, "prompt_len": SPEED_PROMPT, "output_len": output,
            "rank": SPEED_RANK, "base_tok_s": base, "adapters_tok_s": adapters, "ratio": adapters / base,
            "rounds": runs, "adapter_load_ms": 1000 * ((marks[1] - marks[0]) - (marks[2] - marks[1]))}
    ctx.say(f"[{NAME}] speed {data}")
    return data


def run(ctx: CheckContext) -> dict[str, Any]:
    """Parity in fp32 and bf16, the kernel, the speed; a failing part leaves the others."""
    data: dict[str, Any] = {"prompt_lens": list(PROMPT_LENS), "adapters": list(NAMES), "runs": []}
    ctx.section(NAME)["data"] = data
    tiny: dict[str, Any] = {}

    def prepare() -> None:
        base, adapters = _tiny(ctx)
        tiny.update(base=base, adapters=adapters, references={
            "base": base, **{name: _merged(base, path, ctx.tmp / f"merged-{name}") for name, path in adapters.items()}})

    if ctx.run_part(NAME, prepare):
        for dtype_name in ("float32", "bfloat16"):
            ctx.run_part(NAME, lambda d=dtype_name: data["runs"].append(
                _parity(ctx, tiny["base"], tiny["adapters"], tiny["references"], d)))
            ctx.save()
    ctx.run_part(NAME, lambda: data.update(kernel=_kernel(ctx)))
    ctx.save()
    if ctx.out_of_time():
        ctx.note(NAME, "speed skipped: time budget")
    else:
        ctx.run_part(NAME, lambda: data.update(speed=_speed(ctx)))
    return data


def goals(section: dict[str, Any]) -> list[str]:
    """fp32 parity of two adapters and the base in one batch, and the speed ratio."""
    if not section:
        return []
    data = section.get("data", {})
    lines = [f"LoRA parity {r['dtype']} ({r['backend']}): {r['verdict']}, "
             f"{sum(c['identical'] for c in r['prompts'])}/{len(r['prompts'])} identical" for r in data.get("runs", [])]
    if speed := data.get("speed"):
        lines.append(f"LoRA speed: {speed['requests']} requests over 4 adapters {speed['adapters_tok_s']:.0f} tok/s, "
                     f"base {speed['base_tok_s']:.0f} tok/s (x{speed['ratio']:.2f}); adapter load "
                     f"{speed['adapter_load_ms']:.0f} ms")
    return lines or [f"LoRA: not measured ({section.get('status', 'not run')})"]


def markdown(data: dict[str, Any]) -> list[str]:
    lines = table(["dtype", "backend", "identical", "divergences", "verdict"], [
        (r["dtype"], r["backend"], f"{sum(c['identical'] for c in r['prompts'])}/{len(r['prompts'])}",
         "; ".join(f"{c['adapter']} len {c['prompt_len']}: step {c['first_divergence']}, gap {c.get('logit_gap')}"
                   for c in r["prompts"] if not c["identical"]) or "-", r["verdict"])
        for r in data.get("runs", [])])
    if kernel := data.get("kernel"):
        lines += [""] + table(["dtype", "tokens", "triton ms", "torch ms", "triton rel. err", "torch rel. err"], [
            (k["dtype"], k["tokens"], k["triton_ms"], k["torch_ms"], k["triton_rel_err"], k["torch_rel_err"])
            for k in kernel])
    if speed := data.get("speed"):
        lines += ["", f"{speed['requests']} requests, {speed['prompt_len']}-token prompts, {speed['output_len']} "
                  f"output tokens, rank {speed['rank']}, CUDA graphs {speed['cuda_graphs']}: base "
                  f"{speed['base_tok_s']:.0f} tok/s, 4 adapters {speed['adapters_tok_s']:.0f} tok/s "
                  f"(x{speed['ratio']:.2f}); rounds {speed['rounds']}; adapter load as a request sees it "
                  f"{speed['adapter_load_ms']:.0f} ms."]
    return lines
