"""The quantized linear kernel (engine/model/quant_kernels.py) against torch's CPU GEMMs, on SmolLM2-135M's shapes.

Decode: every projection of a layer and the LM head at a few token rows, through
our C kernel (q4 = GGUF Q4_1, q8 = Q8_0; bf16 activations), oneDNN with the
weight pre-packed (bf16 and fp32, as the engine's unquantized linear method runs
it) and torch's own quantized kernels (``_weight_int4pack_mm_for_cpu``, group
32, and ``_weight_int8pack_mm``, per channel; bf16 activations). Each time is
the fastest of repeated calls (as ``benchmarks.roofline``), with the GB/s of
weight bytes it implies next to the copy bandwidth roofline measures.

Prefill (``--prefill-rows``): the kernel against dequantizing the weight and
calling ``F.linear`` (what ``quantized_linear`` does above
``KERNEL_MAX_ROWS``), with the bf16 packed GEMM for reference; the crossover
sets ``KERNEL_MAX_ROWS``.

    python -m benchmarks.quant_gemv [--rows 1 4 16] [--prefill-rows 16 64 256 2048] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.roofline import SMOLLM2_135M, _best_time_s, measure_bandwidth, num_threads
from pagedserve.engine.model.quant_kernels import (
    GROUP_SIZE,
    QuantizedWeight,
    dequantize,
    force_isa,
    kernel_linear,
    load_kernel,
    pack_q4,
    pack_q8,
)

#: (name, in_features, out_features) of SmolLM2-135M's products.
SHAPES = (("q/o", 576, 576), ("k/v", 576, 192), ("gate/up", 576, 1536), ("down", 1536, 576),
          ("lm_head", 576, SMOLLM2_135M.vocab_size))
DECODE_METHODS = ("q4", "q8", "q4 avx2", "bf16 packed", "fp32 packed", "int4pack", "int8pack")
PREFILL_METHODS = ("q4 kernel", "q4 dequant+F.linear", "bf16 packed")


def random_q4(in_features: int, out_features: int) -> QuantizedWeight:
    scales = torch.rand(out_features, in_features // GROUP_SIZE) * 0.01
    return pack_q4(torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8), scales, -8 * scales)


def random_q8(in_features: int, out_features: int) -> QuantizedWeight:
    scales = torch.rand(out_features, in_features // GROUP_SIZE) * 0.01
    return pack_q8(torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8), scales)


def packed(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    """oneDNN with the weight reordered once, as ``OneDNNPackedLinearMethod``."""
    blocked = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, blocked, None, "none", [], "")


def decode_method(name: str, in_features: int, out_features: int) -> tuple[Callable[[torch.Tensor], object],
                                                                             torch.dtype, int]:
    """(the product, the activations' dtype, the weight's bytes) of method ``name``."""
    n, k = out_features, in_features
    if name in ("q4", "q4 avx2", "q8"):
        weight = random_q4(k, n) if name.startswith("q4") else random_q8(k, n)
        if name == "q4 avx2":
            def avx2(x: torch.Tensor) -> object:
                with force_isa("avx2"):
                    return kernel_linear(x, weight)
            return avx2, torch.bfloat16, weight.nbytes
        return lambda x: kernel_linear(x, weight), torch.bfloat16, weight.nbytes
    if name in ("bf16 packed", "fp32 packed"):
        dtype = torch.bfloat16 if name.startswith("bf16") else torch.float32
        return packed(torch.randn(n, k, dtype=dtype) * 0.02), dtype, n * k * dtype.itemsize
    if name == "int4pack":
        weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
        scales_and_zeros = torch.rand(k // GROUP_SIZE, n, 2).bfloat16()
        return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, weight, GROUP_SIZE, scales_and_zeros),
                torch.bfloat16, weight.numel() + scales_and_zeros.numel() * 2)
    weight8, scales8 = torch.randint(-128, 128, (n, k), dtype=torch.int8), torch.rand(n).bfloat16()
    return lambda x: torch.ops.aten._weight_int8pack_mm(x, weight8, scales8), torch.bfloat16, n * k + 2 * n


def prefill_method(name: str, in_features: int, out_features: int) -> Callable[[torch.Tensor], object]:
    weight = random_q4(in_features, out_features)
    if name == "q4 kernel":
        return lambda x: kernel_linear(x, weight)
    if name == "q4 dequant+F.linear":
        return lambda x: F.linear(x, dequantize(weight, x.dtype))
    return packed(dequantize(weight, torch.bfloat16))


def measure(rows: list[int], prefill_rows: list[int], min_time_s: float) -> dict[str, object]:
    """Microseconds (and weight GB/s) per method, shape and row count."""
    decode: list[dict[str, object]] = []
    for shape, k, n in SHAPES:
        for name in DECODE_METHODS:
            fn, dtype, nbytes = decode_method(name, k, n)
            for m in rows:
                x = torch.randn(m, k, dtype=dtype)
                seconds = _best_time_s(lambda fn=fn, x=x: fn(x), min_time_s)
                decode.append({"shape": shape, "method": name, "rows": m, "us": seconds * 1e6,
                               "weight_gb_per_s": nbytes / seconds / 1e9})
    prefill: list[dict[str, object]] = []
    for shape, k, n in SHAPES[2:4]:
        for name in PREFILL_METHODS:
            fn = prefill_method(name, k, n)
            for m in prefill_rows:
                x = torch.randn(m, k, dtype=torch.bfloat16)
                seconds = _best_time_s(lambda fn=fn, x=x: fn(x), min_time_s)
                prefill.append({"shape": shape, "method": name, "rows": m, "us": seconds * 1e6})
    return {"threads": torch.get_num_threads(), "bandwidth_gb_per_s": measure_bandwidth(min_time_s=min_time_s) / 1e9,
            "decode": decode, "prefill": prefill}


def table(results: list[dict[str, object]], methods: tuple[str, ...], with_bandwidth: bool) -> str:
    """One line per (shape, rows), one column per method: microseconds (and GB/s of weights)."""
    lines = ["shape      rows  " + "  ".join(f"{m:>19}" for m in methods)]
    keys = dict.fromkeys((r["shape"], r["rows"]) for r in results)
    for shape, rows in keys:
        cells = []
        for method in methods:
            r = next(r for r in results if (r["shape"], r["rows"], r["method"]) == (shape, rows, method))
            cells.append(f"{r['us']:8.1f} us {r['weight_gb_per_s']:5.1f} GB/s" if with_bandwidth
                         else f"{r['us']:16.1f} us")
        lines.append(f"{shape:<9} {rows:5}  " + "  ".join(f"{c:>19}" for c in cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--prefill-rows", type=int, nargs="*", default=[16, 64, 256, 2048])
    parser.add_argument("--threads", type=int, default=num_threads())
    parser.add_argument("--min-time", type=float, default=0.3, help="seconds of calls per measurement")
    parser.add_argument("--result-json", type=Path)
    args = parser.parse_args(argv)
    if load_kernel() is None:
        parser.error("the C kernel could not be built (see the warning above)")
    torch.set_num_threads(args.threads)
    results = measure(args.rows, args.prefill_rows, args.min_time)
    print(f"{results['threads']} threads; copy bandwidth {results['bandwidth_gb_per_s']:.1f} GB/s")
    print(table(results["decode"], DECODE_METHODS, with_bandwidth=True))
    if results["prefill"]:
        print(table(results["prefill"], PREFILL_METHODS, with_bandwidth=False))
    if args.result_json:
        args.result_json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
