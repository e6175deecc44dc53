"""How a linear layer stores and multiplies its weight: plain, pre-packed for oneDNN, or quantized.

A layer (``pagedserve.engine.model.linear``) decides the shape of its slice and how
checkpoint tensors map onto it; its ``LinearMethodBase`` decides what the
weight is in memory and which kernel multiplies by it. The split is vLLM's
(``vllm/model_executor/layers/linear.py``, ``LinearMethodBase``): the method
creates the layer's weight parameters (``create_weights``), may rewrite them
once after loading (``process_weights_after_loading``), and runs the product
(``apply``). A quantization scheme (GGUF blocks, int8, int4:
``pagedserve.engine.model.quantization``) is one more subclass; the model code does not
change. ``linear_method_for`` is the one place that picks the method for a
device, dtype and quantization.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.model.cpu_threads import all_threads
from pagedserve.engine.model.quant_kernels import QuantizedWeight, dequantize, quantized_linear
from pagedserve.engine.model.quantization import quantize_int4, quantize_int8, staged_shape, unstage_once
from pagedserve.engine.model.weights import WeightLoader, set_weight_loader


class LinearMethodBase(ABC):
    """Weight storage and GEMM kernel of a linear layer. Stateless: one instance serves every layer."""

    @abstractmethod
    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       weight_loader: WeightLoader) -> None:
        """Register the layer's weight parameters (uninitialised), each carrying ``weight_loader``.

        Args:
            layer: the module that will own the parameters.
            input_size_per_partition: input features on this rank.
            output_partition_sizes: output features on this rank, one entry per
                fused checkpoint tensor (e.g. q, k, v), stacked along the rows.
            weight_loader: copies this rank's slice of a checkpoint tensor into a parameter.
        """

    def process_weights_after_loading(self, layer: nn.Module) -> None:  # noqa: B027 (optional hook)
        """Rewrite the loaded weights into the form ``apply`` reads (default: keep them as they are)."""

    @abstractmethod
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ weight.T + bias``: ``[..., input_size_per_partition]`` -> ``[..., sum(output_partition_sizes)]``."""


class UnquantizedLinearMethod(LinearMethodBase):
    """A plain ``[out, in]`` weight in the model's dtype, multiplied with ``F.linear``."""

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       weight_loader: WeightLoader) -> None:
        """See ``LinearMethodBase.create_weights``: ``layer.weight`` ``[sum(output_partition_sizes), in]``."""
        weight = nn.Parameter(torch.empty(sum(output_partition_sizes), input_size_per_partition),
                              requires_grad=False)
        layer.register_parameter("weight", set_weight_loader(weight, weight_loader))

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """See ``LinearMethodBase.apply``."""
        # A GEMM repays an OpenMP barrier: it gets every thread even in a serial CPU step (cpu_threads).
        with all_threads():
            return F.linear(x, layer.weight, bias)


class OneDNNPackedLinearMethod(UnquantizedLinearMethod):
    """The weight reordered once, after loading, into oneDNN's blocked layout (CPU only).

    ``F.linear`` hands a plain row-major weight to the GEMM, which then
    re-blocks it on every call; with few token rows that repacking, not the
    arithmetic, sets the speed. Measured on the 2-core test machine over
    SmolLM2-135M's GEMMs: 1.4-1.6x faster in bf16 at 1-16 rows and 1.25x at
    64, 1.7-2.4x in fp32. ``torch.compile``'s CPU backend packs bf16 weights
    the same way (inductor's ``mkldnn_fusion`` pass). In bf16 the results are
    bit-identical to ``F.linear``; in fp32 the summation order differs
    (relative error about 1e-6). After ``process_weights_after_loading`` the
    layer holds ``packed_weight``, and a float32 one its plain weight too, as
    ``plain_weight`` (a tensor, no longer a parameter: the module does not list
    it in ``parameters()`` or ``state_dict()``), for the fused CPU decode
    (``pagedserve.engine.model.fused_decode``, which multiplies dense weights in float32
    only); ``release_plain_weights`` drops it where nothing reads it.
    """

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """Replace ``layer.weight`` by ``layer.packed_weight``, its oneDNN-blocked copy (and, float32,
        ``plain_weight``)."""
        layer.packed_weight = torch.ops.mkldnn._reorder_linear_weight(layer.weight.detach(), None)
        layer.plain_weight = layer.weight.detach() if layer.weight.dtype == torch.float32 else None
        layer.weight = None

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """See ``LinearMethodBase.apply``. Rows are padded up to ``padded_num_rows`` (see there)."""
        rows = x.reshape(-1, x.shape[-1])
        num_rows = rows.shape[0]
        with all_threads():
            if (padded := padded_num_rows(num_rows)) != num_rows:
                rows = F.pad(rows, (0, 0, 0, padded - num_rows))
            out = torch.ops.mkldnn._linear_pointwise(rows, layer.packed_weight, bias, "none", [], "")
        return out[:num_rows].view(*x.shape[:-1], out.shape[-1])


# Rows up to this count are multiplied as they are; above it, padded (see padded_num_rows).
EXACT_ROWS = 64
# Above EXACT_ROWS, 2**BUCKET_BITS row counts per doubling: at most 1/16 of a product is padding.
BUCKET_BITS = 4


def padded_num_rows(num_rows: int) -> int:
    """The row count a oneDNN product of ``num_rows`` rows runs at: itself up to ``EXACT_ROWS``, else rounded up
    to a multiple of ``2**(floor(log2(num_rows)) - BUCKET_BITS)``: 16 sizes per doubling.

    oneDNN builds (JIT-compiles: 1.3 ms in float32, 5 ms in bfloat16 on the
    test machine) a primitive for every new ``(rows, in, out)`` shape and keeps
    up to 1,024 of them in each of two LRU caches (its own and ideep's). With
    chunked-prefill batches of any size from 1 to ``max_num_batched_tokens``
    rows those caches kept growing: in an 8-minute soak RSS rose 3065 -> 3936
    MiB, +250 MiB of it after minute 3, and still rising. Bucketing bounds the
    shapes to 64 + 16 per doubling (144 up to 2,048 rows, per layer shape), all
    met within minutes, at a cost of under 1/16 padding (about 2% on average)
    on a prefill's products.
    """
    if num_rows <= EXACT_ROWS:
        return num_rows
    step = 1 << (num_rows.bit_length() - 1 - BUCKET_BITS)
    return -(-num_rows // step) * step


def release_plain_weights(model: nn.Module) -> None:
    """Drop the plain copies ``OneDNNPackedLinearMethod`` keeps beside its packed weights (memory nothing reads
    when the model runs no fused CPU decode on them)."""
    for module in model.modules():
        if getattr(module, "plain_weight", None) is not None:
            module.plain_weight = None


def _onednn_packs(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether oneDNN can pack weights here: on the CPU, in float32 or (with CPU support) bfloat16."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return dtype == torch.float32 or (dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


class QuantizedLinearMethod(LinearMethodBase):
    """A ``QuantizedWeight`` per layer (``layer.qweight``), multiplied by ``quant_kernels``.

    On the CPU ``quantized_linear`` runs its C kernel; elsewhere (CUDA) the
    weight is dequantized to the activations' dtype for each product and
    multiplied by ``F.linear`` (``use_kernel=False``). A layer left in float
    (``layer.qweight`` None) runs ``fallback``, the method of an unquantized model.

    Args:
        device, dtype: where the model runs and its activation dtype.
        use_kernel: ``quantized_linear`` (default: on the CPU), else dequantize + ``F.linear``.
    """

    def __init__(self, device: torch.device | str, dtype: torch.dtype, use_kernel: bool | None = None) -> None:
        self.device, self.dtype = torch.device(device), dtype
        self.fallback = _float_method(self.device, dtype)
        self.use_kernel = self.device.type == "cpu" if use_kernel is None else use_kernel

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """See ``LinearMethodBase.apply``."""
        weight: QuantizedWeight | None = getattr(layer, "qweight", None)
        if weight is None:
            return self.fallback.apply(layer, x, bias)
        rows = x.reshape(-1, x.shape[-1])
        with all_threads():
            if self.use_kernel:
                out = quantized_linear(rows, weight, bias)
            else:
                out = F.linear(rows, dequantize(weight, x.dtype), bias)
        return out.view(*x.shape[:-1], weight.out_features)


class WeightOnlyQuantizedLinearMethod(QuantizedLinearMethod):
    """``--quantization int8`` / ``int4``: the float weight loaded as usual, quantized once after loading.

    Args:
        scheme: ``"int8"`` (``quantize_int8``) or ``"int4"`` (``quantize_int4``).
        device, dtype, use_kernel: as for ``QuantizedLinearMethod``.
    """

    def __init__(self, scheme: str, device: torch.device | str, dtype: torch.dtype,
                 use_kernel: bool | None = None) -> None:
        super().__init__(device, dtype, use_kernel)
        self.quantize = {"int8": quantize_int8, "int4": quantize_int4}[scheme]

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       weight_loader: WeightLoader) -> None:
        """See ``LinearMethodBase.create_weights``: a float ``layer.weight``, as ``UnquantizedLinearMethod``."""
        UnquantizedLinearMethod().create_weights(layer, input_size_per_partition, output_partition_sizes,
                                                 weight_loader)

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """``layer.weight`` -> ``layer.qweight``; the float weight is dropped."""
        layer.qweight = self.quantize(layer.weight.detach()).to(self.device)
        layer.weight = None


class GGUFLinearMethod(QuantizedLinearMethod):
    """``--quantization gguf``: the file's Q4_0, Q4_1 and Q8_0 blocks, as stored.

    The weight is created staged (``pagedserve.engine.model.quantization``: ``[out,
    in / 32, 34]`` in ``staging_dtype``), which the layers' weight loaders cut
    like a plain weight; after loading it is packed when all its blocks are of
    one kind, else (other GGUF types) dequantized into a float layer.

    Args:
        staging_dtype: float16 when it holds every staged value of the file exactly, else float32
            (``quantization.staging_dtype``).
        device, dtype, use_kernel: as for ``QuantizedLinearMethod``.
    """

    def __init__(self, staging_dtype: torch.dtype, device: torch.device | str, dtype: torch.dtype,
                 use_kernel: bool | None = None) -> None:
        super().__init__(device, dtype, use_kernel)
        self.staging_dtype = staging_dtype

    def create_weights(self, layer: nn.Module, input_size_per_partition: int, output_partition_sizes: list[int],
                       weight_loader: WeightLoader) -> None:
        """See ``LinearMethodBase.create_weights``: ``layer.weight`` staged, ``[sum(output_partition_sizes),
        in / 32, 34]``.

        Raises:
            ValueError: when ``input_size_per_partition`` is not a multiple of 32.
        """
        shape = staged_shape(sum(output_partition_sizes), input_size_per_partition)
        weight = nn.Parameter(torch.empty(shape, dtype=self.staging_dtype), requires_grad=False)
        layer.register_parameter("weight", set_weight_loader(weight, weight_loader))

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        """The staged ``layer.weight`` -> ``layer.qweight`` (or a float weight); a tied head takes its
        embedding's result (``unstage_once``)."""
        unstaged = unstage_once(layer.weight, self.dtype)
        if isinstance(unstaged, torch.Tensor):  # a float layer, as without quantization
            layer.qweight, layer.weight = None, nn.Parameter(unstaged, requires_grad=False)
            self.fallback.process_weights_after_loading(layer)
        else:
            layer.qweight = unstaged.to(self.device)
            layer.weight = None


def _float_method(device: torch.device, dtype: torch.dtype) -> LinearMethodBase:
    """The method of an unquantized model: oneDNN-packed where it can be, else plain."""
    if _onednn_packs(device, dtype):
        return OneDNNPackedLinearMethod()
    return UnquantizedLinearMethod()


def linear_method_for(device: torch.device | str, dtype: torch.dtype, quantization: str | None = None,
                      staging_dtype: torch.dtype = torch.float32) -> LinearMethodBase:
    """The linear method a model on ``device`` in ``dtype`` runs.

    Args:
        device, dtype: where the model runs and its activation dtype.
        quantization: None: the float method, oneDNN-packed where it can be, else plain; ``"gguf"``:
            ``GGUFLinearMethod``; ``"int8"``, ``"int4"``: ``WeightOnlyQuantizedLinearMethod``.
        staging_dtype: the GGUF method's staging dtype (``quantization.staging_dtype``).

    Raises:
        ValueError: for another ``quantization``.
    """
    if quantization is None:
        return _float_method(torch.device(device), dtype)
    if quantization == "gguf":
        return GGUFLinearMethod(staging_dtype, device, dtype)
    if quantization in ("int8", "int4"):
        return WeightOnlyQuantizedLinearMethod(quantization, device, dtype)
    raise ValueError(f"quantization must be None, 'gguf', 'int8' or 'int4', got {quantization!r}")
