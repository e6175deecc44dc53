"""The Llama family's mixtures of experts: Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE.

Each is its dense sibling's decoder (``llama.py``: attention, norms, rope,
sliding windows) with a ``SparseMoeBlock`` (``moe.py``) in place of the MLP of
its sparse layers:

* Mixtral (Jiang et al., 2024, arXiv:2401.04088): every layer, ``num_local_experts``
  experts of ``intermediate_size`` with scores renormalised over the chosen ones; the
  checkpoint calls the block ``block_sparse_moe`` and an expert's projections
  ``w1`` (gate), ``w3`` (up) and ``w2`` (down).
* Qwen2-MoE: experts of ``moe_intermediate_size`` plus a shared expert of
  ``shared_expert_intermediate_size`` behind a sigmoid gate; scores renormalised when
  ``norm_topk_prob``; biases on q/k/v as Qwen2.
* Qwen3-MoE: Qwen3's attention (per-head q/k norms), experts as Qwen2-MoE's without the
  shared one.
* OLMoE (Muennighoff et al., 2024, arXiv:2409.02060): RMSNorm of the whole query and key
  projections (``ProjectionQKNorm``), optionally clamped (``clip_qkv``); 64 experts of
  ``intermediate_size``, 8 per token, renormalised when ``norm_topk_prob``.

The Qwen models put experts in layer i when i is not in ``mlp_only_layers`` and
``(i + 1) % decoder_sparse_step == 0``; the other layers keep a dense MLP of
``intermediate_size``. The experts' projections go through the model's linear method
(oneDNN packing, ``--quantization``) like any other; decode steps run layer by layer
(the fused decode runs dense MLPs only).
"""

from __future__ import annotations

from transformers import PretrainedConfig

from pagedserve.engine.model.linear_methods import LinearMethodBase
from pagedserve.engine.model.llama import (
    ArchFlags,
    LlamaForCausalLM,
    MistralForCausalLM,
    MLPBlock,
    Qwen2ForCausalLM,
    Qwen3ForCausalLM,
)
from pagedserve.engine.model.moe import SparseMoeBlock
from pagedserve.engine.model.parallel import TensorParallel
from pagedserve.engine.model.weights import StackedParamsMapping


class MixtralForCausalLM(MistralForCausalLM):
    """Mixtral: Mistral with eight (``num_local_experts``) experts in every layer."""

    supports_cuda_graphs = False  # routing sizes each expert's batch by the values

    #: Attention as Llama's; an expert's w1 and w3 fused as gate_up_proj, w2 its down_proj.
    stacked_params_mapping: StackedParamsMapping = [
        *LlamaForCausalLM.stacked_params_mapping[:3],
        ("gate_up_proj", "w1", 0),
        ("gate_up_proj", "w3", 1),
        ("down_proj", "w2", 0),
    ]

    @staticmethod
    def mlp_block(config: PretrainedConfig, flags: ArchFlags, layer_index: int, *, linear_method: LinearMethodBase,
                  tp: TensorParallel) -> MLPBlock:
        """Every layer: ``num_local_experts`` experts, top ``num_experts_per_tok``, renormalised."""
        return "block_sparse_moe", SparseMoeBlock(
            config.hidden_size, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok,
            renormalize=True, linear_method=linear_method, tp=tp)


def qwen_moe_block(config: PretrainedConfig, flags: ArchFlags, layer_index: int, *,
                   linear_method: LinearMethodBase, tp: TensorParallel) -> MLPBlock:
    """A Qwen-MoE layer's feed-forward block: experts where the config puts them (with Qwen2-MoE's shared
    expert when it has one), else a dense MLP."""
    sparse = (layer_index not in (getattr(config, "mlp_only_layers", None) or [])
              and config.num_experts > 0 and (layer_index + 1) % config.decoder_sparse_step == 0)
    if not sparse:
        return LlamaForCausalLM.mlp_block(config, flags, layer_index, linear_method=linear_method, tp=tp)
    return "mlp", SparseMoeBlock(
        config.hidden_size, config.moe_intermediate_size, config.num_experts, config.num_experts_per_tok,
        renormalize=bool(config.norm_topk_prob), linear_method=linear_method, tp=tp,
        shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", None))


class Qwen2MoeForCausalLM(Qwen2ForCausalLM):
    """Qwen2-MoE: Qwen2 with routed experts and a gated shared expert."""

    supports_cuda_graphs = False

    mlp_block = staticmethod(qwen_moe_block)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3 with routed experts."""

    supports_cuda_graphs = False

    mlp_block = staticmethod(qwen_moe_block)


class OlmoeForCausalLM(LlamaForCausalLM):
    """OLMoE: whole-projection q/k norms, clamped q/k/v where ``clip_qkv`` is set, routed experts in every layer."""

    supports_cuda_graphs = False

    @staticmethod
    def arch_flags(config: PretrainedConfig) -> ArchFlags:
        return ArchFlags(projection_qk_norm=True, clip_qkv=getattr(config, "clip_qkv", None))

    @staticmethod
    def mlp_block(config: PretrainedConfig, flags: ArchFlags, layer_index: int, *, linear_method: LinearMethodBase,
                  tp: TensorParallel) -> MLPBlock:
        """Every layer: ``num_experts`` experts of ``intermediate_size``, top ``num_experts_per_tok``."""
        return "mlp", SparseMoeBlock(
            config.hidden_size, config.intermediate_size, config.num_experts, config.num_experts_per_tok,
            renormalize=bool(config.norm_topk_prob), linear_method=linear_method, tp=tp)
