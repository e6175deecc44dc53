"""EngineCore wiring: device selection, profiling forward, abort and cleanup steps (tiny model)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.tiny_models import tiny_hf_model
from pagedserve.engine.config import EngineArgs
from pagedserve.engine.engine_core import EngineCore
from pagedserve.engine.engine_factory import resolve_engine_config
from pagedserve.engine.model.loader import load_hf_config, load_model, resolve_model_path
from pagedserve.engine.request import EngineCoreRequest
from pagedserve.engine.sampling_params import SamplingParams
from pagedserve.engine.worker.worker import profile_forward, resolve_device
from tests.model_fixtures import embedded_gguf_path


def make_core(**engine_args) -> EngineCore:
    return EngineCore(resolve_engine_config(EngineArgs(**engine_args)))


def add(core: EngineCore, request_id: str, prompt: list[int], params: SamplingParams) -> None:
    core.add_request(EngineCoreRequest(request_id, prompt, params, eos_token_id=None, arrival_time=0.0))


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("llama", folder, tie_word_embeddings=False)
    path = embedded_gguf_path()
    AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(folder)
    return str(folder)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU fallback")
def test_auto_device_picks_cpu_without_cuda(tiny_folder):
    assert resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ValueError, match="no CUDA device"):
        resolve_device("cuda")
    core = make_core(model=tiny_folder, device="auto", max_model_len=128, kv_cache_memory_bytes="4MiB")
    worker = core.executor.worker
    assert worker.device.type == "cpu" and worker.model_runner.cuda_graphs is None
    assert next(worker.model_runner.model.parameters()).dtype == torch.float32


def test_attention_backend_is_checked_against_the_device(tiny_folder, monkeypatch):
    from pagedserve.engine.model.triton_attention import TritonAttentionBackend

    assert make_core(model=tiny_folder, max_model_len=128, kv_cache_memory_bytes="4MiB",
                     attention_backend="torch").executor.worker.attention_backend == "torch"
    # The tests run Triton on the CPU (TRITON_INTERPRET=1); outside them it is CUDA only.
    monkeypatch.setattr(TritonAttentionBackend, "supported_devices", ("cuda",))
    with pytest.raises(ValueError, match="attention_backend 'triton'.*cpu"):
        make_core(model=tiny_folder, device="cpu", max_model_len=128, kv_cache_memory_bytes="4MiB",
                  attention_backend="triton")


def test_max_num_batched_tokens_below_max_num_seqs_is_refused_not_raised_silently():
    with pytest.raises(ValueError, match=r"max_num_batched_tokens \(32\) must be >= max_num_seqs \(64\)"):
        EngineArgs(max_num_batched_tokens=32, max_num_seqs=64)


def test_profile_forward_runs_the_largest_step(tiny_folder):
    """300 tokens over 2 sequences of at most max_model_len - 1 tokens (127, 127, 46), then logits for
    the 2 rows the sampler would take."""
    source = resolve_model_path(tiny_folder)
    model = load_model(source, load_hf_config(source), torch.float32, torch.device("cpu"))
    ran = {}
    forward, compute_logits = model.forward, model.compute_logits

    def recorded_forward(input_ids, positions, *args):
        ran["input_ids"], ran["positions"] = input_ids, positions.tolist()
        return forward(input_ids, positions, *args)

    def recorded_logits(hidden_states):
        ran["logits"] = compute_logits(hidden_states)
        return ran["logits"]

    model.forward, model.compute_logits = recorded_forward, recorded_logits
    profile_forward(model, num_tokens=300, num_seqs=2, max_model_len=128, block_size=16, dtype=torch.float32,
                    device=torch.device("cpu"))
    assert ran["input_ids"].shape == (300,)
    assert ran["positions"] == [*range(127), *range(127), *range(46)]
    assert ran["logits"].shape == (2, 256) and ran["logits"].isfinite().all()


def test_abort_is_applied_and_reported_in_a_cleanup_step(tiny_folder):
    core = make_core(model=tiny_folder, max_model_len=128, kv_cache_memory_bytes="4MiB")
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    add(core, "a", [5, 6, 7, 8], params)
    add(core, "b", [9, 10, 11], params)
    core.step()
    core.abort_requests(["a"])
    assert core.scheduler.kv_cache_manager.get_block_ids("a") == []
    outputs = core.step()
    assert {o.request_id for o in outputs} == {"b"}
    runner = core.executor.worker.model_runner
    assert "a" not in runner.requests
    core.abort_requests(["b"])
    assert core.has_unfinished_requests()  # the worker still has to hear about "b"
    assert core.step() == []
    assert not core.has_unfinished_requests() and runner.requests == {}
    assert core.make_stats().kv_cache_usage == 0.0


def test_prompt_logprobs_are_reported_once_despite_preemption(tiny_folder):
    """Regression: a preempted request recomputes its prompt and used to report its logprobs again."""
    from pagedserve.engine import LLM

    llm = LLM(tiny_folder, max_model_len=128, block_size=4, num_gpu_blocks_override=13,
              long_prefill_token_threshold=4)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, prompt_logprobs=1)
    prompts = [[(3 * i + k) % 200 + 3 for k in range(10)] for i in range(3)]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine_core.make_stats().num_preemptions > 0
    alone = LLM(tiny_folder, max_model_len=128, kv_cache_memory_bytes="4MiB").generate(
        prompts, params, use_tqdm=False)
    for out, ref in zip(outputs, alone, strict=True):
        assert len(out.prompt_logprobs) == 10 and out.prompt_logprobs[0] is None
        assert [e.token_ids[0] for e in out.prompt_logprobs[1:]] == out.prompt_token_ids[1:]
        for got, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:], strict=True):
            assert got.token_ids == want.token_ids
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_kv_cache_too_small_for_one_max_model_len_request_is_a_start_up_error(tiny_folder):
    """The tiny model keeps 2 x 2 layers x 2 KV heads x 16 x 4 bytes = 512 bytes per token: 64 KiB hold 128."""
    make_core(model=tiny_folder, max_model_len=112, kv_cache_memory_bytes="64KiB")
    with pytest.raises(ValueError, match="cannot hold one request of max_model_len 256 tokens.*at most 112"):
        make_core(model=tiny_folder, max_model_len=256, kv_cache_memory_bytes="64KiB")


def test_default_cpu_kv_cache_follows_available_memory(tiny_folder, monkeypatch):
    from pagedserve.engine.worker import kv_cache

    assert kv_cache.default_cpu_kv_cache_bytes(available=64 * 2**30) == 2 * 2**30
    assert kv_cache.default_cpu_kv_cache_bytes(available=2**30) == 2**29
    monkeypatch.setattr(kv_cache, "available_memory_bytes", lambda: 2**20)  # a container at its limit
    core = make_core(model=tiny_folder, max_model_len=128)
    assert (core.scheduler.kv_cache_manager.block_pool.num_blocks - 1) * 16 * 512 <= 2**19
