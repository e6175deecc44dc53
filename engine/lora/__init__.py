"""LoRA adapters served beside the base model (Hu et al., 2021, arXiv:2106.09685), as vLLM serves them.

``request``: ``LoRARequest``, the adapter a request runs with (vLLM's). ``peft``: reading and checking a PEFT folder.
``registry``: the adapters a server knows by name (``--lora-modules``, loaded and unloaded at run time). The worker's
side, slots of stacked A/B weights applied per token, is ``pagedserve.engine.worker.lora_manager`` over
``pagedserve.engine.model.lora``. docs/lora.md tells the whole story. Imports no torch model code: the frontend and
the scheduler import it.
"""
