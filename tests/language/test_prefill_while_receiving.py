"""Prefill while the prompt arrives: chunks of a room are prefilled before its last one lands.

The engine gets a prompt's chunks (``deliver_chunk``, as the receiver reports them) with steps
in between, then the whole prompt (``deliver_inputs``); greedy tokens must equal transformers'
``generate`` for 1, 2 and 4 images, chunk boundaries that cut images, prefill chunks that cut
them again, and prompts longer than the transfer's default buffer.
"""

from __future__ import annotations

import pytest

from services.language.engine.request import FinishReason, RequestStatus
from services.language.engine.sampling import SamplingParams
from services.language.inputs import PromptChunk, PromptInputs
from tests.conftest import ARCHS
from tests.language.conftest import make_image, run_to_completion, tokens_of

PROMPT = "describe these pictures"


@pytest.fixture(scope="module", params=ARCHS)
def h(request, harness):
    return harness(request.param)


def split(inputs: PromptInputs, vocab_size: int, bounds: list[int]) -> list[PromptChunk]:
    """``inputs`` cut at token indices ``bounds`` into the chunks a receiver would report."""
    is_image = (inputs.fill_ids >= vocab_size).long()
    rows_before = [0, *is_image.cumsum(0).tolist()]
    edges = [0, *bounds, len(inputs)]
    chunks = []
    for a, b in zip(edges, edges[1:], strict=False):
        piece = PromptInputs(
            inputs.fill_ids[a:b],
            inputs.positions[:, a:b],
            inputs.image_rows[rows_before[a] : rows_before[b]],
            inputs.mrope_delta,
            inputs.num_deepstack,
            inputs.images,
        )
        chunks.append(PromptChunk(a, piece, len(inputs)))
    return chunks


def run_arriving(engine, rid: str, inputs: PromptInputs, bounds: list[int], room: int, **kw):
    """Deliver the prompt in chunks with engine steps between them, then whole; returns the
    outputs and how many prompt tokens were computed before the whole prompt was there."""
    engine.add_request(rid, SamplingParams(max_new_tokens=kw.pop("max_new_tokens", 8)), room=room)
    vocab = engine.model_config.vocab_size
    outputs = []
    for chunk in split(inputs, vocab, bounds)[:-1]:
        assert engine.deliver_chunk(room, chunk) == []
        for _ in range(4):  # a few steps while "the rest is in flight"
            outputs += engine.step()
    req = engine.requests[rid]
    computed_early = req.num_computed
    assert req.status in (RequestStatus.WAITING, RequestStatus.PREFILL)
    engine.deliver_inputs(room, inputs)
    outputs += [o for outs in run_to_completion(engine).values() for o in outs]
    return [o for o in outputs if o.request_id == rid], computed_early


@pytest.mark.parametrize("num_images", [1, 2, 4])
def test_greedy_equal_with_chunks_that_cut_images(h, num_images):
    images = [make_image(60 + 20 * i, 40 + 10 * i, i + 1) for i in range(num_images)]
    case = h.case(PROMPT, images, 8)
    n = len(case.inputs)
    bounds = sorted({n // 5, n // 3, n // 2 + 1, (3 * n) // 4})  # inside images, mostly
    engine = h.engine(chunk_size=13)  # prefill chunks cut the received chunks again
    outs, computed_early = run_arriving(engine, "r", case.inputs, bounds, room=11)
    assert tokens_of(outs) == case.expected
    assert outs[-1].num_prompt_tokens == n
    assert computed_early >= bounds[-1] - 1  # the arrived tokens were prefilled early
    assert engine.cache_manager.num_used == engine.cache_manager.cache.size_info().evictable_size


def test_prompt_longer_than_the_default_buffer(h):
    case = h.case(PROMPT, [make_image(1100, 1100, 4)], 8)
    assert len(case.inputs) > 1024
    engine = h.engine(chunk_size=256)
    outs, computed_early = run_arriving(engine, "long", case.inputs, [1024], room=12)
    assert tokens_of(outs) == case.expected
    assert computed_early == 1024


def test_repeated_prompt_waits_on_the_cache_then_hits_it(h):
    """The second time, the arrived prefix is all cached: the request waits, holding nothing,
    until more arrives, and then matches the cache as far as the whole prompt goes (not only
    its first chunk); equal tokens."""
    case = h.case(PROMPT, [make_image(64, 48, 1), make_image(100, 60, 2)], 8)
    engine = h.engine()
    first, _ = run_arriving(engine, "a", case.inputs, [len(case.inputs) // 2], room=13)
    again, computed_early = run_arriving(engine, "b", case.inputs, [len(case.inputs) // 2], 14)
    assert tokens_of(first) == tokens_of(again) == case.expected
    assert again[-1].num_cached_tokens == len(case.inputs) - 1  # all but the token it samples
    assert computed_early == 0


def test_abort_and_failure_mid_prompt_free_everything(h):
    case = h.case(PROMPT, [make_image(64, 48, 1), make_image(100, 60, 2)], 8)
    engine = h.engine(chunk_size=16)
    half = split(case.inputs, engine.model_config.vocab_size, [len(case.inputs) // 2])[0]
    engine.add_request("aborted", SamplingParams(), room=21)
    engine.deliver_chunk(21, half)
    engine.step()
    assert engine.requests["aborted"].num_computed > 0
    [out] = engine.abort("aborted")
    assert out.finish_reason == FinishReason.ABORT
    assert engine.receiving == {} and not engine.has_work()
    engine.add_request("failed", SamplingParams(), room=22)
    engine.deliver_chunk(22, half)
    engine.step()
    out = engine.deliver_inputs(22, RuntimeError("room 22: sender_dead"))[0]
    assert out.finish_reason == FinishReason.ERROR and "sender_dead" in out.error
    info = engine.cache_manager.cache.size_info()
    assert info.protected_size == 0  # no radix lock left
    assert engine.cache_manager.num_used == info.evictable_size  # no slot left to a request


def test_a_chunk_out_of_order_fails_the_request_alone(h):
    case = h.case(PROMPT, [make_image(64, 48, 1)], 8)
    engine = h.engine()
    chunks = split(case.inputs, engine.model_config.vocab_size, [10, 20])
    engine.add_request("bad", SamplingParams(), room=31)
    engine.deliver_chunk(31, chunks[0])
    out = engine.deliver_chunk(31, chunks[2])[0]
    assert out.finish_reason == FinishReason.ERROR and "chunk at token" in out.error
    assert engine.receiving == {} and not engine.has_work()


def start_decoding(engine, rid: str, inputs: PromptInputs, room: int) -> list:
    """Add a request with its whole prompt and step until it decodes; returns the outputs."""
    engine.add_request(rid, SamplingParams(max_new_tokens=24), room=room)
    engine.deliver_inputs(room, inputs)
    outputs = []
    while engine.requests[rid].status != RequestStatus.DECODE:
        outputs += engine.step()
    return outputs


@pytest.mark.parametrize("partial", [False, True], ids=["whole-chunks", "partial"])
def test_a_partial_prompt_waits_for_a_whole_chunk_while_others_decode(h, partial):
    """While another request decodes, the arrived part of a prompt is prefilled once a whole
    chunk of it is ready, not piece by piece (each step with prefill tokens delays the
    decoding stream); ``partial_prefill_while_decoding`` prefills it as it lands. Greedy
    tokens of both requests equal transformers' either way, and nothing is left held."""
    talk = h.case("count from one to twenty", [], 24)
    case = h.case(PROMPT, [make_image(160, 120, 1), make_image(200, 140, 2)], 8)
    chunk, first, second = 24, 20, 60  # first: less than a chunk, past the template prefix
    assert len(case.inputs) > second
    engine = h.engine(chunk_size=chunk, partial_prefill_while_decoding=partial)
    outputs = start_decoding(engine, "talk", talk.inputs, room=41)
    pieces = split(case.inputs, engine.model_config.vocab_size, [first, second])
    engine.add_request("late", SamplingParams(max_new_tokens=8), room=42)
    engine.deliver_chunk(42, pieces[0])  # less than a chunk
    outputs += engine.step() + engine.step()
    late = engine.requests["late"]
    assert engine.requests["talk"].status == RequestStatus.DECODE  # still decoding
    if partial:
        assert late.status == RequestStatus.PREFILL and late.num_computed == first
    else:
        assert late.status == RequestStatus.WAITING  # not admitted: it holds nothing yet
    engine.deliver_chunk(42, pieces[1])  # now more than a whole chunk is ready
    outputs += engine.step()
    assert late.status == RequestStatus.PREFILL
    if partial:
        assert late.num_computed == first + chunk
    else:  # a whole chunk after what the radix cache matched (the shared template prefix)
        assert chunk <= late.num_computed <= 2 * chunk
    engine.deliver_inputs(42, case.inputs)
    outputs += [o for outs in run_to_completion(engine).values() for o in outs]
    assert tokens_of([o for o in outputs if o.request_id == "talk"]) == talk.expected
    assert tokens_of([o for o in outputs if o.request_id == "late"]) == case.expected
    info = engine.cache_manager.cache.size_info()
    assert info.protected_size == 0 and engine.cache_manager.num_used == info.evictable_size


def test_a_partial_prompt_rides_along_with_a_whole_one_while_others_decode(h):
    """A step that prefills a complete prompt beside the decodes carries prefill tokens anyway:
    a partial prompt is prefilled in what is left of its budget. Equal greedy tokens."""
    talk = h.case("count from one to twenty", [], 24)
    other = h.case("name three colours", [], 8)
    case = h.case(PROMPT, [make_image(160, 120, 1), make_image(200, 140, 2)], 8)
    first = 20  # less than a chunk, past the template prefix
    engine = h.engine(chunk_size=128)
    outputs = start_decoding(engine, "talk", talk.inputs, room=51)
    engine.add_request("late", SamplingParams(max_new_tokens=8), room=52)
    engine.deliver_chunk(52, split(case.inputs, engine.model_config.vocab_size, [first])[0])
    engine.add_request("other", SamplingParams(max_new_tokens=8), room=53)
    engine.deliver_inputs(53, other.inputs)
    outputs += engine.step()
    assert engine.requests["talk"].status == RequestStatus.DECODE
    assert engine.requests["other"].status == RequestStatus.DECODE  # prefilled whole
    assert engine.requests["late"].num_computed == first  # rode along
    engine.deliver_inputs(52, case.inputs)
    outputs += [o for outs in run_to_completion(engine).values() for o in outs]
    for rid, expected in (
        ("talk", talk.expected),
        ("other", other.expected),
        ("late", case.expected),
    ):
        assert tokens_of([o for o in outputs if o.request_id == rid]) == expected
