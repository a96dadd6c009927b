"""Property-based tests (hypothesis) over the public request: any ``GenerateRequest`` a client
can build — NaN and infinite floats, extreme integers, empty or huge counts, control characters,
random image bytes and references — is either served or refused with ``INVALID_ARGUMENT``
naming the field, and leaves nothing behind.

Two levels: ``validate_request`` alone (many examples, no I/O), and the live gateway's
``GenerateUnary`` over real gRPC with the scripted workers of ``test_orchestrator`` (the real
workers' own refusals are covered by the e2e suites).
"""

from __future__ import annotations

import math

import grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.epd.v1 import common_pb2, gateway_pb2
from services.gateway.errors import GatewayError
from services.gateway.validation import RequestLimits, validate_request
from tests.gateway.test_orchestrator import pools  # noqa: F401  (the fixture)

LIMITS = RequestLimits(
    max_messages=4,
    max_parts_per_message=3,
    max_text_chars=64,
    max_images=2,
    max_image_bytes=256,
    max_image_ref_chars=64,
    max_stop=2,
    max_stop_chars=8,
    max_stop_token_ids=3,
    max_top_k=1000,
    max_new_tokens_limit=500,
    max_request_id_chars=16,
)
# what a refusal's message starts with: the field it names
FIELDS = ("messages", "sampling.", "request_id")

floats = st.floats(width=32, allow_nan=True, allow_infinity=True, allow_subnormal=True)
texts = st.text(max_size=80)
int32 = st.integers(-(2**31), 2**31 - 1)
uint32 = st.integers(0, 2**32 - 1)

images = st.one_of(
    st.builds(lambda b: common_pb2.ImageSource(data=b), st.binary(max_size=300)),
    st.builds(lambda t: common_pb2.ImageSource(base64=t), texts),
    st.builds(lambda t: common_pb2.ImageSource(path=t), texts),
    st.builds(lambda t: common_pb2.ImageSource(url=t), texts),
    st.just(common_pb2.ImageSource()),  # no source set
)
parts = st.one_of(
    st.builds(lambda t: common_pb2.ContentPart(text=t), texts),
    st.builds(lambda i: common_pb2.ContentPart(image=i), images),
    st.just(common_pb2.ContentPart()),  # neither
)
messages = st.builds(
    lambda role, content: common_pb2.ChatMessage(role=role, content=content),
    st.one_of(st.sampled_from(["user", "system", "assistant", ""]), texts),
    st.lists(parts, max_size=5),
)
sampling = st.builds(
    common_pb2.SamplingParams,
    max_new_tokens=st.one_of(st.integers(0, 600), uint32),
    temperature=floats,
    top_p=floats,
    top_k=int32,
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    stop_token_ids=st.lists(int32, max_size=5),
    stop=st.lists(texts, max_size=4),
    ignore_eos=st.booleans(),
    logprobs=st.booleans(),
    top_logprobs=st.one_of(st.integers(0, 25), uint32),
)
requests = st.builds(
    gateway_pb2.GenerateRequest,
    messages=st.lists(messages, max_size=6),
    sampling=sampling,
    request_id=st.one_of(st.just(""), texts),
)

# requests every gateway must serve: sane values, drawn widely within them
plausible = st.builds(
    lambda text, image, tokens, temperature, top_p, top_k, stop: gateway_pb2.GenerateRequest(
        messages=[
            common_pb2.ChatMessage(
                role="user",
                content=[
                    *([common_pb2.ContentPart(image=common_pb2.ImageSource(data=image))]
                      if image else []),
                    common_pb2.ContentPart(text=text),
                ],
            )
        ],
        sampling=common_pb2.SamplingParams(
            max_new_tokens=tokens, temperature=temperature, top_p=top_p, top_k=top_k, stop=stop
        ),
    ),
    st.text(min_size=1, max_size=40).filter(lambda t: "\x00" not in t),
    st.one_of(st.just(b""), st.binary(min_size=1, max_size=200)),
    st.integers(1, 64),
    st.one_of(st.just(0.0), st.floats(0.02, 2.0)),
    st.floats(0.0, 1.0),
    st.integers(-1, 100),
    st.lists(st.text(min_size=1, max_size=4).filter(lambda t: "\x00" not in t), max_size=2),
)  # fmt: skip


def assert_within_bounds(request: gateway_pb2.GenerateRequest) -> None:
    """What a request that passed validation must be."""
    s = request.sampling
    assert math.isfinite(s.temperature) and 0 <= s.temperature <= 100
    assert math.isfinite(s.top_p) and 0 <= s.top_p <= 1
    assert -1 <= s.top_k <= LIMITS.max_top_k
    assert s.max_new_tokens <= LIMITS.max_new_tokens_limit
    assert s.top_logprobs <= 20
    assert len(s.stop) <= LIMITS.max_stop and len(s.stop_token_ids) <= LIMITS.max_stop_token_ids
    assert 1 <= len(request.messages) <= LIMITS.max_messages
    images = [p for m in request.messages for p in m.content if p.HasField("image")]
    assert len(images) <= LIMITS.max_images


@settings(max_examples=600, deadline=None)
@given(requests)
def test_validation_refuses_naming_the_field_or_passes_within_bounds(request) -> None:
    try:
        validate_request(request, LIMITS)
    except GatewayError as exc:
        assert exc.code == grpc.StatusCode.INVALID_ARGUMENT, exc.message
        assert exc.message.startswith(FIELDS), exc.message
        return
    assert_within_bounds(request)


@settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.one_of(st.tuples(st.just("any"), requests), st.tuples(st.just("sane"), plausible)))
def test_the_live_gateway_serves_or_refuses_and_frees_everything(pools, case) -> None:  # noqa: F811
    kind, request = case
    stub, encoder, language, gateway = pools
    encoder.refuse, language.mode = None, "stream"
    try:
        reply = stub.GenerateUnary(request, timeout=30)
    except grpc.RpcError as exc:
        assert kind == "any", (request, exc.code(), exc.details())
        assert exc.code() == grpc.StatusCode.INVALID_ARGUMENT, (exc.code(), exc.details())
        assert exc.details(), "a refusal names its problem"
    else:
        assert reply.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED
    assert gateway.admission.num_in_flight == 0
