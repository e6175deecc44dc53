"""Tensor-parallel layers: which slice of each checkpoint tensor every parameter takes.

At size 1 a tiny random checkpoint is loaded and every fused parameter is
compared with the tensors it was stacked from. Ranks of a larger group are
simulated: a layer built with ``TensorParallel(rank=1, size=2)`` loads without
``torch.distributed`` (only its forward would communicate), so each weight
loader's slice is checked against the full tensor directly. Last, two real
processes (gloo) run a tiny model split in two and must give transformers' logits.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import load_file

from benchmarks.step_metadata import build_metadata
from benchmarks.tiny_models import tiny_hf_model
from pagedserve.engine.model.layers import QKNorm
from pagedserve.engine.model.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from pagedserve.engine.model.linear_methods import UnquantizedLinearMethod
from pagedserve.engine.model.parallel import TensorParallel
from pagedserve.engine.model.registry import model_class
from pagedserve.engine.model.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

PLAIN = UnquantizedLinearMethod()
RANK_1_OF_2 = TensorParallel(rank=1, size=2)


def full(*shape: int) -> torch.Tensor:
    """A checkpoint tensor whose every entry is distinct, so any wrong slice shows."""
    return torch.arange(float(torch.Size(shape).numel())).reshape(shape)


def load(param: torch.nn.Parameter, tensor: torch.Tensor, shard_id=None) -> None:
    param.weight_loader(param, tensor, shard_id)


# --- a whole model at size 1 --------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen2", "qwen3"])
def test_fused_parameters_hold_the_checkpoint_tensors_they_stack(model_type: str, tmp_path) -> None:
    theirs = tiny_hf_model(model_type, tmp_path, tie_word_embeddings=True)
    checkpoint = theirs.state_dict()
    config = theirs.config
    ours = model_class(config)(config, attn_backend="torch", block_size=16, linear_method=PLAIN,
                               tp=TensorParallel())

    ours.load_weights(checkpoint.items())

    head_dim = ours.head_dim
    q_rows, kv_rows = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    for i, layer in enumerate(ours.model.layers):
        prefix = f"model.layers.{i}"
        qkv = layer.self_attn.qkv_proj
        for suffix in ["weight"] + (["bias"] if qkv.bias is not None else []):
            q, k, v = getattr(qkv, suffix).split([q_rows, kv_rows, kv_rows])
            for part, name in ((q, "q_proj"), (k, "k_proj"), (v, "v_proj")):
                assert torch.equal(part, checkpoint[f"{prefix}.self_attn.{name}.{suffix}"]), (name, suffix)
        gate, up = layer.mlp.gate_up_proj.weight.chunk(2)
        assert torch.equal(gate, checkpoint[f"{prefix}.mlp.gate_proj.weight"])
        assert torch.equal(up, checkpoint[f"{prefix}.mlp.up_proj.weight"])
        assert torch.equal(layer.self_attn.o_proj.weight, checkpoint[f"{prefix}.self_attn.o_proj.weight"])
        if model_type == "qwen3":
            q_norm, k_norm = layer.self_attn.qk_norm.weight.split([config.num_attention_heads,
                                                                   config.num_key_value_heads])
            assert torch.equal(q_norm, checkpoint[f"{prefix}.self_attn.q_norm.weight"].expand_as(q_norm))
            assert torch.equal(k_norm, checkpoint[f"{prefix}.self_attn.k_norm.weight"].expand_as(k_norm))
    assert ours.lm_head.weight is ours.model.embed_tokens.weight  # tied: the saved lm_head.weight is skipped
    assert torch.equal(ours.model.embed_tokens.weight, checkpoint["model.embed_tokens.weight"])


def test_checkpoint_names_unstack_the_fused_parameters(tmp_path) -> None:
    config = tiny_hf_model("qwen3", tmp_path, tie_word_embeddings=False).config
    with torch.device("meta"):
        ours = model_class(config)(config, attn_backend="torch", block_size=16, linear_method=PLAIN,
                                   tp=TensorParallel())
    names = ours.checkpoint_weight_names()
    assert names[:6] == ["model.embed_tokens.weight", "model.layers.0.input_layernorm.weight",
                         "model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight",
                         "model.layers.0.self_attn.v_proj.weight", "model.layers.0.self_attn.o_proj.weight"]
    assert {"model.layers.1.self_attn.q_norm.weight", "model.layers.1.mlp.up_proj.weight", "lm_head.weight"} <= set(
        names)
    assert not [n for n in names if "qkv_proj" in n or "gate_up_proj" in n or "qk_norm" in n]


@pytest.mark.parametrize(("rename", "message"), [
    (lambda name: name.replace("k_proj", "qkv_proj"), r"'model\.layers\.\d\.self_attn\.qkv_proj\.weight' has no"),
    (lambda name: name.replace("embed_tokens", "wte"), r"'model\.wte\.weight' has no parameter"),
])
def test_unknown_checkpoint_names_are_refused_by_name(rename, message: str, tmp_path) -> None:
    theirs = tiny_hf_model("llama", tmp_path, tie_word_embeddings=False)
    config = theirs.config
    ours = model_class(config)(config, attn_backend="torch", block_size=16, linear_method=PLAIN,
                               tp=TensorParallel())
    with pytest.raises(ValueError, match=message):
        ours.load_weights((rename(name), tensor) for name, tensor in theirs.state_dict().items())


def test_a_tensor_of_the_wrong_shape_is_refused_by_name(tmp_path) -> None:
    theirs = tiny_hf_model("qwen3", tmp_path, tie_word_embeddings=False)
    config = theirs.config
    ours = model_class(config)(config, attn_backend="torch", block_size=16, linear_method=PLAIN,
                               tp=TensorParallel())
    checkpoint = dict(theirs.state_dict())
    checkpoint["model.layers.1.self_attn.v_proj.weight"] = torch.zeros(33, 64)
    with pytest.raises(ValueError, match=r"'model\.layers\.1\.self_attn\.v_proj\.weight' has shape \(33, 64\), "
                                         r"expected \(32, 64\)"):
        ours.load_weights(checkpoint.items())
    checkpoint = dict(theirs.state_dict())
    checkpoint["model.layers.0.self_attn.k_norm.weight"] = torch.zeros(8)
    with pytest.raises(ValueError, match=r"k_norm\.weight' has shape \(8,\), expected \(16,\)"):
        ours.load_weights(checkpoint.items())


# --- one layer at rank 1 of 2 -------------------------------------------------------------------------


def test_column_parallel_takes_its_rows() -> None:
    layer = ColumnParallelLinear(8, 6, bias=True, linear_method=PLAIN, tp=RANK_1_OF_2)
    weight, bias = full(6, 8), full(6)
    load(layer.weight, weight)
    load(layer.bias, bias)
    assert torch.equal(layer.weight, weight[3:]) and torch.equal(layer.bias, bias[3:])


def test_row_parallel_takes_its_columns_and_the_whole_bias() -> None:
    layer = RowParallelLinear(8, 6, bias=True, linear_method=PLAIN, tp=RANK_1_OF_2)
    weight, bias = full(6, 8), full(6)
    load(layer.weight, weight)
    load(layer.bias, bias)
    assert torch.equal(layer.weight, weight[:, 4:]) and torch.equal(layer.bias, bias)


def test_merged_column_parallel_takes_its_rows_of_each_shard() -> None:
    layer = MergedColumnParallelLinear(8, [6, 4], bias=True, linear_method=PLAIN, tp=RANK_1_OF_2)
    gate, up = full(6, 8), full(4, 8) + 1000
    load(layer.weight, gate, 0)
    load(layer.weight, up, 1)
    load(layer.bias, full(6), 0)
    load(layer.bias, full(4) + 1000, 1)
    assert torch.equal(layer.weight, torch.cat([gate[3:], up[2:]]))
    assert torch.equal(layer.bias, torch.cat([full(6)[3:], full(4)[2:] + 1000]))


def qkv_rows(layer: QKVParallelLinear, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> list[torch.Tensor]:
    """Load q, k and v into ``layer`` and return its q, k and v rows."""
    for shard_id, tensor in zip("qkv", (q, k, v), strict=True):
        load(layer.weight, tensor, shard_id)
    return list(layer.weight.split(layer.output_partition_sizes))


def test_qkv_parallel_splits_query_and_kv_heads() -> None:
    head_dim, hidden = 2, 8
    layer = QKVParallelLinear(hidden, head_dim, 4, 2, linear_method=PLAIN, tp=RANK_1_OF_2)
    q, k, v = full(8, hidden), full(4, hidden) + 100, full(4, hidden) + 200

    assert (layer.num_heads, layer.num_kv_heads) == (2, 1)
    rows = qkv_rows(layer, q, k, v)
    assert torch.equal(rows[0], q[4:]) and torch.equal(rows[1], k[2:]) and torch.equal(rows[2], v[2:])


@pytest.mark.parametrize(("num_kv_heads", "tp", "kv_head"), [
    (1, RANK_1_OF_2, 0),                          # one KV head, on both ranks
    (2, TensorParallel(rank=3, size=4), 1),       # ranks 2 and 3 share KV head 1
    (2, TensorParallel(rank=1, size=4), 0),
])
def test_qkv_parallel_replicates_kv_heads_when_fewer_than_ranks(num_kv_heads: int, tp: TensorParallel,
                                                                   kv_head: int) -> None:
    head_dim, hidden = 2, 8
    layer = QKVParallelLinear(hidden, head_dim, 4, num_kv_heads, bias=True, linear_method=PLAIN, tp=tp)
    q, k, v = full(8, hidden), full(2 * num_kv_heads, hidden) + 100, full(2 * num_kv_heads, hidden) + 200

    assert (layer.num_heads, layer.num_kv_heads) == (4 // tp.size, 1)
    rows = qkv_rows(layer, q, k, v)
    heads = slice(kv_head * head_dim, (kv_head + 1) * head_dim)
    q_heads = slice(tp.rank * 4 // tp.size * head_dim, (tp.rank + 1) * 4 // tp.size * head_dim)
    assert torch.equal(rows[0], q[q_heads]) and torch.equal(rows[1], k[heads]) and torch.equal(rows[2], v[heads])
    load(layer.bias, full(2 * num_kv_heads), "k")
    assert torch.equal(layer.bias[layer.output_partition_sizes[0]:][:head_dim], full(2 * num_kv_heads)[heads])


def test_qkv_parallel_refuses_heads_that_do_not_split() -> None:
    with pytest.raises(ValueError, match="num_attention_heads"):
        QKVParallelLinear(8, 2, 3, 1, linear_method=PLAIN, tp=RANK_1_OF_2)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        QKVParallelLinear(8, 2, 6, 3, linear_method=PLAIN, tp=RANK_1_OF_2)
    with pytest.raises(ValueError, match="num_key_value_heads"):
        QKVParallelLinear(8, 2, 8, 3, linear_method=PLAIN, tp=TensorParallel(rank=0, size=4))


@pytest.mark.parametrize("vocab", [10, 9])  # 9: the last rank's rows are padded
def test_vocab_parallel_embedding_and_head_take_their_rows(vocab: int) -> None:
    embedding = VocabParallelEmbedding(vocab, 4, tp=RANK_1_OF_2)
    head = ParallelLMHead(vocab, 4, linear_method=PLAIN, tp=RANK_1_OF_2)
    table = full(vocab, 4)
    for layer in (embedding, head):
        load(layer.weight, table)
        assert layer.weight.shape == (5, 4)
        assert torch.equal(layer.weight[:vocab - 5], table[5:]) and not layer.weight[vocab - 5:].any()
    assert (embedding.shard.start, embedding.shard.end) == (5, vocab)


def test_qk_norm_fills_every_head_row_of_its_kind() -> None:
    norm = QKNorm(num_heads=3, num_kv_heads=1, head_dim=4, eps=1e-6)
    load(norm.weight, full(4), "q")
    load(norm.weight, full(4) + 10, "k")
    assert torch.equal(norm.weight, torch.stack([full(4)] * 3 + [full(4) + 10]))


def test_loaders_refuse_tensors_not_of_the_full_shape() -> None:
    column = ColumnParallelLinear(8, 6, linear_method=PLAIN, tp=RANK_1_OF_2)
    with pytest.raises(ValueError, match=r"has shape \(3, 8\), expected \(6, 8\)"):
        load(column.weight, full(3, 8))  # this rank's slice, not the checkpoint tensor
    row = RowParallelLinear(8, 6, linear_method=PLAIN, tp=RANK_1_OF_2)
    with pytest.raises(ValueError, match=r"expected \(6, 8\)"):
        load(row.weight, full(6, 4))


def test_tensor_parallel_checks_its_rank_and_splits() -> None:
    with pytest.raises(ValueError, match="rank 2"):
        TensorParallel(rank=2, size=2)
    with pytest.raises(ValueError, match=r"output_size \(7\) is not divisible by the tensor-parallel size \(2\)"):
        ColumnParallelLinear(8, 7, linear_method=PLAIN, tp=RANK_1_OF_2)
    single = TensorParallel()
    x = torch.ones(3)
    assert single.all_reduce(x) is x and single.all_gather(x) is x


# --- two ranks for real -------------------------------------------------------------------------------

PROMPT = [5, 17, 99, 3, 200, 41, 7, 64, 128, 255, 1]


def _run_rank(rank: int, folder: str) -> None:
    """One rank of a size-2 group: load its half of the tiny checkpoint, prefill PROMPT, rank 0 saves logits."""
    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=2)
    try:
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(folder)
        model = model_class(config)(config, attn_backend="torch", block_size=16, linear_method=PLAIN,
                                    tp=TensorParallel(rank=rank, size=2))
        model.load_weights(load_file(f"{folder}/model.safetensors").items())
        kv_caches = [torch.zeros(2, 2, 16, model.num_kv_heads, model.head_dim) for _ in range(model.num_layers)]
        metadata = model.attn_backend.build_metadata(build_metadata([[1]], [0], [len(PROMPT)], 16))
        with torch.inference_mode():
            hidden = model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), kv_caches, metadata)
            logits = model.compute_logits(hidden)
        if rank == 0:
            torch.save((model.num_heads, model.num_kv_heads, logits), f"{folder}/logits.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
@pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs torch.distributed gloo")
def test_two_ranks_give_the_logits_of_the_whole_model(tmp_path: Path) -> None:
    """Column/row splits, the all-reduces, the vocabulary-split embedding and the gathered (tied) head."""
    theirs = tiny_hf_model("qwen2", tmp_path, tie_word_embeddings=True)  # q/k/v biases: split with their rows
    with torch.inference_mode():
        expected = theirs(torch.tensor([PROMPT])).logits[0]

    mp.spawn(_run_rank, args=(str(tmp_path),), nprocs=2)

    num_heads, num_kv_heads, logits = torch.load(tmp_path / "logits.pt")
    assert (num_heads, num_kv_heads) == (2, 1)  # 4 query and 2 KV heads over 2 ranks
    torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-5)
