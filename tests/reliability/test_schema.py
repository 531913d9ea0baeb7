"""Property-based requests from the server's own OpenAPI schema (schemathesis): no 5xx,
documented status codes and content types, and bodies that match the schema."""

from __future__ import annotations

import pytest

schemathesis = pytest.importorskip("schemathesis")
from collections import Counter  # noqa: E402

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (  # noqa: E402
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.reliability.conftest import start  # noqa: E402

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def schema(smollm2_path, tmp_path_factory):
    # a short context bounds generation, so random max_tokens stay quick on the CPU
    proc = start(smollm2_path, tmp_path_factory, "schema", "--max-model-len", "48", "--max-num-seqs", "8")
    yield schemathesis.openapi.from_url(proc.url + "/openapi.json"), proc
    proc.stop()


def test_every_operation_against_its_schema(schema):
    spec, proc = schema
    operations = [op.ok() for op in spec.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health",
                                              "/metrics", "/tokenize", "/detokenize"}
    calls: Counter = Counter()
    statuses: Counter = Counter()
    failures = []
    def make_test(operation, mode):
        @settings(max_examples=25, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy(generation_mode=mode))
        def run(case):
            calls[(operation.path, mode.value)] += 1
            response = case.call_and_validate(checks=CHECKS, timeout=60)
            statuses[response.status_code // 100] += 1
        return run

    for operation in operations:
        # invalid inputs exist only where there is an input: bodies (path strings are free-form)
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.method == "post" else [])
        for mode in modes:
            try:
                make_test(operation, mode)()
            except Exception as exc:  # noqa: BLE001 - collect every operation's failure
                failures.append(f"{operation.method.upper()} {operation.path} ({mode.value}): {exc}")
    assert not failures, "\n\n".join(failures)[:6000]
    assert all(calls[(op.path, "positive")] > 0 for op in operations), calls
    assert all(calls[(op.path, "negative")] > 0 for op in operations if op.method == "post"), calls
    assert statuses[5] == 0 and statuses[2] > 0 and statuses[4] > 0, statuses
    assert proc.proc.poll() is None
