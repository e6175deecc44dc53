"""Where an engine step's time goes, read from the regions the engine marks itself.

``EngineCore.step`` runs inside the region ``engine_core.step`` and each of its
phases inside a region of its own (``pagedserve.engine.profiling.region``); the attention
backends mark each layer's call ``attention``, inside the forward. A region is a
``torch.profiler.record_function`` while a profiler records, so its
``cpu_time_total`` in the profiler's key averages is the host wall time spent
inside it, all calls together. Nothing is patched: the benchmark only reads.

On CUDA these are host times: kernels run asynchronously, so the device's work
shows where the host waits for it (the copy of the sampled ids in
``model_runner.sample``), and a replayed CUDA graph runs the forward without
its per-layer Python, so no ``attention`` region is recorded then.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

STEP_REGION = "engine_core.step"
#: The phases of one step, in the order they run; none runs inside another.
PHASE_REGIONS = (
    "scheduler.schedule",
    "model_runner.update_states",
    "model_runner.prepare_inputs",
    "model_runner.forward",
    "model_runner.compute_logits",
    "model_runner.sample",
    "scheduler.update_from_output",
)
FORWARD_REGION = "model_runner.forward"
#: Marked once per layer per step, inside the forward.
ATTENTION_REGION = "attention"
#: Rows of a breakdown besides the regions themselves.
ATTENTION_ROW = "  of which attention, all layers (KV write + paged attention)"
REST_ROW = "rest of the step (outside the regions above)"


def step_breakdown(events: Mapping[str, Any], steps: int) -> dict[str, float]:
    """Milliseconds per step of each region, from the profiler's key averages over ``steps`` steps.

    Args:
        events: region name -> its averaged event (``FunctionEventAvg``: ``count``, ``cpu_time_total`` in us),
            as ``{e.key: e for e in profiler.key_averages()}``.
        steps: engine steps the profiler recorded; every one must have run every phase (a decode step does).

    Returns:
        ``STEP_REGION``, then each of ``PHASE_REGIONS`` with ``ATTENTION_ROW`` after the forward when attention
        regions were recorded, then ``REST_ROW``: the step's time outside every phase.

    Raises:
        ValueError: when the step or a phase was not recorded exactly once per step, naming it (the engine
            renamed a region, or a step ran without it).
    """
    counts = {name: events[name].count if name in events else 0 for name in (STEP_REGION, *PHASE_REGIONS)}
    wrong = {name: count for name, count in counts.items() if count != steps}
    if wrong:
        raise ValueError(f"expected each engine region once in each of {steps} steps, got counts {wrong}")

    def per_step_ms(name: str) -> float:
        return events[name].cpu_time_total / steps / 1e3

    breakdown = {STEP_REGION: per_step_ms(STEP_REGION)}
    for name in PHASE_REGIONS:
        breakdown[name] = per_step_ms(name)
        if name == FORWARD_REGION and ATTENTION_REGION in events:
            breakdown[ATTENTION_ROW] = per_step_ms(ATTENTION_REGION)
    breakdown[REST_ROW] = breakdown[STEP_REGION] - sum(breakdown[name] for name in PHASE_REGIONS)
    return breakdown


@dataclass(frozen=True)
class StepProfile:
    """What ``profile_steps`` measured.

    Attributes:
        breakdown_ms: ``step_breakdown`` of the profiled steps.
        sampled: tokens each profiled step sampled.
        top_ops: the profiler's table of ops by self CPU time.
    """

    breakdown_ms: dict[str, float]
    sampled: list[int]
    top_ops: str


def profile_steps(step: Callable[[], int], steps: int) -> StepProfile:
    """Run ``step`` (one engine step, returning the tokens it sampled) ``steps`` times under ``torch.profiler``."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profiler:
        sampled = [step() for _ in range(steps)]
    averages = profiler.key_averages()
    return StepProfile(step_breakdown({e.key: e for e in averages}, steps), sampled,
                       averages.table(sort_by="self_cpu_time_total", row_limit=20))
