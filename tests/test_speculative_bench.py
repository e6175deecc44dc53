"""benchmarks/speculative.py without a model: its grounded prompts and its report (the runs need the engine)."""

from __future__ import annotations

from benchmarks.speculative import NGRAM_CONFIG, BenchConfig, grounded_chats, markdown_report


class CharTokenizer:
    """One token per character."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(map(chr, token_ids))


def test_grounded_chats_hold_a_passage_and_ask_for_it_back_with_one_word_changed():
    chats = grounded_chats(CharTokenizer(), 3, passage_len=300)
    assert len(chats) == 3 and len({chat[0]["content"] for chat in chats}) == 3
    for [message] in chats:
        passage, instruction = message["content"].rsplit("\n\n", 1)
        assert message["role"] == "user" and len(passage) == 300
        word = instruction.split('"')[3]
        assert word in passage.split() and f'write "{word.upper()}" instead of "{word}"' in instruction


def test_report_compares_each_scenario_with_and_without_speculation():
    def run(tok_s: float, tpot_ms: float, **spec: float) -> dict:
        return {"output_tok_s": tok_s, "tpot_p50_ms": tpot_ms} | spec

    spec = {"acceptance_rate": 0.5, "mean_acceptance_length": 3.0, "propose_time_share": 0.0012,
            "draft_tokens_per_output_token": 0.25}
    rows = [{"scenario": kind, "concurrency": 16, "num_prompts": 16, "off": run(100.0, 50.0),
             "ngram": run(tok_s, 40.0, **spec), "tok_s_ratio": tok_s / 100.0, "tpot_p50_ratio": 0.8}
            for kind, tok_s in (("grounded", 150.0), ("random", 98.0))]
    config = {"speculative_config": NGRAM_CONFIG, "output_len": BenchConfig.output_len, "repeats": 1,
              "random_temperature": 1.0}
    table = markdown_report({"config": config, "rows": rows})
    assert "| grounded | 16 | 16 | 100.0 | 150.0 | 1.50x | 50.0 | 40.0 | 0.80x | 50% | 3.00 | 0.12% | 0.250 |" in table
    assert "largest slowdown 2.0% (goal < 3%" in table
