"""The fused decode step (``pagedserve.engine.model.fused_decode``) against the layer-by-layer path it replaces.

On quantized models the fused call runs the same kernels' code with the same
roundings, so its final hidden states and the keys and values it writes must
equal the unfused path's bit for bit, in float32 and bfloat16, and greedy
generation must produce the same tokens. On dense float32 models its products
sum in another order than oneDNN's: it must agree to rounding (and
tests/test_llm.py's greedy parity with transformers runs through it). Where it
does not apply it must do nothing, so the step runs layer by layer.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from benchmarks.quant_error import use_kernel
from benchmarks.step_metadata import build_metadata, step_positions
from benchmarks.tiny_models import tiny_hf_model
from pagedserve.engine.llm import LLM
from pagedserve.engine.model import fused_decode
from pagedserve.engine.model.fused_decode import MAX_DENSE_ROWS, MAX_ROWS, FusedDecoder
from pagedserve.engine.model.loader import load_hf_config, load_model, resolve_model_path
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.worker.model_runner import RESERVED_CORES_MAX_TOKENS

CPU = torch.device("cpu")
BLOCK_SIZE = 16
#: head_dim 32 (the fused call quantizes each head's output by 32-blocks; attention's generic head_dim code).
TINY_SIZES = dict(hidden_size=128, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
#: SmolLM2's shapes in small: head_dim 64 (attention's specialised code), 4 query heads a kv head, an
#: intermediate size of 17 blocks (3 activation spans, the last partial).
SMALL_SIZES = dict(hidden_size=256, intermediate_size=544, num_attention_heads=4, num_key_value_heads=1)


def tiny_model(tmp_path_factory, model_type: str, dtype: torch.dtype, quantization: str | None,
               sizes: dict = TINY_SIZES):
    folder = tmp_path_factory.mktemp(model_type)
    tiny_hf_model(model_type, folder, tie_word_embeddings=False, **sizes)
    source = resolve_model_path(str(folder))
    return load_model(source, load_hf_config(source), dtype, CPU, attn_backend="cpu", block_size=BLOCK_SIZE,
                      quantization=quantization)


def random_step(model, context_lens: list[int], seed: int = 0):
    """A decode step of ``len(context_lens)`` requests over random cached keys and values:
    (input ids, positions, kv caches, the runner's common metadata)."""
    generator = torch.Generator().manual_seed(seed)
    dtype = model.model.norm.weight.dtype
    blocks_each = [-(-(n + 1) // BLOCK_SIZE) for n in context_lens]
    num_blocks = sum(blocks_each) + 2
    kv_caches = [(torch.randn(2, num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim, generator=generator)
                  * 0.5).to(dtype) for _ in range(model.num_layers)]
    ids = np.random.default_rng(seed).permutation(num_blocks - 1)[:sum(blocks_each)] + 1  # block 0 stays unused
    tables = np.split(ids, np.cumsum(blocks_each)[:-1])
    metadata = build_metadata([t.tolist() for t in tables], context_lens, [1] * len(context_lens), BLOCK_SIZE)
    input_ids = torch.randint(3, model.vocab_size, (len(context_lens),), generator=generator)
    positions = torch.from_numpy(step_positions(context_lens, [1] * len(context_lens)))
    return input_ids, positions, kv_caches, metadata


def both_paths(model, context_lens: list[int]):
    """(unfused hidden states and caches, fused hidden states and caches) of one random decode step."""
    input_ids, positions, kv_caches, metadata = random_step(model, context_lens)
    fused = FusedDecoder.build(model)
    assert fused is not None
    with torch.inference_mode():
        expected_caches = [t.clone() for t in kv_caches]
        expected = model(input_ids, positions, expected_caches, model.attn_backend.build_metadata(metadata))
        caches = [t.clone() for t in kv_caches]
        hidden = fused(input_ids, positions, caches, metadata)
    return (expected, expected_caches), (hidden, caches)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("model_type", "quantization", "sizes"), [
    ("llama", "int8", TINY_SIZES), ("qwen2", "int4", TINY_SIZES), ("mistral", "int8", TINY_SIZES),
    ("llama", "int4", SMALL_SIZES), ("mistral", "int8", TINY_SIZES | {"sliding_window": 20})])
def test_fused_step_equals_the_layer_by_layer_step_bit_for_bit(tmp_path_factory, model_type, quantization, sizes,
                                                               dtype) -> None:
    """Batches of 1, 3 and 9 requests with contexts inside one block, across blocks, and over 100 tokens
    (qwen2: biases on q, k and v; a Mistral with a 20-token window: most contexts outrun it)."""
    model = tiny_model(tmp_path_factory, model_type, dtype, quantization, sizes)
    for context_lens in ([0], [5, 37, 100], [1, 2, 15, 16, 17, 40, 63, 64, 130]):
        (expected, expected_caches), (hidden, caches) = both_paths(model, context_lens)
        assert hidden is not None
        assert torch.equal(hidden, expected), (context_lens, (hidden.float() - expected.float()).abs().max())
        for layer, (got, want) in enumerate(zip(caches, expected_caches, strict=True)):
            assert torch.equal(got, want), (context_lens, layer)


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_dense_fused_step_agrees_with_the_layer_by_layer_step_to_rounding(tmp_path_factory, model_type) -> None:
    """float32 hidden states and cache writes within 1e-5 relative (sums in another order than oneDNN's)."""
    model = tiny_model(tmp_path_factory, model_type, torch.float32, None)
    for context_lens in ([0], [5, 37, 100], [1, 16, 40, 130][:MAX_DENSE_ROWS]):
        (expected, expected_caches), (hidden, caches) = both_paths(model, context_lens)
        assert hidden is not None
        torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
        for got, want in zip(caches, expected_caches, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_dense_model_keeps_plain_weights_only_where_the_fused_decode_reads_them(tmp_path_factory) -> None:
    """The plain copies beside oneDNN's packed weights cost the weights' memory again: the decoder's
    projections keep them when the fused decode runs, the LM head never, a model it does not run (Qwen3,
    dense bfloat16) none."""
    llama = tiny_model(tmp_path_factory, "llama", torch.float32, None)
    assert llama._fused_decoder is not None and not llama._fused_decoder.quantized
    projections = [m for layer in llama.model.layers for m in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                                               layer.mlp.gate_up_proj, layer.mlp.down_proj)]
    assert all(m.plain_weight is not None for m in projections)
    assert llama.lm_head.plain_weight is None
    for model_type, dtype in (("qwen3", torch.float32), ("llama", torch.bfloat16)):
        model = tiny_model(tmp_path_factory, model_type, dtype, None)
        assert model._fused_decoder is None
        assert all(getattr(m, "plain_weight", None) is None for m in model.modules())


def test_where_it_does_not_apply_it_does_nothing(tmp_path_factory, monkeypatch) -> None:
    model = tiny_model(tmp_path_factory, "llama", torch.float32, "int8")
    fused = FusedDecoder.build(model)
    input_ids, positions, kv_caches, metadata = random_step(model, [3, 4])
    before = [t.clone() for t in kv_caches]
    # A position beyond the rotary table: None, and no cache written.
    beyond = positions.clone()
    beyond[1] = model.model.rotary_emb.cos_sin.shape[0]
    assert fused(input_ids, beyond, kv_caches, metadata) is None
    assert all(torch.equal(a, b) for a, b in zip(kv_caches, before, strict=True))
    # A cache of another dtype than the activations.
    assert fused(input_ids, positions, [t.to(torch.bfloat16) for t in kv_caches], metadata) is None
    # The quantized layers set to dequantize and multiply (benchmarks.quant_error.use_kernel).
    use_kernel(model, False)
    assert fused(input_ids, positions, kv_caches, metadata) is None
    use_kernel(model, True)
    assert fused(input_ids, positions, kv_caches, metadata) is not None
    # More rows than the quantized kernel takes; for a dense model, more than it runs faster than oneDNN.
    assert fused(*random_step(model, [3] * (MAX_ROWS + 1))) is None
    dense = tiny_model(tmp_path_factory, "llama", torch.float32, None)
    assert dense._fused_decoder(*random_step(dense, [3] * (MAX_DENSE_ROWS + 1))) is None
    # The switch off.
    monkeypatch.setenv("PAGEDSERVE_FUSED_DECODE", "0")
    assert FusedDecoder.build(model) is None


@pytest.mark.parametrize(("model_type", "dtype", "quantization", "reason"), [
    ("qwen3", torch.float32, "int8", "no query and key norms"),
    ("llama", torch.bfloat16, None, "dense weights in float32 only"),
    ("mixtral", torch.float32, "int8", "not mixtures of experts"),  # its experts quantized, layer by layer
])
def test_models_it_does_not_run_say_why(tmp_path_factory, caplog, model_type, dtype, quantization, reason) -> None:
    with caplog.at_level("INFO", logger=fused_decode.__name__):
        model = tiny_model(tmp_path_factory, model_type, dtype, quantization)
    assert model._fused_decoder is None
    assert reason in caplog.text


# --- the embedded SmolLM2 with --quantization gguf ------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_llm():
    llm = LLM(quantization="gguf", max_model_len=512, kv_cache_memory_bytes="32MiB")
    yield llm
    del llm
    gc.collect()


def test_smollm2_gguf_greedy_tokens_are_the_same_fused_or_not(gguf_llm) -> None:
    """Four prompts decoded together (the batch shrinks as they finish), each 40 tokens."""
    model = gguf_llm.engine_core.executor.worker.model
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,",
               "List three colours:"]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (40, 31, 22, 13)]

    def generate() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in gguf_llm.generate(prompts, params, use_tqdm=False)]

    fused = model._fused_decoder
    assert fused is not None
    model._fused_decoder = None
    expected = generate()
    model._fused_decoder = fused
    statuses = []  # every call the runner made into the fused kernel, and what it returned
    kernel = fused._forward
    fused._forward = lambda *args: statuses.append(kernel(*args)) or statuses[-1]
    try:
        assert generate() == expected
    finally:
        fused._forward = kernel
    # Every decode step: 39 of the longest request (its first token comes from the prefill).
    assert len(statuses) == 39 and set(statuses) == {0}


def test_small_steps_leave_the_reserved_cores_to_the_frontend(gguf_llm, monkeypatch) -> None:
    """With ``cpu_reserved_cores`` (a server's default), decode steps of at most RESERVED_CORES_MAX_TOKENS
    requests run their forward and logits on ``small_step_threads``; larger steps on all of them, and the count
    is back after each step. (The fused kernel shares torch's OpenMP runtime, so torch's count is its team.)"""
    runner = gguf_llm.engine_core.executor.worker.model_runner
    model = runner.model
    assert runner.reserved_cores == 0 and runner.small_step_threads is None  # offline: every core
    monkeypatch.setattr(runner, "small_step_threads", 2)  # a server's on 3 cores
    before = torch.get_num_threads()
    torch.set_num_threads(3)
    seen: list[tuple[str, int, int]] = []  # (what, tokens, threads)
    forward, logits = model.decode_forward, model.compute_logits
    monkeypatch.setattr(model, "decode_forward", lambda input_ids, *args: seen.append(
        ("forward", len(input_ids), torch.get_num_threads())) or forward(input_ids, *args))
    monkeypatch.setattr(model, "compute_logits", lambda hidden: seen.append(
        ("logits", len(hidden), torch.get_num_threads())) or logits(hidden))
    lengths = (9, 8, 7, 6, 5, 4)  # 6 requests decoding, then 5, 4, ... 1
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
    try:
        gguf_llm.generate([f"Count to {n}:" for n in lengths], params, use_tqdm=False)
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(before)
    # A decode step calls the fused forward, then the logits; the prefill step (more tokens) only the logits.
    assert seen[0][0] == "logits" and seen[0][2] == 3
    steps = list(zip(seen[1::2], seen[2::2], strict=True))
    assert sorted({forward[1] for forward, _ in steps}) == [1, 2, 3, 4, 5, 6]
    for forward, logits in steps:
        assert forward[0] == "forward" and logits[0] == "logits"
        assert forward[2] == logits[2] == (2 if forward[1] <= RESERVED_CORES_MAX_TOKENS else 3), seen
