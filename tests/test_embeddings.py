"""Embeddings (``--runner pooling``): a tiny random-weight Llama's vectors against transformers' last hidden state
(after the final norm) at the pooled positions, float32, for prompts of different lengths batched and chunked; then
``/v1/embeddings`` and ``/pooling`` on the real server through the openai SDK, and their refusals."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from benchmarks.tiny_models import tiny_hf_model
from pagedserve.engine.errors import InvalidRequestError
from pagedserve.engine.llm import LLM
from pagedserve.engine.model.loader import gguf_cache_folder, resolve_model_path
from pagedserve.engine.pooling_params import PoolerConfig, PoolingParams
from tests.conftest import Served

#: Cosine similarity to transformers' vector that counts as the same (float32 on both sides).
MIN_COSINE = 0.9999
#: Lengths that run in one chunk and in several (chunks of at most 16 tokens below), one of a single token.
LENGTHS = [1, 3, 20, 45, 70]
#: Small enough that the 45- and 70-token prompts run in chunks, and the batch mixes lengths.
ENGINE_ARGS = {"max_model_len": 128, "block_size": 16, "long_prefill_token_threshold": 16,
               "max_num_batched_tokens": 32, "max_num_seqs": 4, "kv_cache_memory_bytes": "8MiB"}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny Llama folder (with SmolLM2's tokenizer: its prompts are token ids below 256) and its transformers
    model, the reference."""
    folder = tmp_path_factory.mktemp("tiny-embed")
    hf = tiny_hf_model("llama", folder, tie_word_embeddings=False)
    AutoTokenizer.from_pretrained(gguf_cache_folder(resolve_model_path(None)).path).save_pretrained(folder)
    return folder, hf


def _prompts() -> list[list[int]]:
    return [[(7 * i + 3 * k) % 250 + 3 for k in range(n)] for i, n in enumerate(LENGTHS)]


def _reference(hf: Any, prompt: list[int], pooling_type: str, normalize: bool = True) -> torch.Tensor:
    with torch.inference_mode():
        hidden = hf.model(torch.tensor([prompt])).last_hidden_state[0]  # after the final norm
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling_type]
    return F.normalize(vector, dim=-1) if normalize else vector


@pytest.mark.parametrize("pooling_type", ["LAST", "MEAN", "CLS"])
def test_vectors_equal_transformers_hidden_states_batched_and_chunked(tiny: tuple[Path, Any],
                                                                      pooling_type: str) -> None:
    folder, hf = tiny
    llm = LLM(str(folder), runner="pooling", pooler_config={"pooling_type": pooling_type}, **ENGINE_ARGS)
    vectors = llm.embed(_prompts(), use_tqdm=False)
    for prompt, vector in zip(_prompts(), vectors, strict=True):
        assert vector.dtype == torch.float32 and vector.shape == (64,)
        assert torch.linalg.vector_norm(vector).item() == pytest.approx(1.0, abs=1e-5)
        assert F.cosine_similarity(vector, _reference(hf, prompt, pooling_type), dim=0) >= MIN_COSINE, len(prompt)
    # Each prompt alone gives the vector it gave in the batch, and its blocks are freed.
    assert torch.allclose(llm.embed(_prompts()[-1], use_tqdm=False)[0], vectors[-1], atol=1e-5)
    assert llm.engine_core.make_stats().kv_cache_usage == 0.0 and not llm.engine_core.scheduler.requests


def test_normalize_false_gives_the_raw_hidden_state_and_a_prefix_cache_hit_the_same_vector(
        tiny: tuple[Path, Any]) -> None:
    folder, hf = tiny
    llm = LLM(str(folder), runner="pooling", pooler_config=json.dumps({"normalize": False}), **ENGINE_ARGS)
    prompt = _prompts()[-1]
    first, again = llm.embed([prompt], use_tqdm=False)[0], llm.embed([prompt], use_tqdm=False)[0]
    assert llm.engine_core.config.cache_config.enable_prefix_caching  # LAST keeps it: the last token always runs
    assert torch.allclose(first, _reference(hf, prompt, "LAST", normalize=False), atol=1e-4)
    assert torch.allclose(again, first, atol=1e-5)


def test_mean_and_cls_pool_every_position_so_the_prefix_cache_is_off(tiny: tuple[Path, Any]) -> None:
    llm = LLM(str(tiny[0]), runner="pooling", pooler_config={"pooling_type": "MEAN"}, **ENGINE_ARGS)
    assert not llm.engine_core.config.cache_config.enable_prefix_caching


def test_matryoshka_dimensions_cut_then_normalise_and_other_models_refuse_them(tiny: tuple[Path, Any],
                                                                               tmp_path: Path) -> None:
    plain = LLM(str(tiny[0]), runner="pooling", **ENGINE_ARGS)
    with pytest.raises(InvalidRequestError) as refused:
        plain.embed([[5, 6, 7]], PoolingParams(dimensions=16), use_tqdm=False)
    assert refused.value.param == "dimensions" and "Matryoshka" in refused.value.message
    hf = tiny_hf_model("llama", tmp_path, tie_word_embeddings=False)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(config | {"matryoshka_dimensions": [16, 32]}))
    AutoTokenizer.from_pretrained(gguf_cache_folder(resolve_model_path(None)).path).save_pretrained(tmp_path)
    matryoshka = LLM(str(tmp_path), runner="pooling", **ENGINE_ARGS)
    prompt = _prompts()[2]
    vector = matryoshka.embed([prompt], PoolingParams(dimensions=16), use_tqdm=False)[0]
    expected = F.normalize(_reference(hf, prompt, "LAST", normalize=False)[:16], dim=-1)
    assert vector.shape == (16,) and F.cosine_similarity(vector, expected, dim=0) >= MIN_COSINE
    with pytest.raises(InvalidRequestError, match=r"one of \[16, 32\]"):
        matryoshka.embed([prompt], PoolingParams(dimensions=20), use_tqdm=False)


def test_a_pooling_engine_generates_nothing_and_a_generating_one_pools_nothing(tiny: tuple[Path, Any]) -> None:
    pooling = LLM(str(tiny[0]), runner="pooling", **ENGINE_ARGS)
    with pytest.raises(InvalidRequestError, match="--runner pooling"):
        pooling.generate([[5, 6, 7]], use_tqdm=False)
    generating = LLM(str(tiny[0]), **ENGINE_ARGS)
    with pytest.raises(InvalidRequestError, match="--runner pooling"):
        generating.embed([[5, 6, 7]], use_tqdm=False)


@pytest.mark.parametrize(("settings", "message"), [
    ({"runner": "pooling", "pooler_config": {"pooling_type": "SUM"}}, "pooling_type"),
    ({"runner": "pooling", "pooler_config": {"normalise": True}}, "unknown keys normalise"),
    ({"runner": "pooling", "pooler_config": "{"}, "not valid JSON"),
    ({"runner": "pooling", "async_scheduling": True}, "async_scheduling"),
    ({"pooler_config": {"pooling_type": "MEAN"}}, "--runner pooling"),
])
def test_pooling_settings_are_checked(settings: dict[str, Any], message: str) -> None:
    from pagedserve.engine.config import EngineArgs

    with pytest.raises(ValueError, match=message):
        EngineArgs(**settings)
    assert PoolerConfig.parse(None) == PoolerConfig("LAST", True)


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def pooling_server(tiny: tuple[Path, Any], serve_fresh_engine: Any) -> Served:
    return serve_fresh_engine(model=str(tiny[0]), runner="pooling", **ENGINE_ARGS)


def test_embeddings_through_the_openai_sdk_match_transformers(pooling_server: Served, tiny: tuple[Path, Any]) -> None:
    client = openai.OpenAI(base_url=f"{pooling_server.url}/v1", api_key="unused", max_retries=0)
    prompts = _prompts()
    response = client.embeddings.create(model=tiny[0].name, input=prompts)  # the SDK asks for base64, decodes it
    assert [item.index for item in response.data] == list(range(len(prompts)))
    for prompt, item in zip(prompts, response.data, strict=True):
        vector = torch.tensor(item.embedding)
        assert F.cosine_similarity(vector, _reference(tiny[1], prompt, "LAST"), dim=0) >= MIN_COSINE
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(LENGTHS)
    assert pooling_server.engine.get_stats().kv_cache_usage == 0.0  # every prompt's blocks are free


def test_float_and_base64_pooling_and_text_input(pooling_server: Served, tiny: tuple[Path, Any]) -> None:
    url = pooling_server.url
    text = {"input": ["1 2 3 4", "5 6"]}  # digits and spaces: SmolLM2's ids below the tiny vocabulary's 256
    as_floats = httpx.post(f"{url}/v1/embeddings", json=text | {"encoding_format": "float"}, timeout=60).json()
    as_base64 = httpx.post(f"{url}/v1/embeddings", json=text | {"encoding_format": "base64"}, timeout=60).json()
    assert as_floats["object"] == "list" and as_floats["data"][0]["object"] == "embedding"
    for floats, encoded in zip(as_floats["data"], as_base64["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(encoded["embedding"]), dtype="<f4")
        assert np.allclose(decoded, floats["embedding"], atol=1e-6) and len(decoded) == 64
    tokenizer = AutoTokenizer.from_pretrained(tiny[0])
    ids = tokenizer.encode(text["input"][0])
    assert as_floats["usage"]["prompt_tokens"] == len(ids) + len(tokenizer.encode("5 6"))
    by_ids = httpx.post(f"{url}/v1/embeddings", json={"input": ids}, timeout=60).json()
    assert np.allclose(by_ids["data"][0]["embedding"], as_floats["data"][0]["embedding"], atol=1e-5)
    pooled = httpx.post(f"{url}/pooling", json={"input": ids}, timeout=60).json()
    assert pooled["object"] == "list" and pooled["data"][0]["object"] == "pooling"
    assert np.allclose(pooled["data"][0]["data"], by_ids["data"][0]["embedding"], atol=1e-5)


@pytest.mark.parametrize(("body", "param"), [
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [5, 300]}, "input"),
    ({"input": list(range(3, 200))}, "input"),
    ({"input": {"text": "hi"}}, "input"),
    ({"input": ["hi"] * 2049}, "input"),
    ({"input": "hi", "dimensions": 16}, "dimensions"),
    ({"input": "hi", "dimensions": 0}, "dimensions"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "hi", "truncate_prompt_tokens": 8}, "truncate_prompt_tokens"),
    ({"input": "hi", "model": "other"}, "model"),
])
def test_bad_input_is_refused_naming_the_field(pooling_server: Served, body: dict[str, Any], param: str) -> None:
    response = httpx.post(f"{pooling_server.url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_the_pooling_server_refuses_to_generate_and_the_generating_one_to_pool(pooling_server: Served,
                                                                               client: httpx.Client) -> None:
    completion = httpx.post(f"{pooling_server.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert completion.status_code == 400 and "--runner pooling" in completion.json()["error"]["message"]
    embedding = client.post("/v1/embeddings", json={"input": "Hi"})
    assert embedding.status_code == 400 and "--runner pooling" in embedding.json()["error"]["message"]
