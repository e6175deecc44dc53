"""The Triton paged-attention backend against an fp64 reference, on CPU through the Triton interpreter.

``TRITON_INTERPRET=1`` must be set before ``triton`` is first imported:
``triton.jit`` reads it when it decorates a kernel, Triton's own library
functions (``tl.zeros``, ``tl.sum``...) included, and returns an interpreted
function (numpy on the host) instead of one compiled for a GPU. This file sets
it first thing; when an earlier test file already imported triton without it,
the file is skipped (set ``TRITON_INTERPRET=1`` in the environment to run it in
the same session). Shapes are small because the interpreter runs each program
in Python.
"""

import importlib.util
import os
import sys

import pytest

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"

import numpy as np  # noqa: E402
import torch  # noqa: E402

pytest.importorskip("triton")

from pagedserve.engine.model.attention import AttentionMetadata, get_attention_backend  # noqa: E402
from pagedserve.engine.model.triton_attention import TritonAttentionBackend  # noqa: E402

NUM_KV_HEADS = 2
TOLERANCE = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_step(
    query_lens: list[int],
    context_lens: list[int],
    *,
    queries_per_kv: int = 1,
    block_size: int = 16,
    head_dim: int = 64,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    """A step whose request i runs ``query_lens[i]`` tokens after ``context_lens[i]`` cached ones.

    Each request gets shuffled, non-contiguous block ids (block 0 is the null
    block). Every cache slot that holds no prior context is NaN, so a kernel
    that reads a slot it should not turns the output NaN.

    Returns:
        query ``[T, Hq, D]``, key and value ``[T, Hkv, D]``, the kv cache
        ``[2, num_blocks, block_size, Hkv, D]`` and the metadata.
    """
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for q, c in zip(query_lens, context_lens, strict=True)]
    blocks_per_req = [-(-s // block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req) + 1
    num_blocks = sum(blocks_per_req) + 3
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    block_table = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    for i, n in enumerate(blocks_per_req):
        block_table[i, :n] = torch.tensor([ids.pop() for _ in range(n)])

    def slots(i: int, positions: range) -> torch.Tensor:
        pos = torch.tensor(list(positions), dtype=torch.int64)
        return block_table[i, pos // block_size].long() * block_size + pos % block_size

    kv_cache = torch.full((2, num_blocks, block_size, NUM_KV_HEADS, head_dim), float("nan"), dtype=dtype)
    flat_cache = kv_cache.view(2, -1, NUM_KV_HEADS, head_dim)
    for i, c in enumerate(context_lens):
        flat_cache[:, slots(i, range(c))] = torch.randn(2, c, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)

    num_tokens = sum(query_lens)
    query = torch.randn(num_tokens, NUM_KV_HEADS * queries_per_kv, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, NUM_KV_HEADS, head_dim, generator=gen).to(dtype)
    slot_mapping = torch.cat([slots(i, range(c, c + q))
                              for i, (q, c) in enumerate(zip(query_lens, context_lens, strict=True))])
    query_start_loc = np.concatenate([[0], np.cumsum(query_lens)]).astype(np.int32)
    metadata = AttentionMetadata(
        num_actual_tokens=num_tokens,
        query_start_loc=torch.from_numpy(query_start_loc),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_table=block_table,
        slot_mapping=slot_mapping,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        query_start_loc_cpu=query_start_loc,
        seq_lens_cpu=np.array(seq_lens, dtype=np.int32),
    )
    return query, key, value, kv_cache, metadata


def reference(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
    metadata: AttentionMetadata, scale: float, sliding_window: int | None = None, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive paged attention: fp64, one request at a time, K/V gathered through the block table; a query sees
    keys up to its position, the last ``sliding_window`` of them when one is given.

    Returns:
        The expected output ``[T, Hq, D]`` (fp64) and the expected cache after the write.
    """
    block_size, num_kv_heads, head_dim = kv_cache.shape[2:]
    cache = kv_cache.clone()
    flat_cache = cache.view(2, -1, num_kv_heads, head_dim)
    flat_cache[0, metadata.slot_mapping] = key
    flat_cache[1, metadata.slot_mapping] = value
    queries_per_kv = query.shape[1] // num_kv_heads
    out = torch.empty(query.shape, dtype=torch.float64)
    for i in range(metadata.num_reqs):
        start, end = metadata.query_start_loc_cpu[i], metadata.query_start_loc_cpu[i + 1]
        seq_len = int(metadata.seq_lens_cpu[i])
        pos = torch.arange(seq_len)
        slots = metadata.block_table[i, pos // block_size].long() * block_size + pos % block_size
        k = flat_cache[0, slots].double().repeat_interleave(queries_per_kv, dim=1)
        v = flat_cache[1, slots].double().repeat_interleave(queries_per_kv, dim=1)
        q = query[start:end].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(seq_len - (end - start), seq_len)
        hidden = pos[None, :] > q_pos[:, None]
        if sliding_window is not None:
            hidden |= pos[None, :] <= q_pos[:, None] - sliding_window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
    return out, cache


def check_against_reference(query_lens: list[int], context_lens: list[int], sliding_window: int | None = None,
                            softcap: float | None = None, **kwargs) -> None:
    """Run the Triton backend on one step and compare output and cache with ``reference``."""
    query, key, value, kv_cache, metadata = make_step(query_lens, context_lens, **kwargs)
    scale = query.shape[-1] ** -0.5
    expected_out, expected_cache = reference(query, key, value, kv_cache, metadata, scale, sliding_window, softcap)
    out = TritonAttentionBackend(kv_cache.shape[2], softcap).forward(query, key, value, kv_cache, metadata, scale,
                                                                     sliding_window)
    tol = TOLERANCE[query.dtype]
    assert out.dtype == query.dtype
    torch.testing.assert_close(out.double(), expected_out, atol=tol, rtol=tol)
    torch.testing.assert_close(kv_cache, expected_cache, atol=0, rtol=0, equal_nan=True)


def test_registers_as_triton() -> None:
    backend = get_attention_backend("triton", 16)
    assert isinstance(backend, TritonAttentionBackend)
    assert backend.supports_cuda_graphs and "cuda" in backend.supported_devices
    metadata = make_step([1], [3])[4]
    assert backend.build_metadata(metadata) is metadata  # the kernels read the common layout


@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
def test_decode_only(queries_per_kv: int) -> None:
    # Sequences end mid-block (5, 41), exactly at a block end (16) and one token into a block (33).
    check_against_reference([1, 1, 1, 1], [4, 15, 32, 40], queries_per_kv=queries_per_kv)


@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
def test_prefill_only(queries_per_kv: int) -> None:
    check_against_reference([7, 33, 16], [0, 0, 0], queries_per_kv=queries_per_kv)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("queries_per_kv", [1, 3, 8])
def test_mixed_prefill_chunks_and_decodes(queries_per_kv: int, block_size: int) -> None:
    # A chunk with prior context, a decode, a fresh prefill, a decode.
    check_against_reference([20, 1, 9, 1], [13, 47, 0, 15], queries_per_kv=queries_per_kv,
                            block_size=block_size)


@pytest.mark.parametrize("sliding_window", [1, 7, 40])
def test_sliding_window(sliding_window: int) -> None:
    # Windows of one token, ending mid-tile, and wider than a key tile (32), over chunks with and without
    # context and decodes.
    check_against_reference([20, 1, 70, 1], [13, 47, 0, 15], queries_per_kv=3, sliding_window=sliding_window)


def test_soft_capped_scores() -> None:
    """Gemma 2's ``cap * tanh(s / cap)``, with a window, over chunks with and without context and decodes."""
    check_against_reference([20, 1, 70, 1], [13, 47, 0, 15], queries_per_kv=3, sliding_window=40, softcap=1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_inputs(dtype: torch.dtype) -> None:
    check_against_reference([20, 1, 9], [13, 47, 0], queries_per_kv=3, dtype=dtype)


@pytest.mark.parametrize("head_dim", [128, 80])
def test_head_dims(head_dim: int) -> None:
    # 80 is not a power of two: the kernel pads it to 128 and masks the rest.
    check_against_reference([5, 1], [3, 20], queries_per_kv=2, head_dim=head_dim)


def test_padded_rows_write_nothing_and_return_zeros() -> None:
    # CUDA-graph padding: a row with slot -1 and seq_len 0 must leave the cache alone.
    query, key, value, kv_cache, metadata = make_step([1, 1, 1], [6, 17, 0])
    metadata.slot_mapping[2] = -1
    metadata.seq_lens[2] = 0
    metadata.seq_lens_cpu[2] = 0
    before = kv_cache.clone()
    out = TritonAttentionBackend(16).forward(query, key, value, kv_cache, metadata, 0.125)
    assert torch.equal(out[2], torch.zeros_like(out[2]))
    flat_before, flat_after = before.view(2, -1, NUM_KV_HEADS, 64), kv_cache.view(2, -1, NUM_KV_HEADS, 64)
    unwritten = torch.ones(flat_before.shape[1], dtype=torch.bool)
    unwritten[metadata.slot_mapping[:2]] = False
    torch.testing.assert_close(flat_after[:, unwritten], flat_before[:, unwritten], atol=0, rtol=0,
                               equal_nan=True)


def test_rows_past_num_actual_tokens_are_zeros_and_not_cached() -> None:
    query, key, value, kv_cache, metadata = make_step([3, 1], [0, 9])
    expected_out, expected_cache = reference(query, key, value, kv_cache, metadata, 0.125)
    # Two trailing rows outside the step, as in a batch padded to a fixed size.
    pad = torch.ones(2, *query.shape[1:])
    padded_kv = [torch.cat([t, pad[:, :NUM_KV_HEADS]]) for t in (key, value)]
    out = TritonAttentionBackend(16).forward(torch.cat([query, pad]), *padded_kv, kv_cache, metadata, 0.125)
    torch.testing.assert_close(out[:4].double(), expected_out, atol=2e-5, rtol=2e-5)
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))
    torch.testing.assert_close(kv_cache, expected_cache, atol=0, rtol=0, equal_nan=True)


def test_rejects_head_count_not_a_multiple_of_kv_heads() -> None:
    query, key, value, kv_cache, metadata = make_step([2], [0])
    with pytest.raises(ValueError, match="num_heads"):
        TritonAttentionBackend(16).forward(query[:, :1].expand(-1, 3, -1), key, value, kv_cache, metadata, 0.1)


@pytest.mark.skipif(importlib.util.find_spec("pagedserve.engine.model.torch_attention") is None,
                    reason="the torch reference backend is not written yet")
def test_matches_torch_backend() -> None:
    import pagedserve.engine.model.torch_attention  # noqa: F401  (registers "torch")

    step = make_step([20, 1, 9, 1], [13, 47, 0, 15], queries_per_kv=3)
    query, key, value, kv_cache, metadata = step
    kv_cache.nan_to_num_(0.0)  # stale slots: the reference backend may gather whole blocks
    torch_cache = kv_cache.clone()
    out = TritonAttentionBackend(16).forward(query, key, value, kv_cache, metadata, 0.125)
    torch_backend = get_attention_backend("torch", 16)
    expected = torch_backend.forward(query, key, value, torch_cache, torch_backend.build_metadata(metadata), 0.125)
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(kv_cache, torch_cache, atol=0, rtol=0, equal_nan=True)
