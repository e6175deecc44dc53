"""The OpenAPI spec says what the server answers: schemathesis sends generated requests, valid and
invalid, to the live test server and checks every status code, content type and JSON body against
the spec; and real responses of the generation routes validate against their documented schemas."""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.conftest import Served, sse_payloads

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
#: Generated requests per operation and generation mode: about 40 s on two shared CPU cores in all.
EXAMPLES_PER_OPERATION = 12
USER = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def api(served: Served) -> Any:
    return schemathesis.openapi.from_url(f"{served.url}/openapi.json")


def _bounded(case: Any) -> Any:
    """``case`` with at most 2 output tokens: a generated valid ``max_tokens`` may be the whole context,
    minutes of generation on a CPU. Other fields stay as generated, so the body may still be invalid."""
    if isinstance(case.body, dict) and case.path in ("/v1/completions", "/v1/chat/completions"):
        case.body["max_tokens"] = 2
        case.body.pop("max_completion_tokens", None)
        case.body["n"] = 1
    if isinstance(case.body, dict) and case.path == "/v1/responses":
        case.body["max_output_tokens"] = 2
    if isinstance(case.body, dict) and case.path == "/v1/messages":
        case.body["max_tokens"] = 2
    return case


def test_the_spec_documents_what_the_server_answers(api: Any, served: Served) -> None:
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/health", "/metrics"}
    strategy = st.one_of([op.as_strategy(generation_mode=mode).map(_bounded)
                          for op in operations for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])

    statuses: list[int] = []

    @settings(max_examples=EXAMPLES_PER_OPERATION * len(operations) * 2, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case: Any) -> None:
        statuses.append(case.call_and_validate(base_url=served.url, checks=CHECKS, timeout=60).status_code)

    check()
    # It ran, and reached both the answers and the refusals.
    assert len(statuses) >= 5 * len(operations) and {200, 400} <= set(statuses), sorted(set(statuses))


def test_no_422_and_real_status_codes(client: httpx.Client) -> None:
    spec = client.get("/openapi.json").json()
    for path, operations in spec["paths"].items():
        for operation in operations.values():
            assert "422" not in operation["responses"], path
    completions = spec["paths"]["/v1/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "429", "503"} <= set(completions)
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    # A stream is described event by event, as schemathesis parses it (a string schema failed the fuzz
    # test whenever it generated stream: true).
    event = completions["200"]["content"]["text/event-stream"]["schema"]
    assert event["type"] == "object" and event["properties"]["data"] == {"type": "string"}
    assert set(spec["paths"]["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    assert "content" not in spec["paths"]["/health"]["get"]["responses"]["200"]
    assert client.get("/health").content == b""


def _schema(spec: dict[str, Any], name: str) -> dict[str, Any]:
    """Component ``name`` as a standalone JSON schema (its references resolve in ``spec``)."""
    return {"$ref": f"#/components/schemas/{name}", "components": spec["components"]}


@pytest.mark.parametrize(("path", "body", "name"), [
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 3, "logprobs": 2, "echo": True}, "CompletionResponse"),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 2, "prompt_logprobs": 1}, "CompletionResponse"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 3, "logprobs": True, "top_logprobs": 2},
     "ChatCompletionResponse"),
    ("/v1/chat/completions", {"messages": USER, "max_tokens": 2, "prompt_logprobs": 1}, "ChatCompletionResponse"),
    ("/v1/messages", {"model": "SmolLM2-135M-Instruct", "messages": USER, "max_tokens": 2}, "Message"),
])
def test_real_responses_validate_against_the_spec(client: httpx.Client, path: str, body: dict[str, Any],
                                                  name: str) -> None:
    spec = client.get("/openapi.json").json()
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    jsonschema.validate(response.json(), _schema(spec, name))
    error = client.post(path, json={**body, "temperature": -1})
    jsonschema.validate(error.json(), _schema(spec, "AnthropicErrorResponse" if path == "/v1/messages" else
                                               "ErrorResponse"))


def test_streamed_responses_are_server_sent_events(client: httpx.Client) -> None:
    with client.stream("POST", "/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "stream": True}) as r:
        assert r.headers["content-type"].startswith("text/event-stream")
        assert sse_payloads(r.iter_lines())[-1] == "[DONE]"
