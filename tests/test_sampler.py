"""Sampler tests on synthetic logits: greedy, seeds, distributions, penalties, logprobs."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from engine.sampling_params import GREEDY_TEMPERATURE_EPS
from engine.worker import sampler as sampler_module
from engine.worker.sampler import (
    Sampler,
    SamplingMetadata,
    apply_penalties_and_bias,
    apply_top_k_top_p,
    compute_logprobs_tensors,
)

# Ten logits in no particular order, so that "most likely" is not "lowest id".
SMALL_LOGITS = torch.tensor([0.5, 2.0, -0.7, 1.2, -2.0, 0.1, 1.5, -0.3, 0.8, -1.2])


def _per_row(value: float | Sequence[float], batch_size: int, dtype: torch.dtype) -> torch.Tensor:
    values = [value] * batch_size if isinstance(value, (int, float)) else list(value)
    return torch.tensor(values, dtype=dtype)


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
) -> SamplingMetadata:
    """Metadata as the model runner builds it, from scalars (all rows) or per-row values."""
    temperatures = _per_row(temperature, batch_size, torch.float32)
    presence_t = _per_row(presence, batch_size, torch.float32)
    frequency_t = _per_row(frequency, batch_size, torch.float32)
    repetition_t = _per_row(repetition, batch_size, torch.float32)
    prompt = None
    if prompt_token_ids is not None:
        width = max(len(ids) for ids in prompt_token_ids)
        prompt = torch.tensor([ids + [vocab_size] * (width - len(ids)) for ids in prompt_token_ids])
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
        logit_bias=logit_bias,
        max_num_logprobs=max_num_logprobs,
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


@pytest.mark.parametrize("num_candidates", [3, 8, 1024])
@pytest.mark.parametrize("use_top_p", [True, False])
def test_top_k_top_p_keep_the_same_tokens_whatever_the_candidate_count(
        monkeypatch: pytest.MonkeyPatch, num_candidates: int, use_top_p: bool):
    """The partial-top-k head and the full-sort fallback must keep exactly the reference sets."""
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", num_candidates)
    logits = 2 * torch.randn(7, 20, generator=torch.Generator().manual_seed(7))
    top_k = [0, 3, 0, 10, 5, 0, 25]
    top_p = [0.9, 0.8, 1.0, 0.5, 1.0, 0.3, 0.95] if use_top_p else [1.0] * 7
    probs = logits.softmax(dim=-1)
    filtered = apply_top_k_top_p(probs, torch.tensor(top_k),
                                 torch.tensor(top_p) if use_top_p else None)

    for row in range(len(top_k)):
        kept = torch.from_numpy(expected_distribution(logits[row], top_k=top_k[row], top_p=top_p[row]) > 0)
        assert torch.equal(filtered[row] > 0, kept), f"row {row}"
        assert torch.equal(filtered[row][kept], probs[row][kept])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    metadata = make_metadata(1, repetition=2.0, prompt_token_ids=[[0, 1]],
                             output_token_ids=[[2, 2, 3]], vocab_size=6)
    expected = torch.tensor([[1.0, -2.0, 0.25, -1.0, 3.0, 0.0]])
    torch.testing.assert_close(apply_penalties_and_bias(logits, metadata), expected, rtol=0, atol=0)


def test_frequency_and_presence_penalties_count_output_tokens_only():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
                           [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    metadata = make_metadata(2, frequency=[0.5, -0.25], presence=[0.25, 1.0],
                             prompt_token_ids=[[5], [0, 1, 2]], output_token_ids=[[4, 4, 4, 1], [3]],
                             vocab_size=6)
    expected = torch.tensor([[2.0, -1.0 - 0.5 - 0.25, 0.5, -0.5, 3.0 - 3 * 0.5 - 0.25, 0.0],
                             [2.0, -1.0, 0.5, -0.5 + 0.25 - 1.0, 3.0, 0.0]])
    torch.testing.assert_close(apply_penalties_and_bias(logits, metadata), expected, rtol=0, atol=1e-6)


def test_penalties_combine_per_row():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0],
                           [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    metadata = make_metadata(2, repetition=[1.5, 1.0], frequency=[0.1, 0.0], presence=[0.2, 0.0],
                             prompt_token_ids=[[4], [4]], output_token_ids=[[0, 0], [0]], vocab_size=6)
    expected = torch.tensor([[2.0 / 1.5 - 2 * 0.1 - 0.2, -1.0, 0.5, -0.5, 3.0 / 1.5, 0.0],
                             [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
    torch.testing.assert_close(apply_penalties_and_bias(logits, metadata), expected, rtol=0, atol=1e-6)


def test_logit_bias_adds_exactly_before_penalties():
    logits = torch.tensor([[0.5, 1.0, -2.0], [0.5, 1.0, -2.0], [0.5, 1.0, -2.0]])
    metadata = make_metadata(3, repetition=[1.0, 1.0, 2.0], output_token_ids=[[], [], [0]], vocab_size=3,
                             logit_bias=[{0: 1.5, 2: -100.0}, None, {0: -1.0}])
    expected = torch.tensor([[2.0, 1.0, -102.0], [0.5, 1.0, -2.0], [-1.0, 1.0, -2.0]])
    torch.testing.assert_close(apply_penalties_and_bias(logits, metadata), expected, rtol=0, atol=0)


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
    torch.testing.assert_close(apply_penalties_and_bias(logits, metadata), expected, rtol=0, atol=1e-5)


def test_logit_bias_rejects_token_ids_outside_vocab():
    metadata = make_metadata(1, logit_bias=[{10: 1.0}])
    with pytest.raises(ValueError, match="logit_bias"):
        apply_penalties_and_bias(torch.zeros(1, 10), metadata)


def test_no_bias_and_no_penalties_return_logits_untouched():
    logits = torch.randn(2, 10)
    assert apply_penalties_and_bias(logits, make_metadata(2)) is logits


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


def test_sampler_forward_speed_report():
    """Prints forward times for B=64, V=49152 (a report, not an assertion); run with -s.

    Peaked logits (nucleus of ~10 tokens) are settled by the partial top-k;
    flat ones (nucleus of ~25k tokens) send the top-p rows to a full sort.
    """
    batch_size, vocab_size = 64, 49152
    gen = torch.Generator().manual_seed(6)
    prompts = torch.randint(0, vocab_size, (batch_size, 512), generator=gen).tolist()
    outputs = torch.randint(0, vocab_size, (batch_size, 256), generator=gen).tolist()
    greedy_only = make_metadata(batch_size, temperature=0.0, vocab_size=vocab_size)
    all_features = make_metadata(
        batch_size, temperature=[0.0, 0.8] * (batch_size // 2), top_k=[50, 0] * (batch_size // 2),
        top_p=0.9, min_p=0.05, generators={row: torch.Generator().manual_seed(row) for row in range(16)},
        presence=0.5, frequency=0.3, repetition=1.1, prompt_token_ids=prompts,
        output_token_ids=outputs, vocab_size=vocab_size,
        logit_bias=[{t: 1.0 for t in range(10)}] * batch_size, max_num_logprobs=5)
    peaked = 5 * torch.randn(batch_size, vocab_size, generator=gen)
    flat = torch.randn(batch_size, vocab_size, generator=gen)
    cases = {"greedy-only": (peaked, greedy_only), "all features, peaked logits": (peaked, all_features),
             "all features, flat logits": (flat, all_features)}
    sampler = Sampler()
    for name, (logits, metadata) in cases.items():
        sampler(logits, metadata)
        wall, cpu = [], []
        for _ in range(5):
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            sampler(logits, metadata)
            wall.append(time.perf_counter() - start_wall)
            cpu.append(time.process_time() - start_cpu)
        print(f"\nsampler forward B={batch_size} V={vocab_size} {name}: "
              f"wall median {1e3 * sorted(wall)[2]:.1f} ms (min {1e3 * min(wall):.1f}), "
              f"process CPU min {1e3 * min(cpu):.1f} ms")


def test_dense_penalties_used_on_gpu_equal_the_sparse_ones():
    """The GPU path (dense [B, V] counts, no host sync) must give the CPU path's logits."""
    from engine.worker.sampler import _apply_penalties_dense_, _apply_penalties_sparse_

    gen = torch.Generator().manual_seed(3)
    vocab, batch = 50, 6
    outputs = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (0, 1, 5, 17, 3, 40)]
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in (4, 1, 9, 2, 30, 7)]
    metadata = make_metadata(batch, presence=[0.0, 0.5, -1.0, 1.5, 0.2, 2.0], frequency=[0.1, 0.0, 0.7, -0.3, 1.0, 0.4],
                             repetition=[1.0, 1.3, 0.8, 2.0, 1.1, 1.5], prompt_token_ids=prompts,
                             output_token_ids=outputs, vocab_size=vocab)
    logits = torch.randn(batch, vocab, generator=gen) * 3
    sparse, dense = logits.clone(), logits.clone()
    _apply_penalties_sparse_(sparse, metadata)
    _apply_penalties_dense_(dense, metadata)
    torch.testing.assert_close(dense, sparse)
