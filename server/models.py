"""What ``model`` may name: the served model and its LoRA adapters (vLLM's ``serving_models``).

``/v1/models`` lists the base model and each adapter, whose ``parent`` is the base model and ``root`` its folder.
With ``--enable-lora`` and runtime updating allowed (vLLM's ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``, or ours,
``PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING=1``), ``POST /v1/load_lora_adapter`` checks an adapter against the model
and serves it under a name, and ``POST /v1/unload_lora_adapter`` stops serving it: its requests in flight finish,
new ones get a 404 naming the model.
"""

from __future__ import annotations

import asyncio
from http import HTTPStatus

from pagedserve.engine import envs
from pagedserve.engine.async_llm import AsyncLLM
from pagedserve.engine.lora.peft import AdapterError
from pagedserve.engine.lora.registry import LoRARegistry
from pagedserve.server.errors import OpenAIError, bad_request, model_not_found
from pagedserve.server.protocol import LoadLoRAAdapterRequest, ModelCard, UnloadLoRAAdapterRequest


def model_cards(engine: AsyncLLM) -> list[ModelCard]:
    """The base model's card, then each adapter's."""
    cards = [ModelCard(id=engine.model_name, max_model_len=engine.max_model_len,
                       root=engine.config.model_config.path)]
    for lora in engine.loras or ():
        cards.append(ModelCard(id=lora.lora_name, max_model_len=engine.max_model_len, root=lora.lora_path,
                               parent=lora.base_model_name))
    return cards


def model_card(model_id: str, engine: AsyncLLM) -> ModelCard:
    """Raises: OpenAIError: 404 ``model_not_found`` for a name nothing is served as."""
    for card in model_cards(engine):
        if card.id == model_id:
            return card
    raise model_not_found(model_id, engine)


async def load_lora_adapter(body: LoadLoRAAdapterRequest, engine: AsyncLLM) -> str:
    """Serve the adapter at ``lora_path`` as ``lora_name`` (its files are read on a worker thread).

    Raises:
        OpenAIError: 400 naming the field: adapters or runtime updating off, a name taken, a base model other than
            the served one, an adapter that does not fit (``AdapterError``).
    """
    registry = _runtime_registry(engine)
    try:
        await asyncio.to_thread(registry.add, body.lora_name, body.lora_path, body.base_model_name)
    except AdapterError as err:
        raise bad_request(str(err), err.param) from err
    return f"Success: LoRA adapter '{body.lora_name}' added successfully."


async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, engine: AsyncLLM) -> str:
    """Raises: OpenAIError: 400 as ``load_lora_adapter``; 404 naming ``lora_name`` when no adapter has it."""
    # On a worker thread: the registry's lock may be held by a load reading its files.
    if await asyncio.to_thread(_runtime_registry(engine).remove, body.lora_name) is None:
        raise OpenAIError(HTTPStatus.NOT_FOUND, f"no LoRA adapter named {body.lora_name!r} is loaded",
                          param="lora_name", code="model_not_found")
    return f"Success: LoRA adapter '{body.lora_name}' removed successfully."


def _runtime_registry(engine: AsyncLLM) -> LoRARegistry:
    if engine.loras is None:
        raise bad_request("this server serves no adapters: start it with --enable-lora")
    if not envs.PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING:
        raise bad_request("loading and unloading adapters at run time is off: set VLLM_ALLOW_RUNTIME_LORA_UPDATING="
                          "True (or PAGEDSERVE_ALLOW_RUNTIME_LORA_UPDATING=1) where the server starts")
    return engine.loras
