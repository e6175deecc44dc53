"""The fused CPU elementwise ops (``pagedserve.engine.model.cpu_ops``) against the layers' torch reference arithmetic.

float32 may differ from torch in summation order only (relative 1e-6); bfloat16
rounds once where torch rounds after every op, so results may differ by one
bfloat16 ulp of the result (relative 2**-7), and the rotary is compared with the
float32 arithmetic rounded once.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.engine.model import cpu_ops

pytestmark = pytest.mark.skipif(cpu_ops._library() is None, reason="no C compiler: the fused ops fall back")

DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {torch.float32: dict(rtol=1e-6, atol=2e-6), torch.bfloat16: dict(rtol=2 ** -7, atol=2 ** -7)}


def torch_rms_norm(x, weight, eps, residual=None):
    """``RMSNorm.forward``'s torch path, operation for operation."""
    if residual is not None:
        x = residual + x
        residual = x
    x32 = x.float()
    out = weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return out if residual is None else (out, residual)


def torch_rotary(x, cos, sin):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 5, 130])  # 130: rows split over threads
def test_rms_norm_with_and_without_residual(dtype: torch.dtype, rows: int) -> None:
    torch.manual_seed(rows)
    x, residual, weight = torch.randn(rows, 96, dtype=dtype), torch.randn(rows, 96, dtype=dtype), torch.rand(96)
    weight = weight.to(dtype)
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-6), torch_rms_norm(x, weight, 1e-6),
                               **TOLERANCE[dtype])
    expected_out, expected_sum = torch_rms_norm(x, weight, 1e-6, residual)
    x_in, residual_in = x.clone(), residual.clone()
    out, summed = cpu_ops.rms_norm(x_in, weight, 1e-6, residual_in)
    # In place, as vLLM's fused_add_rms_norm: the sum is exact (one rounding, as torch's add).
    assert out.data_ptr() == x_in.data_ptr() and summed.data_ptr() == residual_in.data_ptr()
    assert torch.equal(summed, expected_sum)
    torch.testing.assert_close(out, expected_out, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_in_place_on_a_strided_view_of_a_fused_projection(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    rows, heads, kv_heads, head_dim = 70, 4, 2, 16
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
    v_before = qkv[:, (heads + kv_heads) * head_dim:].clone()
    qk = qkv[:, :(heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
    table = torch.randn(256, head_dim, dtype=dtype)
    cos, sin = table[torch.randint(0, 256, (rows,))].unsqueeze(1).chunk(2, dim=-1)
    # In float32, rounded once (torch's bfloat16 chain rounds each product, then their difference).
    expected = torch_rotary(qk.float(), cos.float(), sin.float()).to(dtype)
    assert cpu_ops.rotary_(qk, cos, sin) is qk
    torch.testing.assert_close(qk, expected, **TOLERANCE[dtype])
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim:], v_before)  # v is not touched


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul(dtype: torch.dtype) -> None:
    gate_up = torch.randn(9, 2 * 40, dtype=dtype) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(cpu_ops.silu_and_mul(gate_up), F.silu(gate) * up, **TOLERANCE[dtype])


def test_unsupported_inputs_fall_back_untouched() -> None:
    half = torch.randn(2, 8, dtype=torch.float16)
    assert cpu_ops.rms_norm(half, torch.ones(8, dtype=torch.float16), 1e-6) is None
    assert cpu_ops.silu_and_mul(torch.randn(4, 8).t()) is None  # not contiguous
    x = torch.randn(2, 8)
    assert cpu_ops.rms_norm(x, torch.ones(8, dtype=torch.bfloat16), 1e-6, torch.randn(2, 8)) is None
    column = torch.randn(8, 2)[:, :1].t()  # a row whose elements are strided
    before = column.clone()
    assert cpu_ops.rms_norm(column, torch.ones(8), 1e-6, torch.randn(1, 8)) is None
    assert torch.equal(column, before)
