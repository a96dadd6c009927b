"""The OpenAI API as clients none of us wrote use it: EleutherAI's ``lm-eval`` and NVIDIA's
``aiperf``, each from a venv of its own under ``.peers/`` (``make test-slow``; the first run
installs them, 1.8 and 1.2 GB, a minute or two each; skipped only when pip cannot install them).

Against one local stack (a gateway with HTTP, an encoder, a language worker, fp32, on the test
checkpoint):

* ``lm-eval`` ``local-completions``, a multiple-choice (log-likelihood) task: four documents of
  three choices, written to ``tmp_path`` with their YAML, sent with ``echo``, ``logprobs: 1``
  and ``max_tokens: 1`` either as token ids four prompts a request, or as text two requests at
  a time; every choice's log-likelihood it reports equals transformers' sum over the
  continuation's tokens;
* ``lm-eval`` ``local-chat-completions`` with ``--apply_chat_template``, a generate-until task:
  each answer is transformers' greedy continuation of the same chat, cut at the stop string;
* ``aiperf profile`` with ``--endpoint-type chat`` (one synthetic 448x448 image a request) and
  ``completions`` (text), streamed, 48 requests at concurrency 8: none failed.

Each lm-eval run allows no retry (``max_retries=1``): it must exit 0, write its results, and log
no failed or retried request. Around every run the gateway's outcome counters grow only by HTTP
requests that ended OK (aiperf's: its 48 and its 4 warm-up ones).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from bench.peers import aiperf
from bench.peers.install_aiperf import ensure_aiperf
from bench.peers.install_lm_eval import ensure_lm_eval
from bench.peers.workloads import MAX_TOKENS
from common.models.hf_reference import HFReference
from tests.e2e.conftest import Stack
from tests.http.conftest import outcomes, start_http_stack

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ARCH = "qwen2_5_vl"
LM_EVAL_TIMEOUT_S = 600
# what lm-eval's API models log when a request fails or is retried, and Python's tracebacks
CLIENT_TROUBLE = re.compile(r"retr(y|ied|ying)|request failed|Traceback|\bERROR\b", re.IGNORECASE)
MC_DOCS = [
    {"question": f"Question {i}: what colour is the sky?", "choices": ["blue", "green", "red"],
     "answer": i % 3}
    for i in range(4)
]  # fmt: skip
GEN_DOCS = [{"question": f"Say the word number {i}.", "answer": "yes"} for i in range(4)]
MAX_GEN_TOKS = 16
UNTIL = "\n\n"


def installed(ensure: Callable[[], Path], what: str) -> Path:
    """``ensure()``'s command; skips when pip cannot install ``what`` (no registry)."""
    try:
        return ensure()
    except subprocess.CalledProcessError as e:
        pytest.skip(f"{what} could not be installed into .peers/ (no package registry?): {e}")


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory) -> Iterator[Stack]:
    stack = start_http_stack(tiny_model_dir(ARCH), tmp_path_factory.mktemp("clients-stack"))
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir) -> HFReference:
    return HFReference(tiny_model_dir(ARCH))


def served_since(stack: Stack, before: dict[tuple[str, str], float], expect: int = 0) -> int:
    """How many requests the gateway finished since ``before`` (its outcome counters; waits up
    to 10 s for ``expect`` of them, the last may be counted just after its answer went out),
    after checking that every one of them was an HTTP request that ended OK."""

    def grown() -> dict[tuple[str, str], float]:
        after = outcomes(stack)
        return {key: n - before.get(key, 0) for key, n in after.items() if n != before.get(key, 0)}

    deadline = time.monotonic() + 10
    while (now := grown()).get(("OK", "http"), 0) < expect and time.monotonic() < deadline:
        time.sleep(0.1)
    assert set(now) <= {("OK", "http")}, now
    return int(now.get(("OK", "http"), 0))


# ---- lm-eval --------------------------------------------------------------------------------


def write_task(folder: Path, name: str, docs: list[dict], spec: dict) -> None:
    """A task ``name`` over ``docs`` (a local JSONL file) in ``folder``: its YAML is JSON, which
    YAML reads as is."""
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in docs))
    task = {"task": name, "dataset_path": "json", "test_split": "test",
            "dataset_kwargs": {"data_files": {"test": str(data)}}, **spec}  # fmt: skip
    (folder / f"{name}.yaml").write_text(json.dumps(task, indent=1))


def run_lm_eval(
    stack: Stack, tmp_path: Path, model_type: str, model_args: dict, task: str, *extra: str
):
    """One ``lm-eval run`` of ``task`` (from ``tmp_path``) against ``stack``; returns (its
    results JSON, its per-document samples), after checking it exited 0, logged no client
    trouble, and that the gateway answered each of its requests OK."""
    command = installed(ensure_lm_eval, "lm-eval")
    before = outcomes(stack)
    args = ",".join(f"{k}={v}" for k, v in model_args.items())
    out, log = tmp_path / f"out-{task}", tmp_path / f"{task}.log"
    argv = [str(command), "run", "--model", model_type, "--model_args", args, "--tasks", task,
            "--include_path", str(tmp_path), "--output_path", str(out), "--log_samples",
            *extra]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", HF_HOME=str(tmp_path / "hf"))
    started = time.monotonic()
    with open(log, "wb") as sink:
        rc = subprocess.run(argv, stdout=sink, stderr=subprocess.STDOUT, env=env,
                            cwd=tmp_path, timeout=LM_EVAL_TIMEOUT_S).returncode  # fmt: skip
    took = time.monotonic() - started
    text = log.read_text(errors="replace")
    print(f"lm-eval {model_type} {task}: exit {rc} in {took:.1f}s")
    assert rc == 0, text[-4000:]
    print(f"  {served_since(stack, before)} requests served OK")
    trouble = [line for line in text.splitlines() if CLIENT_TROUBLE.search(line)]
    assert not trouble, trouble
    results = [json.loads(p.read_text()) for p in out.rglob("results_*.json")]
    assert len(results) == 1, list(out.rglob("*"))
    samples = [json.loads(line) for p in out.rglob(f"samples_{task}_*.jsonl")
               for line in p.read_text().splitlines()]  # fmt: skip
    return results[0], samples


@torch.no_grad()
def continuation_logprob(ref: HFReference, context: str, continuation: str) -> float:
    """transformers' log-likelihood of ``continuation`` after ``context``, split into tokens as
    lm-eval splits them (the whole's tokens past the context's)."""
    encode = ref.tokenizer.encode
    context_ids = encode(context, add_special_tokens=False)
    whole = encode(context + continuation, add_special_tokens=False)
    ids = torch.tensor([whole])
    logits = ref.model(input_ids=ids, attention_mask=torch.ones_like(ids),
                       mm_token_type_ids=torch.zeros_like(ids)).logits[0].float()  # fmt: skip
    logprobs = torch.log_softmax(logits, dim=-1)
    return sum(float(logprobs[i - 1, whole[i]]) for i in range(len(context_ids), len(whole)))


# how lm-eval sends its log-likelihood requests: token ids, four prompts a request, one request
# at a time; or text, one prompt a request, two requests at a time (its aiohttp path)
LOGLIKELIHOOD_MODES = {
    "token-ids-batched": ({"tokenized_requests": True}, ("--batch_size", "4")),
    "text-concurrent": ({"tokenized_requests": False, "num_concurrent": 2}, ()),
}


@pytest.mark.parametrize("mode", LOGLIKELIHOOD_MODES)
def test_lm_eval_loglikelihood_through_completions(
    stack, reference, tiny_model_dir, tmp_path, mode
):
    model_dir = tiny_model_dir(ARCH)
    mode_args, extra = LOGLIKELIHOOD_MODES[mode]
    spec = {"output_type": "multiple_choice", "doc_to_text": "{{question}}",
            "doc_to_choice": "{{choices}}", "doc_to_target": "{{answer}}",
            "metric_list": [{"metric": "acc", "aggregation": "mean",
                             "higher_is_better": True}]}  # fmt: skip
    write_task(tmp_path, "epd_tiny_mc", MC_DOCS, spec)
    model_args = {"model": model_dir.name, "base_url": f"{stack.http_url}/v1/completions",
                  "tokenizer": model_dir, "tokenizer_backend": "huggingface",
                  "max_retries": 1, **mode_args}  # fmt: skip
    results, samples = run_lm_eval(
        stack, tmp_path, "local-completions", model_args, "epd_tiny_mc", *extra
    )
    assert "acc,none" in results["results"]["epd_tiny_mc"]
    assert len(samples) == len(MC_DOCS)
    for sample in samples:
        for i, ((loglikelihood, _greedy),) in enumerate(sample["resps"]):
            arg = sample["arguments"][f"gen_args_{i}"]
            want = continuation_logprob(reference, arg["arg_0"], arg["arg_1"])
            assert float(loglikelihood) == pytest.approx(want, abs=2e-3), arg


def test_lm_eval_generate_until_through_chat(stack, reference, tiny_model_dir, tmp_path):
    model_dir = tiny_model_dir(ARCH)
    spec = {"output_type": "generate_until", "doc_to_text": "{{question}}",
            "doc_to_target": "{{answer}}",
            "generation_kwargs": {"until": [UNTIL], "max_gen_toks": MAX_GEN_TOKS,
                                  "do_sample": False},
            "metric_list": [{"metric": "exact_match", "aggregation": "mean",
                             "higher_is_better": True}]}  # fmt: skip
    write_task(tmp_path, "epd_tiny_gen", GEN_DOCS, spec)
    model_args = {"model": model_dir.name, "base_url": f"{stack.http_url}/v1/chat/completions",
                  "max_retries": 1, "eos_string": "<|im_end|>"}  # fmt: skip
    results, samples = run_lm_eval(
        stack, tmp_path, "local-chat-completions", model_args, "epd_tiny_gen",
        "--apply_chat_template",
    )  # fmt: skip
    assert "exact_match,none" in results["results"]["epd_tiny_gen"]
    assert len(samples) == len(GEN_DOCS)
    for sample in samples:
        (chat,) = sample["arguments"]["gen_args_0"]["arg_0"]  # the chat as a JSON string
        messages = json.loads(chat)
        ids = reference.generate(reference.build_chat_inputs(messages, []), MAX_GEN_TOKS)
        want = reference.tokenizer.decode(ids, skip_special_tokens=True).split(UNTIL)[0]
        assert sample["resps"] == [[want]], messages


# ---- aiperf ---------------------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_aiperf_has_no_failed_requests(stack, tiny_model_dir, tmp_path, endpoint):
    model_dir = tiny_model_dir(ARCH)
    command = installed(ensure_aiperf, "aiperf")
    argv = aiperf.command(command, stack.http_url, model_dir.name, model_dir, tmp_path,
                          endpoint=endpoint)  # fmt: skip
    before, started = outcomes(stack), time.monotonic()
    result = aiperf.run_aiperf(argv, tmp_path)
    took = time.monotonic() - started
    served = served_since(stack, before, aiperf.REQUESTS + aiperf.WARMUP)
    export = json.loads((tmp_path / aiperf.EXPORT).read_text())
    print(f"aiperf {endpoint}: {result.requests} requests, {result.error_rate_pct}% errors, "
          f"{result.requests_per_s:.1f} req/s, {took:.1f}s; {served} served OK")  # fmt: skip
    assert served == aiperf.REQUESTS + aiperf.WARMUP
    assert (result.requests, result.error_rate_pct, result.errors) == (aiperf.REQUESTS, 0.0, [])
    assert export["completed_request_count"]["avg"] == aiperf.REQUESTS
    assert export.get("is_complete", True) and not export.get("was_cancelled", False)
    assert export["output_token_count"]["min"] == export["output_token_count"]["max"] == MAX_TOKENS
