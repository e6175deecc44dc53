"""The check's summary: ``gpu_check_<device>.json`` (the results as measured) and ``.md`` (goals, then tables)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.gpu import attention_kernels, decode_throughput, greedy_parity, lora, tensor_parallel
from benchmarks.gpu.markdown import fmt

#: Section name -> its title and the Markdown of its data, in check order.
SECTIONS: dict[str, tuple[str, Callable[[dict[str, Any]], list[str]]]] = {
    greedy_parity.NAME: (greedy_parity.TITLE, greedy_parity.markdown),
    attention_kernels.NAME: (attention_kernels.TITLE, attention_kernels.markdown),
    decode_throughput.THROUGHPUT: (decode_throughput.THROUGHPUT_TITLE, decode_throughput.throughput_markdown),
    decode_throughput.DECODE: (decode_throughput.DECODE_TITLE, decode_throughput.decode_markdown),
    tensor_parallel.NAME: (tensor_parallel.TITLE, tensor_parallel.markdown),
    lora.NAME: (lora.TITLE, lora.markdown),
}


def goals(sections: dict[str, dict[str, Any]]) -> list[str]:
    """The issue's goals, each as a line saying what was measured (or that it was not)."""
    lines = greedy_parity.goals(sections.get(greedy_parity.NAME, {}))
    lines += decode_throughput.decode_goals(sections.get(decode_throughput.DECODE, {}))
    lines += tensor_parallel.goals(sections.get(tensor_parallel.NAME, {}))
    lines += lora.goals(sections.get(lora.NAME, {}))
    return lines or ["No goal was measured in this run."]


def render_markdown(results: dict[str, Any]) -> str:
    """The Markdown summary of a results dict (as ``benchmarks.gpu_check.run_check`` builds it)."""
    meta = results["meta"]
    lines = [f"# GPU check ({meta['device']}{', quick' if meta.get('quick') else ''})", "",
             f"{meta.get('device_name', '?')}; torch {meta.get('torch')}, triton {meta.get('triton')}, "
             f"transformers {meta.get('transformers')}; started {meta.get('started')}, "
             f"{fmt(meta.get('elapsed_s'))} s.", "", "## Goals", ""]
    if meta["device"] != "cuda":
        lines += ["- Dry run off CUDA: times and goals below say nothing about a GPU."]
    lines += [f"- {line}" for line in goals(results["sections"])]
    for name, section in results["sections"].items():
        title, markdown = SECTIONS[name]
        lines += ["", f"## {title} (`{name}`)", "",
                  f"Status: **{section['status']}** in {fmt(section.get('elapsed_s'))} s.", ""]
        if section.get("error"):
            lines += ["```", section["error"].rstrip(), "```", ""]
        if section.get("data"):
            lines += markdown(section["data"])
        if section.get("notes"):
            lines += [""] + [f"- {note}" for note in section["notes"]]
    return "\n".join(lines) + "\n"


def write_summary(results: dict[str, Any], out: Path) -> tuple[Path, Path]:
    """Write ``gpu_check_<device>.json`` and ``.md`` into ``out`` (created); returns both paths."""
    out.mkdir(parents=True, exist_ok=True)
    stem = f"gpu_check_{results['meta']['device']}"
    json_path, md_path = out / f"{stem}.json", out / f"{stem}.md"
    json_path.write_text(json.dumps(results, indent=2, default=str) + "\n")
    md_path.write_text(render_markdown(results))
    return json_path, md_path
