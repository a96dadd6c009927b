"""``epd generate``: every bad argument or unreachable gateway is one line on stderr and a non-zero
exit status, never a traceback; ``--n`` choices are each printed with their index."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from common.procs import free_port
from protos.epd.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from services.cli import main

ROOT = Path(__file__).resolve().parents[2]


def generate(capsys, *args: str) -> tuple[int, str]:
    try:
        code = main(["generate", "--prompt", "hi", "--timeout", "5", *args])
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    return code, err


@pytest.mark.parametrize(
    "args, status, needle",
    [
        (["--max-tokens", "-1"], 2, "--max-tokens must be in [0, 4294967295], got -1"),
        (["--max-tokens", str(1 << 33)], 2, "--max-tokens must be in"),
        (["--temperature", "nan"], 2, "--temperature must be a finite number >= 0, got nan"),
        (["--temperature", "-1"], 2, "--temperature"),
        (["--top-p", "2"], 2, "--top-p must be in [0, 1]"),
        (["--top-k", "-5"], 2, "--top-k"),
        (["--seed", "-1"], 2, "--seed"),
        (["--n", "0"], 2, "--n must be in [1, 16], got 0"),
        (["--n", "17"], 2, "--n must be in [1, 16], got 17"),
        (["--timeout", "0"], 2, "--timeout must be a positive number"),
        (["--image", "/no/such/image.png"], 2, "cannot read image '/no/such/image.png'"),
        (["--image", "/"], 2, "cannot read image '/'"),
        (["--tls-ca", "/no/such/ca.pem"], 2, "cannot read CA file"),
        (["--gateway", "nonsense"], 2, "gateway address 'nonsense' is not host:port"),
        (["--gateway", "127.0.0.1:99999"], 2, "is not host:port"),
        (["--gateway", ","], 2, "no gateway address given"),
    ],
)
def test_bad_arguments_are_one_line(capsys, args: list[str], status: int, needle: str) -> None:
    code, err = generate(capsys, *args)
    assert code == status
    assert len(err.splitlines()) == 1, err
    assert err.startswith("epd generate: error: ") and needle in err, err


@pytest.mark.parametrize("json_flag", [[], ["--json"]], ids=["stream", "json"])
def test_unreachable_gateway_is_one_line(capsys, json_flag: list[str]) -> None:
    dead = f"127.0.0.1:{free_port()}"
    code, err = generate(capsys, "--gateway", f"{dead},{dead}", *json_flag)
    assert code == 1
    assert len(err.splitlines()) == 1 and err.startswith("UNAVAILABLE: "), err


def test_argparse_errors_exit_2_without_traceback(capsys) -> None:
    code, err = generate(capsys, "--max-tokens", "many")
    assert code == 2
    assert err.splitlines()[-1].endswith("argument --max-tokens: invalid int value: 'many'")


def test_a_real_process_prints_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "generate", "--prompt", "x", "--max-tokens", "-1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "epd generate: error: --max-tokens must be in [0, 4294967295], got -1"
    )
    assert proc.stdout == ""


STOP, LENGTH = common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH


class ChoicesGateway(gateway_pb2_grpc.GatewayServicer):
    """Answers ``sampling.n`` choices (one when 0): choice i is "answer i" in 2 + i tokens,
    finishing LENGTH for the last choice and STOP for the others; streamed interleaved, the
    choices finishing last to first."""

    def __init__(self) -> None:
        self.requests: list[gateway_pb2.GenerateRequest] = []

    def Generate(self, request, context):  # noqa: N802
        self.requests.append(request)
        n = max(1, request.sampling.n)
        for i in range(n):
            yield gateway_pb2.GenerateChunk(index=i, text="answer ", token_ids=[1])
        for i in reversed(range(n)):
            usage = gateway_pb2.Usage(prompt_tokens=5, completion_tokens=2 + i)
            reason = LENGTH if i == n - 1 else STOP
            yield gateway_pb2.GenerateChunk(
                index=i, text=str(i), token_ids=[2], finish_reason=reason, usage=usage
            )

    def GenerateUnary(self, request, context):  # noqa: N802
        self.requests.append(request)
        n = max(1, request.sampling.n)
        choices = [
            gateway_pb2.GenerateResponse.Choice(
                index=i,
                text=f"answer {i}",
                token_ids=[1, 2],
                finish_reason=STOP,
                usage=gateway_pb2.Usage(prompt_tokens=5, completion_tokens=2),
            )
            for i in range(n)
        ]
        return gateway_pb2.GenerateResponse(
            text="answer 0",
            token_ids=[1, 2],
            finish_reason=STOP,
            usage=gateway_pb2.Usage(prompt_tokens=5, completion_tokens=2 * n),
            choices=choices,
        )


@pytest.fixture
def choices_gateway():
    servicer = ChoicesGateway()
    server = grpc.server(futures.ThreadPoolExecutor(2), options=[("grpc.so_reuseport", 0)])
    gateway_pb2_grpc.add_GatewayServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield servicer, f"127.0.0.1:{port}"
    server.stop(0)


def test_n_choices_are_each_printed_with_their_index(capsys, choices_gateway) -> None:
    gateway, address = choices_gateway
    args = ["generate", "--gateway", address, "--prompt", "hi", "--n", "3"]
    assert main(args) == 0
    out = capsys.readouterr()
    assert out.out.splitlines() == ["[0] answer 0", "[1] answer 1", "[2] answer 2"]
    assert out.err.startswith("finish: stop, stop, length   tokens: prompt 5 (cached 0), ")
    assert "completion 9 (2 + 3 + 4)" in out.err

    assert main([*args, "--json"]) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply["text"] == "answer 0" and reply["usage"]["completion_tokens"] == 6
    assert [c["index"] for c in reply["choices"]] == [0, 1, 2]
    assert [c["text"] for c in reply["choices"]] == ["answer 0", "answer 1", "answer 2"]
    assert reply["choices"][2] == {
        "index": 2,
        "text": "answer 2",
        "token_ids": [1, 2],
        "finish_reason": "stop",
        "usage": {"prompt_tokens": 5, "cached_tokens": 0, "completion_tokens": 2},
    }

    # by default one choice, streamed as it comes, without an index
    assert main(args[:-2]) == 0
    out = capsys.readouterr()
    assert out.out == "answer 0\n"
    assert out.err.startswith("finish: length   tokens: prompt 5 (cached 0), completion 2\n")
    assert [r.sampling.n for r in gateway.requests] == [3, 3, 1]
