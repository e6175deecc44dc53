"""Copying checkpoint tensors into parameters: per-parameter weight loaders and the loading loop.

Every parameter may carry a ``weight_loader(param, loaded, shard_id=None)``
attribute (as in vLLM): the layer that owns it knows its tensor-parallel rank
and which slice of the checkpoint tensor is its own, and, for a fused
parameter, where the checkpoint tensor named by ``shard_id`` goes. Parameters
without one are copied whole (``default_weight_loader``).

Checkpoint names map onto parameters through a model's stacked-params mapping
(vLLM's ``stacked_params_mapping``): ``(fused module, checkpoint module, shard
id)`` triples, e.g. ``("qkv_proj", "k_proj", "k")``, matched on whole name
components; every other name is the parameter's own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

ShardId = str | int
WeightLoader = Callable[[nn.Parameter, torch.Tensor, ShardId | None], None]
#: (fused module name, checkpoint module name, shard id) entries of a model.
StackedParamsMapping = list[tuple[str, str, ShardId]]


def set_weight_loader(param: nn.Parameter, weight_loader: WeightLoader) -> nn.Parameter:
    """Attach ``weight_loader`` to ``param``; returns ``param``."""
    param.weight_loader = weight_loader
    return param


def default_weight_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: ShardId | None = None) -> None:
    """Copy ``loaded`` into the whole of ``param``, cast to its dtype and device.

    Raises:
        ValueError: when the shapes differ.
    """
    check_shape(loaded, param.shape)
    param.data.copy_(loaded)


def copy_shard(target: torch.Tensor, loaded: torch.Tensor, dim: int, index: int, num_shards: int) -> None:
    """Copy part ``index`` of ``loaded``, cut into ``num_shards`` equal parts along ``dim``, into ``target``.

    Args:
        target: the destination, a parameter or a slice of one; its size along
            ``dim`` is the part's.
        loaded: the checkpoint tensor, ``target``'s shape with ``dim`` ``num_shards`` times as large.
        dim: the split dimension.
        index: which part, ``0 <= index < num_shards``.
        num_shards: parts ``loaded`` is cut into.

    Raises:
        ValueError: when ``loaded`` does not have that shape.
    """
    expected = list(target.shape)
    expected[dim] *= num_shards
    check_shape(loaded, expected)
    target.copy_(loaded.narrow(dim, index * target.shape[dim], target.shape[dim]))


def check_shape(loaded: torch.Tensor, expected: Iterable[int]) -> None:
    """Raises ValueError (``has shape ..., expected ...``) when ``loaded`` is not of shape ``expected``."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"has shape {tuple(loaded.shape)}, expected {tuple(expected)}")


def checkpoint_weight_names(model: nn.Module, mapping: StackedParamsMapping) -> list[str]:
    """The checkpoint names ``load_weights`` expects for ``model``'s parameters.

    A fused parameter stands for one name per shard, in the mapping's order
    (``...qkv_proj.weight`` -> ``...q_proj.weight``, ``...k_proj.weight``,
    ``...v_proj.weight``); a parameter shared by two modules (a tied head) is
    named once, by its first owner.
    """
    parts: dict[str, list[str]] = {}
    for fused, part, _ in mapping:
        parts.setdefault(fused, []).append(part)
    names = []
    for name, _ in model.named_parameters():
        *path, module, suffix = name.split(".")
        names += [".".join([*path, part, suffix]) for part in parts.get(module, [module])]
    return names


def load_weights(model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], mapping: StackedParamsMapping,
                 ignored: Callable[[str], bool]) -> None:
    """Copy ``(checkpoint name, tensor)`` pairs into ``model``'s parameters through their weight loaders.

    Args:
        model: the module whose ``named_parameters()`` receive the tensors.
        weights: the checkpoint, in any order; tensors are cast to each parameter's dtype.
        mapping: the model's stacked-params mapping.
        ignored: names a checkpoint may hold that the model has no parameter
            for and skips (e.g. a tied head saved anyway).

    Raises:
        ValueError: on a name that is neither expected nor ignored, on a tensor
            whose shape does not fit (both named in the message), and when
            expected names are missing (listed).
    """
    params = dict(model.named_parameters())
    expected = set(checkpoint_weight_names(model, mapping))
    fused = {part: (module, shard_id) for module, part, shard_id in mapping}
    loaded = set()
    for name, tensor in weights:
        if name not in expected:
            if ignored(name):
                continue
            raise ValueError(f"checkpoint weight {name!r} has no parameter in {type(model).__name__}")
        *path, module, suffix = name.split(".")
        module, shard_id = fused.get(module, (module, None))
        param = params[".".join([*path, module, suffix])]
        try:
            getattr(param, "weight_loader", default_weight_loader)(param, tensor, shard_id)
        except ValueError as err:
            raise ValueError(f"weight {name!r} {err}") from None
        loaded.add(name)
    if expected - loaded:
        raise ValueError(f"checkpoint lacks weights: {sorted(expected - loaded)}")
