"""``LoRARequest``: the adapter one request runs with."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    """An adapter as the engine knows it (vLLM's ``LoRARequest``).

    Attributes:
        lora_name: the name clients give as ``model``.
        lora_int_id: > 0 and never reused by a server: a name loaded again gets a new id, so that nothing cached
            under the old one (the worker's copy of its weights, KV blocks of its prompts) is taken for the new.
        lora_path: the PEFT folder (``adapter_config.json``, ``adapter_model.safetensors``).
        base_model_name: the model it was trained on, as ``/v1/models`` shows its ``parent``; None = the served one.
    """

    lora_name: str
    lora_int_id: int
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")

    @property
    def cache_key(self) -> str:
        """What the prefix cache adds to each block's hash: a block computed with an adapter holds other K/V."""
        return f"lora:{self.lora_int_id}"
