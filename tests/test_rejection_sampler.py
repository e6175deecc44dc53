"""Rejection sampler tests: greedy acceptance, k = 0 against the Sampler, target distributions, seeds, logprobs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from benchmarks.step_metadata import make_metadata
from pagedserve.engine.worker.rejection_sampler import RejectionSampler
from pagedserve.engine.worker.sampler import Sampler
from tests.sampling_fixtures import expected_distribution

#: Eight logits whose least likely token still has p of about 0.035 (so
#: acceptances of an unlikely draft still number in the hundreds over 20k trials).
TARGET_LOGITS = torch.tensor([[0.5, 2.0, -0.3, 1.0, 0.2, 1.5, 0.0, 0.7],
                              [1.0, -0.2, 0.4, 2.2, 0.0, 0.9, 1.3, -0.5],
                              [-0.4, 0.6, 1.7, 0.1, 2.1, 0.3, -0.1, 1.1]])


def rows_of(logits_per_request: list[torch.Tensor]) -> torch.Tensor:
    """``[sum(k_i + 1), V]``: each request's rows, one request after the other."""
    return torch.cat(logits_per_request)


def test_greedy_right_drafts_are_all_accepted_plus_the_bonus_argmax():
    gen = torch.Generator().manual_seed(0)
    num_drafts = [3, 0, 2, 1]
    logits = torch.randn(sum(num_drafts) + len(num_drafts), 40, generator=gen)
    argmax = logits.argmax(dim=-1).tolist()
    firsts = np.cumsum([0] + [k + 1 for k in num_drafts])[:-1].tolist()
    drafts = [argmax[first:first + k] for first, k in zip(firsts, num_drafts, strict=True)]
    # Request 3 is random (temperature 1): greedy rows must not depend on it.
    temperature = [0.0] * 8 + [1.0, 1.0]
    out = RejectionSampler()(logits, make_metadata(len(logits), temperature=temperature, vocab_size=40), drafts)
    greedy_requests = zip(firsts[:3], num_drafts[:3], strict=True)
    assert out.sampled_token_ids[:3] == [argmax[first:first + k + 1] for first, k in greedy_requests]
    assert out.logprobs is None


@pytest.mark.parametrize("wrong_at", [0, 1, 2])
def test_greedy_first_wrong_draft_ends_the_step_with_that_rows_argmax(wrong_at: int):
    logits = torch.randn(4, 40, generator=torch.Generator().manual_seed(1))
    argmax = logits.argmax(dim=-1).tolist()
    drafts = argmax[:3]
    drafts[wrong_at] = (drafts[wrong_at] + 1) % 40
    out = RejectionSampler()(logits, make_metadata(4, temperature=0.0, vocab_size=40), [drafts])
    assert out.sampled_token_ids == [argmax[:wrong_at + 1]]


def test_greedy_speculation_equals_single_token_steps_under_penalties():
    """A toy model whose next logits depend on the last token; penalties see the drafts before each row."""
    vocab_size, prompt, num_steps = 20, [4, 9], 5
    table = 2 * torch.randn(vocab_size, vocab_size, generator=torch.Generator().manual_seed(2))
    penalties = dict(repetition=1.8, presence=0.7, frequency=0.3, vocab_size=vocab_size, temperature=0.0)

    def metadata(outputs: list[list[int]]):
        return make_metadata(len(outputs), prompt_token_ids=[prompt] * len(outputs), output_token_ids=outputs,
                             **penalties)

    reference: list[int] = []
    for _ in range(num_steps):
        logits = table[([*prompt, *reference])[-1]].unsqueeze(0)
        reference.append(int(Sampler()(logits, metadata([list(reference)])).sampled_token_ids[0]))
    assert len(set(reference)) > 2  # the penalties steer away from the toy model's loops

    for wrong_at in (None, 0, 2):
        drafts = reference[:num_steps - 1]
        if wrong_at is not None:
            drafts[wrong_at] = (drafts[wrong_at] + 1) % vocab_size
        contexts = [drafts[:j] for j in range(len(drafts) + 1)]
        logits = torch.stack([table[([*prompt, *context])[-1]] for context in contexts])
        out = RejectionSampler()(logits, metadata(contexts), [drafts])
        assert out.sampled_token_ids == [reference if wrong_at is None else reference[:wrong_at + 1]]


def test_requests_without_drafts_sample_exactly_as_the_sampler():
    """Seeded random rows, greedy rows, bias, penalties, a bitmask and logprobs: same tokens, same logprobs."""
    vocab_size, batch_size = 30, 5
    logits = torch.randn(batch_size, vocab_size, generator=torch.Generator().manual_seed(3))
    seeded = {0: 11, 2: 12, 3: 13}
    params = dict(temperature=[1.0, 0.0, 0.7, 1.2, 0.0], top_k=[0, 0, 5, 0, 0], top_p=[1.0, 1.0, 1.0, 0.8, 1.0],
                  repetition=1.3, output_token_ids=[[1], [2, 2], [], [4], [5]], logit_bias=[None, {7: 3.0}, None,
                                                                                              None, None],
                  allowed_tokens={3: [0, 1, 2, 3, 29], 4: [6, 8]}, max_num_logprobs=3, vocab_size=vocab_size)

    def generators() -> dict[int, torch.Generator]:
        return {row: torch.Generator().manual_seed(seed) for row, seed in seeded.items()}

    expected = Sampler()(logits, make_metadata(batch_size, generators=generators(), **params))
    out = RejectionSampler()(logits, make_metadata(batch_size, **params), [[]] * batch_size, generators())

    assert out.sampled_token_ids == [[token] for token in expected.sampled_token_ids.tolist()]
    for name in ("token_ids", "logprobs", "ranks"):
        assert torch.equal(getattr(out.logprobs, name), getattr(expected.logprobs, name)), name


def _counts(tokens: list[int], expected: np.ndarray) -> np.ndarray:
    """Histogram of ``tokens``, asserting no filtered-out token occurs and a chi-square fit (p > 0.001)."""
    counts = np.bincount(tokens, minlength=len(expected))
    kept = expected > 0
    assert counts[~kept].sum() == 0, f"filtered-out tokens emitted: {counts}"
    assert chisquare(counts[kept], expected[kept] * len(tokens)).pvalue > 0.001, (counts, expected)
    return counts


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.8, top_k=6, top_p=0.9)],
                         ids=["plain", "filtered"])
@pytest.mark.parametrize("draft", ["likely", "unlikely"])
def test_random_tokens_follow_the_target_distribution(params: dict, draft: str):
    """Leviathan et al. 2023, Theorem 1: each emitted token is distributed as the target's p at its row.

    20k requests with two drafts each, over the three rows of ``TARGET_LOGITS``:
    the first token must follow p_0 whatever the first draft; given that
    draft accepted, the second must follow p_1; given both, the bonus p_2.
    """
    num_trials = 20_000
    target = [expected_distribution(row, **params) for row in TARGET_LOGITS]
    order = np.argsort(-target[0])
    first_draft = int(order[0] if draft == "likely" else order[(target[0] > 0).sum() - 1])
    drafts = [first_draft, int(np.argmax(target[1]))]
    metadata = make_metadata(3 * num_trials, vocab_size=8, **params)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        out = RejectionSampler()(TARGET_LOGITS.repeat(num_trials, 1), metadata, [drafts] * num_trials)

    tokens = out.sampled_token_ids
    assert all(1 <= len(t) <= 3 and t[:len(t) - 1] == drafts[:len(t) - 1] for t in tokens)
    counts = _counts([t[0] for t in tokens], target[0])
    assert counts[first_draft] > 300  # enough acceptances for the conditional checks below
    _counts([t[1] for t in tokens if t[0] == first_draft], target[1])
    _counts([t[2] for t in tokens if t[:2] == drafts], target[2])


def test_a_draft_the_bitmask_forbids_is_never_accepted():
    vocab_size, num_trials, allowed = 40, 500, [3, 17, 33, 39]
    logits = torch.zeros(2 * num_trials, vocab_size)
    logits[:, 5] = 4.0  # the model's favourite token is forbidden
    metadata = make_metadata(2 * num_trials, vocab_size=vocab_size,
                             allowed_tokens={row: allowed for row in range(2 * num_trials)})
    with torch.random.fork_rng():
        torch.manual_seed(1)
        forbidden = RejectionSampler()(logits, metadata, [[5]] * num_trials).sampled_token_ids
        permitted = RejectionSampler()(logits, metadata, [[17]] * num_trials).sampled_token_ids
    assert all(len(t) == 1 and t[0] in allowed for t in forbidden)
    assert {t[0] for t in forbidden} == set(allowed)
    assert all(token in allowed for t in permitted for token in t)
    assert 0 < sum(len(t) == 2 for t in permitted) < num_trials  # accepted with p = 1/4


def test_seeded_request_emits_the_same_tokens_alone_and_in_any_batch():
    vocab_size, num_drafts, num_steps = 50, 3, 6
    gen = torch.Generator().manual_seed(4)
    step_logits = 0.5 * torch.randn(num_steps, num_drafts + 1, vocab_size, generator=gen)
    # Drafts the target often accepts, so that steps emit varying numbers of tokens.
    step_drafts = step_logits[:, :num_drafts].argmax(dim=-1).tolist()
    params = dict(temperature=0.9, top_p=0.95, vocab_size=vocab_size)

    def run_alone(seed: int) -> list[list[int]]:
        generator = torch.Generator().manual_seed(seed)
        metadata = make_metadata(num_drafts + 1, **params)
        return [RejectionSampler()(step_logits[step], metadata, [step_drafts[step]], {0: generator})
                .sampled_token_ids[0] for step in range(num_steps)]

    generator, other = torch.Generator().manual_seed(1234), torch.Generator().manual_seed(5)
    in_batch = []
    with torch.random.fork_rng():
        torch.manual_seed(99)  # a different global RNG state must not matter
        for step in range(num_steps):
            # Request 2 is ours; request 0 is seeded too, 1 greedy, 3 unseeded with no drafts.
            other_rows = torch.randn(2 + 3 + 1, vocab_size, generator=gen)
            logits = torch.cat([other_rows[:2], other_rows[2:5], step_logits[step], other_rows[5:]])
            metadata = make_metadata(len(logits), temperature=[1.0] * 2 + [0.0] * 3 + [0.9] * 4 + [1.0],
                                     top_p=0.95, vocab_size=vocab_size)
            drafts = [[7], [1, 2], step_drafts[step], []]
            out = RejectionSampler()(logits, metadata, drafts, {2: generator, 0: other})
            in_batch.append(out.sampled_token_ids[2])

    assert in_batch == run_alone(1234)
    assert run_alone(1234) != run_alone(4321)
    assert len({len(tokens) for tokens in in_batch}) > 1


def test_logprobs_are_raw_logprobs_of_each_emitted_token_at_its_row():
    vocab_size, num_drafts = 30, [2, 0, 3]
    logits = torch.randn(sum(num_drafts) + 3, vocab_size, generator=torch.Generator().manual_seed(5))
    argmax = logits.argmax(dim=-1).tolist()
    drafts = [argmax[0:2], [], [argmax[4], (argmax[5] + 1) % vocab_size, 0]]
    metadata = make_metadata(len(logits), temperature=0.0, vocab_size=vocab_size, max_num_logprobs=4)
    out = RejectionSampler()(logits, metadata, drafts)

    raw = logits.log_softmax(dim=-1)
    emitted_rows = [0, 1, 2, 3, 4, 5]  # all of request 0, request 1's one row, request 2 up to its rejection
    assert [len(t) for t in out.sampled_token_ids] == [3, 1, 2]
    emitted = torch.tensor([token for tokens in out.sampled_token_ids for token in tokens])
    assert torch.equal(out.logprobs.token_ids[:, 0], emitted)
    torch.testing.assert_close(out.logprobs.logprobs[:, 0], raw[emitted_rows, emitted])
    top_values, top_ids = raw[emitted_rows].topk(4, dim=-1)
    assert torch.equal(out.logprobs.token_ids[:, 1:], top_ids)
    torch.testing.assert_close(out.logprobs.logprobs[:, 1:], top_values)

    per_request = out.logprobs_per_request([2, None, 0])
    assert per_request[1] is None
    assert [[len(entry.token_ids) for entry in entries] for entries in (per_request[0], per_request[2])] == [
        [3, 3, 3], [1, 1]]
    assert [entry.token_ids[0] for entry in per_request[2]] == out.sampled_token_ids[2]


@pytest.mark.parametrize("num_rows, drafts, generators, match", [
    (3, [[1]], {}, "logits must be"),
    (2, [[10]], {}, "draft token ids"),
    (2, [[1]], {1: torch.Generator()}, "generators"),
], ids=["rows", "draft-id", "generator-key"])
def test_bad_inputs_are_refused(num_rows: int, drafts: list[list[int]], generators: dict, match: str):
    with pytest.raises(ValueError, match=match):
        RejectionSampler()(torch.zeros(num_rows, 10), make_metadata(num_rows), drafts, generators)


def test_logprobs_per_request_needs_logprobs():
    out = RejectionSampler()(torch.zeros(1, 10), make_metadata(1), [[]])
    with pytest.raises(ValueError, match="no logprobs"):
        out.logprobs_per_request([1])
