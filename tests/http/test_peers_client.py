"""The peer benchmark's streaming client against our real stack (``http_stack``: gateway with
its HTTP API, encoder, language worker on the test-size checkpoint): a couple of requests of
each workload at concurrency 2, every figure positive and no failures. (No vLLM here: CI does
not install it.)"""

from __future__ import annotations

import pytest

from bench.peers import client, stats, workloads


@pytest.mark.parametrize("name", ["text", "image", "repeated_image"])
def test_client_drives_our_stack(http_stack, name: str) -> None:
    model = client.served_model(http_stack.http_url)
    assert model
    bodies = workloads.bodies(workloads.WORKLOADS[name], model, 2)
    run = client.run_requests(http_stack.http_url, bodies, concurrency=2, timeout_s=120)
    summary = stats.summarize([run])
    assert summary.failures == 0, summary.errors
    assert summary.requests == 2
    assert summary.output_tokens == 2 * workloads.MAX_TOKENS  # EOS ignored: all 32 each
    for figure in (
        "requests_per_s",
        "output_tokens_per_s",
        "ttft_p50_ms",
        "itl_p50_ms",
        "e2e_p50_ms",
    ):
        assert getattr(summary, figure) > 0, figure
    for result in run.results:
        assert 0 < result.ttft_s < result.e2e_s
        assert result.prompt_tokens > 0
        assert len(result.itl_s) >= 1
