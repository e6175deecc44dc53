"""Data crossing the engine's boundaries.

``ModelRunnerOutput`` goes worker -> scheduler once per step,
``EngineCoreOutput`` goes scheduler -> frontend (one per request per step),
and ``RequestOutput`` is what callers of ``LLM`` / ``AsyncLLM`` receive.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the scheduler and the frontend import these without torch
    import torch


class FinishReason(enum.StrEnum):
    """Why a request ended, with OpenAI's ``finish_reason`` values."""

    STOP = "stop"      # EOS, a stop token or a stop string
    LENGTH = "length"  # max_tokens or max_model_len reached
    ABORT = "abort"    # client went away, or the engine shut down
    ERROR = "error"    # the engine failed this request alone (EngineCoreOutput.error says why)


@dataclass
class TokenLogprobs:
    """Logprobs at one position: the chosen token first, then the top-k.

    Attributes:
        token_ids: ``[1 + k]`` ids: the chosen token, then the k most likely.
        logprobs: ``[1 + k]`` natural-log probabilities (float) of those ids.
        rank: rank of the chosen token in the distribution (1 = most likely).
    """

    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class ModelRunnerOutput:
    """What one ``execute_model`` step produced.

    Attributes:
        req_ids: the scheduled requests in persistent-batch row order.
        req_id_to_index: request id -> index into the lists below.
        sampled_token_ids: per request, the tokens sampled this step
            (empty while a prompt is still being prefilled in chunks).
        logprobs: per request, the logprobs of each sampled token
            (None for requests that asked for none).
        prompt_logprobs: request id -> logprobs of the prompt positions
            computed this step (None for position 0, which has no logprob).
        failed_req_ids: request id -> error message, for the scheduled requests whose own state,
            inputs or sampling raised this step. The worker has dropped their state already; any
            entries they still have in the lists above are to be ignored.
        pooler_output: request id -> ``[D]`` float32 CPU vector, for the pooling requests whose prompt this
            step completed (``--runner pooling``).
    """

    req_ids: list[str]
    req_id_to_index: dict[str, int]
    sampled_token_ids: list[list[int]]
    logprobs: list[list[TokenLogprobs] | None] | None = None
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = field(default_factory=dict)
    failed_req_ids: dict[str, str] = field(default_factory=dict)
    pooler_output: dict[str, torch.Tensor] = field(default_factory=dict)


EMPTY_MODEL_RUNNER_OUTPUT = ModelRunnerOutput(req_ids=[], req_id_to_index={}, sampled_token_ids=[])


@dataclass
class EngineCoreOutput:
    """New tokens of one request from one engine step.

    Attributes:
        request_id: the request.
        new_token_ids: tokens appended this step (may be empty, e.g. on abort).
        finish_reason: set on the request's last output.
        stop_reason: the stop token id that ended it, if any.
        num_cached_tokens: prompt tokens served from the prefix cache.
        new_logprobs: logprobs of ``new_token_ids`` when asked for.
        new_prompt_logprobs: prompt logprobs computed this step when asked for.
        first_scheduled_time: ``time.monotonic()`` seconds when the scheduler first
            gave the request tokens (for the queue-time metric).
        error: why the engine failed the request, with ``finish_reason`` ``ERROR``; None otherwise.
        error_param: with ``error``, the request field at fault when its own input failed it (a
            grammar that outgrew llguidance's limits while generating: ``structured_outputs``), so
            the frontend can answer as for invalid input; None for a fault of the engine's.
        pooling_output: a pooling request's ``[D]`` float32 vector, on its last output.
    """

    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    new_logprobs: list[TokenLogprobs] | None = None
    new_prompt_logprobs: list[TokenLogprobs | None] | None = None
    first_scheduled_time: float | None = None
    error: str | None = None
    error_param: str | None = None
    pooling_output: torch.Tensor | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    """One completion of a request (there are ``n`` per prompt).

    ``text`` and ``token_ids`` are the full output so far, or only the new
    part when the caller streams in delta mode.
    """

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The output of one prompt, as returned by ``LLM.generate``."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    prompt_logprobs: list[TokenLogprobs | None] | None = None
    num_cached_tokens: int = 0
    #: A pooling request's vector (``AsyncLLM.encode``): ``[D]`` float32 on the CPU; None for generation.
    pooling_output: torch.Tensor | None = None
