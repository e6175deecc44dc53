"""The torch and CPU attention backends and the CPU kernels against a float64 reference (softmax over an
explicit causal mask, one request at a time); the backends' declared contracts (devices, CUDA graphs,
metadata)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.step_metadata import build_metadata
from pagedserve.engine.model.attention import (
    AttentionMetadata,
    attention_backends_for,
    check_attention_backend,
    get_attention_backend,
)
from pagedserve.engine.model.torch_attention import TorchAttentionBackend

NUM_KV_HEADS = 2
HEAD_DIM = 32

# name -> (query_lens, context_lens); lengths chosen to end mid-block for both block sizes.
SCENARIOS = {
    "decode_only": ([1, 1, 1, 1], [5, 16, 47, 70]),
    "prefill_only": ([7, 33, 16], [0, 0, 0]),
    "mixed": ([1, 12, 1, 5, 1], [20, 0, 47, 0, 1]),
    "chunked_prefill_with_context": ([10, 16, 3], [16, 37, 5]),
}


def make_step(query_lens: list[int], context_lens: list[int], num_heads: int, block_size: int, seed: int = 0,
              head_dim: int = HEAD_DIM
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata,
                         list[tuple[torch.Tensor, torch.Tensor]]]:
    """A step whose request i runs ``query_lens[i]`` tokens after ``context_lens[i]`` cached ones.

    Blocks are handed out in shuffled order (the same for every ``seed``), so
    no request's blocks are contiguous. Slots holding no context keep large
    random values, which a backend reading past a sequence would turn into
    visibly wrong output. ``seed`` draws the tensors.

    Returns:
        query ``[T, H, D]``, key and value ``[T, Hkv, D]``, the cache, the
        metadata, and each request's full float64 (keys, values) ``[seq_len, Hkv, D]``.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [q + c for q, c in zip(query_lens, context_lens, strict=True)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(blocks_per_req) + 4
    ids = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).tolist()
    tables = []
    for n in blocks_per_req:
        tables.append(ids[:n])
        ids = ids[n:]
    kv_cache = torch.randn(2, num_blocks, block_size, NUM_KV_HEADS, head_dim, generator=gen) * 100
    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    key = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen)
    value = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen)
    full_kv, start = [], 0
    for table, context, n in zip(tables, context_lens, query_lens, strict=True):
        context_kv = torch.randn(2, context, NUM_KV_HEADS, head_dim, generator=gen)
        for pos in range(context):
            kv_cache[:, table[pos // block_size], pos % block_size] = context_kv[:, pos]
        full_kv.append((torch.cat([context_kv[0], key[start:start + n]]).double(),
                        torch.cat([context_kv[1], value[start:start + n]]).double()))
        start += n
    metadata = build_metadata(tables, context_lens, query_lens, block_size)
    return query, key, value, kv_cache, metadata, full_kv


def run_backend(name: str, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                common: AttentionMetadata, scale: float, sliding_window: int | None = None) -> torch.Tensor:
    """One layer of one step, the way the model runner drives a backend: build the metadata, then forward."""
    backend = get_attention_backend(name, kv_cache.shape[2])
    return backend.forward(query, key, value, kv_cache, backend.build_metadata(common), scale, sliding_window)


def reference_attention(query: torch.Tensor, query_lens: list[int], full_kv: list, scale: float,
                        sliding_window: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal GQA attention in float64, one request at a time: its query ``i`` after ``context`` cached tokens
    sees keys ``0..context + i``, or the last ``sliding_window`` of them; scores soft-capped at ``softcap``."""
    out = torch.empty_like(query, dtype=torch.float64)
    group = query.shape[1] // NUM_KV_HEADS
    start = 0
    for n, (keys, values) in zip(query_lens, full_kv, strict=True):
        context = len(keys) - n
        k = keys.repeat_interleave(group, dim=1)                  # [seq_len, H, D]
        v = values.repeat_interleave(group, dim=1)
        q = query[start:start + n].double()                       # [n, H, D]
        positions = torch.arange(context, context + n)[:, None]
        visible = torch.arange(len(keys))[None, :] <= positions
        if sliding_window is not None:
            visible &= torch.arange(len(keys))[None, :] > positions - sliding_window
        scores = torch.einsum("nhd,khd->hnk", q, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        out[start:start + n] = torch.einsum("hnk,khd->nhd", probs, v)
        start += n
    return out


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_backend_matches_reference(scenario: str, queries_per_kv: int, block_size: int, backend: str) -> None:
    query_lens, context_lens = SCENARIOS[scenario]
    query, key, value, kv_cache, metadata, full_kv = make_step(
        query_lens, context_lens, NUM_KV_HEADS * queries_per_kv, block_size)
    scale = HEAD_DIM ** -0.5

    out = run_backend(backend, query, key, value, kv_cache, metadata, scale)

    expected = reference_attention(query, query_lens, full_kv, scale)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


# A window of one token (each query sees itself alone), windows ending mid-block, and one longer than some
# of the sequences.
@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("sliding_window", [1, 7, 20, 50])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_backend_with_a_sliding_window_matches_reference(scenario: str, sliding_window: int, backend: str) -> None:
    query_lens, context_lens = SCENARIOS[scenario]
    query, key, value, kv_cache, metadata, full_kv = make_step(query_lens, context_lens, NUM_KV_HEADS * 3, 16)
    scale = HEAD_DIM ** -0.5

    out = run_backend(backend, query, key, value, kv_cache, metadata, scale, sliding_window)

    expected = reference_attention(query, query_lens, full_kv, scale, sliding_window)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_backend_with_soft_capped_scores_matches_reference(scenario: str, sliding_window: int | None,
                                                           backend: str) -> None:
    """Gemma 2's ``cap * tanh(s / cap)`` of each scaled score; a cap of 2 bends the test's scores (about +-6)."""
    query_lens, context_lens = SCENARIOS[scenario]
    query, key, value, kv_cache, common, full_kv = make_step(query_lens, context_lens, NUM_KV_HEADS * 3, 16)
    scale = HEAD_DIM ** -0.5
    backend_ = get_attention_backend(backend, 16, logit_softcap=2.0)

    out = backend_.forward(query, key, value, kv_cache, backend_.build_metadata(common), scale, sliding_window)

    expected = reference_attention(query, query_lens, full_kv, scale, sliding_window, softcap=2.0)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, reference_attention(query, query_lens, full_kv, scale, sliding_window))


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("queries_per_kv", [1, 3])
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_backend_in_bfloat16_matches_reference(scenario: str, queries_per_kv: int, backend: str) -> None:
    """A bf16 cache and activations: the reference sees the same bf16-rounded inputs, in float64."""
    query_lens, context_lens = SCENARIOS[scenario]
    step = make_step(query_lens, context_lens, NUM_KV_HEADS * queries_per_kv, 16)
    query, key, value, kv_cache = (t.bfloat16() for t in step[:4])
    metadata, context_kv = step[4], step[5]
    full_kv, start = [], 0
    for (keys, values), n in zip(context_kv, query_lens, strict=True):
        context = len(keys) - n
        full_kv.append((torch.cat([keys[:context].bfloat16().double(), key[start:start + n].double()]),
                        torch.cat([values[:context].bfloat16().double(), value[start:start + n].double()])))
        start += n
    scale = HEAD_DIM ** -0.5

    out = run_backend(backend, query, key, value, kv_cache, metadata, scale)

    assert out.dtype == torch.bfloat16
    expected = reference_attention(query, query_lens, full_kv, scale)
    torch.testing.assert_close(out.double(), expected, rtol=1.6e-2, atol=1e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens", [[3, 1], [1, 1]], ids=["mixed", "decode-only"])
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_step_keys_and_values_land_in_their_slots(backend: str, query_lens: list[int], dtype: torch.dtype,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Also where the CPU kernel writes them itself (a decode-only step: the torch plan must not run), from
    views of a wider tensor as the model hands them over (its QKV output)."""
    from pagedserve.engine.model.cpu_attention import load_kernel

    query, key, value, kv_cache, metadata, _ = make_step(query_lens, [0, 20], NUM_KV_HEADS * 2, 16)
    query, kv_cache = query.to(dtype), kv_cache.to(dtype)
    heads = query.shape[1]
    qkv = torch.cat([query, key, value], dim=1).to(dtype)
    key, value = qkv[:, heads:heads + NUM_KV_HEADS], qkv[:, heads + NUM_KV_HEADS:]
    if backend == "cpu" and query_lens == [1, 1]:
        assert load_kernel() is not None
        monkeypatch.setattr(TorchAttentionBackend, "run", lambda *args: pytest.fail("the torch plan ran"))

    run_backend(backend, query, key, value, kv_cache, metadata, 1.0)

    slots = kv_cache.view(2, -1, NUM_KV_HEADS, HEAD_DIM)[:, metadata.slot_mapping]
    torch.testing.assert_close(slots, torch.stack([key, value]), rtol=0, atol=0)


@pytest.mark.parametrize("backend_name", ["torch", "cpu"])
def test_one_backend_serves_every_layer_of_a_step(backend_name: str) -> None:
    """The step's metadata is built once; each layer still reads its own cache."""
    query_lens, context_lens = SCENARIOS["mixed"]
    backend = get_attention_backend(backend_name, 16)
    first = make_step(query_lens, context_lens, 4, 16, seed=1)
    second = make_step(query_lens, context_lens, 4, 16, seed=2)
    metadata = backend.build_metadata(first[4])  # same layout, so one metadata object serves both "layers"

    for query, key, value, kv_cache, _, full_kv in (first, second):
        out = backend.forward(query, key, value, kv_cache, metadata, 0.25)
        torch.testing.assert_close(out.double(), reference_attention(query, query_lens, full_kv, 0.25),
                                   rtol=1e-5, atol=1e-5)


def test_padding_rows_past_the_actual_tokens_are_zero() -> None:
    """Rows a runner pads the batch with (e.g. for CUDA graphs) come back as zeros."""
    query_lens, context_lens = SCENARIOS["decode_only"]
    query, key, value, kv_cache, metadata, full_kv = make_step(query_lens, context_lens, 4, 16)
    pad = torch.zeros(2, *query.shape[1:])
    padded_kv = torch.zeros(2, *key.shape[1:])

    out = run_backend("torch", torch.cat([query, pad]), torch.cat([key, padded_kv]), torch.cat([value, padded_kv]),
                      kv_cache, metadata, 0.5)

    expected = reference_attention(query, query_lens, full_kv, 0.5)
    torch.testing.assert_close(out[:len(query)].double(), expected, rtol=1e-5, atol=1e-5)
    assert not out[len(query):].any()


def test_torch_metadata_splits_decodes_from_prefill_chunks() -> None:
    """``build_metadata`` plans the step once: decode rows and their blocks, one entry per prefill chunk."""
    query_lens, context_lens = SCENARIOS["mixed"]  # decodes are requests 0, 2 and 4
    common = make_step(query_lens, context_lens, 4, 16)[4]

    metadata = get_attention_backend("torch", 16).build_metadata(common)

    assert metadata.slot_mapping is common.slot_mapping and metadata.num_reqs == common.num_reqs
    assert not metadata.all_decode
    assert metadata.decodes.rows.tolist() == [0, 13, 19]
    assert metadata.decodes.seq_lens.tolist() == [21, 48, 2]
    assert metadata.decodes.blocks.numel() == 3 * 3  # padded to the longest decode: 48 tokens, 3 blocks each
    assert [(c.start, c.end, c.blocks is None) for c in metadata.prefills] == [(1, 13, True), (14, 19, True)]
    batch = metadata.prefill_batch  # the same chunks as the CPU prefill kernel reads them
    assert (batch.row_starts.tolist(), batch.query_lens.tolist(), batch.seq_lens.tolist()) == ([1, 14], [12, 5],
                                                                                             [12, 5])
    assert batch.block_table.dtype == torch.int32 and batch.block_table.is_contiguous()
    torch.testing.assert_close(batch.block_table, common.block_table[[1, 3]])


def test_backend_refuses_a_cache_with_other_blocks_than_it_was_built_for() -> None:
    query, key, value, kv_cache, metadata, _ = make_step([1, 1], [5, 20], NUM_KV_HEADS, 16)
    backend = get_attention_backend("torch", 32)
    with pytest.raises(ValueError, match="blocks of 16 tokens"):
        backend.forward(query, key, value, kv_cache, backend.build_metadata(metadata), 1.0)


def test_backends_declare_their_devices_and_cuda_graph_support() -> None:
    from pagedserve.engine.model.cpu_attention import CpuAttentionBackend
    from pagedserve.engine.model.torch_attention import TorchAttentionBackend
    from pagedserve.engine.model.triton_attention import TritonAttentionBackend

    assert {"cpu", "torch"} <= set(attention_backends_for("cpu"))
    assert attention_backends_for(torch.device("cuda")) == ["torch", "triton"]
    assert (TorchAttentionBackend.supports_cuda_graphs, CpuAttentionBackend.supports_cuda_graphs,
            TritonAttentionBackend.supports_cuda_graphs) == (False, False, True)
    check_attention_backend("cpu", "cpu")
    check_attention_backend("torch", "cuda")
    check_attention_backend("triton", "cuda")


def test_a_backend_on_a_device_it_does_not_run_on_is_refused_naming_the_setting() -> None:
    with pytest.raises(ValueError, match=r"attention_backend 'cpu' does not run on cuda.*\['torch', 'triton'\]"):
        check_attention_backend("cpu", "cuda")
    with pytest.raises(ValueError, match=r"attention_backend 'flash' is unknown.*'cpu', .*'torch'"):
        check_attention_backend("flash", "cpu")


@pytest.mark.parametrize("sliding_window", [None, 21])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128])  # the kernel's compile-time specialisations
@pytest.mark.parametrize("num_decodes", [1, 5])  # fewer requests than threads: split by kv head
def test_cpu_decode_kernel_at_real_head_dims(num_decodes: int, head_dim: int, dtype: torch.dtype,
                                             sliding_window: int | None) -> None:
    from pagedserve.engine.model.cpu_attention import paged_decode_attention

    context_lens = [5, 40, 16, 33, 70][:num_decodes]
    query, key, value, kv_cache, metadata, full_kv = make_step([1] * num_decodes, context_lens, NUM_KV_HEADS * 3,
                                                               16, head_dim=head_dim)
    kv_cache.view(2, -1, NUM_KV_HEADS, head_dim)[:, metadata.slot_mapping] = torch.stack([key, value])
    query, kv_cache = query.to(dtype), kv_cache.to(dtype)
    full_kv = [(k.to(dtype).double(), v.to(dtype).double()) for k, v in full_kv]
    out = paged_decode_attention(query, kv_cache, metadata.block_table, metadata.seq_lens + 0, head_dim ** -0.5,
                                 sliding_window=sliding_window)
    expected = reference_attention(query, [1] * num_decodes, full_kv, head_dim ** -0.5, sliding_window)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


def test_cpu_decode_kernel_refuses_shapes_beyond_its_buffers() -> None:
    """256 query heads of 32 channels fit the query buffer but not the per-head softmax state."""
    from pagedserve.engine.model.cpu_attention import paged_decode_attention

    query = torch.randn(1, 256, 32)
    kv_cache = torch.zeros(2, 2, 16, 16, 32)
    out = paged_decode_attention(query, kv_cache, torch.zeros(1, 1, dtype=torch.int32),
                                 torch.ones(1, dtype=torch.int32), 1.0)
    assert out is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_decode_kernel_compiles_and_is_used(dtype: torch.dtype) -> None:
    """The C kernel must really run here for both cache dtypes, not silently fall back to torch."""
    from pagedserve.engine.model.cpu_attention import load_kernel, paged_decode_attention

    assert load_kernel() is not None
    query, _, _, kv_cache, metadata, _ = make_step([1, 1], [5, 40], NUM_KV_HEADS * 3, 16)
    out = paged_decode_attention(query.to(dtype), kv_cache.to(dtype), metadata.block_table, metadata.seq_lens + 0,
                                 0.1)
    assert out is not None and out.shape == query.shape and out.dtype == dtype


# Chunks longer than one query tile of the kernel for every group below (192 / group tokens), ending
# mid-tile and mid-block, after no context, a short one and one longer than a key tile (64).
PREFILL_KERNEL_STEP = ([200, 7, 70], [0, 37, 130])


def check_prefill_kernel(queries_per_kv: int, head_dim: int, dtype: torch.dtype, amx: bool,
                         extra_flags: tuple[str, ...] = (), sliding_window: int | None = None) -> None:
    """The prefill kernel on ``PREFILL_KERNEL_STEP`` against ``reference_attention``."""
    from pagedserve.engine.model.cpu_attention import paged_prefill_attention, prefill_kernel_amx

    query_lens, context_lens = PREFILL_KERNEL_STEP
    query, key, value, kv_cache, common, full_kv = make_step(query_lens, context_lens,
                                                             NUM_KV_HEADS * queries_per_kv, 16, head_dim=head_dim)
    kv_cache.view(2, -1, NUM_KV_HEADS, head_dim)[:, common.slot_mapping] = torch.stack([key, value])
    # The model hands over a view of its QKV output: heads contiguous, tokens further apart.
    qkv = torch.cat([query, torch.full_like(query[:, :NUM_KV_HEADS], 1e4)], dim=1).to(dtype)
    query, kv_cache = qkv[:, :query.shape[1]], kv_cache.to(dtype)
    full_kv = [(k.to(dtype).double(), v.to(dtype).double()) for k, v in full_kv]
    prefills = get_attention_backend("cpu", 16).build_metadata(common).prefill_batch
    if amx and not prefill_kernel_amx():
        pytest.skip("this CPU has no AMX")
    try:
        prefill_kernel_amx(amx)
        out = paged_prefill_attention(query, kv_cache, prefills, head_dim ** -0.5, extra_flags, sliding_window)
    finally:
        prefill_kernel_amx(True)
    assert out is not None and out.dtype == dtype  # the kernel ran: no silent torch fallback
    expected = reference_attention(query, query_lens, full_kv, head_dim ** -0.5, sliding_window)
    # bf16: the output's own rounding (2^-9 relative), plus on AMX the probabilities' (measured 4e-3 abs).
    tolerance = 2e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(("dtype", "amx"), [pytest.param(torch.float32, False, id="float32"),
                                           pytest.param(torch.bfloat16, False, id="bfloat16-avx"),
                                           pytest.param(torch.bfloat16, True, id="bfloat16-amx")])
@pytest.mark.parametrize(("queries_per_kv", "head_dim"), [(1, 64), (3, 64), (4, 128)])
def test_cpu_prefill_kernel_matches_reference(queries_per_kv: int, head_dim: int, dtype: torch.dtype,
                                              amx: bool) -> None:
    """FlashAttention-style tiles over the paged cache against float64 softmax attention, causal from each
    chunk's offset: shuffled (non-contiguous) blocks, grouped query heads, chunks of several tiles."""
    check_prefill_kernel(queries_per_kv, head_dim, dtype, amx)


@pytest.mark.parametrize(("dtype", "amx"), [pytest.param(torch.float32, False, id="float32"),
                                           pytest.param(torch.bfloat16, False, id="bfloat16-avx"),
                                           pytest.param(torch.bfloat16, True, id="bfloat16-amx")])
@pytest.mark.parametrize("sliding_window", [1, 50, 100])
def test_cpu_prefill_kernel_with_a_sliding_window_matches_reference(sliding_window: int, dtype: torch.dtype,
                                                                    amx: bool) -> None:
    """Windows narrower than a key tile (64), so that a query tile's first key tile hides every key from
    its later rows, and wider: tiles masked at the window's edge as well as at the diagonal."""
    check_prefill_kernel(3, 64, dtype, amx, sliding_window=sliding_window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_cpu_prefill_kernel_built_for_an_avx2_only_cpu(dtype: torch.dtype) -> None:
    """-march=haswell: 8-float vectors and no AMX, the code an AVX2 machine compiles (with and without a
    sliding window)."""
    check_prefill_kernel(3, 64, dtype, amx=False, extra_flags=("-march=haswell",))
    check_prefill_kernel(3, 64, dtype, amx=False, extra_flags=("-march=haswell",), sliding_window=50)


def test_cpu_prefill_kernel_refuses_shapes_it_lacks_and_the_backend_falls_back() -> None:
    """head_dim 36 is not a multiple of 8: the kernel declines and the torch path answers."""
    from pagedserve.engine.model.cpu_attention import paged_prefill_attention

    query_lens, context_lens = SCENARIOS["chunked_prefill_with_context"]
    query, key, value, kv_cache, common, full_kv = make_step(query_lens, context_lens, NUM_KV_HEADS * 2, 16,
                                                             head_dim=36)
    backend = get_attention_backend("cpu", 16)
    metadata = backend.build_metadata(common)
    assert paged_prefill_attention(query, kv_cache, metadata.prefill_batch, 1 / 6) is None

    out = backend.forward(query, key, value, kv_cache, metadata, 1 / 6)

    torch.testing.assert_close(out.double(), reference_attention(query, query_lens, full_kv, 1 / 6),
                               rtol=1e-5, atol=1e-5)
