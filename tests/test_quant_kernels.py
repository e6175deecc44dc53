"""Quantized-weight linear layers (pagedserve.engine.model.quant_kernels): packing round trips, the C kernel against
float64 within the error its int8 activations allow, each instruction-set path, the torch fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.engine.model import quant_kernels
from pagedserve.engine.model.quant_kernels import (
    GROUP_SIZE,
    KERNEL_MAX_ROWS,
    QuantizedWeight,
    dequantize,
    embedding_rows,
    force_isa,
    kernel_linear,
    load_kernel,
    pack_q4,
    pack_q8,
    quantized_linear,
)

KINDS = ("q4", "q8")
DTYPES = (torch.float32, torch.bfloat16)
ROW_COUNTS = (1, 3, 8, 17, 64)


def random_weight(kind: str, out_features: int, in_features: int, seed: int = 0) -> QuantizedWeight:
    """Random blocks: q4 as GGUF Q4_1 (any offset), q8 as Q8_0."""
    gen = torch.Generator().manual_seed(seed)
    blocks = (out_features, in_features // GROUP_SIZE)
    scales = torch.rand(blocks, generator=gen) * 0.02 + 1e-3
    if kind == "q4":
        q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=gen)
        return pack_q4(q, scales, -8 * scales + 0.01 * torch.randn(blocks, generator=gen))
    q = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=gen)
    return pack_q8(q, scales)


def kernel_tolerance(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """What the kernel may differ from ``x @ w.T`` in float64, per output.

    Each 32-block of an x row is rounded to ``dx * q`` with ``dx = max|x| / 127``,
    so each x is off by at most ``dx / 2 = max|x| / 254``, and an output by at most
    the sum over blocks of ``max|x_b| / 254 * sum|w_b|``; plus float32 summation
    (1e-4 of ``|x| @ |w|.T``) and, for a bfloat16 output, its rounding (2**-8
    relative, with margin).
    """
    x, w = x.double(), w.double()
    blocks = x.shape[1] // GROUP_SIZE
    amax = x.abs().view(x.shape[0], blocks, GROUP_SIZE).amax(-1)
    l1 = w.abs().view(w.shape[0], blocks, GROUP_SIZE).sum(-1)
    bound = amax / 254 @ l1.T + 1e-4 * (x.abs() @ w.abs().T)
    if out_dtype == torch.bfloat16:
        bound += 2**-8 * ((x @ w.T).abs() + bound)
    return bound


def linear_tolerance(x: torch.Tensor, w: torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
    """``kernel_tolerance``, or for rows above ``KERNEL_MAX_ROWS`` (dequantize + F.linear) the weights'
    rounding to x's dtype."""
    if x.shape[0] <= KERNEL_MAX_ROWS:
        return kernel_tolerance(x, w, out_dtype)
    rounding = 2**-8 if out_dtype == torch.bfloat16 else 1e-5
    return rounding * (x.double().abs() @ w.double().abs().T) + 1e-6


def assert_within(out: torch.Tensor, reference: torch.Tensor, tolerance: torch.Tensor) -> None:
    excess = (out.double() - reference).abs() - tolerance
    assert excess.max() <= 0, f"off by {excess.max():.3g} more than the tolerance"


@pytest.mark.parametrize("kind", KINDS)
def test_pack_then_dequantize_gives_back_the_blocks(kind: str) -> None:
    """``scale * q + min`` per block exactly (scales stored as float16), rows of a partial last tile too."""
    out_features, in_features = 37, 96
    gen = torch.Generator().manual_seed(1)
    scales = torch.rand(out_features, 3, generator=gen).half().float()
    if kind == "q4":
        q = torch.randint(0, 16, (out_features, in_features), dtype=torch.uint8, generator=gen)
        mins = -8 * scales  # GGUF Q4_0
        weight = pack_q4(q, scales, mins)
        expected = q.float().view(out_features, 3, 32) * scales[..., None] + mins[..., None]
    else:
        q = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8, generator=gen)
        weight = pack_q8(q, scales)
        expected = q.float().view(out_features, 3, 32) * scales[..., None]
    expected = expected.view(out_features, in_features)
    assert torch.equal(dequantize(weight, torch.float32), expected)
    assert torch.equal(dequantize(weight, torch.bfloat16), expected.bfloat16())
    assert torch.equal(quant_kernels._dequantize_rows(weight, None, torch.float32), expected)
    assert weight.nbytes == 48 * 3 * (20 if kind == "q4" else 34)  # 3 tiles of 16 rows, GGUF's block bytes


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_kernel_matches_float64_within_the_activation_rounding(kind: str, dtype: torch.dtype) -> None:
    weight = random_weight(kind, 37, 544)
    w = dequantize(weight, torch.float64)
    for num_rows in ROW_COUNTS:
        x = torch.randn(num_rows, 544, dtype=dtype)
        reference = x.double() @ w.T
        out = kernel_linear(x, weight)
        assert out.dtype == dtype and out.shape == (num_rows, 37)
        assert_within(out, reference, kernel_tolerance(x, w, dtype))
        out = quantized_linear(x, weight)
        assert out.dtype == dtype
        assert_within(out, reference, linear_tolerance(x, w, dtype))


def test_the_activation_rounding_is_about_that_of_bfloat16() -> None:
    """The measured error, relative to the output's RMS, next to rounding x to bfloat16 (module docstring)."""
    weight = random_weight("q4", 256, 576)
    w = dequantize(weight, torch.float64)
    x = torch.randn(8, 576)
    reference = x.double() @ w.T
    kernel_error = (kernel_linear(x, weight).double() - reference).pow(2).mean().sqrt()
    bf16_error = (x.bfloat16().double() @ w.T - reference).pow(2).mean().sqrt()
    assert kernel_error < 4 * bf16_error, (kernel_error, bf16_error)


@pytest.mark.parametrize("kind", KINDS)
def test_every_instruction_set_path_computes_the_same(kind: str) -> None:
    """AVX2 and scalar paths on this machine, plus a build for an AVX2-only CPU (-march=haswell): the same
    integer dot products, so equal up to float32 summation order."""
    weight = random_weight(kind, 50, 544)
    x = torch.randn(11, 544)
    bias = torch.randn(50)
    best = kernel_linear(x, weight, bias)
    for name in ("avx2", "scalar"):
        with force_isa(name):
            torch.testing.assert_close(kernel_linear(x, weight, bias), best, rtol=1e-5, atol=1e-5)
    haswell = load_kernel(("-march=haswell",))
    assert haswell is not None
    with pytest.raises(ValueError, match="avx512"), force_isa("avx512", haswell):
        pass
    out = torch.empty(11, 50)
    assert haswell.quant_linear_bias(weight.kernel_handle, x.data_ptr(), out.data_ptr(), 11, 0,
                                     bias.data_ptr()) == quant_kernels.ISAS["avx2"]
    torch.testing.assert_close(out, best, rtol=1e-5, atol=1e-5)


def test_without_the_kernel_the_torch_path_gives_the_dequantized_product(monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler (or a non-CPU device): dequantize + F.linear, the same weights through torch ops."""
    weight = random_weight("q4", 37, 96)
    with_kernel = dequantize(weight, torch.float32)
    ids = torch.tensor([[36, 0], [5, 36]])
    rows = embedding_rows(weight, ids, torch.bfloat16)
    monkeypatch.setattr(quant_kernels, "load_kernel", lambda extra_flags=(): None)
    assert torch.equal(dequantize(weight, torch.float32), with_kernel)
    assert torch.equal(embedding_rows(weight, ids, torch.bfloat16), rows)
    x, bias = torch.randn(3, 96), torch.randn(37)
    assert kernel_linear(x, weight) is None
    torch.testing.assert_close(quantized_linear(x, weight, bias), F.linear(x, with_kernel, bias))
    with pytest.raises(IndexError):
        embedding_rows(weight, torch.tensor([37]), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_bias_and_non_contiguous_and_batched_x(dtype: torch.dtype) -> None:
    weight = random_weight("q8", 37, 96)
    w = dequantize(weight, torch.float64)
    wide = torch.randn(4, 2 * 96, dtype=dtype)
    x = wide[:, ::2]  # non-contiguous
    for bias in (torch.randn(37, dtype=dtype), torch.randn(37, dtype=torch.float16)):
        out = quantized_linear(x, weight, bias)
        tolerance = kernel_tolerance(x, w, dtype) + 2**-8 * bias.abs().double()
        assert_within(out, x.double() @ w.T + bias.double(), tolerance)
    batched = quantized_linear(x.reshape(2, 2, 96), weight)
    assert batched.shape == (2, 2, 37)
    assert torch.equal(batched.reshape(4, 37), quantized_linear(x.contiguous(), weight))


@pytest.mark.parametrize("kind", KINDS)
def test_embedding_rows_are_the_dequantized_rows(kind: str) -> None:
    weight = random_weight(kind, 37, 96)
    ids = torch.tensor([[36, 0, 17], [16, 15, 36]])
    for dtype in DTYPES:
        assert torch.equal(embedding_rows(weight, ids, dtype), dequantize(weight, dtype)[ids])
    with pytest.raises(IndexError):
        embedding_rows(weight, torch.tensor([0, 37]), torch.float32)
    with pytest.raises(IndexError):
        embedding_rows(weight, torch.tensor([-1]), torch.float32)


def test_bad_shapes_and_values_raise_value_error() -> None:
    q4, q8 = torch.zeros(4, 64, dtype=torch.uint8), torch.zeros(4, 64, dtype=torch.int8)
    scales = torch.ones(4, 2)
    with pytest.raises(ValueError, match="multiple of 32"):
        pack_q4(torch.zeros(4, 40, dtype=torch.uint8), torch.ones(4, 1), torch.ones(4, 1))
    with pytest.raises(ValueError, match="scales must be"):
        pack_q8(q8, torch.ones(4, 3))
    with pytest.raises(ValueError, match="mins must be"):
        pack_q4(q4, scales, torch.ones(2, 2))
    with pytest.raises(ValueError, match="0..15"):
        pack_q4(q4 + 16, scales, scales)
    with pytest.raises(ValueError, match="int8"):
        pack_q8(q4, scales)
    with pytest.raises(ValueError, match="float16"):
        pack_q8(q8, scales * 1e6)
    weight = pack_q8(q8, scales)
    with pytest.raises(ValueError, match="in_features=64"):
        quantized_linear(torch.zeros(1, 32), weight)
    with pytest.raises(ValueError, match="bias"):
        quantized_linear(torch.zeros(1, 64), weight, torch.zeros(5))
    with pytest.raises(ValueError, match="data must be"):
        QuantizedWeight("q8", 4, 64, weight.data[:, :1], weight.scales, None)
    with pytest.raises(ValueError, match="kind"):
        QuantizedWeight("q2", 4, 64, weight.data, weight.scales, None)
