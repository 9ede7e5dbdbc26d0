"""schemathesis against `baton serve`: generated requests from the server's own OpenAPI schema.

Every operation gets schema-valid and schema-violating requests (hypothesis,
derandomised so CI runs the same cases). The checks: no 5xx; every status and
content type the server sends is documented; every JSON body matches its
documented schema (errors in OpenAI's shape included); schema-violating
requests are refused. Not checked: that every schema-valid request is accepted
(``positive_data_acceptance``): the schema cannot say "prompt + max_tokens fit
the model's context" or which model is served, and those refusals are
documented 400s and 404s.
"""

from __future__ import annotations

import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance
from schemathesis.config import SchemathesisConfig

from .conftest import running_server

# a short context keeps every accepted request cheap on the tiny model
FUZZ_MAX_MODEL_LEN = 64
EXAMPLES = 80
POSITIVE, NEGATIVE = GenerationMode.POSITIVE, GenerationMode.NEGATIVE
OPERATIONS = [
    ("POST", "/v1/chat/completions", POSITIVE),
    ("POST", "/v1/chat/completions", NEGATIVE),
    ("POST", "/v1/completions", POSITIVE),
    ("POST", "/v1/completions", NEGATIVE),
    ("POST", "/v1/embeddings", POSITIVE),
    ("POST", "/v1/embeddings", NEGATIVE),
    ("POST", "/v1/responses", POSITIVE),
    ("POST", "/v1/responses", NEGATIVE),
    ("GET", "/v1/responses/{response_id}", POSITIVE),
    ("DELETE", "/v1/responses/{response_id}", POSITIVE),
    ("POST", "/v1/messages", POSITIVE),
    ("POST", "/v1/messages", NEGATIVE),
    ("POST", "/v1/messages/count_tokens", POSITIVE),
    ("POST", "/v1/messages/count_tokens", NEGATIVE),
    ("POST", "/tokenize", POSITIVE),
    ("POST", "/tokenize", NEGATIVE),
    ("POST", "/detokenize", POSITIVE),
    ("POST", "/detokenize", NEGATIVE),
    # multipart: a schema-violating "file" is still a file (its bytes), so positive only
    ("POST", "/v1/files", POSITIVE),
    ("GET", "/v1/files", POSITIVE),
    ("GET", "/v1/files/{file_id}", POSITIVE),
    ("GET", "/v1/files/{file_id}/content", POSITIVE),
    ("DELETE", "/v1/files/{file_id}", POSITIVE),
    ("POST", "/v1/batches", POSITIVE),
    ("POST", "/v1/batches", NEGATIVE),
    ("GET", "/v1/batches", POSITIVE),
    ("GET", "/v1/batches/{batch_id}", POSITIVE),
    ("POST", "/v1/batches/{batch_id}/cancel", POSITIVE),
    ("GET", "/v1/models", POSITIVE),
    ("GET", "/health", POSITIVE),
    ("GET", "/version", POSITIVE),
    ("GET", "/metrics", POSITIVE),
]


@pytest.fixture(scope="module")
def fuzz_server(model_dir):
    with running_server(model_dir, max_model_len=FUZZ_MAX_MODEL_LEN) as srv:
        yield srv


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    # A schema-violating request counts as refused with schemathesis' own statuses and 413: a
    # generated body over server.max_request_bytes (one of 9.9 MB for /v1/messages/count_tokens)
    # is refused for its size, before its fields are read, as the schema documents.
    default = SchemathesisConfig.from_dict({}).projects.default.checks.negative_data_rejection
    refusals = [*default.expected_statuses, "413"]
    config = SchemathesisConfig.from_dict(
        {"checks": {"negative_data_rejection": {"expected-statuses": refusals}}}
    )
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json", config=config)


def test_the_schema_documents_openai_errors_and_no_422(api_schema):
    raw = api_schema.raw_schema
    chat = raw["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert {"200", "400", "404", "413", "503"} <= set(chat) and "422" not in chat
    error = chat["400"]["content"]["application/json"]["schema"]
    assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert "HTTPValidationError" not in raw["components"]["schemas"]


@pytest.mark.slow
@pytest.mark.parametrize(("method", "path", "mode"), OPERATIONS)
def test_generated_requests_conform_and_never_reach_a_5xx(
    fuzz_server, api_schema, method, path, mode
):
    operation = api_schema[path][method]
    statuses: collections.Counter[int] = collections.Counter()

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        deadline=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )
    def run(case):
        response = case.call_and_validate(excluded_checks=[positive_data_acceptance], timeout=60)
        statuses[response.status_code] += 1

    run()
    if mode is POSITIVE and path in ("/v1/chat/completions", "/v1/responses", "/v1/messages"):
        # some generated chats got through to the engine and back, so 200 bodies were checked
        # too (random completion prompts are nearly never runnable: ids outside the
        # vocabulary, texts longer than the context; tests/e2e/test_fuzz.py runs valid ones)
        assert statuses[200] > 0, dict(statuses)
    elif mode is NEGATIVE:
        assert all(400 <= status < 500 for status in statuses), dict(statuses)
    # the server still serves a plain request afterwards
    assert not fuzz_server.server.engine.errored
    out = fuzz_server.client().completions.create(
        model=fuzz_server.model, prompt="hi", max_tokens=2
    )
    assert out.choices[0].finish_reason in ("stop", "length")
