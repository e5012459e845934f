"""Fuzzing the HTTP API from outside with schemathesis, against the server's own /openapi.json.

Every operation the document lists gets generated requests, valid and invalid by the schema
(hypothesis underneath, a bounded example budget per operation), sent to a real `tokios serve`.
Each response must be no 5xx, match the documented status codes, content types and schemas,
reject data the schema forbids with a 4xx, and carry an Allow header on a 405. Data the schema
allows must reach the handler's logic: an operation that refuses every generated valid request
documents a schema looser than its validation (schemathesis's "schema validation mismatch"),
which fails the run. After the run the server must still answer, hold no KV block and no
request, and its invariants must hold.
The server runs with a short context so that a fuzzed `max_tokens` costs at most a few dozen
decode steps.
"""

from __future__ import annotations

import os
import re

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,
                                               response_schema_conformance, status_code_conformance)

from conftest import serve

FUZZ_MAX_MODEL_LEN = 96
# TOKIOS_FUZZ_EXAMPLES scales the budget for a longer run outside the suite (docs/reliability.md).
SCALE = float(os.environ.get("TOKIOS_FUZZ_EXAMPLES_SCALE", "1"))
EXAMPLES_PER_OPERATION = {GenerationMode.POSITIVE: int(20 * SCALE), GenerationMode.NEGATIVE: int(12 * SCALE)}
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance,
          negative_data_rejection]
# Every route the server has, as the document must list them (test_the_document_lists_every_route).
OPERATIONS = [("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/v1/models"),
              ("GET", "/v1/models/{model}"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/health"), ("GET", "/metrics"),
              ("GET", "/v1/engine/stats"), ("GET", "/v1/engine/cache_events"), ("POST", "/api/chat"), ("POST", "/api/generate"), ("GET", "/api/tags"),
              ("POST", "/api/show"), ("GET", "/api/ps"), ("GET", "/api/version"), ("POST", "/v1/messages"),
              ("POST", "/v1/messages/count_tokens"), ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
              ("GET", "/tokenizer_info"), ("POST", "/v1/embeddings"), ("POST", "/api/embed"),
              ("POST", "/api/embeddings"), ("POST", "/v1/rerank"), ("POST", "/v2/rerank"), ("POST", "/rerank")]
NEEDS_A_CROSS_ENCODER = {"/v1/rerank", "/v2/rerank", "/rerank"}


@pytest.fixture(scope="module")
def fuzz_server():
    with serve("--max-model-len", str(FUZZ_MAX_MODEL_LEN), "--max-num-seqs", "8") as server:
        yield server


def responses_by_status(server) -> dict[str, float]:
    metrics = httpx.get(f"{server.base_url}/metrics", timeout=10).text
    return {status: float(count) for status, count in
            re.findall(r'^tokios:http_requests_total\{status="(\d+)"\} (\S+)$', metrics, re.M)}


@pytest.fixture(scope="module")
def statuses_before_fuzzing(fuzz_server):
    return responses_by_status(fuzz_server)  # the 503s of /health while the model loaded


@pytest.fixture(scope="module")
def api_schema(fuzz_server, statuses_before_fuzzing):
    return schemathesis.openapi.from_url(f"{fuzz_server.base_url}/openapi.json")


def test_the_document_lists_every_route():
    from tokios.server.app import create_app
    from tokios.server.serving import ServerSettings

    app = create_app(ServerSettings(), engine_loader=lambda: None)
    # A path parameter's converter ("{model:path}") is the router's, not the document's.
    routes = {(method, re.sub(r"\{(\w+):\w+\}", r"{\1}", route.path)) for route in app.routes
              for method in getattr(route, "methods", None) or ()
              if method != "HEAD" and route.path not in ("/", "/favicon.ico", "/openapi.json", "/static/vendor/{name}")}
    assert routes == set(OPERATIONS)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda mode: mode.value)
@pytest.mark.parametrize("method,path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_every_operation_survives_fuzzing(api_schema, fuzz_server, method, path, mode):
    operation = api_schema[path][method]
    if mode is GenerationMode.NEGATIVE and "requestBody" not in operation.definition.raw and path != "/health":
        pytest.skip("no input to make invalid")

    answers: list[tuple[int, str]] = []

    @settings(max_examples=EXAMPLES_PER_OPERATION[mode], deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def fuzz(case):
        response = case.call_and_validate(checks=CHECKS, timeout=60)
        answers.append((response.status_code, response.text[:300]))

    fuzz()
    # Some refusals need the model (the context length, token ids in the vocabulary), so a few
    # valid cases are refused by chance: before calling the schema loose, try two more batches.
    for _ in range(2):
        if mode is not GenerationMode.POSITIVE or not is_validation_mismatch([status for status, _ in answers]):
            break
        fuzz()
    assert fuzz_server.popen.poll() is None, fuzz_server.log_tail()
    if mode is GenerationMode.POSITIVE and path in NEEDS_A_CROSS_ENCODER:
        # The fuzz server serves no cross-encoder: a valid rerank request names a model of another
        # kind (a 400 by design; tests/e2e/test_server_embeddings.py serves one). It must get there.
        assert any(status == 400 and "reranking needs a cross-encoder" in text for status, text in answers), answers[:5]
    elif mode is GenerationMode.POSITIVE:
        assert not is_validation_mismatch([status for status, _ in answers]), (
            f"{method} {path}: every request valid by the published schema was refused, so the schema is looser "
            f"than the validation: {sorted(set(answers))[:5]}")


# Statuses that say nothing about the data sent (schemathesis leaves them out of the same rule).
_NOT_ABOUT_THE_DATA = {401, 403, 409, 429}


def is_validation_mismatch(statuses: list[int]) -> bool:
    """schemathesis's "schema validation mismatch": no valid case was served, and the refusals are
    4xx about the data (not only 404s, which mean missing test data such as an unknown id)."""
    if not statuses or any(status < 400 for status in statuses):
        return False
    refusals = [status for status in statuses if 400 <= status < 500 and status not in _NOT_ABOUT_THE_DATA]
    other = [status for status in refusals if status != 404]
    return bool(refusals) and len(other) / len(refusals) >= 0.1


def test_the_mismatch_rule_flags_an_operation_that_refuses_all_valid_data():
    assert is_validation_mismatch([400, 400, 422])
    assert is_validation_mismatch([400, 404, 404])
    assert not is_validation_mismatch([400, 200, 400])
    assert not is_validation_mismatch([404, 404, 404])  # an unknown id: missing test data, not a loose schema
    assert not is_validation_mismatch([401, 401])


def test_the_server_is_clean_after_the_fuzzing(fuzz_server, statuses_before_fuzzing):
    # Runs after the fuzzing above (file order): nothing running, no block held, invariants hold,
    # and the fuzzer got past validation often enough to have run the engine.
    with fuzz_server.client() as client:
        stats = client.get("/v1/engine/stats").json()
        assert client.get("/health").status_code == 200
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0, stats
    assert stats["num_blocks_used"] == 0 and stats["invariants_error"] is None, stats
    statuses = {status: count - statuses_before_fuzzing.get(status, 0)
                for status, count in responses_by_status(fuzz_server).items()}
    statuses = {status: count for status, count in statuses.items() if count}
    print("responses by status during the fuzzing:", statuses)
    assert not any(status.startswith("5") for status in statuses), statuses
    # Generated tokens are counted from the request log: the fuzzer may unload the model
    # (keep_alive 0) and a reloaded engine's counters start again at zero.
    num_generated = sum(int(count) for count in re.findall(r"completion_tokens=(\d+)", fuzz_server.log_text()))
    assert num_generated > 0 and statuses.get("400", 0) > 0, (num_generated, stats, statuses)


def test_405_names_the_allowed_methods(tokios_server):
    response = httpx.get(f"{tokios_server.base_url}/v1/chat/completions", timeout=10)
    assert response.status_code == 405
    assert response.headers["allow"] == "POST"
    assert response.json()["error"]["type"] == "invalid_request_error"
