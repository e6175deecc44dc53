"""The worker's adapters: ``max_loras`` slots in every targeted layer, filled per step from adapters read once.

Each step, the model runner hands the manager its rows' adapters (``LoRARequest``, None for the base model). An
adapter already in a slot stays there; another takes a slot no row of the step needs, the least recently used
first, filled from the adapter's weights kept in memory (``max_cpu_loras`` of them, least recently used dropped)
or read from its PEFT folder. The scheduler never runs more distinct adapters in a step than there are slots.
The token -> slot map it then sets (``LoRAMapping``) is what every layer's ``LoRALayer`` reads in the forward pass.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from pagedserve.engine.config import LoRAConfig
from pagedserve.engine.lora.peft import load_adapter
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.model.linear import LinearBase, QKVParallelLinear, RowParallelLinear
from pagedserve.engine.model.lora import LoRALayer, LoRAMapping
from pagedserve.engine.model.registry import CausalLM

#: Our module names of the layers adapters may target (fused: ``qkv_proj``, ``gate_up_proj``); experts are not.
_TARGETS = re.compile(r"model\.layers\.\d+\.(self_attn\.(qkv_proj|o_proj)|mlp\.(gate_up_proj|down_proj))")

#: An adapter as the slots take it: our module name -> [(part, A [r, in on this rank], B [out of the part, r])].
RankWeights = dict[str, list[tuple[int, torch.Tensor, torch.Tensor]]]


class LoRAManager:
    """Attaches a ``LoRALayer`` to each targeted layer of ``model`` and fills its slots step by step.

    Args:
        model: the loaded model (its layers get their ``lora``).
        config: slots, rank and memory limits.
        dtype, device: the activations'.
        triton: run the layers' products with the Triton kernel (``triton_lora``; with the Triton attention
            backend), else with torch's.
    """

    def __init__(self, model: CausalLM, config: LoRAConfig, dtype: torch.dtype, device: torch.device,
                 triton: bool = False) -> None:
        self.mapping = LoRAMapping()
        self.config = config
        self.device = device
        self.triton = triton
        self.layers: dict[str, LinearBase] = {}
        for name, module in model.named_modules():
            if isinstance(module, LinearBase) and _TARGETS.fullmatch(name):
                in_features = (module.input_size_per_partition if isinstance(module, RowParallelLinear)
                               else module.input_size)
                out_features = (module.output_partition_sizes if hasattr(module, "output_partition_sizes")
                                else [module.output_size])
                module.lora = LoRALayer(self.mapping, config.max_loras, config.max_lora_rank, in_features,
                                        out_features, dtype, device)
                self.layers[name] = module
        # Checkpoint module name suffix -> (ours, shard id) for the fused layers.
        self._fused = {part: (fused, shard) for fused, part, shard in model.stacked_params_mapping}
        self.slots: list[int | None] = [None] * config.max_loras  # the adapter id in each slot
        self._slot_use = [0] * config.max_loras  # step counter at each slot's last use
        self._step = 0
        self._read: OrderedDict[int, RankWeights] = OrderedDict()  # most recently used last

    def set_step(self, loras: Sequence[LoRARequest | None], num_scheduled: np.ndarray) -> None:
        """Fill the slots for the step's rows (``loras[i]`` row ``i``'s adapter) and set the token -> slot map.

        Raises:
            RuntimeError: more distinct adapters than slots (a scheduler bug).
            AdapterError, ValueError: an adapter that can no longer be read or fit (``failing``
                finds which).
        """
        self._step += 1
        needed = {lora.lora_int_id: lora for lora in loras if lora is not None}
        if len(needed) > len(self.slots):
            raise RuntimeError(f"{len(needed)} adapters in one step, above max_loras {len(self.slots)}")
        slot_of = {adapter_id: slot for slot, adapter_id in enumerate(self.slots) if adapter_id in needed}
        free = sorted((slot for slot, adapter_id in enumerate(self.slots) if adapter_id not in needed),
                      key=self._slot_use.__getitem__)
        for adapter_id, lora in needed.items():
            if adapter_id not in slot_of:
                slot_of[adapter_id] = slot = free.pop(0)
                self._fill(slot, lora)
        for slot in slot_of.values():
            self._slot_use[slot] = self._step
        row_slots = np.array([slot_of[lora.lora_int_id] if lora is not None else -1 for lora in loras])
        self.mapping.update(np.repeat(row_slots, num_scheduled), self.device, segments=self.triton)

    def failing(self, loras: Sequence[LoRARequest | None]) -> dict[int, str]:
        """The adapters among ``loras`` that cannot be read or fit, id -> why; the others are read (and kept)."""
        errors: dict[int, str] = {}
        for lora in {lora.lora_int_id: lora for lora in loras if lora is not None}.values():
            if lora.lora_int_id in self.slots:
                continue  # in a slot already: nothing to read (its folder may be gone since)
            try:
                self._rank_weights(lora)
            except Exception as err:  # whatever the folder holds now fails its requests, never the engine
                errors[lora.lora_int_id] = f"adapter {lora.lora_name!r} cannot be served: {err}"
        return errors

    def _fill(self, slot: int, lora: LoRARequest) -> None:
        weights = self._rank_weights(lora)
        self.slots[slot] = None  # until filled: a failure leaves the slot empty, not half another adapter's
        for layer in self.layers.values():
            layer.lora.clear_slot(slot)
        for name, parts in weights.items():
            for part, a, b in parts:
                self.layers[name].lora.set_part(slot, part, a, b)
        self.slots[slot] = lora.lora_int_id

    def _rank_weights(self, lora: LoRARequest) -> RankWeights:
        """The adapter's weights as this rank's slots take them, read from its folder the first time.

        Raises:
            AdapterError, ValueError: a folder that no longer holds what was checked when the adapter was added
                (a module we do not serve, shapes that do not fit a slot).
        """
        if (weights := self._read.get(lora.lora_int_id)) is not None:
            self._read.move_to_end(lora.lora_int_id)
            return weights
        config, tensors = load_adapter(lora.lora_path)
        weights = {}
        for module, (a, b) in tensors.items():
            prefix, _, kind = module.rpartition(".")
            ours, shard = self._fused.get(kind, (kind, None))
            name = f"{prefix}.{ours}"
            if (layer := self.layers.get(name)) is None:
                raise ValueError(f"{module} is not a layer this model serves adapters on")
            try:
                part = _rank_slices(layer, shard, a, b.float() * config.scaling)  # scaled before the cast
                layer.lora.check_part(*part)
            except (ValueError, RuntimeError) as err:
                raise ValueError(f"{lora.lora_path}: {module}: {err}") from err
            weights.setdefault(name, []).append(part)
        self._read[lora.lora_int_id] = weights
        while len(self._read) > self.config.max_cpu_loras:
            self._read.popitem(last=False)
        return weights


def _rank_slices(layer: LinearBase, shard: str | int | None, a: torch.Tensor, b: torch.Tensor
                 ) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(part, A, B)`` of this rank for one checkpoint module's ``A [r, in]`` and scaled ``B [out, r]``: each is
    cut as the layer's own weight is (its ``weight_loader``: B's rows by output, A's columns on a row-parallel
    layer)."""
    rank = a.shape[0]
    lora = layer.lora
    if isinstance(layer, RowParallelLinear):
        a_rank = torch.empty(rank, layer.input_size_per_partition, dtype=lora.a.dtype)
        layer.weight_loader(a_rank, a)
        return 0, a_rank, b.to(lora.b.dtype)
    part = 0 if shard is None else ("q", "k", "v").index(shard) if isinstance(layer, QKVParallelLinear) else shard
    rows = torch.empty(sum(lora.output_sizes), rank, dtype=lora.b.dtype)
    layer.weight_loader(rows, b, shard)
    offset = sum(lora.output_sizes[:part])
    return part, a.to(lora.a.dtype), rows[offset:offset + lora.output_sizes[part]]
