"""Turns one step's logits into sampled tokens (and their logprobs).

The steps, in order, follow vLLM V1's sampler; each is a small op in
``pagedserve.engine.worker.sample_ops`` that costs nothing when no row uses it:

1. logprobs, when any row asks for them, from the *raw* logits (vLLM's default
   ``raw_logprobs``: before any processing below);
2. the allowed-token bitmask (structured output), ``logit_bias``, then
   repetition / frequency / presence penalties;
3. greedy rows take the argmax;
4. random rows: temperature, top-k, top-p, min-p (Hugging Face's warper order),
   then one draw per row by the exponential race, with a per-request generator
   for seeded requests so that their samples do not depend on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.engine.outputs import TokenLogprobs
from pagedserve.engine.worker.sample_ops import process_logits, sample_tokens
from pagedserve.engine.worker.sampling_metadata import SamplingMetadata


@dataclass
class LogprobsTensors:
    """Logprobs of N positions: the chosen token first, then the top k.

    Attributes:
        token_ids: ``[N, 1 + k]`` int64: the chosen token, then the k most likely.
        logprobs: ``[N, 1 + k]`` float32 natural-log probabilities of those ids.
        ranks: ``[N]`` int64 rank of the chosen token (1 = most likely).
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor
    ranks: torch.Tensor

    def to_lists(self, num_logprobs_per_row: list[int | None]) -> list[TokenLogprobs | None]:
        """Per row, the chosen token and that row's own top ``k`` as Python lists.

        Args:
            num_logprobs_per_row: ``[N]`` each row's ``k`` (<= the tensors' k),
                or None for a row that asked for no logprobs.

        Returns:
            ``[N]`` a ``TokenLogprobs`` with ``1 + k`` entries per row, None where asked none.

        Raises:
            ValueError: when the list's length is not N or a row asks more than k.
        """
        num_rows, width = self.token_ids.shape
        if len(num_logprobs_per_row) != num_rows:
            raise ValueError(
                f"num_logprobs_per_row has {len(num_logprobs_per_row)} entries for {num_rows} rows")
        if any(k is not None and not 0 <= k < width for k in num_logprobs_per_row):
            raise ValueError(f"num_logprobs_per_row must be in [0, {width - 1}], got {num_logprobs_per_row}")
        # One device->host copy per tensor; the per-row loop only slices lists.
        token_ids = self.token_ids.tolist()
        logprobs = self.logprobs.tolist()
        ranks = self.ranks.tolist()
        return [
            None if k is None else TokenLogprobs(token_ids[i][:1 + k], logprobs[i][:1 + k], ranks[i])
            for i, k in enumerate(num_logprobs_per_row)
        ]


@dataclass
class SamplerOutput:
    """What the sampler returns for one step.

    Attributes:
        sampled_token_ids: ``[B]`` int64, one token per row.
        logprobs: the sampled tokens' logprobs and the top ``max_num_logprobs``,
            None when no row asked for logprobs.
    """

    sampled_token_ids: torch.Tensor
    logprobs: LogprobsTensors | None


def compute_logprobs_tensors(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_logprobs: int
) -> LogprobsTensors:
    """Gather the logprob and rank of chosen tokens, and the top ``num_logprobs``.

    Used for sampled tokens and for prompt logprobs alike.

    Args:
        logprobs: ``[N, V]`` float32 log-probabilities (a log_softmax).
        token_ids: ``[N]`` int64 the chosen token of each row.
        num_logprobs: k, how many most likely tokens to add (0 = only the chosen one).

    Returns:
        ``token_ids`` / ``logprobs`` of shape ``[N, 1 + k]`` and ``ranks`` ``[N]``,
        where rank = 1 + the number of tokens strictly more likely than the
        chosen one (so an argmax always has rank 1, even among ties).

    Raises:
        ValueError: when ``num_logprobs`` is not in ``[0, V]``.
    """
    vocab_size = logprobs.shape[-1]
    if not 0 <= num_logprobs <= vocab_size:
        raise ValueError(f"num_logprobs must be in [0, {vocab_size}], got {num_logprobs}")
    token_ids = token_ids.to(torch.int64).unsqueeze(-1)
    token_logprobs = logprobs.gather(-1, token_ids)
    ranks = (logprobs > token_logprobs).sum(-1) + 1
    top_logprobs, top_ids = logprobs.topk(num_logprobs, dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat([token_ids, top_ids], dim=-1),
        logprobs=torch.cat([token_logprobs, top_logprobs], dim=-1),
        ranks=ranks,
    )


class Sampler(torch.nn.Module):
    """Samples one token per row of the logits; see the module docstring for the steps."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``[B, V]`` logits of each row's last position (any float
                dtype, computed in float32), not modified.
            metadata: the rows' sampling parameters.

        Returns:
            ``[B]`` int64 sampled tokens, and their logprobs (from the raw
            logits) with the top ``max_num_logprobs`` when any row asked.

        Raises:
            ValueError: when ``logits`` is not ``[B, V]`` for B = ``metadata.num_rows``,
                or on a malformed allowed-token bitmask.
        """
        check_logits_shape(logits, metadata.num_rows)
        logits = logits.to(torch.float32)
        raw_logprobs = None if metadata.max_num_logprobs is None else logits.log_softmax(dim=-1)
        sampled = sample_tokens(process_logits(logits, metadata), metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = compute_logprobs_tensors(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def check_logits_shape(logits: torch.Tensor, num_rows: int) -> None:
    """Raise ValueError unless ``logits`` is 2-D with ``num_rows`` rows."""
    if logits.dim() != 2 or logits.shape[0] != num_rows:
        raise ValueError(f"logits must be [B, V] with B = {num_rows} (rows of the sampling metadata), "
                         f"got {list(logits.shape)}")
