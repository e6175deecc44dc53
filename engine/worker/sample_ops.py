"""The sampler's steps as small ops over a batch of logits rows.

Each op is a function of (logits or probabilities, ``SamplingMetadata``) that
returns a new tensor, never changing its input, and returns its input itself,
at no cost, when no row uses its feature. In order:

1. logits ops (``LOGITS_OPS``): allowed-token bitmask, ``logit_bias``,
   repetition / frequency / presence penalties;
2. greedy rows take the argmax of the processed logits;
3. the other rows: temperature, softmax, top-k and top-p, min-p (Hugging
   Face's warper order), then one draw per row by the exponential race.

``Sampler`` and ``RejectionSampler`` both build on these ops, so a
speculative step's target distribution is exactly a plain step's.
"""

from __future__ import annotations

import itertools

import torch

from pagedserve.engine.worker.sampling_metadata import SamplingMetadata

#: Bits in one word of a packed allowed-token bitmask (int32 words, as xgrammar and llguidance pack them).
BITMASK_WORD_BITS = 32

#: Top-p first looks for each nucleus among this many most likely tokens, which
#: a partial top-k finds far faster than a full sort of the vocabulary; only
#: rows whose nucleus is wider are then sorted in full.
TOP_P_CANDIDATES = 1024


def unpack_token_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Unpack allowed-token bitmasks into booleans.

    Args:
        bitmask: ``[R, ceil(V / 32)]`` int32; bit j (little-endian) of word i
            set = token ``32 * i + j`` allowed. Bits past V are ignored.
        vocab_size: V.

    Returns:
        ``[R, V]`` bool, True = allowed.

    Raises:
        ValueError: when ``bitmask`` is not int32 ``[R, ceil(V / 32)]``.
    """
    num_words = -(-vocab_size // BITMASK_WORD_BITS)
    if bitmask.dim() != 2 or bitmask.shape[1] != num_words or bitmask.dtype != torch.int32:
        raise ValueError(f"allowed_token_bitmask must be int32 [R, {num_words}] for V = {vocab_size}, "
                         f"got {bitmask.dtype} {list(bitmask.shape)}")
    shifts = torch.arange(BITMASK_WORD_BITS, dtype=torch.int32, device=bitmask.device)
    # An arithmetic shift copies the sign bit leftwards, but "& 1" keeps only bit j.
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1
    return bits.view(bitmask.shape[0], num_words * BITMASK_WORD_BITS)[:, :vocab_size].bool()


def apply_allowed_token_mask(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Set the logits of the tokens a constrained row does not allow to -inf.

    Structured output (a grammar) hands over one packed bitmask per constrained
    row; unlisted rows are untouched. Each constrained row must allow at
    least one token, or it has no distribution to sample from.

    Args:
        logits: ``[B, V]`` float32, not modified.
        metadata: ``allowed_token_bitmask`` ``[R, ceil(V / 32)]`` int32 and
            ``constrained_rows`` ``[R]`` int64 (both None: no row constrained).

    Returns:
        ``[B, V]`` float32 masked logits; ``logits`` itself when no row is constrained.

    Raises:
        ValueError: on a malformed bitmask, or when ``constrained_rows`` is
            missing or does not have one entry per bitmask row.
    """
    bitmask, rows = metadata.allowed_token_bitmask, metadata.constrained_rows
    if bitmask is None:
        return logits
    if rows is None or rows.shape != bitmask.shape[:1]:
        raise ValueError(f"constrained_rows must be [{bitmask.shape[0]}] (one per bitmask row), "
                         f"got {None if rows is None else list(rows.shape)}")
    allowed = unpack_token_bitmask(bitmask, logits.shape[-1])
    masked_rows = logits[rows].masked_fill_(~allowed, float("-inf"))
    return logits.index_put((rows,), masked_rows)


def apply_logit_bias(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Add each row's ``logit_bias`` to its logits, in one ``index_add`` over the flattened logits.

    Args:
        logits: ``[B, V]`` float32, not modified.
        metadata: ``logit_bias`` (None: no row has one); its token ids were checked against V when
            their rows entered the batch (``InputBatch.add_request``).

    Returns:
        ``[B, V]`` float32 biased logits; ``logits`` itself when no row has a bias.

    Raises:
        ValueError: the logits are not V wide (a flat position would land in another row).
    """
    bias = metadata.logit_bias
    if bias is None:
        return logits
    if logits.shape[-1] != bias.vocab_size:
        raise ValueError(f"logit_bias was gathered for {bias.vocab_size} logits a row, got {logits.shape[-1]}")
    return logits.flatten().index_add(0, bias.index, bias.values).view_as(logits)


def apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Apply repetition, then frequency and presence penalties.

    Repetition (Keskar et al. 2019, CTRL, arXiv:1909.05858, as in Hugging Face
    and vLLM): for a token in the prompt or the output so far, a logit ``l``
    becomes ``l / r`` when ``l > 0`` and ``l * r`` otherwise. Frequency and
    presence (OpenAI API reference, "parameter details"): over output tokens
    only, ``l -= frequency * count + presence * (count > 0)``.

    Only the (row, token) pairs that occur are read and written, as flat
    indices into the ``[B * V]`` logits made distinct by one ``unique``, so
    the cost follows the number of prompt and output tokens, not B * V.
    This is the one implementation for CPU and CUDA. The alternative, dense
    ``[B, V]`` counts and masks, needs no host sync, but it moves several
    ``B * V`` tensors every step (about 150 MB each for B = 256 and a
    152k vocabulary) and is many times slower on a CPU. The price here, on
    CUDA, is that ``unique`` must tell the host its output size: one sync,
    only in steps where a row uses a penalty, that keeps the host from
    queueing the few remaining sampler kernels ahead of the forward pass;
    the step syncs anyway when it reads the sampled tokens back.

    Args:
        logits: ``[B, V]`` float32, not modified.
        metadata: the penalties, ``prompt_token_ids`` and ``output_token_ids``.

    Returns:
        ``[B, V]`` float32 penalised logits; ``logits`` itself when no row has a penalty.
    """
    if metadata.no_penalties:
        return logits
    index, output_counts = _occurring_tokens(metadata, logits.shape[-1], logits.device)
    rows = index // logits.shape[-1]
    flat_logits = logits.flatten()
    values = flat_logits[index]
    repetition = metadata.repetition_penalties[rows]
    values = torch.where(values > 0, values / repetition, values * repetition)
    values -= (metadata.frequency_penalties[rows] * output_counts
               + metadata.presence_penalties[rows] * (output_counts > 0))
    return flat_logits.index_put((index,), values).view_as(logits)


def _occurring_tokens(metadata: SamplingMetadata, vocab_size: int,
                      device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (row, token) pairs of the prompts and outputs, and their output counts.

    Returns:
        ``[D]`` int64 distinct flat indices ``row * V + token``, and ``[D]``
        float32 how often each occurs in the row's output (0 = prompt only).
    """
    num_rows = len(metadata.output_token_ids)
    lengths = torch.tensor([len(ids) for ids in metadata.output_token_ids])
    output_ids = torch.tensor(list(itertools.chain.from_iterable(metadata.output_token_ids)), dtype=torch.int64)
    output_index = (torch.repeat_interleave(torch.arange(num_rows), lengths) * vocab_size + output_ids).to(device)
    # One index past the logits stands for prompt padding. It is appended once
    # more, so it is always the last distinct index and is dropped without
    # asking the device whether it occurred.
    past_end = num_rows * vocab_size
    parts = [output_index, torch.tensor([past_end], device=device)]
    if metadata.prompt_token_ids is not None:
        prompt = metadata.prompt_token_ids.to(device)
        prompt_index = torch.arange(num_rows, device=device).unsqueeze(1) * vocab_size + prompt
        parts.append(torch.where(prompt < vocab_size, prompt_index, past_end).flatten())
    index, inverse = torch.cat(parts).unique(return_inverse=True)
    output_counts = torch.zeros(len(index), dtype=torch.float32, device=device)
    output_counts.index_add_(0, inverse[:len(output_index)], torch.ones(len(output_index), device=device))
    return index[:-1], output_counts[:-1]


LOGITS_OPS = (apply_allowed_token_mask, apply_logit_bias, apply_penalties)


def process_logits(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Run ``LOGITS_OPS`` in order: bitmask, then bias, then penalties.

    The mask comes first so that no bias or penalty can bring a disallowed
    token back (-inf stays -inf under both).

    Args:
        logits: ``[B, V]`` float32, not modified.
        metadata: the rows' sampling parameters.

    Returns:
        ``[B, V]`` float32 processed logits, ``logits`` itself when no op applies.
    """
    for op in LOGITS_OPS:
        logits = op(logits, metadata)
    return logits


def apply_temperature(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Divide each random row's logits by its temperature.

    Greedy rows are divided by 1 instead of a near-zero temperature (no
    overflow); their random draw is discarded in favour of the argmax.

    Args:
        logits: ``[B, V]`` float32, not modified.
        metadata: ``temperature`` and ``all_greedy``.

    Returns:
        ``[B, V]`` float32; ``logits`` itself when every row is greedy.
    """
    if metadata.all_greedy:
        return logits
    temperature = torch.where(metadata.is_greedy, 1.0, metadata.temperature)
    return logits / temperature.unsqueeze(1)


def apply_top_k_top_p(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
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
        metadata: ``top_k`` ``[B]`` int64 (0 = no limit for that row, above V
            means V) and ``top_p`` ``[B]`` float32 in (0, 1] (1 = no limit), each or None.

    Returns:
        ``[B, V]`` float32 filtered probabilities; ``probs`` itself when neither is set.
    """
    top_k, top_p = metadata.top_k, metadata.top_p
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
    # The top token is always kept: a top_p too small for float32 (1e-300) rounds to 0 and keeps none.
    num_kept = (in_nucleus & in_top_k).sum(dim=-1, keepdim=True).clamp(min=1)
    keeps_all = unlimited_k & (top_p >= 1)
    threshold = head.gather(1, num_kept - 1).masked_fill(keeps_all.unsqueeze(1), 0.0)
    # The candidates decide a row when its top-k fits in them (they are at least
    # the largest limited k) or when they alone reach p.
    settled = ~unlimited_k | keeps_all | (cumulative[:, -1] >= top_p)
    return threshold, settled


def apply_min_p(probs: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Zero the tokens less likely than ``min_p`` times the row's top token.

    Min-p sampling (Nguyen et al. 2024, arXiv:2407.01082). The result is not
    renormalised: the exponential race does not need it.

    Args:
        probs: ``[B, V]`` float32 probabilities (need not sum to 1), not modified.
        metadata: ``min_p`` ``[B]`` float32 in [0, 1] (0 = off for that row), or None.

    Returns:
        ``[B, V]`` float32 filtered probabilities; ``probs`` itself when ``min_p`` is None.
    """
    if metadata.min_p is None:
        return probs
    threshold = metadata.min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return probs.masked_fill(probs < threshold, 0.0)


def sampling_probs(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """The distribution a random row draws from: temperature, softmax, top-k/top-p, min-p.

    Args:
        logits: ``[B, V]`` float32 processed logits (``process_logits``), not modified.
        metadata: the rows' sampling parameters.

    Returns:
        ``[B, V]`` float32 filtered probabilities, not renormalised (divide by
        the row sum for the distribution). Greedy rows get their temperature-1
        distribution, which only a random draw would use.
    """
    probs = apply_temperature(logits, metadata).softmax(dim=-1)
    return apply_min_p(apply_top_k_top_p(probs, metadata), metadata)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row from ``probs``.

    With independent ``E_i ~ Exp(1)``, ``argmax_i p_i / E_i`` is token i with
    probability ``p_i / sum(p)`` (the first of independent exponential clocks
    with rates ``p_i``), the Gumbel-max trick in another form. Seeded rows draw
    their V uniforms from their own generator, so they do not depend on the batch.

    Args:
        probs: ``[B, V]`` float32 probabilities, need not sum to 1; each row
            needs one positive entry.
        generators: row -> generator for the seeded rows; the others use the global RNG.

    Returns:
        ``[B]`` int64 drawn token ids.
    """
    uniform = torch.rand_like(probs)
    for row, generator in generators.items():
        uniform[row].uniform_(generator=generator)
    # E = -log(U) is Exp(1), and argmax p / E = argmax log(U) / p, computed in place;
    # log(U) < 0, so a filtered token (p = 0) scores -inf, never NaN.
    return uniform.log_().div_(probs).argmax(dim=-1)


def sample_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """One token per row: the argmax for greedy rows, a draw from ``sampling_probs`` for the others.

    Args:
        logits: ``[B, V]`` float32 processed logits (``process_logits``), not modified.
        metadata: the rows' sampling parameters.

    Returns:
        ``[B]`` int64 token ids.
    """
    greedy = None if metadata.all_random else logits.argmax(dim=-1)
    if metadata.all_greedy:
        return greedy
    sampled = exponential_race(sampling_probs(logits, metadata), metadata.generators)
    return sampled if greedy is None else torch.where(metadata.is_greedy, greedy, sampled)
