"""Turns one step's logits into sampled tokens (and their logprobs).

The steps, in order, follow vLLM V1's sampler:

1. logprobs, when any row asks for them, from the *raw* logits (vLLM's default
   ``raw_logprobs``: before bias, penalties and temperature);
2. ``logit_bias``, then repetition / frequency / presence penalties;
3. greedy rows take the argmax;
4. random rows: temperature, top-k, top-p, min-p (Hugging Face's warper order),
   then one draw per row by the exponential race, with a per-request generator
   for seeded requests so that their samples do not depend on the batch.

Everything is vectorized over the batch, and a feature no row uses costs
nothing: ``SamplingMetadata`` carries ``None`` / flags for that.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from engine.outputs import TokenLogprobs
from engine.sampling_params import GREEDY_TEMPERATURE_EPS


@dataclass
class SamplingMetadata:
    """The sampling parameters of the rows of one step's logits, as tensors.

    B is the number of rows (requests that sample this step), V the vocabulary
    size. Tensors live on the logits' device.

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
            step's sample), ids in ``[0, V)``.
        logit_bias: per row, token id -> bias, or None for that row; None when
            no row has a bias.
        max_num_logprobs: the largest ``logprobs`` any row asked for; None if none asked.
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


def apply_penalties_and_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Add ``logit_bias``, then apply repetition, frequency and presence penalties.

    Repetition (Keskar et al. 2019, CTRL, arXiv:1909.05858, as in Hugging Face
    and vLLM): for a token in the prompt or the output so far, a logit ``l``
    becomes ``l / r`` when ``l > 0`` and ``l * r`` otherwise. Frequency and
    presence (OpenAI API reference, "parameter details"): over output tokens
    only, ``l -= frequency * count + presence * (count > 0)``.

    Args:
        logits: ``[B, V]`` float32, not modified.
        metadata: the batch's sampling parameters.

    Returns:
        ``[B, V]`` float32 processed logits; ``logits`` itself when no row has
        a bias or a penalty.

    Raises:
        ValueError: when a ``logit_bias`` token id is not in ``[0, V)``.
    """
    if metadata.logit_bias is None and metadata.no_penalties:
        return logits
    logits = logits.clone()  # the one copy; the steps below work on it in place
    if metadata.logit_bias is not None:
        _add_logit_bias_(logits, metadata.logit_bias)
    if not metadata.no_penalties:
        _apply_penalties_(logits, metadata)
    return logits


def _add_logit_bias_(logits: torch.Tensor, logit_bias: list[dict[int, float] | None]) -> None:
    rows, token_ids, biases = [], [], []
    for row, bias in enumerate(logit_bias):
        if bias:
            rows.extend(itertools.repeat(row, len(bias)))
            token_ids.extend(bias.keys())
            biases.extend(bias.values())
    vocab_size = logits.shape[-1]
    token_ids_t = torch.tensor(token_ids, dtype=torch.int64)
    if bool(((token_ids_t < 0) | (token_ids_t >= vocab_size)).any()):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got {sorted(set(token_ids))}")
    index = (torch.tensor(rows, dtype=torch.int64).to(logits.device), token_ids_t.to(logits.device))
    logits.index_put_(index, torch.tensor(biases, dtype=logits.dtype).to(logits.device), accumulate=True)


def _apply_penalties_(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Penalise ``logits`` in place (see ``_apply_penalties_sparse_`` and ``_apply_penalties_dense_``)."""
    if logits.is_cuda:
        _apply_penalties_dense_(logits, metadata)
    else:
        _apply_penalties_sparse_(logits, metadata)


def _apply_penalties_dense_(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Penalise ``logits`` in place through dense ``[B, V]`` counts (vLLM's way).

    Every shape is known up front, so on a GPU nothing waits for the device;
    the sparse variant's ``unique`` and boolean indexing would each force a sync.
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    max_len = max((len(ids) for ids in metadata.output_token_ids), default=0)
    padded = [ids + [vocab_size] * (max_len - len(ids)) for ids in metadata.output_token_ids]
    output_ids = torch.tensor(padded, dtype=torch.int64).view(num_rows, max_len).to(device, non_blocking=True)
    counts = torch.zeros(num_rows, vocab_size + 1, dtype=logits.dtype, device=device)
    counts.scatter_add_(1, output_ids, torch.ones_like(output_ids, dtype=logits.dtype))
    counts = counts[:, :vocab_size]
    seen = counts > 0
    if metadata.prompt_token_ids is not None:
        in_prompt = torch.zeros(num_rows, vocab_size + 1, dtype=torch.bool, device=device)
        in_prompt.scatter_(1, metadata.prompt_token_ids.to(device), True)
        seen = seen | in_prompt[:, :vocab_size]
    repetition = metadata.repetition_penalties.unsqueeze(1)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits.copy_(torch.where(seen, penalised, logits))
    logits -= (metadata.frequency_penalties.unsqueeze(1) * counts
               + metadata.presence_penalties.unsqueeze(1) * (counts > 0))


def _apply_penalties_sparse_(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    """Penalise ``logits`` in place, touching only the (row, token) pairs that occur.

    Works on indices into the flattened ``[B * V]`` logits, made unique with
    counts, rather than on dense ``[B, V]`` masks: the cost follows the number of
    prompt and output tokens, not the vocabulary.
    """
    num_rows, vocab_size = logits.shape
    device = logits.device
    flat_logits = logits.view(-1)
    output_token_ids = metadata.output_token_ids
    lengths = torch.tensor([len(ids) for ids in output_token_ids])
    output_ids = torch.tensor(list(itertools.chain.from_iterable(output_token_ids)), dtype=torch.int64)
    output_rows = torch.repeat_interleave(torch.arange(num_rows), lengths)
    output_index = (output_rows * vocab_size + output_ids).to(device)  # repeats kept: they count

    seen_index = output_index
    if metadata.prompt_token_ids is not None:
        prompt = metadata.prompt_token_ids.to(device)
        prompt_index = torch.arange(num_rows, device=device).unsqueeze(1) * vocab_size + prompt
        seen_index = torch.cat([seen_index, prompt_index[prompt < vocab_size]])  # drop the padding
    seen_index = seen_index.unique()
    seen = flat_logits[seen_index]
    repetition = metadata.repetition_penalties[seen_index // vocab_size]
    flat_logits[seen_index] = torch.where(seen > 0, seen / repetition, seen * repetition)

    distinct_index, counts = output_index.unique(return_counts=True)
    rows = distinct_index // vocab_size
    penalty = metadata.frequency_penalties[rows] * counts + metadata.presence_penalties[rows]
    flat_logits.index_add_(0, distinct_index, -penalty)


#: Top-p first looks for each nucleus among this many most likely tokens, which
#: a partial top-k finds far faster than a full sort of the vocabulary; only
#: rows whose nucleus is wider are then sorted in full.
TOP_P_CANDIDATES = 1024


def apply_top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Zero the probabilities outside each row's top-k, then outside its top-p nucleus.

    Top-k keeps the k most likely tokens. Top-p (Holtzman et al. 2020,
    arXiv:1904.09751) then keeps the smallest set of most likely tokens whose
    probability, renormalised over the top-k set, sums to >= p; the top token
    is always kept. Each row keeps the tokens at least as likely as its last
    kept one, so ties with it survive. The result is not renormalised. Top-p
    looks for the nucleus among the ``TOP_P_CANDIDATES`` most likely tokens
    first (a partial top-k) and sorts a row in full only when it is wider.

    Args:
        probs: ``[B, V]`` float32 probabilities (temperature applied), rows summing to 1; not modified.
        top_k: ``[B]`` int64, 0 = no limit for that row (above V means V); or None.
        top_p: ``[B]`` float32 in (0, 1], 1 = no limit for that row; or None.

    Returns:
        ``[B, V]`` float32 filtered probabilities.
    """
    if top_k is None and top_p is None:
        return probs
    vocab_size = probs.shape[-1]
    if top_k is None:
        top_k = torch.full(probs.shape[:1], vocab_size, device=probs.device)
    top_k = torch.where(top_k > 0, top_k, vocab_size).clamp(max=vocab_size)
    if top_p is None:
        threshold = _top_k_threshold(probs, top_k)
    else:
        threshold = _top_k_top_p_threshold(probs, top_k, top_p)
    return probs.masked_fill(probs < threshold, 0.0)


def _top_k_threshold(probs: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` each row's k-th largest probability (0 where k = V), from one partial top-k."""
    unlimited = top_k >= probs.shape[-1]
    # Unlimited rows would force a full sort; they read column 0 and are reset to 0.
    top_k = top_k.masked_fill(unlimited, 1)
    # On a GPU a full top-k costs less than the device-to-host sync that sizing it would need.
    num_candidates = probs.shape[-1] if probs.is_cuda else int(top_k.max())
    kth_largest = probs.topk(num_candidates, dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
    return kth_largest.masked_fill(unlimited.unsqueeze(1), 0.0)


def _top_k_top_p_threshold(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """``[B, 1]`` each row's smallest kept probability under top-k then top-p (0 = keep all)."""
    vocab_size = probs.shape[-1]
    if probs.is_cuda:  # no data-dependent sizes, so no device-to-host sync: sort every row in full
        return _head_threshold(probs, top_k, top_p, vocab_size)[0]
    limited_k = top_k[top_k < vocab_size]
    num_candidates = min(vocab_size, max(TOP_P_CANDIDATES, int(limited_k.max()) if len(limited_k) else 0))
    threshold, settled = _head_threshold(probs, top_k, top_p, num_candidates)
    if not bool(settled.all()):
        rows = (~settled).nonzero().squeeze(1)
        threshold[rows] = _head_threshold(probs[rows], top_k[rows], top_p[rows], vocab_size)[0]
    return threshold


def _head_threshold(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                    num_candidates: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k then top-p over each row's ``num_candidates`` most likely tokens.

    Returns:
        ``[B, 1]`` float32 smallest kept probability (0 = keep all), and ``[B]``
        bool: whether the candidates were enough to decide the row.
    """
    vocab_size = probs.shape[-1]
    in_top_k = torch.arange(num_candidates, device=probs.device) < top_k.unsqueeze(1)
    head = probs.topk(num_candidates, dim=-1).values.masked_fill(~in_top_k, 0.0)
    cumulative = head.cumsum(dim=-1)
    unlimited_k = top_k >= vocab_size
    # Top-p renormalises over the top-k set, whose mass is 1 when k = V.
    top_k_mass = torch.where(unlimited_k, 1.0, cumulative[:, -1])
    # p = 1 keeps the whole top-k set explicitly: rounding in the cumulative sum
    # could otherwise push the mass before a tail token up to the total.
    in_nucleus = (cumulative - head < (top_p * top_k_mass).unsqueeze(1)) | (top_p >= 1).unsqueeze(1)
    num_kept = (in_nucleus & in_top_k).sum(dim=-1, keepdim=True)
    keeps_all = unlimited_k & (top_p >= 1)
    threshold = head.gather(1, num_kept - 1).masked_fill(keeps_all.unsqueeze(1), 0.0)
    # The candidates decide a row when its top-k fits in them (they are at least
    # the largest limited k) or when they alone reach p.
    settled = ~unlimited_k | keeps_all | (cumulative[:, -1] >= top_p)
    return threshold, settled


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero the tokens less likely than ``min_p`` times the row's top token.

    Min-p sampling (Nguyen et al. 2024, arXiv:2407.01082). The result is not
    renormalised: the exponential race in ``Sampler`` does not need it.

    Args:
        probs: ``[B, V]`` float32 probabilities (need not sum to 1), not modified.
        min_p: ``[B]`` float32 in [0, 1], 0 = off for that row.

    Returns:
        ``[B, V]`` float32 filtered probabilities.
    """
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def _exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """``[B]`` int64: one token per row drawn from ``probs`` (``[B, V]``, need not sum to 1).

    With independent ``E_i ~ Exp(1)``, ``argmax_i p_i / E_i`` is token i with
    probability ``p_i / sum(p)`` (the first of independent exponential clocks
    with rates ``p_i``), the Gumbel-max trick in another form. Seeded rows draw
    their noise from their own generator, so they do not depend on the batch.
    """
    uniform = torch.rand_like(probs)
    for row, generator in generators.items():
        uniform[row].uniform_(generator=generator)
    # E = -log(U) is Exp(1), and argmax p / E = argmax log(U) / p, computed in place;
    # log(U) < 0, so a filtered token (p = 0) scores -inf, never NaN.
    return uniform.log_().div_(probs).argmax(dim=-1)


class Sampler(torch.nn.Module):
    """Samples one token per row of the logits; see the module docstring for the steps."""

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row.

        Args:
            logits: ``[B, V]`` float32 logits of each row's last position, not modified.
            metadata: the rows' sampling parameters.

        Returns:
            ``[B]`` int64 sampled tokens, and their logprobs (from the raw
            logits) with the top ``max_num_logprobs`` when any row asked.

        Raises:
            ValueError: when ``logits`` is not 2-D or its rows do not match
                ``metadata.temperature``; on a bad ``logit_bias`` token id.
        """
        if logits.dim() != 2 or logits.shape[0] != metadata.temperature.shape[0]:
            raise ValueError(f"logits must be [B, V] with B = {metadata.temperature.shape[0]} "
                             f"(len of temperature), got {list(logits.shape)}")
        logits = logits.to(torch.float32)
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            raw_logprobs = logits.log_softmax(dim=-1)
        logits = apply_penalties_and_bias(logits, metadata)
        sampled = self._sample(logits, metadata)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = compute_logprobs_tensors(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def _sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        greedy = None if metadata.all_random else logits.argmax(dim=-1)
        if metadata.all_greedy:
            return greedy
        is_greedy = metadata.temperature < GREEDY_TEMPERATURE_EPS
        # Greedy rows divide by 1 instead of ~0; their random draw is discarded below.
        temperature = torch.where(is_greedy, 1.0, metadata.temperature)
        probs = (logits / temperature.unsqueeze(1)).softmax(dim=-1)
        probs = apply_top_k_top_p(probs, metadata.top_k, metadata.top_p)
        if metadata.min_p is not None:
            probs = apply_min_p(probs, metadata.min_p)
        sampled = _exponential_race(probs, metadata.generators)
        return sampled if greedy is None else torch.where(is_greedy, greedy, sampled)
