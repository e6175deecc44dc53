"""PEFT LoRA folders: ``adapter_config.json`` and ``adapter_model.safetensors``, read and checked.

A LoRA adapter adds ``scaling * B @ A`` to a projection's weight (Hu et al., 2021, arXiv:2106.09685): ``A`` is
``[r, in_features]``, ``B`` is ``[out_features, r]``, ``scaling = lora_alpha / r`` (``lora_alpha / sqrt(r)`` with
rsLoRA, Kalajdzievski, 2023, arXiv:2312.03732). PEFT saves them under the base model's module names:
``base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight``. We serve adapters of the attention and MLP
projections of decoder layers (``TARGET_MODULES``); anything else in the folder (embeddings, the head, DoRA's
magnitudes, biases, ``modules_to_save``, per-module rank patterns) is refused by name rather than ignored.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PretrainedConfig

#: The projections an adapter may target, by their checkpoint names.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
#: ``LoraConfig.lora_alpha``'s default, for a config that leaves it out.
PEFT_DEFAULT_ALPHA = 8
_KEY = re.compile(r"base_model\.model\.(model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+))\.lora_([AB])\.weight")


class AdapterError(ValueError):
    """An adapter that cannot be served: the message says which file, key or setting, and why; ``param`` is the
    request field it is about (``lora_path`` unless said otherwise)."""

    def __init__(self, message: str, param: str = "lora_path") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class AdapterConfig:
    """What ``adapter_config.json`` says that changes the served weights.

    Attributes:
        rank: ``r``, the inner dimension of every ``A``/``B`` pair.
        scaling: the factor of ``B @ A`` (``lora_alpha / r``, or ``/ sqrt(r)`` with ``use_rslora``).
    """

    rank: int
    scaling: float


def read_config(path: str | Path) -> AdapterConfig:
    """``path``'s ``adapter_config.json``.

    Raises:
        AdapterError: a missing or unreadable folder or file, invalid JSON, another PEFT method than LORA, or a
            setting we do not serve (``use_dora``, ``bias`` other than ``none``, ``modules_to_save``,
            ``rank_pattern``, ``alpha_pattern``, ``fan_in_fan_out``, ``layer_replication``), named.
    """
    folder = Path(path)
    try:
        is_folder = folder.is_dir()
    except OSError as err:  # a name too long, a folder we may not enter
        raise AdapterError(f"cannot read {str(path)[:256]!r}: {err.strerror}") from err
    if not is_folder:
        raise AdapterError(f"no LoRA adapter folder at {str(path)[:256]!r}")
    try:
        config: dict[str, Any] = json.loads((folder / CONFIG_FILE).read_text())
    except FileNotFoundError as err:
        raise AdapterError(f"{folder} has no {CONFIG_FILE} (a PEFT adapter folder has one)") from err
    except (OSError, ValueError) as err:
        raise AdapterError(f"{folder / CONFIG_FILE} is not readable JSON: {err}") from err
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{folder}: peft_type must be LORA, got {config.get('peft_type')!r}"
                           if isinstance(config, dict) else f"{folder / CONFIG_FILE} is not a JSON object")
    unsupported = {"use_dora": bool(config.get("use_dora")), "bias": config.get("bias", "none") != "none",
                   "lora_bias": bool(config.get("lora_bias")), "modules_to_save": bool(config.get("modules_to_save")),
                   "rank_pattern": bool(config.get("rank_pattern")), "alpha_pattern": bool(config.get("alpha_pattern")),
                   "fan_in_fan_out": bool(config.get("fan_in_fan_out")),
                   "layer_replication": bool(config.get("layer_replication"))}
    if named := [name for name, found in unsupported.items() if found]:
        raise AdapterError(f"{folder}: {', '.join(named)} {'is' if len(named) == 1 else 'are'} not served (plain "
                           f"LoRA of {', '.join(TARGET_MODULES)} is)")
    rank, alpha = config.get("r"), config.get("lora_alpha", PEFT_DEFAULT_ALPHA)
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, int | float):
        raise AdapterError(f"{folder}: r must be a positive integer and lora_alpha a number, got {rank!r}, {alpha!r}")
    scaling = alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
    return AdapterConfig(rank, scaling)


def module_shapes(hf_config: PretrainedConfig) -> dict[str, tuple[int, int]]:
    """``(out_features, in_features)`` of each module of a decoder layer that adapters may target on this model:
    every projection of a dense Llama-family layer; the attention's alone on a mixture of experts (experts are
    not served); ``o_proj`` and ``down_proj`` on Phi-3, whose checkpoints fuse the others (PEFT adapters of it
    target ``qkv_proj`` and ``gate_up_proj``, which we do not serve)."""
    hidden, heads, kv_heads = hf_config.hidden_size, hf_config.num_attention_heads, hf_config.num_key_value_heads
    head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
    intermediate = hf_config.intermediate_size
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
              "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
              "gate_proj": (intermediate, hidden), "up_proj": (intermediate, hidden),
              "down_proj": (hidden, intermediate)}
    if getattr(hf_config, "num_local_experts", None) or getattr(hf_config, "num_experts", None):
        return {kind: shapes[kind] for kind in ("q_proj", "k_proj", "v_proj", "o_proj")}
    if hf_config.model_type == "phi3":
        return {kind: shapes[kind] for kind in ("o_proj", "down_proj")}
    return shapes


def check_adapter(path: str | Path, hf_config: PretrainedConfig, max_lora_rank: int) -> AdapterConfig:
    """Check that ``path`` fits the served model and the server's limits, reading the tensors' shapes only.

    Raises:
        AdapterError: as ``read_config``; a rank above ``max_lora_rank``; no weights file; a key that is not the
            A or B of a target module of a layer the model has, or a shape that differs from the served model's
            (an adapter trained for another base model); an A without its B.
    """
    config = read_config(path)
    if config.rank > max_lora_rank:
        raise AdapterError(f"{path}: its rank {config.rank} is above --max-lora-rank {max_lora_rank}")
    from safetensors import safe_open  # the frontend reads headers only; torch is loaded by then anyway

    shapes, num_layers = module_shapes(hf_config), hf_config.num_hidden_layers
    halves: dict[str, set[str]] = {}
    with _open_weights(path, safe_open) as weights:
        for key in weights.keys():  # noqa: SIM118 (safe_open is no Mapping)
            module, layer, kind, half = _parse_key(path, key)
            if int(layer) >= num_layers or kind not in shapes:
                raise AdapterError(f"{path}: {key} targets a module this model does not serve adapters on (layers "
                                   f"0-{num_layers - 1} of {', '.join(shapes)}): trained for another base model?")
            out_features, in_features = shapes[kind]
            expected = [config.rank, in_features] if half == "A" else [out_features, config.rank]
            shape = list(weights.get_slice(key).get_shape())
            if shape != expected:
                raise AdapterError(f"{path}: {key} is {shape}, the served model needs {expected}: trained for another "
                                   "base model?")
            halves.setdefault(module, set()).add(half)
    if missing := sorted(module for module, found in halves.items() if found != {"A", "B"}):
        raise AdapterError(f"{path}: {missing[0]} has lora_A or lora_B without the other")
    if not halves:
        raise AdapterError(f"{path}: {WEIGHTS_FILE} holds no LoRA weights")
    return config


def load_adapter(path: str | Path) -> tuple[AdapterConfig, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The adapter's config and its weights: module name (``model.layers.3.self_attn.q_proj``, the checkpoint's)
    -> ``(A [r, in_features], B [out_features, r])`` as stored (``check_adapter`` checks them first).

    Raises:
        AdapterError: as ``read_config``, or a file that is gone or not safetensors.
    """
    from safetensors import safe_open

    config = read_config(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    with _open_weights(path, safe_open) as weights:
        for key in weights.keys():  # noqa: SIM118
            module, _, _, half = _parse_key(path, key)
            pairs.setdefault(module, {})[half] = weights.get_tensor(key)
    return config, {module: (pair["A"], pair["B"]) for module, pair in pairs.items()}


def _open_weights(path: str | Path, safe_open: Any) -> Any:
    file = Path(path) / WEIGHTS_FILE
    try:
        return safe_open(str(file), framework="pt")
    except FileNotFoundError as err:
        raise AdapterError(f"{path} has no {WEIGHTS_FILE} (.bin adapters are not read: save with safetensors)") from err
    except Exception as err:  # safetensors raises its own SafetensorError on a damaged file
        raise AdapterError(f"{file} is not a safetensors file: {err}") from err


def _parse_key(path: str | Path, key: str) -> tuple[str, str, str, str]:
    """``(module, layer index, module kind, "A" or "B")`` of a PEFT key; an ``AdapterError`` for any other key."""
    match = _KEY.fullmatch(key)
    if match is None or match.group(3) not in TARGET_MODULES:
        raise AdapterError(f"{path}: {key[:200]} is not the lora_A or lora_B weight of a decoder layer's "
                           f"{', '.join(TARGET_MODULES)}")
    return match.group(1), match.group(2), match.group(3), match.group(4)
