"""The sampling parameters of one step's logits rows, as tensors (built by ``InputBatch``)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.sampling_params import GREEDY_TEMPERATURE_EPS


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
        logit_bias: per row, token id -> bias, or None for that row; None when
            no row has a bias.
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
    logit_bias: list[dict[int, float] | None] | None
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
