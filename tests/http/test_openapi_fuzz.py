"""``schemathesis`` (an OpenAPI-driven fuzzer) against ``/openapi.json`` of a live gateway.

It generates requests from the published schema, valid and invalid, for every operation, and
checks each answer: never a 5xx, every status documented, every body of the documented type and
matching its schema. The gateway under test sits in front of the shared stack's workers, with
completions capped at 16 tokens so that the accepted requests finish quickly. Every request
carries a generous ``X-Request-Timeout``: a deadline the client itself made too short is a 504 by
design (tests/http/test_lifecycle.py), not a defect the fuzzer should flag. Afterwards the
workers hold nothing.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx

from tests.http.conftest import start_side_gateway

CHECKS = (
    "not_a_server_error",
    "status_code_conformance",
    "content_type_conformance",
    "response_schema_conformance",
)


def test_fuzzing_the_openapi_schema_finds_no_error(http_stack, tmp_path: Path) -> None:
    gateway, url = start_side_gateway(
        http_stack, tmp_path, "--max-new-tokens-limit", "16", "--default-max-new-tokens", "16"
    )
    try:
        spec = httpx.get(url + "/openapi.json").json()
        assert set(spec["paths"]) == {
            "/v1/chat/completions",
            "/v1/completions",
            "/v1/models",
            "/v1/models/{model}",
            "/health",
        }
        schemathesis = Path(sys.executable).parent / "schemathesis"
        har = tmp_path / "fuzz.har"
        run = subprocess.run(
            [
                str(schemathesis),
                "run",
                url + "/openapi.json",
                "--checks",
                ",".join(CHECKS),
                "--max-examples",
                "25",
                "--workers",
                "1",
                "--seed",
                "1",
                "--request-timeout",
                "60",
                "--header",
                "X-Request-Timeout: 60",
                "--report",
                "har",
                "--report-har-path",
                str(har),
                "--no-color",
            ],  # fmt: skip
            capture_output=True,
            text=True,
            timeout=480,
            cwd=tmp_path,  # its cache directory goes there, not into the checkout
        )
        report = run.stdout[-6000:] + run.stderr[-2000:]
        assert run.returncode == 0, report
        found = re.search(r"(\d+) generated, (\d+) passed", run.stdout)
        assert found is not None, report
        assert int(found.group(1)) == int(found.group(2)) >= 100, report
        assert "5 selected / 5 total" in run.stdout, report
        # the fuzzer got past validation: completions, streamed and not, were served
        answered = [
            e["response"]
            for e in json.loads(har.read_text())["log"]["entries"]
            if e["request"]["method"] == "POST" and e["response"]["status"] == 200
        ]
        types = {a["content"]["mimeType"].split(";")[0] for a in answered}
        assert types == {"application/json", "text/event-stream"}, types
    finally:
        gateway.stop()
    http_stack.wait_no_leaks()
