"""The scheduler side, with no torch or numpy (vLLM's ``v1/core``): the scheduler, the KV cache manager and
its block pool, block hashing, and the protocols of the grammar manager and the drafter it calls.

``pagedserve.engine.engine_core``, the module beside this package, is the step loop that joins the scheduler
to the executor (vLLM's ``EngineCore``).
"""
