"""Executors: how the engine core reaches its workers (one in-process worker, or one process per tensor-parallel
rank); ``Executor.get_class`` picks one."""
