"""Property-based fuzz of the whole OpenAPI surface (schemathesis): no answer is a 5xx.
Bounded: a few examples per operation and generation mode, and a time limit."""
from __future__ import annotations

import time

import httpx
import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis.errors import Unsatisfiable  # noqa: E402
from schemathesis import GenerationMode  # noqa: E402

from tests.test_api import BOB, server  # noqa: E402,F401  (the module-scoped server fixture)

from schemathesis.transport.requests import REQUESTS_TRANSPORT, binary_serializer  # noqa: E402

REQUESTS_TRANSPORT.serializer("application/zip")(binary_serializer)  # POST /v1/packages takes raw zip bytes
EXAMPLES = 12
BUDGET_S = 150


def test_no_server_errors_anywhere(server):  # noqa: F811
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    operations = [r.ok() for r in schema.get_all_operations()]
    assert len(operations) >= 10
    deadline = time.monotonic() + BUDGET_S
    failures, calls = [], []
    for op in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            if time.monotonic() > deadline:
                break

            @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                      suppress_health_check=list(HealthCheck))
            @given(case=op.as_strategy(mode))
            def check(case):
                response = case.call(base_url=server.url, headers={"Authorization": f"Bearer {BOB}"}, timeout=60)
                calls.append(response.status_code)
                if response.status_code >= 500:
                    failures.append(f"{case.method} {case.formatted_path} -> {response.status_code}: "
                                    f"{response.text[:300]} (body {str(case.body)[:300]})")

            try:
                check()
            except Unsatisfiable:  # nothing in this operation can be made invalid (e.g. GET /healthz)
                assert mode is GenerationMode.NEGATIVE
    # stop whatever valid jobs the fuzz submitted
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {BOB}"}, timeout=60) as c:
        for job in c.get("/v1/jobs", params={"state": ["PENDING", "RUNNING"], "limit": 500}).json()["items"]:
            c.post(f"/v1/jobs/{job['id']}/cancel")
    assert failures == []
    assert len(calls) > 150 and {201, 422} <= set(calls)  # it did reach the server, with valid and invalid input
