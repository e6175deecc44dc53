"""The sampling parameters of one step's logits rows, as tensors (built by ``InputBatch``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.engine.sampling_params import GREEDY_TEMPERATURE_EPS


@dataclass
class LogitBias:
    """The ``logit_bias`` of a step's rows: biases to add at flat positions of the ``[B, V]`` logits.

    Attributes:
        index: ``[N]`` int64 distinct positions ``row * V + token id``.
        values: ``[N]`` float32 the bias to add at each.
        vocab_size: V, the width of the logits the positions are for.
    """

    index: torch.Tensor
    values: torch.Tensor
    vocab_size: int

    @classmethod
    def from_rows(cls, rows: Sequence[tuple[np.ndarray, np.ndarray] | None], vocab_size: int,
                  device: torch.device) -> LogitBias | None:
        """Gathers the rows' own biases with a few array ops, whatever their sizes (numpy: on a busy
        CPU, torch's threaded copies were several times slower for these sizes).

        Args:
            rows: per row, ``[k]`` int64 distinct token ids in ``[0, V)`` and ``[k]`` float32 biases, or
                None for a row without a bias.
            vocab_size: V.
            device: where the logits are.

        Returns:
            The batch's bias; None when no row has one.
        """
        biased = [(row, bias) for row, bias in enumerate(rows) if bias is not None]
        if not biased:
            return None
        starts = np.array([row * vocab_size for row, _ in biased], dtype=np.int64)
        lengths = [len(token_ids) for _, (token_ids, _) in biased]
        index = np.repeat(starts, lengths) + np.concatenate([token_ids for _, (token_ids, _) in biased])
        values = np.concatenate([values for _, (_, values) in biased])
        return cls(torch.from_numpy(index).to(device, non_blocking=True),
                   torch.from_numpy(values).to(device, non_blocking=True), vocab_size)


@dataclass
class SamplingMetadata:
    """The sampling parameters of the rows of one step's logits, as tensors.

    B is the number of rows (one per sampled position), V the vocabulary size.
    Tensors live on the logits' device. A feature no row uses is None or
    flagged off, so the op that applies it costs nothing.

    Attributes:
        temperature: ``[B]`` float32; rows below ``GREEDY_TEMPERATURE_EPS`` are greedy.
        all_greedy: every row is greedy (the random path is skipped).
        all_random: no row is greedy (the argmax is skipped).
        top_p: ``[B]`` float32 nucleus mass in (0, 1]; None when every row has 1.0.
        top_k: ``[B]`` int64, 0 = disabled for that row; None when no row uses it.
        min_p: ``[B]`` float32 in [0, 1]; None when no row uses it.
        generators: batch row -> the request's generator (seeded requests only).
        no_penalties: no row has a presence, frequency or repetition penalty.
        presence_penalties: ``[B]`` float32, 0 = off.
        frequency_penalties: ``[B]`` float32, 0 = off.
        repetition_penalties: ``[B]`` float32, 1 = off.
        prompt_token_ids: ``[B, max_prompt_len]`` int64 padded with V; only
            needed when penalties are used (None = no prompt tokens count).
        output_token_ids: per row, the output tokens so far (before this
            row's sample), ids in ``[0, V)``.
        logit_bias: the rows' ``logit_bias``; None when no row has one.
        max_num_logprobs: the largest ``logprobs`` any row asked for; None if none asked.
        allowed_token_bitmask: ``[R, ceil(V / 32)]`` int32 packed allowed-token
            masks of the R constrained rows (structured output), in
            xgrammar / llguidance's layout: bit j (little-endian) of word i set
            = token ``32 * i + j`` allowed. None when no row is constrained.
        constrained_rows: ``[R]`` int64 the logits rows the bitmask rows apply
            to; set exactly when ``allowed_token_bitmask`` is.
    """

    temperature: torch.Tensor
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None
    top_k: torch.Tensor | None
    min_p: torch.Tensor | None
    generators: dict[int, torch.Generator]
    no_penalties: bool
    presence_penalties: torch.Tensor
    frequency_penalties: torch.Tensor
    repetition_penalties: torch.Tensor
    prompt_token_ids: torch.Tensor | None
    output_token_ids: list[list[int]]
    logit_bias: LogitBias | None
    max_num_logprobs: int | None
    allowed_token_bitmask: torch.Tensor | None = None
    constrained_rows: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        """B, the number of logits rows these parameters describe."""
        return self.temperature.shape[0]

    @property
    def is_greedy(self) -> torch.Tensor:
        """``[B]`` bool: the rows that take the argmax instead of a random draw."""
        return self.temperature < GREEDY_TEMPERATURE_EPS
