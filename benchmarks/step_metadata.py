"""A step's metadata built from plain lists, as the model runner builds it: the attention metadata of a step and
the sampling metadata of a batch. For the kernel and sampler benchmarks and for the tests.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
import torch

from pagedserve.engine.model.attention import AttentionMetadata
from pagedserve.engine.sampling_params import GREEDY_TEMPERATURE_EPS
from pagedserve.engine.worker.sampling_metadata import LogitBias, SamplingMetadata


def build_metadata(block_tables: list[list[int]], context_lens: list[int], query_lens: list[int],
                   block_size: int, device: torch.device | str = "cpu") -> AttentionMetadata:
    """Metadata of a step where request i runs ``query_lens[i]`` tokens after ``context_lens[i]`` cached ones.

    Args:
        block_tables: each request's block ids, in order, covering at least
            ``context_lens[i] + query_lens[i]`` tokens.
        context_lens: tokens already in the cache per request.
        query_lens: tokens scheduled this step per request.
        block_size: tokens per block.

    Returns:
        The metadata; ``block_table`` rows are padded with block 0.
    """
    seq_lens = np.add(context_lens, query_lens)
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    width = max(len(blocks) for blocks in block_tables)
    table = np.zeros((len(block_tables), width), dtype=np.int32)
    for row, blocks in enumerate(block_tables):
        table[row, :len(blocks)] = blocks
    req = np.repeat(np.arange(len(query_lens)), query_lens)
    positions = step_positions(context_lens, query_lens)
    slot_mapping = table[req, positions // block_size].astype(np.int64) * block_size + positions % block_size
    return AttentionMetadata(
        num_actual_tokens=int(query_start_loc[-1]),
        query_start_loc=torch.from_numpy(query_start_loc).to(device),
        seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(device),
        block_table=torch.from_numpy(table).to(device),
        slot_mapping=torch.from_numpy(slot_mapping).to(device),
        max_query_len=int(max(query_lens)),
        max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=seq_lens.astype(np.int32),
    )


def step_positions(context_lens: list[int], query_lens: list[int]) -> np.ndarray:
    """``[T]`` int64 positions of a step's tokens: the request's context length + the offset in its chunk."""
    starts = np.concatenate([[0], np.cumsum(query_lens)])
    offsets = np.arange(starts[-1]) - np.repeat(starts[:-1], query_lens)
    return np.repeat(np.asarray(context_lens, dtype=np.int64), query_lens) + offsets


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
