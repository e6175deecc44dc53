"""Default sampling parameters from a model's ``generation_config.json``, as vLLM's ``--generation-config``.

Model creators ship recommended sampling settings (e.g. ``temperature: 0.6``)
in ``generation_config.json``; with ``generation_config="auto"`` a request that
leaves such a field unset gets the model's value instead of the engine's
default. A field the request sets always wins.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from pagedserve.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
#: ``generation_config`` values that turn the model's defaults off ("vllm" is vLLM's spelling).
NO_GENERATION_CONFIG = ("vllm", "none")
#: ``generation_config.json`` keys the defaults come from -> the ``SamplingParams`` field they set
#: (HF's ``max_new_tokens`` is our ``max_tokens``). Other keys (``do_sample``, ``eos_token_id``, ...)
#: are not sampling defaults of a request, as in vLLM.
_SAMPLING_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                  "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}


def load_generation_defaults(model_path: str, generation_config: str) -> dict[str, Any]:
    """The sampling defaults that ``generation_config`` asks for, logged when there are any.

    Args:
        model_path: the model's folder (the converted folder for a GGUF model).
        generation_config: ``auto`` = ``model_path``'s ``generation_config.json``, if it has one;
            ``vllm`` or ``none`` = no defaults; otherwise a folder holding a ``generation_config.json``.

    Returns:
        ``SamplingParams`` field name -> value, for the keys the file sets (not null).

    Raises:
        ValueError: a folder was given without a ``generation_config.json``, the file is not a JSON
            object, or a value is out of ``SamplingParams``' range (naming the file).
    """
    if generation_config in NO_GENERATION_CONFIG:
        return {}
    folder = model_path if generation_config == "auto" else os.path.expanduser(generation_config)
    path = os.path.join(folder, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        if generation_config == "auto":
            return {}  # most GGUF models and many checkpoints have none: the engine's defaults apply
        raise ValueError(f"generation_config {generation_config!r} is not a folder holding a "
                         f"{GENERATION_CONFIG_FILE}")
    with open(path, encoding="utf-8") as file:
        config = json.load(file)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(config).__name__}")
    defaults = {field: config[key] for key, field in _SAMPLING_KEYS.items() if config.get(key) is not None}
    try:
        SamplingParams(**{"max_tokens": None, **defaults})  # fail at startup, not on every request
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from exc
    if defaults:
        logger.info("Default sampling parameters have been overridden by the model's generation config: %s "
                    "(from %s; a request's own values win; --generation-config vllm turns this off)",
                    defaults, path)
    return defaults
