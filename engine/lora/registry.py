"""The adapters a server serves, by the name clients give as ``model`` (vLLM's ``--lora-modules`` and its
``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter``)."""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve.engine.lora.peft import AdapterError, check_adapter
from pagedserve.engine.lora.request import LoRARequest

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from pagedserve.engine.config import EngineConfig


@dataclass(frozen=True)
class LoRAModulePath:
    """One ``--lora-modules`` entry: ``name=path``, or vLLM's JSON form ``{"name", "path", "base_model_name"}``."""

    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, value: str) -> LoRAModulePath:
        """Raises: ValueError: neither form, or an empty name or path."""
        if value.lstrip().startswith("{"):
            try:
                entry = json.loads(value)
            except json.JSONDecodeError as err:
                raise ValueError(f"lora_modules: {value[:200]!r} is not valid JSON: {err}") from err
            unknown = set(entry) - {"name", "path", "base_model_name"} if isinstance(entry, dict) else None
            if unknown is None or unknown:
                raise ValueError(f"lora_modules: a JSON entry has the keys name, path and base_model_name, got "
                                 f"{value[:200]!r}")
            module = cls(str(entry.get("name") or ""), str(entry.get("path") or ""), entry.get("base_model_name"))
        else:
            name, _, path = value.partition("=")
            module = cls(name.strip(), path.strip())
        if not module.name or not module.path:
            raise ValueError(f"lora_modules entries are name=path or a JSON object with name and path, got "
                             f"{value[:200]!r}")
        return module


class LoRARegistry:
    """Name -> ``LoRARequest`` for the adapters being served; each load checks the adapter against the model.

    Args:
        base_model_name: the served model's name (no adapter may take it).
        hf_config: the served model's config, which an adapter's shapes must fit.
        max_lora_rank: the largest rank the worker's slots hold (``--max-lora-rank``).
    """

    def __init__(self, base_model_name: str, hf_config: PretrainedConfig, max_lora_rank: int) -> None:
        self.base_model_name = base_model_name
        self.hf_config = hf_config
        self.max_lora_rank = max_lora_rank
        self._by_name: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # the server checks adapters on worker threads

    @classmethod
    def for_engine(cls, config: EngineConfig) -> LoRARegistry | None:
        """The registry of an engine with ``enable_lora``, serving its ``lora_modules``; None without adapters.

        Raises:
            AdapterError: a module that does not fit, naming it.
        """
        if config.lora_config is None:
            return None
        model_config = config.model_config
        registry = cls(model_config.served_model_name, model_config.hf_config, config.lora_config.max_lora_rank)
        for entry in config.args.lora_modules:
            module = LoRAModulePath.parse(entry)
            try:
                registry.add(module.name, module.path, module.base_model_name)
            except AdapterError as err:
                raise AdapterError(f"lora_modules {module.name}: {err}", err.param) from err
        return registry

    def __iter__(self) -> Iterator[LoRARequest]:
        return iter(list(self._by_name.values()))

    def get(self, name: str) -> LoRARequest | None:
        return self._by_name.get(name)

    def add(self, name: str, path: str, base_model_name: str | None = None) -> LoRARequest:
        """Check the adapter at ``path`` and serve it as ``name``, under a new ``lora_int_id`` (thread-safe).

        Raises:
            AdapterError: ``name`` empty or taken (by the base model or an adapter; ``lora_name``), a
                ``base_model_name`` other than the served model's, or as ``check_adapter`` (``lora_path``).
        """
        with self._lock:
            return self._add(name, path, base_model_name)

    def _add(self, name: str, path: str, base_model_name: str | None) -> LoRARequest:
        if not name:
            raise AdapterError("lora_name must not be empty", "lora_name")
        if name == self.base_model_name:
            raise AdapterError(f"the name {name[:256]!r} is the base model's: pick another", "lora_name")
        if name in self._by_name:
            raise AdapterError(f"the name {name[:256]!r} is already served by an adapter: pick another (or unload "
                               "that one first)", "lora_name")
        if base_model_name is not None and base_model_name != self.base_model_name:
            raise AdapterError(f"the adapter's base model {base_model_name[:256]!r} is not the served model "
                               f"{self.base_model_name!r}", "base_model_name")
        check_adapter(path, self.hf_config, self.max_lora_rank)
        request = LoRARequest(name, next(self._ids), str(path), base_model_name or self.base_model_name)
        self._by_name[name] = request
        return request

    def remove(self, name: str) -> LoRARequest | None:
        """Stop serving ``name``; its requests in flight finish with it. None when no adapter has that name."""
        with self._lock:
            return self._by_name.pop(name, None)
