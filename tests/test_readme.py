"""The examples of README.md and of docs/*.md, run as written against the real server, must answer sensibly.

Which blocks run:

- every ``curl`` command in a ```` ```sh ```` block. Commands are separated by
  a blank line or a comment line; a command may continue over several lines
  (a trailing backslash, or a quoted JSON body spanning lines);
- every ```` ```python ```` block, as a script of its own (``python -c``).

A block that cannot run here (it needs an API key, another model, ...) is
marked by the line ``<!-- readme-test: skip -->`` right above its fence.
Other blocks (``make``, ``docker``, plain text) are not run.

The README's address, ``http://127.0.0.1:8000``, is replaced by the test
server's (the session's ``served`` app with the embedded SmolLM2). Each
example must exit 0 and return valid JSON or a valid SSE stream ending in
``[DONE]``, and its answer must be non-empty, mostly ASCII words. Each
generation request must set ``temperature``: without it the server samples at
1.0, where the embedded model writes gibberish. A greedy example must also
give the answer listed for its prompt in ``GREEDY_ANSWERS``: add your
prompt there (check the answer first) when you add a greedy example.
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import Served, sse_payloads

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
README_URL = "http://127.0.0.1:8000"
SKIP_MARKER = "<!-- readme-test: skip -->"
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/messages")
#: Prompt (a substring of it) -> regex its greedy answer must match, as SmolLM2-135M-Instruct answers.
GREEDY_ANSWERS = {"capital of France": r"\bParis\b"}
#: An offline example loads a second engine in its subprocess: allow for the model load.
TIMEOUT_S = 300


DOCS = [README, *sorted((ROOT / "docs").glob("*.md"))]


@dataclass
class Example:
    kind: str   # "curl" or "python"
    line: int   # line of its file where the command or block starts
    code: str
    file: str = "README.md"  # relative to the repository

    @property
    def id(self) -> str:
        return f"{self.file}:{self.line}-{self.kind}"


def _fenced_blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, first line number of the code, code) of each fenced block not marked to skip."""
    blocks = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            language = lines[i][3:].strip()
            start = i + 1
            end = next(j for j in range(start, len(lines)) if lines[j].startswith("```"))
            previous = next((line for line in reversed(lines[:i]) if line.strip()), "")
            if previous.strip() != SKIP_MARKER:
                blocks.append((language, start + 1, "\n".join(lines[start:end])))
            i = end
        i += 1
    return blocks


def readme_examples(text: str, file: str = "README.md") -> list[Example]:
    examples = []
    for language, first_line, code in _fenced_blocks(text):
        if language == "python":
            examples.append(Example("python", first_line, code, file))
        elif language in ("sh", "bash", "shell"):
            command: list[str] = []
            for offset, line in enumerate([*code.splitlines(), ""]):
                if not line.strip() or line.lstrip().startswith("#"):
                    if command and command[0].startswith("curl "):
                        examples.append(Example("curl", first_line + offset - len(command), "\n".join(command), file))
                    command = []
                else:
                    command.append(line)
    return examples


EXAMPLES = [example for doc in DOCS for example in readme_examples(doc.read_text(), doc.relative_to(ROOT).as_posix())]


def _curl_request(command: str) -> tuple[str, dict[str, Any]]:
    """The URL path and the JSON body (empty without one) of a curl command."""
    argv = shlex.split(command)
    assert argv.count("curl") == 1, f"one curl command per paragraph, separated by a blank line: {command}"
    url = next(arg for arg in argv if arg.startswith("http"))
    body: dict[str, Any] = {}
    for flag in ("-d", "--data", "--data-raw"):
        if flag in argv:
            body = json.loads(argv[argv.index(flag) + 1])
    return "/" + url.split("/", 3)[3], body


def _prompt_text(body: dict[str, Any]) -> str:
    if "messages" in body:
        return " ".join(str(m.get("content", "")) for m in body["messages"])
    return str(body.get("prompt", ""))


def assert_sensible(text: str, prompt: str, greedy: bool) -> None:
    assert text.strip(), "the answer is empty"
    ascii_share = sum(c.isascii() for c in text) / len(text)
    assert ascii_share >= 0.95, f"mostly non-ASCII answer: {text!r}"
    assert re.search(r"[A-Za-z]{2,}", text), f"no word in the answer: {text!r}"
    if greedy:
        expected = [answer for key, answer in GREEDY_ANSWERS.items() if key in prompt]
        assert expected, f"add the greedy answer to {prompt!r} to GREEDY_ANSWERS"
        for answer in expected:
            assert re.search(answer, text), f"{prompt!r} -> {text!r}, expected {answer}"


def _run(args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert result.returncode == 0, f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    return result


def _with_test_server(code: str, served: Served) -> str:
    code = code.replace(README_URL, served.url)
    assert ":8000" not in code, f"examples must use {README_URL}, which the test replaces"
    return code


def _check_curl(example: Example, served: Served) -> None:
    path, body = _curl_request(example.code)
    # --fail-with-body makes an HTTP error a non-zero exit, still showing the error body.
    command = _with_test_server(example.code, served).replace("curl ", "curl --fail-with-body ", 1)
    stdout = _run(["bash", "-c", command]).stdout
    if path not in GENERATION_PATHS:
        return
    assert "temperature" in body, "set temperature: the embedded model has no generation config"
    key = "text" if path == "/v1/completions" else "content"
    if body.get("stream"):
        events = sse_payloads(stdout.splitlines())
        assert events and events[-1] == "[DONE]", stdout
        chunks = events[:-1]
        assert chunks and all(isinstance(c, dict) and "error" not in c for c in chunks), stdout
        text = "".join((choice.get("delta", choice).get(key) or "") for c in chunks for choice in c["choices"])
        if body.get("stream_options", {}).get("include_usage"):
            assert chunks[-1]["usage"]["completion_tokens"] > 0, chunks[-1]
    elif path == "/v1/messages":  # Anthropic's shape: content blocks
        text = "".join(block.get("text", "") for block in json.loads(stdout)["content"])
    else:
        response = json.loads(stdout)
        choice = response["choices"][0]
        text = choice["text"] if key == "text" else choice["message"]["content"]
    assert_sensible(text, _prompt_text(body), greedy=body["temperature"] == 0)


def _check_python(example: Example, served: Served) -> None:
    for call in ast.walk(ast.parse(example.code)):
        if isinstance(call, ast.Call):
            name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
            if name in ("create", "stream", "SamplingParams"):
                # The anthropic SDK (2.x) has no sampling arguments: it sends them in extra_body.
                assert any(k.arg == "temperature" or (k.arg == "extra_body" and "temperature" in ast.unparse(k.value))
                           for k in call.keywords), (
                    f"line {call.lineno} of the block: set temperature, the embedded model has no generation config")
    stdout = _run([sys.executable, "-c", _with_test_server(example.code, served)]).stdout
    # The script's prompts that have a known greedy answer must show it; the whole output must read as text.
    prompts = [key for key in GREEDY_ANSWERS if key in example.code]
    assert_sensible(stdout, " ".join(prompts), greedy=bool(prompts))


def test_readme_has_curl_and_python_examples() -> None:
    kinds = {example.kind for example in EXAMPLES if example.file == "README.md"}
    assert kinds == {"curl", "python"}, f"found {[e.id for e in EXAMPLES]}"


@pytest.mark.parametrize("example", EXAMPLES, ids=[example.id for example in EXAMPLES])
def test_readme_example_answers_sensibly(example: Example, served: Served) -> None:
    if example.kind == "curl":
        _check_curl(example, served)
    else:
        _check_python(example, served)


def test_docs_link_only_to_files_in_the_repository() -> None:
    """The repository stands on its own: no link to a file outside it or missing from it."""
    for doc in DOCS:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)#\s]+)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            path = (doc.parent / target).resolve()
            assert path.is_relative_to(ROOT), f"{doc.name} links outside the repository: {target}"
            assert path.exists(), f"{doc.name} links to a missing file: {target}"
        assert "../shared" not in text, f"{doc.name} refers to a file outside the repository"
