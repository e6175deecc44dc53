"""A decode step's decoder layers in one native call on the CPU (``csrc/fused_decode.c``).

One token per request makes the torch path's cost its dispatch: per layer about
forty Python-level calls, and an OpenMP fork and join around every kernel. The
fused call runs all layers in one OpenMP region whose threads meet at barriers
between phases (see the C file), with the same kernels' code and the same
roundings as the unfused path (``tests/test_fused_decode.py``).

It serves decode-only CPU steps of a Llama-family model (Llama, Mistral, Qwen2;
not Qwen3's per-head norms) on one rank, with the CPU attention backend, whose
four projections of every layer are either all quantized (``QuantizedWeight``:
``--quantization gguf``, ``int8``, ``int4``; float32 or bfloat16 activations;
steps of up to ``MAX_ROWS`` tokens) or all dense in float32 (no
``--quantization``: steps of up to ``MAX_DENSE_ROWS`` tokens, beyond which
oneDNN's blocked GEMM is faster). A dense model keeps a plain copy of each
projection's weight beside oneDNN's packed one for this
(``OneDNNPackedLinearMethod.plain_weight``): the projections' memory twice
(405 MiB more for SmolLM2).
Dense products sum in another order than oneDNN's, so dense results equal the
unfused path's to rounding (about 1e-5 relative after 30 layers), quantized
ones bit for bit. Dense bfloat16 stays layer by layer: rounded to bfloat16
after sums in another order, greedy output parted from transformers' bfloat16
(whose products are oneDNN's, as ours are) away from near-ties. Anything else,
or ``PAGEDSERVE_FUSED_DECODE=0`` (set before loading: no plain copies then), or
no compiler: the model's ``decode_forward`` returns None and the step runs the
layers one by one.
"""

from __future__ import annotations

import ctypes
import logging
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagedserve.engine import envs
from pagedserve.engine.model.c_kernels import load_c_library
from pagedserve.engine.model.cpu_attention import CpuAttentionBackend
from pagedserve.engine.model.layers import GatedMLP
from pagedserve.engine.model.quant_kernels import KERNEL_MAX_ROWS, CWeight

if TYPE_CHECKING:
    from pagedserve.engine.model.attention import AttentionMetadata
    from pagedserve.engine.model.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "fused_decode.c"
#: Tokens per step up to which the fused call runs a quantized model: the quantized kernel's row limit (the
#: unfused path multiplies more rows another way, so the two would no longer agree bit for bit).
MAX_ROWS = KERNEL_MAX_ROWS
#: ... and a dense float32 one. Its products (one FMA chain per row of x, a weight row read once per 4 rows)
#: do not keep up with oneDNN's blocked GEMM for long: SmolLM2's forward, fused / layer by layer, measured
#: 0.50-0.56x at 1 token, 0.74-0.87x at 4, 1.06x at 8, 1.41x at 16 (2-core dev machine, nothing else running).
MAX_DENSE_ROWS = 4
#: ``qweight_t.kind`` of a dense weight (``csrc/fused_decode.c``'s ``KIND_DENSE``).
_KIND_DENSE = 2


class _Layer(ctypes.Structure):
    """``fused_layer_t``."""

    _fields_ = [*((name, ctypes.c_void_p) for name in (
        "qkv", "o", "gate_up", "down", "qkv_bias", "o_bias", "gate_up_bias", "down_bias", "input_norm",
        "post_norm", "key_cache", "value_cache")), ("window", ctypes.c_int64)]


class _Model(ctypes.Structure):
    """``fused_model_t``."""

    _fields_ = [*((name, ctypes.c_int64) for name in (
        "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads", "head_dim", "block_size",
        "bf16", "quantized")), ("eps", ctypes.c_float), ("scale", ctypes.c_float), ("layers", ctypes.POINTER(_Layer)),
        ("final_norm", ctypes.c_void_p), ("cos_sin", ctypes.c_void_p), ("max_positions", ctypes.c_int64)]


@cache
def load_kernel() -> ctypes.CDLL | None:
    """The compiled ``csrc/fused_decode.c`` (``c_kernels.load_c_library``); None when it cannot be had."""
    lib = load_c_library(_SOURCE, "fused CPU decode")
    if lib is None:
        return None
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.fused_decode_forward.restype = ctypes.c_int
    lib.fused_decode_forward.argtypes = [p, p, i64, p, p, p, i64, p]
    return lib


def _pointer(t: torch.Tensor | None, dtype: torch.dtype) -> int | None:
    """``t``'s address, None for no tensor; raises ValueError unless it is a contiguous CPU tensor of ``dtype``."""
    if t is None:
        return None
    if t.dtype != dtype or not t.is_cpu or not t.is_contiguous():
        raise ValueError(f"a {t.dtype} tensor where the fused decode reads contiguous {dtype}")
    return t.data_ptr()


class FusedDecoder:
    """The fused call bound to one model's weights; ``build`` says whether the model qualifies.

    The model must outlive it (the C structures point into its parameters).
    """

    def __init__(self, model: LlamaForCausalLM, lib: ctypes.CDLL) -> None:
        decoder = model.model
        self.dtype = decoder.norm.weight.dtype
        self.embed = decoder.embed_tokens
        self._linear_method = decoder.layers[0].self_attn.qkv_proj.linear_method  # one instance serves every layer
        self._forward = lib.fused_decode_forward
        first = decoder.layers[0]
        attention = first.self_attn
        self.quantized = getattr(first.mlp.down_proj, "qweight", None) is not None
        self.max_rows = MAX_ROWS if self.quantized else MAX_DENSE_ROWS
        self._dense_weights: list[CWeight] = []  # the C structures of dense weights, kept alive here
        layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            modules = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            layers.append(_Layer(*(self._weight_handle(m) for m in modules),
                                 *(_pointer(m.bias, self.dtype) for m in modules),
                                 _pointer(layer.input_layernorm.weight, self.dtype),
                                 _pointer(layer.post_attention_layernorm.weight, self.dtype), None, None,
                                 attn.sliding_window or 0))
        self._layers = (_Layer * len(layers))(*layers)
        self._model = _Model(len(layers), first.input_layernorm.weight.shape[0], first.mlp.down_proj.input_size,
                             attention.num_heads, attention.num_kv_heads, attention.head_dim,
                             model.attn_backend.block_size, int(self.dtype == torch.bfloat16), int(self.quantized),
                             first.input_layernorm.eps, attention.scale, self._layers,
                             _pointer(decoder.norm.weight, self.dtype),
                             _pointer(decoder.rotary_emb.cos_sin, self.dtype), decoder.rotary_emb.cos_sin.shape[0])
        self._handle = ctypes.addressof(self._model)
        self._bound_caches: tuple[list[torch.Tensor], list[int]] | None = None  # the list and its addresses

    def _weight_handle(self, module: torch.nn.Module) -> int:
        """The address of the ``qweight_t`` of ``module``'s weight: its quantized one, else a dense one over its
        plain weight (``[out, in]`` in the activations' dtype)."""
        if (quantized := getattr(module, "qweight", None)) is not None:
            return quantized.kernel_handle
        weight = module.plain_weight
        _pointer(weight, self.dtype)
        self._dense_weights.append(CWeight(_KIND_DENSE, weight.shape[0], weight.shape[1], weight.data_ptr(), 0, 0))
        return ctypes.addressof(self._dense_weights[-1])

    @classmethod
    def build(cls, model: LlamaForCausalLM) -> FusedDecoder | None:
        """A ``FusedDecoder`` for ``model``, or None (with the reason logged once) where it does not apply."""
        if not envs.PAGEDSERVE_FUSED_DECODE:
            return None
        reason = cls._unsupported(model)
        if reason is None and (lib := load_kernel()) is not None:
            try:
                return cls(model, lib)
            except ValueError as err:
                reason = str(err)
        if reason is not None:
            logger.info("decode steps run the decoder layers one by one: %s", reason)
        return None

    @staticmethod
    def _unsupported(model: LlamaForCausalLM) -> str | None:
        """Why ``model`` cannot run the fused call, or None when it can."""
        decoder = model.model
        dtype, device = decoder.norm.weight.dtype, decoder.norm.weight.device
        if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
            return f"the fused decode runs float32 and bfloat16 models on the CPU, not {dtype} on {device}"
        if not isinstance(model.attn_backend, CpuAttentionBackend):
            return "the fused decode runs with the CPU attention backend"
        first = decoder.layers[0]
        attention = first.self_attn
        if attention.qk_norm is not None:
            return "the fused decode has no query and key norms (Qwen3, OLMoE)"
        if not all(isinstance(getattr(layer, "mlp", None), GatedMLP) for layer in decoder.layers):
            return "the fused decode runs dense MLPs, not mixtures of experts"
        heads, kv_heads, head_dim = attention.num_heads, attention.num_kv_heads, attention.head_dim
        group = heads // kv_heads
        hidden, intermediate = first.input_layernorm.weight.shape[0], first.mlp.down_proj.input_size
        # csrc/paged_decode_attention.c's buffers, and 32-blocks of every product's input (quant_gemv.c).
        if (heads % kv_heads or group > 16 or head_dim > 256 or heads > 128 or heads * head_dim > 8192
                or model.attn_backend.block_size > 128 or head_dim % 32 or hidden % 32 or intermediate % 32
                or decoder.rotary_emb.cos_sin.shape[1] != head_dim):
            return (f"the fused decode does not hold these shapes ({heads} heads, {kv_heads} kv heads, head_dim "
                    f"{head_dim}, hidden {hidden}, intermediate {intermediate})")
        if first.self_attn.qkv_proj.tp.size != 1:
            return "the fused decode runs on one tensor-parallel rank"
        kinds = set()
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
                if getattr(m, "qweight", None) is not None:
                    kinds.add("quantized")
                else:
                    kinds.add("dense" if getattr(m, "packed_weight", None) is not None else "other")
        if kinds not in ({"quantized"}, {"dense"}):
            return ("the fused decode needs every projection quantized (--quantization gguf, int8 or int4) or "
                    "every one dense and oneDNN-packed")
        if kinds == {"dense"} and dtype != torch.float32:
            # Its bf16 products would round unlike oneDNN's (which transformers' bf16 runs too), and greedy
            # output then parts from transformers' away from near-ties (tests/test_llm.py's bf16 parity).
            return "the fused decode multiplies dense weights in float32 only"
        if kinds == {"dense"} and any(getattr(m, "plain_weight", None) is None for m in decoder.modules()
                                      if getattr(m, "packed_weight", None) is not None):
            return "the plain weight copies the fused decode reads were dropped (release_plain_weights)"
        return None

    def _bind_caches(self, kv_caches: list[torch.Tensor]) -> bool:
        """Point every layer at its ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` cache; False (none
        bound) when one is not such a contiguous tensor of the activations' dtype."""
        model = self._model
        shape = (model.block_size, model.num_kv_heads, model.head_dim)
        if len(kv_caches) != len(self._layers) or any(
                t.dtype != self.dtype or not t.is_cpu or not t.is_contiguous() or t.dim() != 5 or t.shape[0] != 2
                or tuple(t.shape[2:]) != shape for t in kv_caches):
            self._bound_caches = None
            return False
        for layer, cache_tensor in zip(self._layers, kv_caches, strict=True):
            layer.key_cache, layer.value_cache = cache_tensor[0].data_ptr(), cache_tensor[1].data_ptr()
        self._bound_caches = (kv_caches, [t.data_ptr() for t in kv_caches])
        return True

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                 metadata: AttentionMetadata) -> torch.Tensor | None:
        """``[B, hidden_size]`` final hidden states of a decode-only step (``B = len(input_ids)``, one token per
        request), its keys and values written into ``kv_caches``; None (nothing done) when the step does not
        qualify (more than ``max_rows`` tokens, a cache of another dtype or layout, shapes the kernels refuse),
        or while the quantized layers are set to dequantize instead of running their kernel (``use_kernel``).

        Args, as ``CausalLM.forward``; ``metadata`` is the runner's common ``AttentionMetadata``.
        """
        num_tokens = input_ids.shape[0]
        block_table, slots, seq_lens = metadata.block_table, metadata.slot_mapping, metadata.seq_lens
        if (num_tokens > self.max_rows or (self.quantized and not self._linear_method.use_kernel)
                or metadata.max_query_len != 1 or seq_lens.shape[0] != num_tokens or block_table.shape[0] != num_tokens
                or block_table.dtype != torch.int32 or block_table.stride(1) != 1
                or seq_lens.dtype != torch.int32 or not seq_lens.is_contiguous()
                or slots.dtype != torch.int64 or not slots.is_contiguous()
                or positions.dtype != torch.int64 or not positions.is_contiguous()):
            return None
        # The runner hands the same list every step; a new list, or its first tensor moved, binds again.
        bound = self._bound_caches
        if (bound is None or bound[0] is not kv_caches or bound[1][0] != kv_caches[0].data_ptr()) and \
                not self._bind_caches(kv_caches):
            return None
        hidden = self.embed(input_ids)
        status = self._forward(self._handle, hidden.data_ptr(), num_tokens, positions.data_ptr(), slots.data_ptr(),
                               block_table.data_ptr(), block_table.stride(0), seq_lens.data_ptr())
        return hidden if status == 0 else None
