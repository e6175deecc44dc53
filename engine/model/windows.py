"""Which layers of a model attend within a sliding window, read from its transformers config (no torch here:
the engine's configuration reads it too)."""

from __future__ import annotations

from typing import Any


def layer_windows(config: Any) -> list[int | None]:
    """Each layer's sliding window in tokens, None for full attention.

    transformers' convention: ``layer_types`` names the sliding layers where the config has it (Qwen2 and Qwen3,
    whose config clears ``sliding_window`` unless ``use_sliding_window``); without it (Mistral) a
    ``sliding_window`` applies to every layer.
    """
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None:
        return [None] * config.num_hidden_layers
    if layer_types is None:
        return [window] * config.num_hidden_layers
    return [window if kind == "sliding_attention" else None for kind in layer_types]


def uniform_sliding_window(config: Any) -> int | None:
    """The window every layer shares, or None when some layer (or every one) attends to everything: the KV cache
    can free a request's blocks before the window only when no layer reads them (``KVCacheManager``)."""
    windows = set(layer_windows(config))
    return windows.pop() if len(windows) == 1 and None not in windows else None
