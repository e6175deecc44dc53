"""Our models and loader against transformers: same logits, same greedy tokens.

SmolLM2 (the embedded Q4_1 GGUF) is loaded once for the module, by us and by
transformers; the other family members are tiny random checkpoints written
with ``save_pretrained`` and read back through ``load_model``.
"""

from __future__ import annotations

import os
import re
import shutil

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import AutoModelForCausalLM, GPT2Config

from benchmarks.step_metadata import build_metadata, step_positions
from benchmarks.tiny_models import TINY_ARCHITECTURES, tiny_hf_model
from pagedserve.engine.chat_template import chat_prompt_token_ids
from pagedserve.engine.model import loader as loader_module
from pagedserve.engine.model.linear import ColumnParallelLinear
from pagedserve.engine.model.linear_methods import (
    EXACT_ROWS,
    OneDNNPackedLinearMethod,
    linear_method_for,
    padded_num_rows,
)
from pagedserve.engine.model.loader import (
    EMBEDDED_GGUF_FILE,
    ModelSource,
    gguf_cache_folder,
    gguf_folder_name,
    load_hf_config,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model_path,
)
from pagedserve.engine.model.parallel import TensorParallel
from pagedserve.engine.model.registry import CausalLM, model_class, supported_architectures
from tests.model_fixtures import embedded_gguf_path

pytestmark = pytest.mark.slow

BLOCK_SIZE = 16
CPU = torch.device("cpu")


@torch.inference_mode()
def greedy_generate(model: CausalLM, prompt: list[int], max_new_tokens: int, prefill_chunk: int | None = None
                    ) -> list[int]:
    """Greedy decoding of one request on a paged cache, the way the model runner drives the model.

    The prompt runs in chunks of ``prefill_chunk`` tokens (all at once when
    None); then each step feeds the last sampled token. Blocks are taken in
    reverse order so the request's blocks are not contiguous.
    """
    total = len(prompt) + max_new_tokens
    num_blocks = -(-total // BLOCK_SIZE) + 1
    kv_caches = [torch.zeros(2, num_blocks, BLOCK_SIZE, model.num_kv_heads, model.head_dim)
                 for _ in range(model.num_layers)]
    blocks = list(range(num_blocks - 1, 0, -1))
    tokens, computed = list(prompt), 0
    while len(tokens) < total:
        step = len(tokens) - computed if prefill_chunk is None else min(prefill_chunk, len(tokens) - computed)
        metadata = model.attn_backend.build_metadata(build_metadata([blocks], [computed], [step], BLOCK_SIZE))
        positions = torch.from_numpy(step_positions([computed], [step]))
        hidden = model(torch.tensor(tokens[computed:computed + step]), positions, kv_caches, metadata)
        computed += step
        if computed == len(tokens):  # a partial prefill chunk samples nothing
            tokens.append(int(model.compute_logits(hidden[-1:]).argmax(-1)))
    return tokens[len(prompt):]


@torch.inference_mode()
def assert_prefill_logits_match(ours: CausalLM, theirs: torch.nn.Module, prompt: list[int]) -> None:
    """Logits of a whole prompt in one step: max abs difference within 1e-4 of the largest reference logit."""
    ids = torch.tensor(prompt)
    num_blocks = -(-len(ids) // BLOCK_SIZE)
    kv_caches = [torch.zeros(2, num_blocks + 1, BLOCK_SIZE, ours.num_kv_heads, ours.head_dim)
                 for _ in range(ours.num_layers)]
    metadata = ours.attn_backend.build_metadata(build_metadata([list(range(num_blocks, 0, -1))], [0], [len(ids)],
                                                               BLOCK_SIZE))
    logits = ours.compute_logits(ours(ids, torch.arange(len(ids)), kv_caches, metadata))
    expected = theirs(ids[None]).logits[0]
    error = (logits - expected).abs().max() / expected.abs().max()
    assert error <= 1e-4, f"relative logit error {error:.2e}"


# --- SmolLM2 from the embedded GGUF ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2() -> tuple[CausalLM, torch.nn.Module, list[int]]:
    """(our model, transformers' model, a chat prompt's token ids)."""
    source = resolve_model_path(None)
    ours = load_model(source, load_hf_config(source), torch.float32, CPU)
    # transformers' own conversion of the GGUF, as its cached HF folder: read in 2 s instead of the 30 s its
    # GGUF reader takes (test_gguf_cache_folder_holds_the_same_model checks the folder against the file).
    theirs = AutoModelForCausalLM.from_pretrained(gguf_cache_folder(source).path, dtype=torch.float32).eval()
    tokenizer = load_tokenizer(source)
    messages = [{"role": "user", "content": "Tell me a story about a brave dragon."}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return ours, theirs, tokenizer(text)["input_ids"]


def test_smollm2_prefill_logits_match_transformers(smollm2) -> None:
    assert_prefill_logits_match(*smollm2)


def linear_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Every module whose weight a linear method owns (projections and the LM head), by name."""
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "linear_method")]


def test_cpu_load_packs_every_linear_weight_including_the_tied_head(smollm2) -> None:
    ours = smollm2[0]
    linears = [m for _, m in linear_layers(ours)]
    assert linears and all(isinstance(m.linear_method, OneDNNPackedLinearMethod) for m in linears)
    assert all(m.packed_weight is not None and m.weight is None for m in linears)
    assert ours.lm_head in linears  # SmolLM2 ties its head: a packed copy of the embedding table
    assert ours.model.embed_tokens.weight.layout == torch.strided


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 16, 65, 300])
def test_packed_linear_equals_f_linear(dtype: torch.dtype, rows: int) -> None:
    """bf16 is bit-identical here; fp32 sums in another order, so it agrees to about 1e-6 relative. 65 and
    300 rows run padded (to 68 and 304): the padding rows never reach the output."""
    method = linear_method_for(CPU, dtype)
    if not isinstance(method, OneDNNPackedLinearMethod):
        pytest.skip(f"oneDNN cannot pack {dtype} weights on this CPU")
    gen = torch.Generator().manual_seed(rows)
    weight, bias = torch.randn(96, 64, generator=gen).to(dtype), torch.randn(96, generator=gen).to(dtype)
    x = torch.randn(rows, 64, generator=gen).to(dtype)
    linear = ColumnParallelLinear(64, 96, bias=True, linear_method=method, tp=TensorParallel())
    linear.weight.data, linear.bias.data = weight.clone(), bias.clone()
    method.process_weights_after_loading(linear)
    expected = F.linear(x, weight, bias)
    tolerance = {"rtol": 0, "atol": 0} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(linear(x), expected, **tolerance)
    torch.testing.assert_close(linear(x.view(1, rows, 64)), expected.view(1, rows, 96), **tolerance)


def test_onednn_row_counts_fall_in_few_buckets() -> None:
    """Every batch size up to 2,048 rows maps to one of 144 GEMM shapes, with under 1/16 of padding."""
    padded = [padded_num_rows(rows) for rows in range(1, 2049)]
    assert padded[:EXACT_ROWS] == list(range(1, EXACT_ROWS + 1))
    assert all(rows <= size and (size - rows) * 16 < size for rows, size in enumerate(padded, start=1))
    assert padded == sorted(padded) and len(set(padded)) == 144
    assert padded_num_rows(2048) == 2048 and padded_num_rows(1025) == 1088


def test_smollm2_greedy_decode_matches_transformers_generate(smollm2) -> None:
    ours, theirs, prompt = smollm2
    with torch.inference_mode():
        output = theirs.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
    expected = output[0, len(prompt):]

    assert len(expected) == 16
    assert greedy_generate(ours, prompt, 16) == expected.tolist()


# --- tiny random members of the family ----------------------------------------------------------------


@pytest.mark.parametrize("tie_word_embeddings", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("model_type", sorted(TINY_ARCHITECTURES))
def test_tiny_model_greedy_decode_matches_transformers(model_type: str, tie_word_embeddings: bool,
                                                       tmp_path) -> None:
    theirs = tiny_hf_model(model_type, tmp_path, tie_word_embeddings=tie_word_embeddings)
    source = resolve_model_path(str(tmp_path))
    ours = load_model(source, load_hf_config(source), torch.float32, CPU)
    prompt = torch.randint(3, 256, (11,), generator=torch.Generator().manual_seed(0)).tolist()
    with torch.inference_mode():
        expected = theirs.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False,
                                   eos_token_id=None)[0, len(prompt):].tolist()

    assert_prefill_logits_match(ours, theirs, prompt)
    assert len(expected) == 16
    assert greedy_generate(ours, prompt, 16) == expected
    assert greedy_generate(ours, prompt, 16, prefill_chunk=4) == expected


# --- errors and paths ---------------------------------------------------------------------------------


def test_unsupported_architecture_lists_supported_ones(tmp_path) -> None:
    config = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=32)
    config.architectures = ["GPT2LMHeadModel"]

    with pytest.raises(ValueError, match="GPT2LMHeadModel") as excinfo:
        load_model(ModelSource(str(tmp_path), None, "gpt2"), config, torch.float32, CPU)
    for name in supported_architectures():
        assert name in str(excinfo.value)


def test_a_longrope_model_serves_within_its_original_positions(tmp_path) -> None:
    """Beyond ``original_max_position_embeddings`` transformers switches to longrope's long factors for the
    whole sequence, which a fixed rotary table cannot: the default stops there and more is refused."""
    from pagedserve.engine.config import max_model_len_for

    config = tiny_hf_model("phi3", tmp_path, tie_word_embeddings=False).config
    assert max_model_len_for(None, config) == 128 and max_model_len_for(100, config) == 100
    with pytest.raises(ValueError, match="original_max_position_embeddings 128"):
        max_model_len_for(129, config)


@pytest.mark.parametrize("model_type", sorted(TINY_ARCHITECTURES))
def test_mixtures_of_experts_say_cuda_graphs_cannot_replay_them(model_type: str) -> None:
    """Routing sizes each expert's batch by the values: the runner must not capture such a model's decode."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type)
    moe = any(name in model_type for name in ("moe", "mixtral"))
    assert model_class(config).supports_cuda_graphs is not moe


def test_checkpoint_missing_a_weight_is_rejected(tmp_path) -> None:
    model = tiny_hf_model("qwen2", tmp_path, tie_word_embeddings=True)
    state = {k: v for k, v in model.state_dict().items() if "layers.1.self_attn.k_proj.bias" not in k}
    model.save_pretrained(tmp_path, state_dict=state)
    source = resolve_model_path(str(tmp_path))

    with pytest.raises(ValueError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias"):
        load_model(source, load_hf_config(source), torch.float32, CPU)


def test_model_paths_resolve(tmp_path) -> None:
    embedded = resolve_model_path(None)
    assert (embedded.path, embedded.gguf_file) == (str(embedded_gguf_path().parent), EMBEDDED_GGUF_FILE)
    gguf = resolve_model_path(str(embedded_gguf_path()))
    assert (gguf.path, gguf.gguf_file, gguf.display_name) == (embedded.path, EMBEDDED_GGUF_FILE,
                                                              "SmolLM2-135M-Instruct.Q4_1")
    folder = resolve_model_path(str(tmp_path))
    assert (folder.path, folder.gguf_file, folder.display_name) == (str(tmp_path), None, tmp_path.name)


@pytest.mark.parametrize("model", ["./no/such/folder", "/no/such/model.gguf",
                                   "pagedserve-test/no-such-model-anywhere"])
def test_missing_models_raise_value_error(model: str) -> None:
    with pytest.raises(ValueError, match=re.escape(repr(model))):
        resolve_model_path(model)


def test_resolve_dtype() -> None:
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        resolve_dtype("int8", torch.device("cpu"))


@pytest.fixture(scope="module")
def fresh_cache_dir(tmp_path_factory) -> str:
    """A cache folder of the module's own: the cache tests below share one conversion (~20 s) of the GGUF."""
    return str(tmp_path_factory.mktemp("gguf-cache"))


def test_gguf_cache_folder_holds_the_same_model(smollm2, fresh_cache_dir, monkeypatch):
    """The HF folder converted from the GGUF gives the same weights, config and tokenizer."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", fresh_cache_dir)
    ours = smollm2[0]
    gguf = resolve_model_path(None)
    cached = gguf_cache_folder(gguf)
    assert cached.gguf_file is None and cached.display_name == gguf.display_name
    assert gguf_cache_folder(gguf) == cached  # converted once, then reused
    config = load_hf_config(cached)
    reloaded = load_model(cached, config, torch.float32, CPU)
    for (name, a), (_, b) in zip(ours.state_dict().items(), reloaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    # Packed linear weights are not in the state dict: compare them densely.
    linears = [linear_layers(model) for model in (ours, reloaded)]
    for (name, a), (_, b) in zip(*linears, strict=True):
        assert torch.equal(a.packed_weight.to_dense(), b.packed_weight.to_dense()), name
    messages = [{"role": "user", "content": "Tell me a story about a brave dragon 🐉 in 中文."}]
    tokenizers = load_tokenizer(cached), load_tokenizer(gguf)
    assert len({tuple(chat_prompt_token_ids(t, messages)) for t in tokenizers}) == 1
    assert config.max_position_embeddings == load_hf_config(gguf).max_position_embeddings


def test_gguf_cache_is_keyed_by_content_not_by_file_times(fresh_cache_dir, tmp_path, monkeypatch):
    """A copy of the GGUF with other timestamps (a pulled image layer, another venv) finds the same
    conversion."""
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", fresh_cache_dir)
    gguf = resolve_model_path(None)
    first = gguf_cache_folder(gguf)
    copy = tmp_path / "elsewhere" / gguf.gguf_file
    copy.parent.mkdir()
    shutil.copyfile(os.path.join(gguf.path, gguf.gguf_file), copy)
    os.utime(copy, ns=(10**18, 10**18))
    converted = os.path.join(first.path, "model.safetensors")
    before = os.stat(converted).st_mtime_ns
    assert gguf_cache_folder(resolve_model_path(str(copy))).path == first.path
    assert os.stat(converted).st_mtime_ns == before  # not converted again


def test_gguf_cache_is_keyed_by_the_transformers_version_too(monkeypatch):
    """transformers writes the conversion (config.json records its version): after an upgrade, a folder
    converted by the old version is not reused (a clean clone's new transformers met a cache from the old)."""
    digest = "ab" * 32
    name = gguf_folder_name(digest)
    assert name.startswith(digest[:32]) and transformers.__version__ in name
    # The loader's own module object: importing peft (tests/test_lora.py, collected before this file) puts a new
    # transformers module in sys.modules, so this file's may not be the one the loader imported.
    monkeypatch.setattr(loader_module.transformers, "__version__", "99.0.0")
    assert gguf_folder_name(digest) != name
