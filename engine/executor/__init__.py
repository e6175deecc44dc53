"""Executors: how the engine core reaches its workers (one in-process worker now; one process per rank later)."""
