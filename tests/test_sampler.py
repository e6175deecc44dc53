"""Sampler tests on synthetic logits: greedy, seeds, distributions, penalties, bitmasks, logprobs."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from benchmarks.step_metadata import make_metadata, pack_bitmask
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.worker import sample_ops
from pagedserve.engine.worker.input_batch import CachedRequestState, InputBatch
from pagedserve.engine.worker.sample_ops import (
    LOGITS_OPS,
    apply_logit_bias,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    process_logits,
    unpack_token_bitmask,
)
from pagedserve.engine.worker.sampler import Sampler, compute_logprobs_tensors
from pagedserve.engine.worker.sampling_metadata import SamplingMetadata
from tests.sampling_fixtures import expected_distribution

# Ten logits in no particular order, so that "most likely" is not "lowest id".
SMALL_LOGITS = torch.tensor([0.5, 2.0, -0.7, 1.2, -2.0, 0.1, 1.5, -0.3, 0.8, -1.2])


def test_all_greedy_batch_takes_argmax():
    logits = torch.randn(16, 100, generator=torch.Generator().manual_seed(0))
    out = Sampler()(logits, make_metadata(16, temperature=0.0))
    assert torch.equal(out.sampled_token_ids, logits.argmax(dim=-1))
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.logprobs is None


def test_mixed_batch_keeps_greedy_rows_exact():
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(1)) * 0.1
    greedy_rows = torch.tensor([True, False] * 4)
    metadata = make_metadata(8, temperature=[0.0, 2.0] * 4, top_k=[3, 0] * 4, top_p=0.9, min_p=0.01)
    random_rows_differ = False
    for _ in range(20):
        sampled = Sampler()(logits, metadata).sampled_token_ids
        assert torch.equal(sampled[greedy_rows], logits.argmax(dim=-1)[greedy_rows])
        random_rows_differ |= bool((sampled[~greedy_rows] != logits.argmax(dim=-1)[~greedy_rows]).any())
    assert random_rows_differ


def test_seeded_request_samples_same_tokens_alone_and_in_batch():
    vocab_size, num_steps = 1000, 6
    step_logits = torch.randn(num_steps, vocab_size, generator=torch.Generator().manual_seed(2))
    target_params = dict(temperature=0.9, top_k=200, top_p=0.95, min_p=0.001)

    alone_generator = torch.Generator().manual_seed(1234)
    alone = []
    for step in range(num_steps):
        metadata = make_metadata(1, generators={0: alone_generator}, vocab_size=vocab_size,
                                 **{k: [v] for k, v in target_params.items()})
        alone.append(int(Sampler()(step_logits[step:step + 1], metadata).sampled_token_ids[0]))

    batch_generator = torch.Generator().manual_seed(1234)
    other_generator = torch.Generator().manual_seed(7)
    other_logits = torch.Generator().manual_seed(3)
    in_batch = []
    with torch.random.fork_rng():
        torch.manual_seed(99)  # a different global RNG state must not matter
        for step, row in enumerate([3, 6, 0, 7, 1, 4]):
            logits = torch.randn(8, vocab_size, generator=other_logits)
            logits[row] = step_logits[step]
            temperature, top_k, top_p, min_p = [1.3] * 8, [0, 5] * 4, [0.8] * 8, [0.0] * 8
            temperature[(row + 1) % 8] = 0.0
            temperature[row], top_k[row] = target_params["temperature"], target_params["top_k"]
            top_p[row], min_p[row] = target_params["top_p"], target_params["min_p"]
            metadata = make_metadata(8, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                                     generators={row: batch_generator, (row + 2) % 8: other_generator},
                                     vocab_size=vocab_size)
            in_batch.append(int(Sampler()(logits, metadata).sampled_token_ids[row]))

    assert in_batch == alone
    assert len(set(alone)) > 1


def test_different_seeds_give_different_samples():
    logits = torch.zeros(1, 1000)

    def draw(seed: int) -> list[int]:
        generator = torch.Generator().manual_seed(seed)
        metadata = make_metadata(1, generators={0: generator}, vocab_size=1000)
        return [int(Sampler()(logits, metadata).sampled_token_ids[0]) for _ in range(5)]

    assert draw(1) == draw(1)
    assert draw(1) != draw(2)


@pytest.mark.parametrize("params", [
    dict(temperature=0.7),
    dict(temperature=1.0, top_k=4),
    dict(temperature=1.0, top_p=0.8),
    dict(temperature=1.0, min_p=0.2),
    dict(temperature=1.3, top_k=7, top_p=0.9),
    dict(temperature=1.3, top_k=7, top_p=0.9, min_p=0.1),
], ids=["temperature", "top_k", "top_p", "min_p", "top_k+top_p", "all"])
def test_samples_follow_filtered_distribution(params: dict):
    """Half the batch uses ``params``, the other half plain softmax; both must fit (chi-square)."""
    half = 10_000
    plain = dict(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
    rows = {name: [params.get(name, plain[name])] * half + [plain[name]] * half for name in plain}
    metadata = make_metadata(2 * half, **rows)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        sampled = Sampler()(SMALL_LOGITS.expand(2 * half, -1), metadata).sampled_token_ids

    for samples, expected in ((sampled[:half], expected_distribution(SMALL_LOGITS, **params)),
                              (sampled[half:], expected_distribution(SMALL_LOGITS))):
        counts = np.bincount(samples.numpy(), minlength=len(SMALL_LOGITS))
        kept = expected > 0
        assert counts[~kept].sum() == 0, f"filtered-out tokens sampled: {counts}"
        assert chisquare(counts[kept], expected[kept] * half).pvalue > 0.001


def test_a_top_p_below_float32s_range_keeps_the_top_token():
    """Regression: top_p 1e-300 is positive, so it passes the door, but is 0 in float32; the nucleus
    was then empty and the threshold read index -1 (an error for the whole batch)."""
    probs = torch.tensor([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25]])
    metadata = make_metadata(2, top_p=[1e-300, 0.6], vocab_size=3)
    assert (apply_top_k_top_p(probs, metadata) > 0).tolist() == [[False, True, False], [True, True, True]]


@pytest.mark.parametrize("num_candidates", [3, 8, 1024])
@pytest.mark.parametrize("use_top_p", [True, False])
def test_top_k_top_p_keep_the_same_tokens_whatever_the_candidate_count(
        monkeypatch: pytest.MonkeyPatch, num_candidates: int, use_top_p: bool):
    """The partial-top-k head and the full-sort fallback must keep exactly the reference sets."""
    monkeypatch.setattr(sample_ops, "TOP_P_CANDIDATES", num_candidates)
    logits = 2 * torch.randn(7, 20, generator=torch.Generator().manual_seed(7))
    top_k = [0, 3, 0, 10, 5, 0, 25]
    top_p = [0.9, 0.8, 1.0, 0.5, 1.0, 0.3, 0.95] if use_top_p else [1.0] * 7
    probs = logits.softmax(dim=-1)
    metadata = make_metadata(len(top_k), top_k=top_k, top_p=top_p if use_top_p else None, vocab_size=20)
    filtered = apply_top_k_top_p(probs, metadata)

    for row in range(len(top_k)):
        kept = torch.from_numpy(expected_distribution(logits[row], top_k=top_k[row], top_p=top_p[row]) > 0)
        assert torch.equal(filtered[row] > 0, kept), f"row {row}"
        assert torch.equal(filtered[row][kept], probs[row][kept])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    metadata = make_metadata(1, repetition=2.0, prompt_token_ids=[[0, 1]],
                             output_token_ids=[[2, 2, 3]], vocab_size=6)
    expected = torch.tensor([[1.0, -2.0, 0.25, -1.0, 3.0, 0.0]])
    torch.testing.assert_close(apply_penalties(logits, metadata), expected, rtol=0, atol=0)


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
                           [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    metadata = make_metadata(2, frequency=[0.5, -0.25], presence=[0.25, 1.0],
                             prompt_token_ids=[[5], [0, 1, 2]], output_token_ids=[[4, 4, 4, 1], [3]],
                             vocab_size=6)
    expected = torch.tensor([[2.0, -1.0 - 0.5 - 0.25, 0.5, -0.5, 3.0 - 3 * 0.5 - 0.25, 0.0],
                             [2.0, -1.0, 0.5, -0.5 + 0.25 - 1.0, 3.0, 0.0]])
    torch.testing.assert_close(apply_penalties(logits, metadata), expected, rtol=0, atol=1e-6)


def test_penalties_combine_per_row():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
                           [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    metadata = make_metadata(2, repetition=[1.5, 1.0], frequency=[0.1, 0.0], presence=[0.2, 0.0],
                             prompt_token_ids=[[4], [4]], output_token_ids=[[0, 0], [0]], vocab_size=6)
    expected = torch.tensor([[2.0 / 1.5 - 2 * 0.1 - 0.2, -1.0, 0.5, -0.5, 3.0 / 1.5, 0.0],
                             [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    torch.testing.assert_close(apply_penalties(logits, metadata), expected, rtol=0, atol=1e-6)


def test_logit_bias_adds_exactly_before_penalties():
    logits = torch.tensor([[0.5, 1.0, -2.0], [0.5, 1.0, -2.0], [0.5, 1.0, -2.0]])
    metadata = make_metadata(3, repetition=[1.0, 1.0, 2.0], output_token_ids=[[], [], [0]], vocab_size=3,
                             logit_bias=[{0: 1.5, 2: -100.0}, None, {0: -1.0}])
    expected = torch.tensor([[2.0, 1.0, -102.0], [0.5, 1.0, -2.0], [-1.0, 1.0, -2.0]])
    torch.testing.assert_close(process_logits(logits, metadata), expected, rtol=0, atol=0)


def test_logit_bias_refuses_logits_of_another_width():
    """Its flat positions are row * V + id: logits of another width would get a bias in the wrong row."""
    metadata = make_metadata(2, vocab_size=3, logit_bias=[None, {0: 1.0}])
    with pytest.raises(ValueError, match="gathered for 3 logits a row, got 4"):
        apply_logit_bias(torch.zeros(2, 4), metadata)


def test_penalties_match_a_per_token_reference_on_random_batches():
    gen = torch.Generator().manual_seed(8)
    batch_size, vocab_size = 6, 40
    logits = 3 * torch.randn(batch_size, vocab_size, generator=gen)
    prompts = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (5, 1, 12, 7, 3, 9)]
    outputs = [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in (0, 8, 20, 3, 15, 1)]
    repetition = (0.5 + 1.5 * torch.rand(batch_size, generator=gen)).tolist()
    frequency = (4 * torch.rand(batch_size, generator=gen) - 2).tolist()
    presence = (4 * torch.rand(batch_size, generator=gen) - 2).tolist()
    metadata = make_metadata(batch_size, repetition=repetition, frequency=frequency, presence=presence,
                             prompt_token_ids=prompts, output_token_ids=outputs, vocab_size=vocab_size)

    expected = logits.clone()
    for row in range(batch_size):
        for token in set(prompts[row]) | set(outputs[row]):
            value = expected[row, token]
            expected[row, token] = value / repetition[row] if value > 0 else value * repetition[row]
        for token, count in Counter(outputs[row]).items():
            expected[row, token] -= frequency[row] * count + presence[row]
    torch.testing.assert_close(apply_penalties(logits, metadata), expected, rtol=0, atol=1e-5)


def _batch_with(params: list[SamplingParams], vocab_size: int = 10) -> InputBatch:
    batch = InputBatch(max_num_reqs=4, max_model_len=8, max_num_blocks_per_req=2, block_size=4,
                       vocab_size=vocab_size, device=torch.device("cpu"))
    for i, p in enumerate(params):
        batch.add_request(CachedRequestState(f"r{i}", [1, 2], p, None, [1], 0))
    return batch


def test_logit_bias_rejects_token_ids_outside_vocab_as_the_row_enters_the_batch():
    batch = _batch_with([SamplingParams(logit_bias={3: 1.0})])
    with pytest.raises(ValueError, match=r"logit_bias token ids must be in \[0, 10\), got 10"):
        batch.add_request(CachedRequestState("bad", [1, 2], SamplingParams(logit_bias={3: 1.0, 10: 1.0}), None,
                                             [2], 0))
    assert batch.req_ids[:2] == ["r0", None]


def test_persistent_batch_applies_each_rows_logit_bias_with_drafts_repeating_rows():
    """The batch's flat bias equals the rows' own, and a row scoring k drafts repeats its bias k + 1 times."""
    params = [SamplingParams(logit_bias={0: 1.5, 9: -100.0}), SamplingParams(), SamplingParams(logit_bias={4: 2.0})]
    batch = _batch_with(params)
    batch.set_draft_tokens({"r2": [7]})
    logits = torch.zeros(3, 10)
    biased = process_logits(logits, batch.make_sampling_metadata(np.arange(3)))
    expected = torch.zeros(3, 10)
    expected[0, 0], expected[0, 9], expected[2, 4] = 1.5, -100.0, 2.0
    assert torch.equal(biased, expected) and torch.equal(logits, torch.zeros(3, 10))
    per_position = process_logits(torch.zeros(4, 10), batch.make_sampling_metadata(np.arange(3), per_position=True))
    assert torch.equal(per_position, torch.cat([expected, expected[2:]]))


@pytest.mark.parametrize("op", [*LOGITS_OPS, apply_top_k_top_p, apply_min_p])
def test_an_op_no_row_uses_returns_its_input_itself(op):
    values = torch.rand(2, 10)
    assert op(values, make_metadata(2)) is values


def test_temperature_is_skipped_when_every_row_is_greedy():
    logits = torch.randn(2, 10)
    assert apply_temperature(logits, make_metadata(2, temperature=0.0)) is logits
    torch.testing.assert_close(apply_temperature(logits, make_metadata(2, temperature=[0.0, 0.5])),
                               torch.stack([logits[0], logits[1] / 0.5]))


def test_logprobs_come_from_raw_logits():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    original = logits.clone()
    metadata = make_metadata(4, temperature=[0.0, 0.5, 1.0, 2.0], top_k=5, repetition=1.3, presence=0.5,
                             output_token_ids=[[1, 2], [3], [], [4, 4]], vocab_size=50,
                             logit_bias=[{7: 5.0}, None, None, {9: -3.0}], max_num_logprobs=5)
    out = Sampler()(logits, metadata)

    assert torch.equal(logits, original)
    raw = torch.log_softmax(original, dim=-1)
    sampled = out.sampled_token_ids
    lp = out.logprobs
    assert lp.token_ids.shape == lp.logprobs.shape == (4, 6)
    assert torch.equal(lp.token_ids[:, 0], sampled)
    torch.testing.assert_close(lp.logprobs[:, 0], raw.gather(1, sampled.unsqueeze(1)).squeeze(1))
    top_values, top_ids = raw.topk(5, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top_ids)
    torch.testing.assert_close(lp.logprobs[:, 1:], top_values)
    assert (lp.logprobs[:, 1:-1] >= lp.logprobs[:, 2:]).all()
    assert lp.ranks.tolist() == [int((raw[i] > raw[i, t]).sum()) + 1 for i, t in enumerate(sampled)]


def test_greedy_sample_has_rank_one():
    logits = torch.randn(6, 30, generator=torch.Generator().manual_seed(4))
    out = Sampler()(logits, make_metadata(6, temperature=0.0, vocab_size=30, max_num_logprobs=2))
    assert out.logprobs.ranks.tolist() == [1] * 6
    assert torch.equal(out.logprobs.token_ids[:, 0], out.logprobs.token_ids[:, 1])


def test_to_lists_trims_each_row_to_its_own_k():
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(5))
    out = Sampler()(logits, make_metadata(4, temperature=0.0, vocab_size=30, max_num_logprobs=5))
    rows = out.logprobs.to_lists([None, 0, 2, 5])

    assert rows[0] is None
    assert [len(r.token_ids) for r in rows[1:]] == [1, 3, 6]
    assert [len(r.logprobs) for r in rows[1:]] == [1, 3, 6]
    assert rows[3].token_ids == out.logprobs.token_ids[3].tolist()
    assert rows[2].logprobs == out.logprobs.logprobs[2, :3].tolist()
    assert rows[1].rank == 1
    with pytest.raises(ValueError, match="num_logprobs_per_row"):
        out.logprobs.to_lists([1, 1, 1, 6])


def test_compute_logprobs_tensors_for_given_tokens():
    logprobs = torch.log_softmax(torch.tensor([[1.0, 3.0, 2.0, 0.0], [0.0, 0.0, 5.0, 1.0]]), dim=-1)
    result = compute_logprobs_tensors(logprobs, torch.tensor([2, 3]), num_logprobs=2)
    assert result.token_ids.tolist() == [[2, 1, 2], [3, 2, 3]]
    assert result.ranks.tolist() == [2, 2]
    torch.testing.assert_close(result.logprobs[:, 0], logprobs[[0, 1], [2, 3]])
    with pytest.raises(ValueError, match="num_logprobs"):
        compute_logprobs_tensors(logprobs, torch.tensor([2, 3]), num_logprobs=5)


def _penalties_bias_and_mask_metadata(device: torch.device) -> tuple[torch.Tensor, SamplingMetadata]:
    """Six rows of V = 50 logits with penalties, bias and two constrained rows, on ``device``."""
    gen = torch.Generator().manual_seed(3)
    vocab, batch = 50, 6
    outputs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (0, 1, 5, 17, 3, 40)]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (4, 1, 9, 2, 30, 7)]
    metadata = make_metadata(batch, presence=[0.0, 0.5, -1.0, 1.5, 0.2, 2.0], frequency=[0.1, 0.0, 0.7, -0.3, 1.0, 0.4],
                             repetition=[1.0, 1.3, 0.8, 2.0, 1.1, 1.5], prompt_token_ids=prompts,
                             output_token_ids=outputs, vocab_size=vocab, logit_bias=[None, {3: 2.0}, None, None,
                                                                                     {49: -1.0, 0: 0.5}, None],
                             allowed_tokens={4: [0, 3, 31, 32, 49], 1: range(0, vocab, 3)})
    for name in ("temperature", "presence_penalties", "frequency_penalties", "repetition_penalties",
                 "prompt_token_ids", "allowed_token_bitmask", "constrained_rows"):
        setattr(metadata, name, getattr(metadata, name).to(device))
    return (torch.randn(batch, vocab, generator=gen) * 3).to(device), metadata


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_logits_ops_on_cuda_equal_the_cpu_ones():
    """One implementation serves both devices: the processed logits must agree."""
    cpu_logits, cpu_metadata = _penalties_bias_and_mask_metadata(torch.device("cpu"))
    cuda_logits, cuda_metadata = _penalties_bias_and_mask_metadata(torch.device("cuda"))
    torch.testing.assert_close(process_logits(cuda_logits, cuda_metadata).cpu(),
                               process_logits(cpu_logits, cpu_metadata))


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 64, 100, 129])
def test_unpack_token_bitmask_matches_a_per_token_reference(vocab_size: int):
    gen = torch.Generator().manual_seed(vocab_size)
    allowed = (torch.rand(4, vocab_size, generator=gen) < 0.5)
    allowed[0] = True  # every bit set, including the sign bit of each word
    allowed[1] = False
    packed = pack_bitmask([row.nonzero().squeeze(1).tolist() for row in allowed], vocab_size)
    assert packed.shape == (4, -(-vocab_size // 32))
    assert torch.equal(unpack_token_bitmask(packed, vocab_size), allowed)


def test_unpack_token_bitmask_ignores_bits_past_the_vocabulary():
    assert unpack_token_bitmask(torch.full((1, 1), -1, dtype=torch.int32), 5).tolist() == [[True] * 5]


@pytest.mark.parametrize("bitmask", [torch.zeros(1, 3, dtype=torch.int32), torch.zeros(1, 5, dtype=torch.int32),
                                     torch.zeros(1, 4, dtype=torch.int64)], ids=["narrow", "wide", "int64"])
def test_malformed_bitmask_is_refused(bitmask: torch.Tensor):
    metadata = make_metadata(2, vocab_size=100)
    metadata.allowed_token_bitmask, metadata.constrained_rows = bitmask, torch.tensor([1])
    with pytest.raises(ValueError, match="allowed_token_bitmask"):
        Sampler()(torch.zeros(2, 100), metadata)


def test_bitmask_without_matching_constrained_rows_is_refused():
    metadata = make_metadata(2, vocab_size=40, allowed_tokens={0: [1], 1: [2]})
    metadata.constrained_rows = torch.tensor([0])
    with pytest.raises(ValueError, match="constrained_rows"):
        Sampler()(torch.zeros(2, 40), metadata)


def test_bitmask_disallowed_tokens_stay_out_whatever_bias_or_penalty():
    logits = torch.tensor([[0.0, 1.0, -2.0, 3.0]])
    metadata = make_metadata(1, vocab_size=4, allowed_tokens={0: [0, 2]}, logit_bias=[{1: 100.0, 2: 1.0}],
                             repetition=0.5, presence=-5.0, output_token_ids=[[3, 3]])
    expected = torch.tensor([[0.0, float("-inf"), -2.0 + 1.0, float("-inf")]])
    torch.testing.assert_close(process_logits(logits, metadata), expected, rtol=0, atol=0)


def test_constrained_rows_sample_only_allowed_tokens_and_free_rows_are_unchanged():
    """Rows 1 (greedy), 3 (seeded) and 4 (unseeded) are constrained, row 5 to a single token.

    V = 101 is not a multiple of 32, and V - 1 is one of the allowed tokens.
    """
    vocab_size, num_draws = 101, 200
    allowed = [3, 40, 77, vocab_size - 1]
    logits = 0.3 * torch.randn(6, vocab_size, generator=torch.Generator().manual_seed(11))
    params = dict(batch_size=6, temperature=[0.0, 0.0, 1.0, 1.0, 1.5, 0.8], top_p=[1.0, 1.0, 0.9, 1.0, 1.0, 0.9],
                  vocab_size=vocab_size, logit_bias=[None, None, {7: 2.0}, None, {allowed[1]: 1.0}, None])

    def draw(allowed_tokens: dict[int, list[int]] | None) -> torch.Tensor:
        generators = {row: torch.Generator().manual_seed(row) for row in (2, 3, 5)}
        metadata = make_metadata(**params, generators=generators, allowed_tokens=allowed_tokens)
        with torch.random.fork_rng():
            torch.manual_seed(0)
            return torch.stack([Sampler()(logits, metadata).sampled_token_ids for _ in range(num_draws)])

    free = draw(None)
    constrained = draw({1: allowed, 3: allowed, 4: allowed, 5: [vocab_size - 1]})

    assert torch.equal(constrained[:, [0, 2]], free[:, [0, 2]])
    assert constrained[:, 1].eq(allowed[int(logits[1, allowed].argmax())]).all()
    for row in (3, 4):
        assert set(constrained[:, row].tolist()) == set(allowed), f"row {row}"
    assert constrained[:, 5].eq(vocab_size - 1).all()
