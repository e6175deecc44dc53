"""Builders shared by the sampler and rejection sampler tests: metadata, bitmasks, reference distributions."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from pagedserve.engine.sampling_params import GREEDY_TEMPERATURE_EPS
from pagedserve.engine.worker.sampling_metadata import LogitBias, SamplingMetadata


def _per_row(value: float | Sequence[float], batch_size: int, dtype: torch.dtype) -> torch.Tensor:
    values = [value] * batch_size if isinstance(value, (int, float)) else list(value)
    return torch.tensor(values, dtype=dtype)


def pack_bitmask(allowed: Sequence[Iterable[int]], vocab_size: int) -> torch.Tensor:
    """Reference packer, one token at a time: ``[R, ceil(V / 32)]`` int32, bit j of word i = token 32 i + j."""
    words = np.zeros((len(allowed), -(-vocab_size // 32)), dtype=np.uint32)
    for row, tokens in enumerate(allowed):
        for token in tokens:
            words[row, token // 32] |= np.uint32(1 << (token % 32))
    return torch.from_numpy(words.view(np.int32))


def make_metadata(
    batch_size: int,
    *,
    temperature: float | Sequence[float] = 1.0,
    top_k: int | Sequence[int] | None = None,
    top_p: float | Sequence[float] | None = None,
    min_p: float | Sequence[float] | None = None,
    generators: dict[int, torch.Generator] | None = None,
    presence: float | Sequence[float] = 0.0,
    frequency: float | Sequence[float] = 0.0,
    repetition: float | Sequence[float] = 1.0,
    prompt_token_ids: list[list[int]] | None = None,
    output_token_ids: list[list[int]] | None = None,
    vocab_size: int = 10,
    logit_bias: list[dict[int, float] | None] | None = None,
    max_num_logprobs: int | None = None,
    allowed_tokens: dict[int, Iterable[int]] | None = None,
) -> SamplingMetadata:
    """Metadata as the model runner builds it, from scalars (all rows) or per-row values.

    ``allowed_tokens`` maps a constrained row to its allowed token ids (packed into a bitmask).
    """
    temperatures = _per_row(temperature, batch_size, torch.float32)
    presence_t = _per_row(presence, batch_size, torch.float32)
    frequency_t = _per_row(frequency, batch_size, torch.float32)
    repetition_t = _per_row(repetition, batch_size, torch.float32)
    prompt = None
    if prompt_token_ids is not None:
        width = max(len(ids) for ids in prompt_token_ids)
        prompt = torch.tensor([ids + [vocab_size] * (width - len(ids)) for ids in prompt_token_ids])
    bitmask = rows = None
    if allowed_tokens:
        rows = torch.tensor(list(allowed_tokens), dtype=torch.int64)
        bitmask = pack_bitmask(list(allowed_tokens.values()), vocab_size)
    is_greedy = temperatures < GREEDY_TEMPERATURE_EPS
    return SamplingMetadata(
        temperature=temperatures,
        all_greedy=bool(is_greedy.all()),
        all_random=not bool(is_greedy.any()),
        top_p=None if top_p is None else _per_row(top_p, batch_size, torch.float32),
        top_k=None if top_k is None else _per_row(top_k, batch_size, torch.int64),
        min_p=None if min_p is None else _per_row(min_p, batch_size, torch.float32),
        generators=generators or {},
        no_penalties=bool((presence_t == 0).all() and (frequency_t == 0).all() and (repetition_t == 1).all()),
        presence_penalties=presence_t,
        frequency_penalties=frequency_t,
        repetition_penalties=repetition_t,
        prompt_token_ids=prompt,
        output_token_ids=output_token_ids or [[] for _ in range(batch_size)],
        logit_bias=LogitBias.from_rows([None if bias is None else (np.array(list(bias), dtype=np.int64),
                                                                   np.array(list(bias.values()), dtype=np.float32))
                                        for bias in logit_bias or ()], vocab_size, torch.device("cpu")),
        max_num_logprobs=max_num_logprobs,
        allowed_token_bitmask=bitmask,
        constrained_rows=rows,
    )


def expected_distribution(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                          top_p: float = 1.0, min_p: float = 0.0) -> np.ndarray:
    """Reference: the filtered, renormalised distribution, one filter after the other."""
    def normalise(p: np.ndarray) -> np.ndarray:
        return p / p.sum()

    probs = normalise(np.exp(logits.double().numpy() / temperature))
    order = np.argsort(-probs)
    if top_k:
        probs[order[top_k:]] = 0.0
        probs = normalise(probs)
    mass_before = np.cumsum(probs[order]) - probs[order]
    probs[order[mass_before >= top_p]] = 0.0
    probs = normalise(probs)
    probs[probs < min_p * probs.max()] = 0.0
    return normalise(probs)
