"""CUDA-graph decode: which batch sizes are captured, how a step is padded to one of them (CPU only)."""

import numpy as np
import pytest
import torch

from pagedserve.engine.worker.cuda_graph import CudaGraphRunner, DecodeBuffers, capture_sizes, padded_batch_size


@pytest.mark.parametrize(
    ("max_num_seqs", "expected"),
    [
        (1, [1]),
        (3, [1, 2, 3]),
        (8, [1, 2, 4, 8]),
        (64, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]),
        (100, [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 100]),
    ],
)
def test_capture_sizes_are_powers_of_two_then_multiples_of_8_up_to_max(
    max_num_seqs: int, expected: list[int]
) -> None:
    assert capture_sizes(max_num_seqs) == expected


def test_capture_sizes_for_256_end_on_the_grid() -> None:
    sizes = capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8]
    assert sizes[3:] == list(range(8, 257, 8))


def test_capture_sizes_rejects_zero() -> None:
    with pytest.raises(ValueError, match="max_num_seqs"):
        capture_sizes(0)


@pytest.mark.parametrize(
    ("num_reqs", "expected"), [(1, 1), (3, 4), (4, 4), (5, 8), (9, 16), (97, 100), (100, 100)]
)
def test_batch_pads_to_smallest_captured_size_that_fits(num_reqs: int, expected: int) -> None:
    assert padded_batch_size(num_reqs, capture_sizes(100)) == expected


def test_batch_above_largest_captured_size_runs_eager() -> None:
    assert padded_batch_size(101, capture_sizes(100)) is None


def test_padded_batch_size_rejects_empty_batch() -> None:
    with pytest.raises(ValueError, match="num_reqs"):
        padded_batch_size(0, [1, 2])


def fill_three_requests(buffers: DecodeBuffers, batch_size: int) -> None:
    buffers.fill(
        input_ids=torch.tensor([11, 12, 13]),
        positions=torch.tensor([5, 20, 7]),
        slot_mapping=torch.tensor([37, 100, 55]),
        seq_lens=torch.tensor([6, 21, 8], dtype=torch.int32),
        block_table=torch.tensor([[2, 0], [6, 3], [3, 0]], dtype=torch.int32),
        batch_size=batch_size,
    )


def test_fill_copies_the_step_and_pads_the_rest_to_null_rows() -> None:
    buffers = DecodeBuffers.allocate(8, 3, torch.device("cpu"))
    fill_three_requests(buffers, 4)
    assert buffers.input_ids[:4].tolist() == [11, 12, 13, 0]
    assert buffers.positions[:4].tolist() == [5, 20, 7, 0]
    assert buffers.slot_mapping[:4].tolist() == [37, 100, 55, -1]
    assert buffers.seq_lens[:4].tolist() == [6, 21, 8, 0]
    assert buffers.block_table[:4, :2].tolist() == [[2, 0], [6, 3], [3, 0], [0, 0]]


def test_refill_with_fewer_requests_pads_stale_rows() -> None:
    buffers = DecodeBuffers.allocate(8, 3, torch.device("cpu"))
    fill_three_requests(buffers, 4)
    buffers.fill(torch.tensor([9]), torch.tensor([1]), torch.tensor([17]),
                 torch.tensor([2], dtype=torch.int32), torch.tensor([[1]], dtype=torch.int32), batch_size=4)
    assert buffers.slot_mapping[:4].tolist() == [17, -1, -1, -1]
    assert buffers.seq_lens[:4].tolist() == [2, 0, 0, 0]
    assert buffers.block_table[1:4].tolist() == [[0, 0, 0]] * 3


def test_fill_rejects_batch_larger_than_the_padded_size() -> None:
    buffers = DecodeBuffers.allocate(8, 3, torch.device("cpu"))
    with pytest.raises(ValueError, match="batch_size"):
        fill_three_requests(buffers, 2)
    with pytest.raises(ValueError, match="batch_size"):
        fill_three_requests(buffers, 16)


def test_fill_rejects_block_table_wider_than_the_buffers() -> None:
    buffers = DecodeBuffers.allocate(8, 1, torch.device("cpu"))
    with pytest.raises(ValueError, match="columns"):
        fill_three_requests(buffers, 4)


def test_metadata_views_the_first_rows_with_one_token_each() -> None:
    buffers = DecodeBuffers.allocate(8, 3, torch.device("cpu"))
    fill_three_requests(buffers, 4)
    metadata = buffers.metadata(4, max_seq_len=64)
    assert metadata.num_reqs == 4 and metadata.num_actual_tokens == 4 and metadata.max_query_len == 1
    assert metadata.query_start_loc.tolist() == [0, 1, 2, 3, 4]
    np.testing.assert_array_equal(metadata.query_start_loc_cpu, [0, 1, 2, 3, 4])
    assert metadata.slot_mapping.data_ptr() == buffers.slot_mapping.data_ptr()
    assert metadata.seq_lens.tolist() == [6, 21, 8, 0]
    assert metadata.block_table.shape == (4, 3)


def test_runner_refuses_a_cpu_device() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        CudaGraphRunner(lambda ids, pos, md: ids, [1, 2], 4, 64, torch.device("cpu"))
