"""The offline API, in vLLM's shapes: ``LLM(model).generate(prompts, params)``."""

from __future__ import annotations

import itertools
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tqdm import tqdm

if TYPE_CHECKING:
    import torch

from pagedserve.engine.config import EngineArgs
from pagedserve.engine.engine_factory import load_engine
from pagedserve.engine.input_processor import ProcessedRequest, PromptType
from pagedserve.engine.lora.peft import check_adapter
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.output_processor import OutputProcessor, RequestOutputKind
from pagedserve.engine.outputs import RequestOutput
from pagedserve.engine.pooling_params import PoolingParams
from pagedserve.engine.sampling_params import SamplingParams


class LLM:
    """Generate text for a batch of prompts, all in one continuous batch.

    Args:
        model: local HF folder, ``.gguf`` file or hub id; None = the embedded SmolLM2.
        **engine_args: any ``EngineArgs`` field (``max_num_seqs``, ``block_size``, ...).

    Attributes:
        engine_core: the ``EngineCore`` it drives from the caller's thread.
        processor: the ``InputProcessor`` every prompt goes through.

    Raises:
        ValueError / TypeError: on invalid engine arguments.
    """

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine_core, self.processor = load_engine(EngineArgs(model=model, **engine_args))
        self.tokenizer = self.processor.tokenizer
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's generation-config defaults (``generation_config``), as
        vLLM's ``LLM``: what ``generate`` and ``chat`` use when given no parameters."""
        return SamplingParams(**self.engine_core.config.model_config.generation_defaults)

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None) -> list[RequestOutput]:
        """Complete every prompt.

        Args:
            prompts: a string, a list of token ids, or a list of either.
            sampling_params: one for all prompts or one per prompt; default ``get_default_sampling_params()``.
            use_tqdm: show a progress bar.
            lora_request: the adapter of all prompts or one per prompt (None: the base model), as vLLM's; needs
                ``enable_lora``. Each is checked against the model (``check_adapter``) before anything is queued.

        Returns:
            One ``RequestOutput`` per prompt, in input order.

        Raises:
            InvalidRequestError: a request the engine could never run (see ``InputProcessor.process``);
                then no prompt is queued.
            ValueError: as many sampling params (and adapters) as prompts are needed; adapters without
                ``enable_lora``; ``AdapterError`` (a ValueError) for an adapter that does not fit.
            RequestFailedError: the engine failed one request (a fault in its own state or sampling);
                the others are aborted, since the call returns all or nothing. ``InvalidRequestError`` in
                the same way when a request's grammar outgrew llguidance's limits while generating.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else self.get_default_sampling_params()
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params_list)} sampling params")
        loras = self._adapters(lora_request, len(prompts))
        # Check every prompt before queueing any, so a bad one leaves nothing half-submitted.
        requests = [self.processor.process(prompt, request_params, lora_request=lora)
                    for prompt, request_params, lora in zip(prompts, params_list, loras, strict=True)]
        return self._run([self._add_request(request) for request in requests], use_tqdm)

    def _adapters(self, lora_request: LoRARequest | Sequence[LoRARequest | None] | None,
                  num_prompts: int) -> list[LoRARequest | None]:
        """One checked adapter (or None) per prompt."""
        loras = (list(lora_request) if isinstance(lora_request, Sequence) else [lora_request] * num_prompts)
        if len(loras) != num_prompts:
            raise ValueError(f"got {num_prompts} prompts but {len(loras)} lora requests")
        lora_config = self.engine_core.config.lora_config
        for lora in {lora.lora_int_id: lora for lora in loras if lora is not None}.values():
            if lora_config is None:
                raise ValueError("lora_request needs an engine made with enable_lora=True")
            check_adapter(lora.lora_path, self.engine_core.config.model_config.hf_config, lora_config.max_lora_rank)
        return loras

    def embed(self, prompts: PromptType | Sequence[PromptType], pooling_params: PoolingParams | None = None,
              use_tqdm: bool = True) -> list[torch.Tensor]:
        """The vector of every prompt, as vLLM's ``LLM.embed``: an engine made with ``runner="pooling"`` pools each
        prompt's final hidden states (``PoolerConfig``).

        Returns:
            One ``[D]`` float32 CPU tensor per prompt, in input order.

        Raises:
            InvalidRequestError: as ``InputProcessor.process_pooling`` (a generate runner among them); then no prompt
                is queued.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        requests = [self.processor.process_pooling(prompt, pooling_params or PoolingParams()) for prompt in prompts]
        return [output.pooling_output for output in self._run([self._add_request(r) for r in requests], use_tqdm)]

    def chat(self, messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, using the model's chat template.

        Raises:
            InvalidRequestError: as ``generate``, and for a conversation the template cannot render.
        """
        conversations = [messages] if messages and isinstance(messages[0], Mapping) else list(messages)
        prompts = [self.processor.render_chat(c, add_generation_prompt) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _add_request(self, request: ProcessedRequest) -> str:
        request_id = str(next(self._request_counter))
        children = self.output_processor.add_request(request_id, request.prompt, request.prompt_token_ids,
                                                     request.sampling_params, RequestOutputKind.FINAL_ONLY)
        for core_request in request.engine_core_requests(children, time.time()):
            self.engine_core.add_request(core_request)
        return request_id

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as progress:
            while self.output_processor.has_unfinished_requests():
                processed = self.output_processor.process_outputs(self.engine_core.step())
                if processed.reqs_to_abort:
                    self.engine_core.abort_requests(processed.reqs_to_abort)
                if processed.failed:
                    # The call cannot return a complete list: stop the others and say which one failed.
                    self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))
                    self._drain()
                    raise next(iter(processed.failed.values()))
                for output in processed.request_outputs:
                    if output.finished:
                        finished[output.request_id] = output
                        progress.update(1)
        self._drain()
        return [finished[r] for r in request_ids]

    def _drain(self) -> None:
        """Let the worker drop finished requests' state now rather than at the next call."""
        while self.engine_core.has_unfinished_requests():
            self.engine_core.step()
