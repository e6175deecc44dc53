"""Weight quantization schemes (``--quantization``): GGUF's blocks kept as stored, int8 and int4 made at load.

All three end in a ``quant_kernels.QuantizedWeight``: blocks of ``GROUP_SIZE``
(32) input features with a scale each (and an offset, ``"q4"``).

* ``gguf``: GGUF's Q4_0, Q4_1 and Q8_0 blocks (ggml's ``block_q4_0``,
  ``block_q4_1``, ``block_q8_0``, ggml/src/ggml-common.h) are decoded and
  loaded as they are, so the model computes with exactly the weights the
  dequantizing path loads. On their way from the file to a layer they are
  *staged*: ``[rows, in_features / 32, 34]``, each block's 32 codes, its scale
  and its offset (``stage_gguf_tensor``). Rows are output features and the
  second dimension is whole blocks, so the tensor-parallel weight loaders
  (``pagedserve.engine.model.linear``), which cut rows or input features, cut staged
  tensors on block boundaries unchanged. A tensor of another GGUF type (F16,
  K-quants) is staged as its values, marked by a NaN scale. After loading,
  ``unstage`` packs a layer's blocks when they are all of one kind and leaves
  the layer dequantized (as without quantization) when they are not.
* ``int8``: weight-only, symmetric, one scale per output channel
  (``absmax / 127``), as LLM.int8()'s vector-wise weight quantization without
  its outlier decomposition (Dettmers et al., 2022, arXiv:2208.07339).
* ``int4``: groups of 32 input features, asymmetric (``scale = (max - min) / 15``,
  offset ``min``): GGUF's Q4_1 rule made from float weights, round to nearest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from pagedserve.engine.model.quant_kernels import GROUP_SIZE, QuantizedWeight, pack_q4, pack_q8

if TYPE_CHECKING:  # gguf takes 0.4 s to import: only GGUF models pay for it
    from gguf import GGMLQuantizationType

#: Per staged block: 32 codes, the scale, the offset.
STAGED_BLOCK = GROUP_SIZE + 2
#: GGUF types (``GGMLQuantizationType`` names) kept as blocks: bytes per block of 32.
NATIVE_GGUF_TYPES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
#: Types whose staged values float16 holds exactly: codes and float16 scales, or float16 values.
_HALF_EXACT_TYPES = {*NATIVE_GGUF_TYPES, "F16"}


def staged_shape(rows: int, in_features: int) -> tuple[int, int, int]:
    """Shape of a staged ``[rows, in_features]`` weight.

    Raises:
        ValueError: when ``in_features`` is not a multiple of ``GROUP_SIZE``.
    """
    if in_features % GROUP_SIZE:
        raise ValueError(f"a quantized weight's in_features ({in_features}) must be a multiple of {GROUP_SIZE}")
    return rows, in_features // GROUP_SIZE, STAGED_BLOCK


def staging_dtype(tensor_types: list[GGMLQuantizationType]) -> torch.dtype:
    """float16 when it holds every staged value exactly (codes, GGUF's float16 scales, F16 values), else float32."""
    return torch.float16 if {t.name for t in tensor_types} <= _HALF_EXACT_TYPES else torch.float32


def stage_gguf_tensor(data: np.ndarray, tensor_type: GGMLQuantizationType, in_features: int) -> np.ndarray:
    """A GGUF tensor's rows as staged blocks, float32 ``[rows, in_features / 32, 34]``.

    Q4_0 and Q4_1 blocks are a float16 scale ``d`` (Q4_1: and offset ``m``)
    then 16 bytes, byte j holding weight j in its low nibble and weight j + 16
    in its high one; ``w = d * q + m`` (Q4_0: ``d * (q - 8)``, staged as offset
    ``-8 d``). Q8_0 is ``d`` then 32 int8 ``q``, ``w = d * q``. Other types are
    dequantized by gguf-py and staged as values: scale NaN, offset 0.

    Args:
        data: the reader's array: ``[rows, bytes per row]`` uint8 for block types, else ``[rows, in_features]``.
        tensor_type: its GGUF type.
        in_features: elements per row.
    """
    from gguf import dequantize

    rows, num_blocks = data.shape[0], staged_shape(0, in_features)[1]
    staged = np.empty((rows, num_blocks, STAGED_BLOCK), dtype=np.float32)
    if tensor_type.name not in NATIVE_GGUF_TYPES:
        staged[..., :GROUP_SIZE] = dequantize(data, tensor_type).reshape(rows, num_blocks, GROUP_SIZE)
        staged[..., GROUP_SIZE], staged[..., GROUP_SIZE + 1] = np.nan, 0.0
        return staged
    blocks = np.ascontiguousarray(data).reshape(rows, num_blocks, NATIVE_GGUF_TYPES[tensor_type.name])
    scale = blocks[..., 0:2].copy().view(np.float16)[..., 0]
    staged[..., GROUP_SIZE] = scale
    if tensor_type.name == "Q8_0":
        staged[..., :GROUP_SIZE] = blocks[..., 2:].view(np.int8)
        staged[..., GROUP_SIZE + 1] = 0.0
        return staged
    if tensor_type.name == "Q4_1":
        staged[..., GROUP_SIZE + 1] = blocks[..., 2:4].copy().view(np.float16)[..., 0]
    else:
        staged[..., GROUP_SIZE + 1] = -8 * scale.astype(np.float32)
    nibbles = blocks[..., -GROUP_SIZE // 2:]
    staged[..., :GROUP_SIZE // 2] = nibbles & 0x0F
    staged[..., GROUP_SIZE // 2:GROUP_SIZE] = nibbles >> 4
    return staged


def unstage(staged: torch.Tensor, dtype: torch.dtype) -> QuantizedWeight | torch.Tensor:
    """A loaded staged weight ``[rows, blocks, 34]`` packed for the kernels, or dequantized.

    ``"q4"`` when every code is in 0..15 (Q4_0, Q4_1), else ``"q8"`` when
    every offset is 0 (Q8_0); either is exact. Otherwise (a layer stacking
    Q4_1 and Q8_0 tensors, or one with a tensor of another type, NaN scales)
    the ``[rows, in_features]`` weight in ``dtype``: ``d * q + m`` in float32,
    as gguf-py computes it, or the staged values.
    """
    rows, num_blocks = staged.shape[:2]
    codes = staged[..., :GROUP_SIZE]
    scales, offsets = staged[..., GROUP_SIZE].float(), staged[..., GROUP_SIZE + 1].float()
    values = scales.isnan()
    if not values.any():
        low, high = torch.aminmax(codes)
        if low >= 0 and high <= 15:
            return pack_q4(codes.to(torch.uint8).reshape(rows, -1), scales, offsets)
        if not offsets.any():
            return pack_q8(codes.to(torch.int8).reshape(rows, -1), scales)
    weight = torch.where(values[..., None], codes.float(), codes.float() * scales[..., None] + offsets[..., None])
    return weight.view(rows, num_blocks * GROUP_SIZE).to(dtype)


def unstage_once(param: torch.nn.Parameter, dtype: torch.dtype) -> QuantizedWeight | torch.Tensor:
    """``unstage(param)``, kept on ``param``: a tied LM head and its embedding share one result."""
    if not hasattr(param, "unstaged"):
        param.unstaged = unstage(param.data, dtype)
    return param.unstaged


def quantize_int8(weight: torch.Tensor) -> QuantizedWeight:
    """``[N, K]`` float -> ``"q8"``: per output channel, symmetric, ``scale = absmax / 127``, round to nearest.

    Raises:
        ValueError: when K is not a multiple of ``GROUP_SIZE`` (the kernels' block).
    """
    rows, cols = weight.shape
    staged_shape(rows, cols)
    w = weight.float()
    # The kernels keep float16 scales: codes are rounded against the scale they will be multiplied by.
    scale = (w.abs().amax(dim=1) / 127).half().float()
    q = torch.round(w / torch.where(scale > 0, scale, 1.0)[:, None]).clamp_(-127, 127)
    return pack_q8(q.to(torch.int8), scale[:, None].expand(rows, cols // GROUP_SIZE))


def quantize_int4(weight: torch.Tensor) -> QuantizedWeight:
    """``[N, K]`` float -> ``"q4"``: groups of 32 along K, ``scale = (max - min) / 15``, offset ``min``, round
    to nearest.

    Raises:
        ValueError: when K is not a multiple of ``GROUP_SIZE``.
    """
    rows, cols = weight.shape
    groups = weight.float().view(*staged_shape(rows, cols)[:2], GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale, offset = ((high - low) / 15).half().float(), low.half().float()
    q = torch.round((groups - offset[..., None]) / torch.where(scale > 0, scale, 1.0)[..., None]).clamp_(0, 15)
    return pack_q4(q.to(torch.uint8).view(rows, cols), scale, offset)
