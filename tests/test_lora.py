"""LoRA adapters (``--enable-lora``): greedy output of each adapter equals transformers + PEFT (the adapter merged
into the weights), float32, with adapters and the base model in one batch, under chunked prefill and preemption;
the scheduler's slot limit; the prefix cache kept apart per adapter; adapters checked against the model; the
server's ``model`` routing, ``/v1/models`` and the runtime load and unload routes."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from benchmarks.tiny_models import random_lora_adapter, tiny_hf_model
from pagedserve import LLM, LoRARequest, SamplingParams
from pagedserve.engine.config import CacheConfig, EngineArgs, SchedulerConfig
from pagedserve.engine.core.scheduler import Scheduler
from pagedserve.engine.lora.peft import AdapterError, check_adapter
from pagedserve.engine.lora.registry import LoRAModulePath
from pagedserve.engine.model.loader import gguf_cache_folder, resolve_model_path
from pagedserve.engine.model.lora import LoRALayer, LoRAMapping
from pagedserve.engine.request import Request, RequestStatus
from tests.conftest import Served

peft = pytest.importorskip("peft")

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
LENGTHS = [3, 9, 20, 33, 41, 50]
BASE_ARGS = {"max_model_len": 128, "block_size": 16, "kv_cache_memory_bytes": "8MiB", "enable_lora": True,
             "max_lora_rank": 8}


def _prompts() -> list[list[int]]:
    return [[(11 * i + 5 * k) % 250 + 3 for k in range(n)] for i, n in enumerate(LENGTHS)]


def peft_greedy(base: str, adapter: Path | None, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy continuations with ``adapter`` merged into the weights (None: the base model)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    if adapter is not None:
        model = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload().eval()
    outputs = []
    with torch.inference_mode():
        for ids in prompts:
            input_ids = torch.tensor([ids])
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=MAX_TOKENS,
                                 do_sample=False, pad_token_id=0, eos_token_id=None)
            outputs.append(out[0, len(ids):].tolist())
    return outputs


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny Llama (with SmolLM2's tokenizer and vocabulary), two adapters of it (rank 8 on every projection;
    rank 4 rsLoRA on q, v and down), and transformers + PEFT's greedy tokens for each."""
    root = tmp_path_factory.mktemp("tiny-lora")
    base = root / "base"
    tiny_hf_model("llama", base, tie_word_embeddings=False, vocab_size=49152)  # the tokenizer's: chat works
    AutoTokenizer.from_pretrained(gguf_cache_folder(resolve_model_path(None)).path).save_pretrained(base)
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapters = {"a": random_lora_adapter(str(base), root / "a", rank=8, targets=every, seed=1),
                "b": random_lora_adapter(str(base), root / "b", rank=4, targets=["q_proj", "v_proj", "down_proj"],
                                         seed=2, rslora=True)}
    prompts = _prompts()
    reference = {name: peft_greedy(str(base), path, prompts) for name, path in [("base", None), *adapters.items()]}
    return {"base": str(base), "adapters": adapters, "prompts": prompts, "reference": reference, "root": root}


def _requests(tiny: dict[str, Any]) -> dict[str, LoRARequest | None]:
    return {"base": None, **{name: LoRARequest(name, i + 1, str(path))
                             for i, (name, path) in enumerate(tiny["adapters"].items())}}


def test_each_adapter_changes_the_output(tiny: dict[str, Any]) -> None:
    """Otherwise the parity below would prove nothing."""
    reference = tiny["reference"]
    assert reference["a"] != reference["base"] and reference["b"] != reference["base"]
    assert reference["a"] != reference["b"]


@pytest.mark.parametrize("engine_args", [
    {"max_loras": 2},
    {"max_loras": 2, "max_num_batched_tokens": 16, "max_num_seqs": 4, "long_prefill_token_threshold": 8},
    {"max_loras": 2, "num_gpu_blocks_override": 12, "max_num_batched_tokens": 64},
    {"max_loras": 1, "max_num_seqs": 4},
    {"max_loras": 2, "attention_backend": "triton", "max_num_batched_tokens": 64},
], ids=["batched", "chunked-prefill", "preempted", "one-slot-adapters-take-turns", "triton-kernels"])
def test_adapters_and_the_base_in_one_batch_equal_peft_merged(tiny: dict[str, Any], engine_args: dict) -> None:
    requests = _requests(tiny)
    names = ["base", "a", "b", "a", "base", "b"]
    llm = LLM(tiny["base"], **(BASE_ARGS | engine_args))
    outputs = llm.generate(tiny["prompts"], GREEDY, use_tqdm=False, lora_request=[requests[n] for n in names])
    for i, (name, output) in enumerate(zip(names, outputs, strict=True)):
        assert output.outputs[0].token_ids == tiny["reference"][name][i], (name, i)
    runner = llm.engine_core.executor.worker.model_runner
    assert runner.lora.triton == (engine_args.get("attention_backend") == "triton")
    scheduler = llm.engine_core.scheduler
    if "num_gpu_blocks_override" in engine_args:
        assert scheduler.num_preemptions > 0
    pool = scheduler.kv_cache_manager.block_pool
    assert pool.get_num_free_blocks() == pool.num_usable_blocks  # nothing leaked


@pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                    reason="needs torch.distributed with gloo")
def test_two_tensor_parallel_ranks_equal_peft_merged(tiny: dict[str, Any]) -> None:
    """Each rank cuts A and B as its layers cut their weights (B's rows on q/k/v and gate/up, A's columns on o and
    down); a row-parallel layer's all-reduce sums the adapters' partial products with the weight's."""
    requests = _requests(tiny)
    names = ["a", "base", "b", "b", "a", "base"]
    llm = LLM(tiny["base"], tensor_parallel_size=2, **(BASE_ARGS | {"max_loras": 2, "max_num_batched_tokens": 32,
                                                                     "max_num_seqs": 4}))
    try:
        outputs = llm.generate(tiny["prompts"], GREEDY, use_tqdm=False, lora_request=[requests[n] for n in names])
    finally:
        llm.engine_core.shutdown()
    for i, (name, output) in enumerate(zip(names, outputs, strict=True)):
        assert output.outputs[0].token_ids == tiny["reference"][name][i], (name, i)


def test_prefix_cache_hits_stay_within_an_adapter(tiny: dict[str, Any]) -> None:
    """The same prompt under the base model and an adapter hashes to other blocks; under the same adapter it hits."""
    prompt = tiny["prompts"][3]
    a = LoRARequest("a", 1, str(tiny["adapters"]["a"]))
    hashes = {key: Request("r", prompt, GREEDY, None, 16, lora_request=lora).block_hashes
              for key, lora in [("base", None), ("a", a), ("a-again", LoRARequest("a", 1, "/elsewhere")),
                                ("a-reloaded", LoRARequest("a", 2, str(tiny["adapters"]["a"])))]}
    assert len(hashes["base"]) == 2
    assert hashes["a"] == hashes["a-again"]  # the id is the key
    assert not set(hashes["base"]) & set(hashes["a"]) and not set(hashes["a"]) & set(hashes["a-reloaded"])
    llm = LLM(tiny["base"], **(BASE_ARGS | {"max_loras": 2}))
    cached = []
    for lora, name in [(None, "base"), (a, "a"), (a, "a")]:
        output = llm.generate([prompt], GREEDY, use_tqdm=False, lora_request=lora)[0]
        assert output.outputs[0].token_ids == tiny["reference"][name][3]
        cached.append(output.num_cached_tokens)
    assert cached == [0, 0, 32]  # only the second "a" hit: the first's two full blocks


def test_the_scheduler_runs_at_most_max_loras_adapters() -> None:
    scheduler = Scheduler(SchedulerConfig(8, 256, 128, max_loras=1), CacheConfig(32, 16, True))
    loras = [LoRARequest("x", 1, "/x"), LoRARequest("y", 2, "/y"), None, LoRARequest("x", 1, "/x")]
    for i, lora in enumerate(loras):
        scheduler.add_request(Request(f"r{i}", [5] * 10, GREEDY, None, 16, lora_request=lora))
    output = scheduler.schedule()
    assert sorted(r.req_id for r in output.scheduled_new_reqs) == ["r0", "r2"]
    assert [r.request_id for r in scheduler.waiting] == ["r1", "r3"]  # kept their places
    scheduler.finish_requests(["r0"], RequestStatus.FINISHED_ABORTED)
    assert [r.req_id for r in scheduler.schedule().scheduled_new_reqs] == ["r1"]


def test_a_request_waiting_for_a_slot_is_not_starved_by_the_running_adapter() -> None:
    """Behind a request that waits for a slot, requests of the running adapter wait too (the base model's do not),
    so the slot drains and it runs next, though a steady stream of requests of that adapter keeps coming."""
    scheduler = Scheduler(SchedulerConfig(8, 256, 128, max_loras=1), CacheConfig(64, 16, True))
    x, c = LoRARequest("x", 1, "/x"), LoRARequest("c", 2, "/c")
    scheduler.add_request(Request("x0", [5] * 10, GREEDY, None, 16, lora_request=x))
    assert [r.req_id for r in scheduler.schedule().scheduled_new_reqs] == ["x0"]
    scheduler.add_request(Request("c0", [5] * 10, GREEDY, None, 16, lora_request=c))
    scheduler.add_request(Request("x1", [5] * 10, GREEDY, None, 16, lora_request=x))
    scheduler.add_request(Request("base", [5] * 10, GREEDY, None, 16))
    assert [r.req_id for r in scheduler.schedule().scheduled_new_reqs] == ["base"]
    assert [r.request_id for r in scheduler.waiting] == ["c0", "x1"]
    scheduler.finish_requests(["x0"], RequestStatus.FINISHED_ABORTED)
    assert [r.req_id for r in scheduler.schedule().scheduled_new_reqs] == ["c0"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_kernel_equals_the_torch_products(dtype: torch.dtype) -> None:
    """One launch per half over segments of one slot each (runs of several requests, base rows between them
    untouched), against the per-slot torch products; on the CPU in the Triton interpreter."""
    pytest.importorskip("triton")
    torch.manual_seed(0)
    mapping = LoRAMapping()
    layer = LoRALayer(mapping, num_slots=3, max_rank=8, input_size=40, output_sizes=[24, 8, 8], dtype=dtype,
                      device=torch.device("cpu"))
    for slot, rank in enumerate([8, 3, 5]):
        for part, size in enumerate(layer.output_sizes):
            layer.set_part(slot, part, torch.randn(rank, 40, dtype=dtype), torch.randn(size, rank, dtype=dtype))
    token_slots = np.array([-1, 2, 2, 2, 0, -1, -1, 0, 0, 1] + [2] * 37 + [-1] * 3)
    x, out = torch.randn(len(token_slots), 40, dtype=dtype), torch.randn(len(token_slots), 40, dtype=dtype)
    results = {}
    for segments in (False, True):
        mapping.update(token_slots, torch.device("cpu"), segments)
        results[segments] = layer.add_to(x, out.clone())
    assert mapping.segments.tolist() == [[1, 3, 2], [4, 1, 0], [7, 2, 0], [9, 1, 1], [10, 37, 2]]
    assert mapping.max_segment_len == 37
    base = token_slots < 0
    assert torch.equal(results[True][base], out[base]) and not torch.equal(results[True][~base], out[~base])
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(results[True], results[False], rtol=tolerance, atol=tolerance * 10)
    # A CUDA graph's decode step: one static row per token, padded to the captured size, rewritten each step.
    mapping.allocate_graph_rows(8, torch.device("cpu"))
    decode_slots = np.array([1, -1, 0, 2, 1])
    mapping.update(decode_slots, torch.device("cpu"), segments=True)
    assert mapping.graph_rows.tolist() == [[0, 1, 1], [1, 0, 0], [2, 1, 0], [3, 1, 2], [4, 1, 1], [5, 0, 0],
                                           [6, 0, 0], [7, 0, 0]]
    expected = layer.add_to(x[:5], out[:5].clone())
    mapping.capture_rows(8)
    graphed = layer.add_to(x[:8], out[:8].clone())
    torch.testing.assert_close(graphed[:5], expected, rtol=tolerance, atol=tolerance * 10)
    assert torch.equal(graphed[5:], out[5:8])  # padding untouched


# --------------------------------------------------------------------------- adapters that do not fit


def test_adapters_are_checked_against_the_model_and_the_limits(tiny: dict[str, Any], tmp_path: Path) -> None:
    hf_config = AutoModelForCausalLM.from_pretrained(tiny["base"]).config
    a = tiny["adapters"]["a"]
    assert check_adapter(a, hf_config, 8).rank == 8
    with pytest.raises(AdapterError, match="rank 8 is above --max-lora-rank 4"):
        check_adapter(a, hf_config, 4)
    with pytest.raises(AdapterError, match="no LoRA adapter folder"):
        check_adapter(tmp_path / "missing", hf_config, 8)
    other = tmp_path / "other-base"
    tiny_hf_model("llama", other, tie_word_embeddings=False, hidden_size=32)
    wrong = random_lora_adapter(str(other), tmp_path / "wrong", rank=4, targets=["q_proj"], seed=3)
    with pytest.raises(AdapterError, match="trained for another base model"):
        check_adapter(wrong, hf_config, 8)
    for setting, value in [("use_dora", True), ("bias", "all"), ("modules_to_save", ["lm_head"])]:
        bad = tmp_path / setting
        bad.mkdir()
        config = json.loads((a / "adapter_config.json").read_text()) | {setting: value}
        (bad / "adapter_config.json").write_text(json.dumps(config))
        with pytest.raises(AdapterError, match=f"{setting} is not served"):
            check_adapter(bad, hf_config, 8)
    # A mixture of experts serves adapters on its attention only; Phi-3 on o_proj and down_proj.
    for overrides, kind in [({"num_local_experts": 4}, "gate_proj"), ({"model_type": "phi3"}, "q_proj")]:
        other_config = hf_config.__class__.from_dict(hf_config.to_dict() | overrides)
        other_config.model_type = overrides.get("model_type", hf_config.model_type)
        with pytest.raises(AdapterError, match="does not serve adapters on") as refused:
            check_adapter(a, other_config, 8)
        assert kind not in str(refused.value).split("(layers")[1]
    embedding = tmp_path / "embedding"
    embedding.mkdir()
    (embedding / "adapter_config.json").write_text((a / "adapter_config.json").read_text())
    save_file({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(8, 256)},
              str(embedding / "adapter_model.safetensors"))
    with pytest.raises(AdapterError, match="embed_tokens.lora_embedding_A is not the lora_A or lora_B"):
        check_adapter(embedding, hf_config, 8)


@pytest.mark.parametrize(("settings", "message"), [
    ({"lora_modules": ["a=/x"]}, "lora_modules needs enable_lora"),
    ({"enable_lora": True, "max_loras": 0}, "max_loras must be >= 1"),
    ({"enable_lora": True, "max_loras": 2, "max_cpu_loras": 1}, "max_cpu_loras"),
    ({"enable_lora": True, "lora_modules": ["nameonly"]}, "name=path"),
    ({"enable_lora": True, "lora_modules": ['{"name": "a", "paht": "/x"}']}, "keys name, path"),
    ({"enable_lora": True, "runner": "pooling"}, "enable_lora is for --runner generate"),
])
def test_lora_settings_are_checked(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(**settings)


def test_lora_modules_parse_both_forms() -> None:
    assert LoRAModulePath.parse("sql=/a/b") == LoRAModulePath("sql", "/a/b")
    assert LoRAModulePath.parse('{"name": "sql", "path": "/a", "base_model_name": "m"}') == LoRAModulePath(
        "sql", "/a", "m")


# --------------------------------------------------------------------------- the server


@pytest.fixture(scope="module")
def lora_server(tiny: dict[str, Any], serve_fresh_engine: Any, monkeypatch_module: Any) -> Served:
    monkeypatch_module.setenv("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "True")
    return serve_fresh_engine(model=tiny["base"], max_loras=2, lora_modules=[f"a={tiny['adapters']['a']}"],
                              **BASE_ARGS)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Any:
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def _complete(client: openai.OpenAI, model: str, prompts: list[list[int]]) -> list[str]:
    response = client.completions.create(model=model, prompt=prompts, max_tokens=MAX_TOKENS, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert response.model == model
    return [choice.text for choice in sorted(response.choices, key=lambda c: c.index)]


@pytest.fixture(scope="module")
def texts(tiny: dict[str, Any]) -> dict[str, list[str]]:
    """Each adapter's (and the base model's) reference tokens as text, detokenized as the server streams them (a
    byte-level token may end inside a character, which a whole decode renders otherwise): ``LLM``'s, whose tokens
    are checked against transformers + PEFT here again."""
    llm = LLM(tiny["base"], **(BASE_ARGS | {"max_loras": 2}))
    texts = {}
    for name, lora in _requests(tiny).items():
        outputs = llm.generate(tiny["prompts"], GREEDY, use_tqdm=False, lora_request=lora)
        assert [output.outputs[0].token_ids for output in outputs] == tiny["reference"][name]
        texts[name] = [output.outputs[0].text for output in outputs]
    return texts


def test_the_server_routes_model_names_to_adapters(lora_server: Served, tiny: dict[str, Any],
                                                   texts: dict[str, list[str]]) -> None:
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="unused", max_retries=0)
    base_name = Path(tiny["base"]).name
    models = {card.id: card for card in client.models.list().data}
    assert set(models) == {base_name, "a"}
    assert models["a"].model_extra["parent"] == base_name and models["a"].model_extra["root"] == str(
        tiny["adapters"]["a"])
    prompts = tiny["prompts"]
    assert _complete(client, "a", prompts) == texts["a"]
    assert _complete(client, base_name, prompts) == texts["base"]
    with pytest.raises(openai.NotFoundError, match="`b` does not exist; this server serves `.*` and the LoRA adapters"
                                                   " `a`"):
        _complete(client, "b", prompts[:1])
    # vLLM's LoRA info gauge, as gateways read it: the slots and the adapters of running and waiting requests.
    metrics = httpx.get(f"{lora_server.url}/metrics", timeout=30).text
    for name in ("pagedserve:lora_requests_info", "vllm:lora_requests_info"):
        assert f'{name}{{max_lora="2",model_name="{base_name}",running_lora_adapters="",waiting_lora_adapters=""}}' \
            in metrics, metrics


def test_an_adapter_whose_folder_changed_fails_its_requests_alone(lora_server: Served, tiny: dict[str, Any],
                                                                  texts: dict[str, list[str]], tmp_path: Path) -> None:
    """Checked when added, then broken on disk before the worker read it: its request fails with the reason,
    the engine and the other requests go on."""
    folder = tmp_path / "changing"
    shutil.copytree(tiny["adapters"]["b"], folder)
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="unused", max_retries=0)
    with httpx.Client(base_url=lora_server.url, timeout=60) as http:
        assert http.post("/v1/load_lora_adapter", json={"lora_name": "changing", "lora_path": str(folder)}
                         ).status_code == 200
        try:
            save_file({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)},
                      str(folder / "adapter_model.safetensors"))  # an A without its B
            with pytest.raises(openai.APIStatusError, match="adapter 'changing' cannot be served"):
                _complete(client, "changing", tiny["prompts"][:1])
            assert _complete(client, Path(tiny["base"]).name, tiny["prompts"]) == texts["base"]
            assert http.get("/health").status_code == 200
        finally:
            http.post("/v1/unload_lora_adapter", json={"lora_name": "changing"})


def test_every_generation_api_routes_to_the_adapter(lora_server: Served, tiny: dict[str, Any]) -> None:
    """Chat, the Responses API and the Messages API take an adapter's name as their model and answer with it."""
    base_name = Path(tiny["base"]).name
    user = [{"role": "user", "content": "Hello there"}]
    bodies = {"/v1/chat/completions": {"messages": user, "max_tokens": 8},
              "/v1/responses": {"input": "Hello there", "max_output_tokens": 8},
              "/v1/messages": {"messages": user, "max_tokens": 8}}
    with httpx.Client(base_url=lora_server.url, timeout=120) as http:
        for route, body in bodies.items():
            answers = {}
            for model in ("a", base_name):
                response = http.post(route, json=body | {"model": model, "temperature": 0})
                assert response.status_code == 200, (route, response.text)
                assert response.json()["model"] == model
                answers[model] = response.json()
            assert _text(answers["a"]) != _text(answers[base_name]), route  # the adapter ran
            assert http.post(route, json=body | {"model": "b"}).status_code == 404


def _text(answer: dict[str, Any]) -> str:
    """The generated text of a chat, Responses or Messages answer."""
    if "choices" in answer:
        return answer["choices"][0]["message"]["content"]
    if "output" in answer:
        return "".join(part["text"] for item in answer["output"] for part in item.get("content", []))
    return "".join(block["text"] for block in answer["content"])


def test_adapters_load_and_unload_at_run_time_with_clear_errors(lora_server: Served, tiny: dict[str, Any],
                                                                texts: dict[str, list[str]], tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=f"{lora_server.url}/v1", api_key="unused", max_retries=0)
    b = str(tiny["adapters"]["b"])
    with httpx.Client(base_url=lora_server.url, timeout=60) as http:
        response = http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": b})
        assert response.status_code == 200, response.text
        assert _complete(client, "b", tiny["prompts"]) == texts["b"]
        errors = [({"lora_name": "b", "lora_path": b}, "lora_name", "already served"),
                  ({"lora_name": "c", "lora_path": str(tmp_path / "none")}, "lora_path", "no LoRA adapter folder"),
                  ({"lora_name": "c", "lora_path": str(tiny["adapters"]["a"]), "base_model_name": "other"},
                   "base_model_name", "is not the served model"),
                  ({"lora_name": Path(tiny["base"]).name, "lora_path": b}, "lora_name", "the base model"),
                  ({"lora_name": "c", "lora_path": "/" + "x" * 300}, "lora_path", "cannot read")]
        for body, param, message in errors:
            response = http.post("/v1/load_lora_adapter", json=body)
            assert response.status_code == 400, response.text
            assert response.json()["error"]["param"] == param and message in response.json()["error"]["message"]
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "b"}).status_code == 200
        with pytest.raises(openai.NotFoundError, match="`b` does not exist"):
            _complete(client, "b", tiny["prompts"][:1])
        response = http.post("/v1/unload_lora_adapter", json={"lora_name": "b"})
        assert response.status_code == 404 and response.json()["error"]["param"] == "lora_name"
    assert lora_server.engine.get_stats().kv_cache_usage == 0.0
