"""Verifies draft tokens against the target model (speculative decoding).

A proposer (an n-gram lookup, say) guesses k_i tokens for request i; the
target model scores all k_i + 1 positions in one forward pass; this module
keeps the longest acceptable prefix of the guesses and adds one token of its
own, so every step emits 1 .. k_i + 1 tokens whose distribution is exactly
that of k_i + 1 ordinary steps.

- Greedy requests accept draft j while it equals the argmax of row j, then
  emit the argmax of the first mismatching row (or of the bonus row).
- Random requests follow speculative sampling (Leviathan et al. 2023,
  arXiv:2211.17192, Algorithm 1; Chen et al. 2023, arXiv:2302.01318) with a
  deterministic draft, q_j = one-hot(x_j): draft x_j is accepted with
  probability min(1, p_j(x_j) / q_j(x_j)) = p_j(x_j); on the first rejection
  the token is drawn from norm(max(0, p_j - q_j)), which is p_j with x_j
  zeroed; when every draft is accepted the bonus token is drawn from the
  last row's p.

p_j is the sampler's own distribution for row j (``sample_ops``: bitmask,
bias, penalties, temperature, top-k / top-p / min-p), so the target is
exactly what ``Sampler`` would sample from.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.engine.outputs import TokenLogprobs
from pagedserve.engine.worker.sample_ops import exponential_race, process_logits, sampling_probs
from pagedserve.engine.worker.sampler import LogprobsTensors, check_logits_shape, compute_logprobs_tensors
from pagedserve.engine.worker.sampling_metadata import SamplingMetadata


@dataclass
class RejectionSamplerOutput:
    """What the rejection sampler returns for one step.

    Attributes:
        sampled_token_ids: per request, its accepted drafts then one token of
            its own: 1 .. k_i + 1 ids.
        logprobs: one row per emitted token, request 0's tokens first, each
            from the raw logits of the row that scored it, with the top
            ``max_num_logprobs``; None when no row asked for logprobs.
    """

    sampled_token_ids: list[list[int]]
    logprobs: LogprobsTensors | None

    def logprobs_per_request(self, num_logprobs: Sequence[int | None]) -> list[list[TokenLogprobs] | None]:
        """Split ``logprobs`` by request, each request's tokens trimmed to its own k.

        Args:
            num_logprobs: per request, the ``logprobs`` it asked for, or None.

        Returns:
            Per request, one ``TokenLogprobs`` per emitted token, or None where it asked none.

        Raises:
            ValueError: when no logprobs were computed, or ``num_logprobs`` does
                not have one entry per request (or asks more than were computed).
        """
        if self.logprobs is None:
            raise ValueError("no logprobs were computed (metadata.max_num_logprobs was None)")
        if len(num_logprobs) != len(self.sampled_token_ids):
            raise ValueError(f"num_logprobs has {len(num_logprobs)} entries for {len(self.sampled_token_ids)} requests")
        per_token = [k for k, tokens in zip(num_logprobs, self.sampled_token_ids, strict=True) for _ in tokens]
        entries = self.logprobs.to_lists(per_token)
        result: list[list[TokenLogprobs] | None] = []
        start = 0
        for k, tokens in zip(num_logprobs, self.sampled_token_ids, strict=True):
            result.append(None if k is None else entries[start:start + len(tokens)])
            start += len(tokens)
        return result


@dataclass
class _Drafts:
    """The draft tokens of B requests, padded to ``[B, K]`` (K = the most drafts of any request).

    Attributes:
        token_ids: ``[B, K]`` int64 draft ids, padded with 0.
        rows: ``[B, K]`` int64 the logits row that checks each draft (padding: a valid row).
        is_draft: ``[B, K]`` bool, False on padding.
        num_drafts: ``[B]`` int64 each request's k_i.
        first_rows: ``[B]`` int64 each request's first logits row.
        num_drafts_list: host copy of each request's k_i.
        first_rows_list: host copy of ``first_rows``.
    """

    token_ids: torch.Tensor
    rows: torch.Tensor
    is_draft: torch.Tensor
    num_drafts: torch.Tensor
    first_rows: torch.Tensor
    num_drafts_list: list[int]
    first_rows_list: list[int]

    @classmethod
    def build(cls, draft_token_ids: list[list[int]], vocab_size: int, device: torch.device) -> _Drafts:
        """Pad ``draft_token_ids`` on the host and copy it to ``device``.

        Raises:
            ValueError: when a draft token is not in ``[0, vocab_size)``.
        """
        if any(not 0 <= t < vocab_size for drafts in draft_token_ids for t in drafts):
            raise ValueError(f"draft token ids must be in [0, {vocab_size}), got {draft_token_ids}")
        num_drafts_list = [len(drafts) for drafts in draft_token_ids]
        width = max(num_drafts_list, default=0)
        first_rows_list, row = [], 0
        for num_drafts in num_drafts_list:
            first_rows_list.append(row)
            row += num_drafts + 1
        num_drafts = torch.tensor(num_drafts_list, dtype=torch.int64).unsqueeze(1)
        first_rows = torch.tensor(first_rows_list, dtype=torch.int64)
        column = torch.arange(width).unsqueeze(0)
        padded = [drafts + [0] * (width - len(drafts)) for drafts in draft_token_ids]
        return cls(
            token_ids=torch.tensor(padded, dtype=torch.int64).view(len(padded), width).to(device),
            # Padding points at the request's bonus row, so every entry is a valid row.
            rows=(first_rows.unsqueeze(1) + column.minimum(num_drafts)).to(device),
            is_draft=(column < num_drafts).to(device),
            num_drafts=num_drafts.squeeze(1).to(device),
            first_rows=first_rows.to(device),
            num_drafts_list=num_drafts_list,
            first_rows_list=first_rows_list,
        )

    @property
    def num_rows(self) -> int:
        """sum(k_i + 1), the logits rows these drafts need."""
        return sum(self.num_drafts_list) + len(self.num_drafts_list)


class RejectionSampler(torch.nn.Module):
    """Accepts or rejects each request's draft tokens; see the module docstring."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata, draft_token_ids: list[list[int]],
                generators: dict[int, torch.Generator] | None = None) -> RejectionSamplerOutput:
        """Score the drafts of B requests and return each request's emitted tokens.

        Args:
            logits: ``[N, V]`` target logits (any float dtype, computed in
                float32), N = sum(k_i + 1), not modified. Request i owns
                ``k_i + 1`` consecutive rows: row j < k_i is the position where
                draft j is checked, the last row gives the bonus token.
            metadata: one row per logits row, each carrying its request's
                parameters, with ``output_token_ids`` of position j including
                drafts 0 .. j - 1 (so penalties see them). ``generators`` in it
                is not read: seeds come from ``generators`` below.
            draft_token_ids: B lists, request i's k_i >= 0 draft ids in ``[0, V)``.
            generators: request index i (not a row) -> the generator of a
                seeded request. Request i draws k_i uniforms for its drafts,
                then V for its last token, so its tokens depend only on its
                seed, logits and drafts. Unseeded requests use the global RNG.

        Returns:
            The emitted tokens per request and, when ``metadata.max_num_logprobs``
            is set, their raw logprobs (see ``RejectionSamplerOutput``).

        Raises:
            ValueError: when ``logits`` or ``metadata`` do not have sum(k_i + 1)
                rows, on a draft id outside the vocabulary, on a generator key
                that is not a request index, or on what ``Sampler`` rejects
                (a malformed bitmask).
        """
        generators = generators or {}
        drafts = _Drafts.build(draft_token_ids, logits.shape[-1], logits.device)
        check_logits_shape(logits, drafts.num_rows)
        check_logits_shape(logits, metadata.num_rows)
        if any(not 0 <= i < len(draft_token_ids) for i in generators):
            raise ValueError(f"generators must be keyed by request index in [0, {len(draft_token_ids)}), "
                             f"got {sorted(generators)}")
        logits = logits.to(torch.float32)
        raw_logprobs = None if metadata.max_num_logprobs is None else logits.log_softmax(dim=-1)
        logits = process_logits(logits, metadata)
        target_argmax = None if metadata.all_random else logits.argmax(dim=-1)
        probs = None if metadata.all_greedy else sampling_probs(logits, metadata)

        accepted = _accept_drafts(drafts, metadata, target_argmax, probs, generators)
        num_accepted = accepted.long().cumprod(dim=1).sum(dim=1)
        final_rows = drafts.first_rows + num_accepted
        final_tokens = _final_tokens(drafts, metadata, target_argmax, probs, num_accepted, final_rows, generators)
        # Accepted drafts, then the final token at column num_accepted; one device-to-host copy.
        tokens = _with_column(drafts.token_ids).scatter_(1, num_accepted.unsqueeze(1), final_tokens.unsqueeze(1))
        sampled = [row[:n + 1] for row, n in zip(tokens.tolist(), num_accepted.tolist(), strict=True)]

        logprobs = None
        if raw_logprobs is not None:
            logprobs = _emitted_logprobs(raw_logprobs, sampled, drafts.first_rows_list, metadata.max_num_logprobs)
        return RejectionSamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)


def _accept_drafts(drafts: _Drafts, metadata: SamplingMetadata, target_argmax: torch.Tensor | None,
                   probs: torch.Tensor | None, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """``[B, K]`` bool: whether each draft, on its own, passes its row's test (False on padding).

    Greedy rows: the draft is the argmax. Random rows: a uniform u < p_j(x_j),
    i.e. acceptance with probability p_j(x_j) / q_j(x_j) for q_j = one-hot(x_j).
    """
    greedy_ok = None if target_argmax is None else target_argmax[drafts.rows] == drafts.token_ids
    random_ok = None if probs is None else _accept_random(drafts, probs, generators)
    if greedy_ok is None:
        accepted = random_ok
    elif random_ok is None:
        accepted = greedy_ok
    else:
        accepted = torch.where(metadata.is_greedy[drafts.rows], greedy_ok, random_ok)
    return accepted & drafts.is_draft


def _accept_random(drafts: _Drafts, probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """``[B, K]`` bool: u < p_j(x_j), with u from the request's generator when it has one."""
    # probs is filtered but not renormalised; the acceptance test needs the true p_j(x_j).
    draft_probs = probs[drafts.rows, drafts.token_ids] / probs.sum(dim=-1)[drafts.rows]
    uniform = torch.rand(draft_probs.shape, device=probs.device)
    for request, generator in generators.items():
        uniform[request, :drafts.num_drafts_list[request]].uniform_(generator=generator)
    return uniform < draft_probs


def _final_tokens(drafts: _Drafts, metadata: SamplingMetadata, target_argmax: torch.Tensor | None,
                  probs: torch.Tensor | None, num_accepted: torch.Tensor, final_rows: torch.Tensor,
                  generators: dict[int, torch.Generator]) -> torch.Tensor:
    """``[B]`` int64 each request's own token, at its first rejected row or its bonus row."""
    greedy = None if target_argmax is None else target_argmax[final_rows]
    if probs is None:
        return greedy
    sampled = exponential_race(_residual_probs(drafts, probs, num_accepted, final_rows), generators)
    return sampled if greedy is None else torch.where(metadata.is_greedy[final_rows], greedy, sampled)


def _residual_probs(drafts: _Drafts, probs: torch.Tensor, num_accepted: torch.Tensor,
                    final_rows: torch.Tensor) -> torch.Tensor:
    """``[B, V]`` the distribution of each request's own token, not renormalised.

    After a rejection at row j: norm(max(0, p_j - q_j)) with q_j = one-hot(x_j),
    which is p_j with x_j zeroed (p_j(x_j) - 1 <= 0). After accepting every
    draft: the bonus row's p unchanged. The exponential race needs no
    renormalisation, and the zeroed row keeps mass: x_j was rejected, so
    p_j(x_j) < 1.
    """
    final_probs = probs[final_rows]
    rejected = num_accepted < drafts.num_drafts
    # Column num_accepted of the padded drafts is the rejected draft; a request
    # that accepted everything reads the padding column, which is left as is.
    rejected_token = _with_column(drafts.token_ids).gather(1, num_accepted.unsqueeze(1))
    kept = final_probs.gather(1, rejected_token).masked_fill_(rejected.unsqueeze(1), 0.0)
    return final_probs.scatter_(1, rejected_token, kept)


def _with_column(token_ids: torch.Tensor) -> torch.Tensor:
    """``[B, K + 1]``: ``token_ids`` with one more column of zeros, for the final token."""
    return torch.nn.functional.pad(token_ids, (0, 1))


def _emitted_logprobs(raw_logprobs: torch.Tensor, sampled: list[list[int]], first_rows: list[int],
                      num_logprobs: int) -> LogprobsTensors:
    """Raw logprobs of every emitted token at the row that scored it (the j-th token: row first + j)."""
    rows = [first + j for first, tokens in zip(first_rows, sampled, strict=True) for j in range(len(tokens))]
    token_ids = [token for tokens in sampled for token in tokens]
    device = raw_logprobs.device
    return compute_logprobs_tensors(raw_logprobs[torch.tensor(rows, device=device)],
                                    torch.tensor(token_ids, device=device), num_logprobs)
