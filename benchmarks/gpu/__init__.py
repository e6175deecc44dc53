"""The device check's parts (``python -m benchmarks.gpu_check`` drives them), one module per measurement.

- ``greedy_parity``: the engine's greedy outputs against transformers' on tiny models;
- ``attention_kernels``: the Triton attention backend against the torch reference, error and time;
- ``decode_throughput``: offline throughput, and decode step time and breakdown against the roofline;
- ``report``: the JSON and Markdown summary;
- ``context``: what the parts share while the check runs; ``fixtures``: models and prompts built in code;
  ``markdown``: table formatting.
"""
