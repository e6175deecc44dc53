"""The offline ``LLM`` on real weights: greedy output equals transformers' ``generate``
token for token (fp32, CPU), also under batching, chunked prefill, prefix caching,
preemption and a small ``max_num_seqs``."""

from __future__ import annotations

import gc

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.tiny_models import tiny_hf_model
from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.model.loader import gguf_cache_folder, resolve_model_path

pytestmark = pytest.mark.slow

PROMPT_LENGTHS = [5, 17, 40, 96, 150, 260, 420, 600]
MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based inks and a wooden screw press into a practical system. "
    "Within decades, print shops spread across Europe, books became cheaper, and literacy rose. "
    "Scholars could compare identical copies of texts, which changed how knowledge was checked and "
    "shared. Newspapers, pamphlets and scientific journals followed, and the pace of ideas quickened. "
)


@pytest.fixture(scope="module")
def embedded_folder() -> str:
    """The embedded GGUF converted to an HF folder (what the engine loads too): transformers reads it fast."""
    return gguf_cache_folder(resolve_model_path(None)).path


@pytest.fixture(scope="module")
def tokenizer(embedded_folder):
    return AutoTokenizer.from_pretrained(embedded_folder)


@pytest.fixture(scope="module")
def hf_model(embedded_folder):
    return AutoModelForCausalLM.from_pretrained(embedded_folder, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * 12)
    # Different starting offsets so the prompts share no prefix.
    return [ids[i * 7:i * 7 + n] for i, n in enumerate(PROMPT_LENGTHS)]


def hf_greedy(model, prompt_ids: list[list[int]], max_tokens: int) -> list[list[int]]:
    """transformers' greedy continuations of ``max_tokens`` tokens, through any end-of-sequence token (as
    ``ignore_eos``; ``min_new_tokens`` would instead suppress it, and part from us where it is the argmax)."""
    outputs = []
    for ids in prompt_ids:
        input_ids = torch.tensor([ids])
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        outputs.append(out[0, len(ids):].tolist())
        assert len(outputs[-1]) == max_tokens
    return outputs


@pytest.fixture(scope="module")
def reference(prompts, hf_model) -> list[list[int]]:
    """transformers' greedy continuation of every prompt, one at a time."""
    with torch.inference_mode():
        return hf_greedy(hf_model, prompts, MAX_TOKENS)


def run_llm(prompts, **engine_args):
    llm = LLM(max_model_len=1024, **engine_args)
    try:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
        return llm, [o.outputs[0].token_ids for o in outputs]
    finally:
        gc.collect()


def assert_same_tokens(actual: list[list[int]], expected: list[list[int]]) -> None:
    for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
        assert a == e, f"prompt {i} ({PROMPT_LENGTHS[i]} tokens) diverges at token " \
                       f"{next(k for k, (x, y) in enumerate(zip(a, e, strict=False)) if x != y)}"


def test_batched_greedy_matches_transformers_and_second_pass_hits_prefix_cache(prompts, reference):
    llm, first = run_llm(prompts, kv_cache_memory_bytes="256MiB")
    assert_same_tokens(first, reference)
    stats = llm.engine_core.make_stats()
    queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
    second = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert_same_tokens(second, reference)
    stats = llm.engine_core.make_stats()
    second_queries, second_hits = stats.prefix_cache_queries - queries, stats.prefix_cache_hits - hits
    assert second_hits / second_queries > 0.9


def test_chunked_prefill_matches_transformers(prompts, reference):
    _, actual = run_llm(prompts, long_prefill_token_threshold=64, max_num_batched_tokens=256,
                        kv_cache_memory_bytes="256MiB")
    assert_same_tokens(actual, reference)


# 44 usable blocks = 704 tokens: the first six prompts fill 39 blocks and their decodes need 12 more, so
# running requests must be preempted.
PREEMPTING_BLOCKS = 45


def test_preemption_matches_transformers(prompts, reference):
    llm, actual = run_llm(prompts, num_gpu_blocks_override=PREEMPTING_BLOCKS)
    assert llm.engine_core.make_stats().num_preemptions > 0
    assert_same_tokens(actual, reference)


def test_async_scheduling_matches_transformers_under_chunked_prefill_and_preemption(prompts, reference):
    """Async scheduling (the next step planned while the last one runs) must not change a token: the two
    tests above at once (one run instead of two; the engine's async timelines are tests/test_scheduler.py's)."""
    llm, actual = run_llm(prompts, num_gpu_blocks_override=PREEMPTING_BLOCKS, long_prefill_token_threshold=64,
                          max_num_batched_tokens=256, async_scheduling=True)
    assert llm.engine_core.make_stats().num_preemptions > 0
    assert_same_tokens(actual, reference)


def test_max_num_seqs_3_matches_transformers(prompts, reference):
    _, actual = run_llm(prompts, max_num_seqs=3, kv_cache_memory_bytes="256MiB")
    assert_same_tokens(actual, reference)


def test_bfloat16_greedy_matches_transformers_bfloat16_up_to_near_ties(prompts, embedded_folder):
    """The fast CPU path (bf16 weights, KV cache and packed GEMMs) against transformers in bf16.

    Two bf16 implementations round differently, so exact equality is not the
    bar: a prompt may diverge only where transformers' own top two logits are
    within ``GAP_TOLERANCE`` (a near-tie), as the GPU check judges it too.
    """
    from benchmarks.gpu.greedy_parity import compare_greedy, greedy_verdict

    _, actual = run_llm(prompts, dtype="bfloat16", kv_cache_memory_bytes="256MiB")
    model = AutoModelForCausalLM.from_pretrained(embedded_folder, dtype=torch.bfloat16).eval()
    comparisons = []
    with torch.inference_mode():
        for ids, ours in zip(prompts, actual, strict=True):
            input_ids = torch.tensor([ids])
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS,
                                 min_new_tokens=MAX_TOKENS, do_sample=False, pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
            logits = torch.stack(out.logits)[:, 0].float().numpy()
            comparisons.append(compare_greedy(ours, out.sequences[0, len(ids):].tolist(), logits))
    assert greedy_verdict(comparisons, "bfloat16") == "pass", comparisons


def test_shared_prefix_prompts_match_transformers(tokenizer, hf_model):
    """Prompts sharing a 300-token prefix: later ones start from cached blocks."""
    prefix = tokenizer.encode(TEXT * 4)[:300]
    prompts = [prefix + tokenizer.encode(f" Question {i}: what happened next?") for i in range(4)]
    with torch.inference_mode():
        expected = hf_greedy(hf_model, prompts, 16)
    llm = LLM(max_model_len=1024, kv_cache_memory_bytes="128MiB")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    first = llm.generate(prompts[:1], params, use_tqdm=False)
    rest = llm.generate(prompts[1:], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == expected
    assert all(o.num_cached_tokens == 288 for o in rest)  # 18 full blocks of the shared prefix


def test_chat_answers_paris():
    llm = LLM(max_model_len=1024, kv_cache_memory_bytes="64MiB")
    out = llm.chat([{"role": "user", "content": "What is the capital of France?"}],
                   SamplingParams(temperature=0.0, max_tokens=24), use_tqdm=False)
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


def test_seeded_request_same_alone_and_in_full_batch():
    llm = LLM(max_model_len=512, kv_cache_memory_bytes="64MiB")
    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=12, ignore_eos=True)
    alone = llm.generate("Once upon a time", seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True)
    prompts = ["A recipe for bread:", "Once upon a time", "def main():", "The weather today"] * 2
    params = [others, seeded, others, others, others, others, others, others]
    batch = llm.generate(prompts, params, use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    again = llm.generate(["Once upon a time"], seeded, use_tqdm=False)[0].outputs[0].token_ids
    assert again == alone


# Every architecture is held to transformers' tokens at the model level (tests/test_model.py) and two ranks to one
# (tests/test_tensor_parallel.py); through the engine, a member of each family of decoder layer.
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "mistral", "llama", "gemma3_text", "qwen2_moe", "phi3"])
def test_tiny_architectures_match_transformers_through_llm(model_type, tmp_path, tokenizer):
    hf = tiny_hf_model(model_type, tmp_path, tie_word_embeddings=model_type in ("qwen3", "gemma3_text"))
    tokenizer.save_pretrained(tmp_path)  # any tokenizer will do: prompts are token ids below 256
    prompts = [[(7 * i + 3 * k) % 250 + 3 for k in range(n)] for i, n in enumerate([3, 20, 45, 70])]
    with torch.inference_mode():
        expected = hf_greedy(hf, prompts, 16)
    llm = LLM(str(tmp_path), max_model_len=128, block_size=16, long_prefill_token_threshold=32,
              kv_cache_memory_bytes="8MiB")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    actual = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert actual == expected


# Tiny models whose 8-token windows the prompts outrun: Mistral's on every layer, Qwen2's from layer 1 on
# (``max_window_layers``).
SLIDING_WINDOW_MODELS = {
    "mistral": {"sliding_window": 8},
    "qwen2": {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
}


@pytest.mark.parametrize("attention_backend", ["cpu", "torch"])
@pytest.mark.parametrize("model_type", sorted(SLIDING_WINDOW_MODELS))
def test_sliding_window_models_match_transformers_past_the_window(model_type, attention_backend, tmp_path,
                                                                  tokenizer):
    """Regression: the window was ignored (with a warning) and tokens parted from transformers' past it.
    Prompts of 3-70 tokens, prefilled in chunks of 16; the last prompt shares 40 tokens with another and comes
    after it, so it reads cached blocks (prefix caching); decodes run the fused decode on the cpu backend."""
    hf = tiny_hf_model(model_type, tmp_path, tie_word_embeddings=False, **SLIDING_WINDOW_MODELS[model_type])
    tokenizer.save_pretrained(tmp_path)
    shared = [(5 * k) % 250 + 3 for k in range(40)]
    prompts = [[(7 * i + 3 * k) % 250 + 3 for k in range(n)] for i, n in enumerate([3, 20, 70])]
    prompts += [shared + [9, 10, 11], shared + [12, 13]]
    full_attention = tiny_hf_model(model_type, tmp_path / "full", tie_word_embeddings=False)  # same weights
    with torch.inference_mode():
        expected = hf_greedy(hf, prompts, 24)
        assert hf_greedy(full_attention, prompts[2:3], 24) != expected[2:3]  # the window changes the answer
    llm = LLM(str(tmp_path), max_model_len=128, block_size=16, long_prefill_token_threshold=16,
              kv_cache_memory_bytes="8MiB", attention_backend=attention_backend)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)

    actual = [o.outputs[0].token_ids for o in llm.generate(prompts[:-1], params, use_tqdm=False)]
    actual += [o.outputs[0].token_ids for o in llm.generate(prompts[-1:], params, use_tqdm=False)]

    assert llm.engine_core.make_stats().prefix_cache_hits >= 32
    assert actual == expected


def test_invalid_requests_are_refused_naming_the_field_before_anything_is_queued():
    from pagedserve.engine.errors import InvalidRequestError

    llm = LLM(max_model_len=64, kv_cache_memory_bytes="16MiB")
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for prompts, request_params, param in [([[5, 6, 7], list(range(3, 80))], params, "prompt"),
                                           (["Hi", ""], params, "prompt"),
                                           ([[5, 6, 7]], SamplingParams(max_tokens=62), "max_tokens"),
                                           ([[5, 6, 7]], SamplingParams(logprobs=21), "logprobs"),
                                           # The server's limit, offline too: 10,000 sequences in one batch.
                                           ([[5, 6, 7]], SamplingParams(n=10**4, max_tokens=4), "n")]:
        with pytest.raises(InvalidRequestError) as raised:
            llm.generate(prompts, request_params, use_tqdm=False)
        assert raised.value.param == param
    with pytest.raises(InvalidRequestError) as raised:
        llm.chat([[]], params, use_tqdm=False)  # one conversation, with no messages
    assert raised.value.param == "messages"
    assert not llm.engine_core.has_unfinished_requests() and not llm.output_processor.has_unfinished_requests()
    assert len(llm.generate([[5, 6, 7]], params, use_tqdm=False)[0].outputs[0].token_ids) == 4
    # max_tokens None: all the room the prompt leaves.
    assert len(llm.generate([[5, 6, 7]], SamplingParams(max_tokens=None, ignore_eos=True),
                            use_tqdm=False)[0].outputs[0].token_ids) == 61
