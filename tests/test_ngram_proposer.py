"""Prompt lookup drafts (``NgramProposer``) and the ``speculative_config`` setting that turns them on."""

from __future__ import annotations

import json
import random
from array import array
from types import SimpleNamespace

import pytest

from pagedserve.engine.config import EngineArgs, SpeculativeConfig
from pagedserve.engine.core import ngram_proposer
from pagedserve.engine.core.ngram_proposer import NgramProposer
from pagedserve.server.cli import build_parser, main
from pagedserve.server.cli_args import resolve_settings


def naive_propose(tokens: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """The rule written out: longest suffix first, then its latest earlier start, then up to k tokens after it."""
    for n in range(min(lookup_max, len(tokens) - 1), lookup_min - 1, -1):
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[len(tokens) - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_longest_suffix_wins_over_a_more_recent_shorter_one():
    #            3-gram 7 8 9 at 0, followed by 1 2;  2-gram 8 9 again at 6, followed by 5
    tokens = [7, 8, 9, 1, 2, 0, 8, 9, 5, 7, 8, 9]
    assert NgramProposer(2, 2, 3).propose(tokens) == [1, 2]
    assert NgramProposer(2, 2, 2).propose(tokens) == [5, 7]  # only 2-grams: the latest one


def test_the_most_recent_occurrence_is_used():
    tokens = [1, 2, 10, 1, 2, 20, 1, 2, 30, 1, 2]
    assert NgramProposer(1, 2, 2).propose(tokens) == [30]


def test_min_and_max_bound_the_suffix_length():
    tokens = [4, 5, 6, 1, 9, 9, 4, 5, 6]  # 4 5 6 occurred before; no longer suffix did
    assert NgramProposer(3, 4, 5).propose(tokens) == []  # needs at least 4 matching tokens
    assert NgramProposer(3, 3, 5).propose(tokens) == [1, 9, 9]
    assert NgramProposer(3, 1, 1).propose(tokens) == [1, 9, 9]  # the 1-gram 6, at index 2


def test_no_match_and_too_short_sequences_propose_nothing():
    assert NgramProposer(4, 1, 3).propose([1, 2, 3, 4, 5]) == []
    assert NgramProposer(4, 2, 3).propose([]) == NgramProposer(4, 2, 3).propose([1, 1]) == []


def test_drafts_are_capped_at_k_and_at_the_end_of_the_sequence():
    tokens = list(range(10)) + [0, 1]
    assert NgramProposer(3, 2, 2).propose(tokens) == [2, 3, 4]
    assert NgramProposer(30, 2, 2).propose(tokens) == list(range(2, 10)) + [0, 1]
    assert NgramProposer(4, 1, 1).propose([5, 5, 5]) == [5]  # the overlapping match at index 1


def test_large_token_ids_never_match_across_token_boundaries():
    # Packed as 4 bytes each, the suffix 0x00000100 0x00000001 also occurs 1 byte off inside [65536, 256, 0]:
    # only whole-token matches count.
    tokens = [65536, 256, 0, 7, 256, 1]
    assert NgramProposer(2, 2, 2).propose(tokens) == []
    assert NgramProposer(2, 2, 2).propose(tokens + [9, 256, 1]) == [9, 256]


def test_matches_the_rule_on_random_sequences():
    rng = random.Random(0)
    for _ in range(2000):
        tokens = [rng.randrange(rng.choice([2, 4, 50_000])) for _ in range(rng.randrange(40))]
        k, lookup_min = rng.randrange(1, 6), rng.randrange(1, 4)
        lookup_max = lookup_min + rng.randrange(4)
        expected = naive_propose(tokens, k, lookup_min, lookup_max)
        assert NgramProposer(k, lookup_min, lookup_max).propose(tokens) == expected, (tokens, k, lookup_min)


class _CountedBytes(bytes):
    """Packed tokens that count the searches made in them."""

    searches = 0

    def rfind(self, *args: object) -> int:
        self.searches += 1
        return super().rfind(*args)


def test_a_4k_token_lookup_is_one_search_per_suffix_length(monkeypatch):
    """One pass over the sequence per n (a C search of the packed tokens), not a Python loop over every
    earlier window. What a call costs is measured, not tested: ``benchmarks/speculative.py`` reports the
    drafter's share of a run's time."""
    packed: list[_CountedBytes] = []

    def counted_array(typecode: str, token_ids: list[int]) -> SimpleNamespace:
        packed.append(_CountedBytes(array(typecode, token_ids).tobytes()))
        return SimpleNamespace(tobytes=lambda: packed[-1])

    monkeypatch.setattr(ngram_proposer, "array", counted_array)
    rng = random.Random(1)
    tokens = [rng.randrange(49152) for _ in range(4096)]
    assert NgramProposer(4, 2, 5).propose(tokens) == []  # no match: every n from 5 down to 2 searches
    assert [each.searches for each in packed] == [4]


@pytest.mark.parametrize("value, message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, r"speculative_config.method must be one of \('ngram',\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "speculative_config: unknown keys lookahead"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens is required"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": True}, "speculative_config.num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
     r"speculative_config.prompt_lookup_min \(4\) must be <= prompt_lookup_max \(3\)"),
    ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": -1},
     "speculative_config.disable_by_batch_size must be"),
    ("{'method': 'ngram'}", "speculative_config is not valid JSON"),
    ("[4]", "speculative_config must be a JSON object"),
])
def test_bad_speculative_configs_are_refused_naming_the_field(value, message):
    with pytest.raises(ValueError, match=message):
        EngineArgs(speculative_config=value)


def test_json_and_mapping_resolve_alike_with_vllm_defaults():
    given = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5,
             "disable_by_batch_size": 8}
    assert EngineArgs(speculative_config=json.dumps(given)).speculative_config == given
    assert SpeculativeConfig.from_dict(given) == SpeculativeConfig("ngram", 4, 2, 5, 8)
    # As vLLM: an unset bound equals the other, both unset = 5.
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3}) == SpeculativeConfig(
        "ngram", 3, 5, 5, None)
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
                                       ).prompt_lookup_min == 3
    assert SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2}
                                       ).prompt_lookup_max == 2


def test_the_yaml_file_takes_a_mapping_and_the_flag_json(tmp_path):
    config = tmp_path / "spec.yaml"
    config.write_text("speculative_config: {method: ngram, num_speculative_tokens: 3, prompt_lookup_max: 4}\n")
    engine_args, _ = resolve_settings(build_parser().parse_args(["serve", "--config", str(config)]))
    assert engine_args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}
    flag = '{"method": "ngram", "num_speculative_tokens": 2}'  # overrides the file's, as every flag does
    engine_args, _ = resolve_settings(build_parser().parse_args(["serve", "--config", str(config),
                                                                 "--speculative-config", flag]))
    assert engine_args.speculative_config == {"method": "ngram", "num_speculative_tokens": 2}


def test_a_bad_speculative_config_flag_exits_2_with_one_line(capsys):
    assert main(["serve", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": -4}']) == 2
    error = capsys.readouterr().err
    assert error.startswith("pagedserve serve: error: speculative_config.num_speculative_tokens must be")
    assert error.count("\n") == 1
