"""configs/*.yaml and the README's configuration table against the settings dataclasses."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from pagedserve.engine.config import EngineArgs, parse_size
from pagedserve.server.app import ServerArgs
from pagedserve.server.cli import build_parser
from pagedserve.server.cli_args import load_config_file, resolve_settings
from pagedserve.server.config_table import SETTINGS_CLASSES, readme_table, render_config_table, shown_default

ROOT = Path(__file__).resolve().parent.parent
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
DEFAULT_YAML, CUDA_YAML = ROOT / "configs/default.yaml", ROOT / "configs/cuda.yaml"
FIELDS = {f.name: f for cls in SETTINGS_CLASSES for f in dataclasses.fields(cls)}
# A key in a file would override PAGEDSERVE_API_KEY: the files leave it out on purpose.
LEFT_OUT = {"api_key"}


def parse_serve(*argv: str) -> tuple[EngineArgs, ServerArgs]:
    return resolve_settings(build_parser().parse_args(["serve", *argv]))


def key_comments(path: Path) -> dict[str, str]:
    """Each top-level key of a YAML file -> the comment lines right above it, joined."""
    comments: dict[str, str] = {}
    block: list[str] = []
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            block.append(line.lstrip("# "))
        elif match := re.match(r"(\w+):", line):
            comments[match.group(1)] = " ".join(block)
            block = []
        else:
            block = []
    return comments


def test_both_config_files_exist() -> None:
    assert [p.name for p in CONFIGS] == ["cuda.yaml", "default.yaml"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_setting_is_in_the_file_and_loads(path: Path) -> None:
    settings = load_config_file(str(path))
    assert set(settings) == set(FIELDS) - LEFT_OUT
    engine_args, server_args = parse_serve("--config", str(path))
    loaded = dataclasses.asdict(engine_args) | dataclasses.asdict(server_args)
    for key, value in settings.items():
        assert loaded[key] == (parse_size(value) if key.endswith("_bytes") and value else value), key


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_key_is_documented_with_its_unit_and_default(path: Path) -> None:
    comments = key_comments(path)
    assert set(comments) == set(load_config_file(str(path)))
    for key, comment in comments.items():
        f = FIELDS[key]
        assert f.metadata["help"] in comment, key
        assert f"(default: {shown_default(f)})" in comment, key
        assert not f.metadata["unit"] or f"[{f.metadata['unit']}]" in comment, key


def test_default_yaml_is_cpu_and_cuda_yaml_is_bf16_on_a_gpu_fraction() -> None:
    cpu, _ = parse_serve("--config", str(DEFAULT_YAML))
    assert (cpu.device, cpu.dtype, cpu.model) == ("cpu", "float32", None)  # the embedded SmolLM2
    assert cpu.kv_cache_memory_bytes is None  # 2 GiB, or less where the memory (cgroup) is smaller
    gpu, _ = parse_serve("--config", str(CUDA_YAML))
    assert (gpu.device, gpu.dtype, gpu.kv_cache_memory_bytes) == ("cuda", "bfloat16", None)
    assert gpu.gpu_memory_utilization == 0.9
    assert gpu.max_num_seqs > cpu.max_num_seqs and gpu.max_num_batched_tokens > cpu.max_num_batched_tokens


def test_unknown_keys_are_rejected_by_name(tmp_path: Path) -> None:
    config = tmp_path / "typo.yaml"
    config.write_text(DEFAULT_YAML.read_text() + "max_batch_size: 8\ngpu_util: 0.5\n")
    with pytest.raises(ValueError, match=r"typo.yaml: unknown keys gpu_util, max_batch_size; known keys: model, "):
        load_config_file(str(config))


def test_flags_override_the_config_file() -> None:
    engine_args, server_args = parse_serve("--config", str(DEFAULT_YAML), "--max-num-seqs", "8",
                                           "--log-format", "json", "--access-log", "--log-stats-interval-s", "0",
                                           "--port", "9001")
    assert engine_args.max_num_seqs == 8 and engine_args.device == "cpu"
    assert (server_args.log_format, server_args.access_log, server_args.log_stats_interval_s) == ("json", True, 0)
    assert server_args.port == 9001


def test_readme_configuration_table_is_the_generated_one() -> None:
    readme = ROOT / "README.md"
    how = ("put `<!-- config-table:start -->` and `<!-- config-table:end -->` in README.md and paste the output "
           "of `python -m pagedserve.server.config_table` between them")
    if not readme.is_file():
        pytest.fail(f"README.md is missing: write it, then {how}")
    table = readme_table(readme.read_text())
    if table is None:
        pytest.fail(f"README.md has no configuration table markers: {how}")
    assert table == render_config_table(), f"README.md's configuration table is out of date: {how}"


def test_generated_table_has_one_row_per_setting() -> None:
    table = render_config_table()
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == list(FIELDS)
    assert "| `enable_prefix_caching` | `--[no-]enable-prefix-caching` | `true` |  |" in table
    assert "| `max_num_seqs` | `--max-num-seqs` | `64` | requests | Most requests running in one step |" in table
    assert "&lt;key&gt;" in table and "one of `text`, `json`" in table
