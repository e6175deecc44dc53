"""The ``pagedserve`` command line: one namespace, ``python -m pagedserve``, what ``serve`` loads, its help."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pagedserve.server.cli import build_parser, main


def _python(code: str, *args: str) -> subprocess.CompletedProcess:
    # -P: the installed package, not the checkout's folders found through the current directory.
    return subprocess.run([sys.executable, "-P", *args] if not code else [sys.executable, "-P", "-c", code, *args],
                          capture_output=True, text=True, timeout=120)


def test_serve_loads_no_benchmark_code() -> None:
    code = ("import sys\nfrom pagedserve.server import cli\ncli.build_parser().parse_args(['serve', '--port', '1'])\n"
            "print(sorted(m for m in sys.modules if '.bench' in m or m.split('.')[0] in "
            "('benchmarks', 'engine', 'server')))")
    result = _python(code)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


def test_python_dash_m_pagedserve_is_the_command() -> None:
    result = _python("", "-m", "pagedserve", "--help")
    assert result.returncode == 0 and result.stdout.startswith("usage: pagedserve ")
    assert "{serve,bench}" in result.stdout


def test_bench_serve_parses_its_own_options(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "serve", "--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: pagedserve bench serve ") and "--max-concurrency" in out


def test_bench_serve_runs_the_load_generator_with_its_options(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedserve.server.bench import serve as bench_serve

    seen = []
    monkeypatch.setattr(bench_serve, "run", lambda args: seen.append(args) or 7)
    assert main(["bench", "serve", "--num-prompts", "3", "--endpoint", "chat"]) == 7
    assert (seen[0].num_prompts, seen[0].endpoint) == (3, "chat")


def test_serve_refuses_an_unknown_flag(capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["serve", "--no-such-flag"])
    assert exit_.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_help_lists_choices_without_none() -> None:
    help_text = build_parser()._subparsers._group_actions[0].choices["serve"].format_help()
    assert "--quantization {gguf,int8,int4}" in help_text and "None" not in help_text.split("--quantization")[1][:30]
