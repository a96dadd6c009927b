"""Requests with ``n`` choices: one prefill through the radix cache, a sequence per choice.

Greedy choices all equal transformers' tokens; the prompt (and its image rows) is computed once;
a seed gives choice i the stream of seed + i, the same on every run; each choice has its own
grammar guide and penalty history; a choice preempted for slots recomputes and still agrees; an
abort or a failure ends every choice and frees every slot and lock.
"""

from __future__ import annotations

import pytest

from services.language.engine.request import FinishReason, RequestStatus
from services.language.engine.sampling import SamplingParams, StructuredOutput
from tests.conftest import ARCHS
from tests.language.conftest import make_image, run_to_completion, tokens_of

PROMPT = "describe this picture in detail"


def by_choice(outputs) -> dict[int, list]:
    choices: dict[int, list] = {}
    for out in outputs:
        choices.setdefault(out.index, []).append(out)
    return choices


def assert_nothing_held(engine) -> None:
    cm = engine.cache_manager
    info = cm.cache.size_info()
    assert not engine.requests and not engine.choices and info.protected_size == 0
    assert cm.num_used == info.evictable_size
    cm.cache.check_integrity()


def run_choices(engine, inputs, rid: str, **params) -> dict[int, list]:
    engine.add_request(rid, SamplingParams(**params), inputs)
    outputs = run_to_completion(engine)[rid]
    assert outputs[-1].ends_request
    assert [o for o in outputs if o.ends_request] == [outputs[-1]]
    return by_choice(outputs)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("images", [0, 2], ids=["text", "two_images"])
def test_greedy_choices_equal_the_reference_over_one_prefill(harness, arch, images):
    h = harness(arch)
    pictures = [make_image(64, 48, 1), make_image(100, 60, 2)][:images]
    case = h.case(PROMPT, pictures, 10)
    engine = h.engine(chunk_size=64)
    num_prompt = len(case.inputs)
    choices = run_choices(engine, case.inputs, "three", n=3, max_new_tokens=10)
    assert sorted(choices) == [0, 1, 2]
    for outs in choices.values():
        assert tokens_of(outs) == case.expected
        assert [o.finished for o in outs].count(True) == 1 and outs[-1].finished
        final = outs[-1]
        assert final.finish_reason == FinishReason.LENGTH
        assert (final.num_prompt_tokens, final.num_completion_tokens) == (num_prompt, 10)
    # choice 0 computed the prompt; the other two matched all of it but its last token
    assert engine.num_prefill_tokens == num_prompt + 2
    assert engine.cache_manager.num_hit_tokens == 2 * (num_prompt - 1)
    assert_nothing_held(engine)


def test_a_seed_gives_each_choice_its_own_reproducible_stream(harness):
    h = harness(ARCHS[0])
    case = h.case(PROMPT, [make_image(64, 48, 3)], 1)
    sampled = dict(temperature=1.0, max_new_tokens=12, ignore_eos=True)
    runs = [
        {i: tokens_of(outs) for i, outs in run_choices(
            h.engine(), case.inputs, "seeded", n=3, seed=7, **sampled
        ).items()}
        for _ in range(2)
    ]  # fmt: skip
    assert runs[0] == runs[1]
    streams = list(runs[0].values())
    assert len({tuple(s) for s in streams}) == 3, streams
    # choice i samples as a request of one choice with seed + i
    alone = run_choices(h.engine(), case.inputs, "alone", seed=8, **sampled)
    assert tokens_of(alone[0]) == runs[0][1]


def test_each_choice_has_its_own_guide_penalties_and_logprobs(harness):
    h = harness(ARCHS[0])
    case = h.case("pick a colour", [], 1)
    engine = h.engine()
    words = ["red", "green", "blue"]
    guided = run_choices(
        engine, case.inputs, "guided", n=3, structured=StructuredOutput.choice(words),
        max_new_tokens=8,
    )  # fmt: skip
    for outs in guided.values():
        assert outs[-1].finish_reason == FinishReason.STOP
        assert "".join(o.text for o in outs) in words
    penalised = dict(max_new_tokens=12, repetition_penalty=1.5, frequency_penalty=1.0)
    one = run_choices(engine, case.inputs, "one", **penalised)
    two = run_choices(engine, case.inputs, "two", n=2, logprobs=True, **penalised)
    for outs in two.values():
        assert tokens_of(outs) == tokens_of(one[0])
        assert [lp.token_id for o in outs for lp in o.logprobs] == tokens_of(outs)
    assert_nothing_held(engine)


def test_abort_of_a_request_with_choices_frees_every_slot_and_lock(harness):
    h = harness(ARCHS[0])
    case = h.case(PROMPT, [make_image(64, 48, 4)], 1)
    engine = h.engine(chunk_size=16)
    engine.add_request("waiting", SamplingParams(n=3, max_new_tokens=50), case.inputs)
    engine.add_request("decoding", SamplingParams(n=3, max_new_tokens=50), case.inputs)
    engine.step()  # "waiting" prefills its first chunk; its other choices wait for it
    assert [c.status for c in engine.choices["waiting"]] == [
        RequestStatus.PREFILL,
        RequestStatus.WAITING_FOR_FIRST_CHOICE,
        RequestStatus.WAITING_FOR_FIRST_CHOICE,
    ]
    engine.abort("waiting")
    for _ in range(200):
        engine.step()
        if all(c.status == RequestStatus.DECODE for c in engine.choices["decoding"]):
            break
    assert all(c.status == RequestStatus.DECODE for c in engine.choices["decoding"])
    outs = engine.abort("decoding")
    assert sorted(o.index for o in outs) == [0, 1, 2]
    assert all(o.finish_reason == FinishReason.ABORT for o in outs)
    assert [o.ends_request for o in outs] == [False, False, True]
    assert not engine.has_work()
    assert_nothing_held(engine)


def test_choices_preempted_for_slots_still_equal_the_reference(harness):
    h = harness(ARCHS[0])
    case = h.case(PROMPT, [make_image(64, 48, 1)], 24)
    # room for the prompt and one choice's tokens, not for three: some choice is preempted
    engine = h.engine(num_kv_slots=len(case.inputs) + 24 + 30, chunk_size=16)
    choices = run_choices(engine, case.inputs, "tight", n=3, max_new_tokens=24)
    assert engine.scheduler.num_preemptions > 0
    assert [tokens_of(choices[i]) for i in range(3)] == [case.expected] * 3
    assert_nothing_held(engine)


def test_a_failing_choice_ends_every_choice_and_frees_everything(harness):
    h = harness(ARCHS[0])
    case = h.case(PROMPT, [make_image(64, 48, 5)], 1)
    engine = h.engine()
    engine.add_request("bad", SamplingParams(n=3, temperature=1.0, max_new_tokens=40), case.inputs)
    for _ in range(4):  # every choice decoding
        engine.step()
    assert all(c.status == RequestStatus.DECODE for c in engine.choices["bad"])

    def broken(*args):
        raise RuntimeError("sampler state corrupted")

    # the row's draw: its uniform on the native sampler, its own sample() on torch's
    engine.choices["bad"][1].sampler.sample = broken
    engine.choices["bad"][1].sampler.uniform = broken
    finals = [o for o in engine.step() if o.finished]
    assert sorted(o.index for o in finals) == [0, 1, 2]
    assert all(o.finish_reason == FinishReason.ERROR for o in finals)
    assert all("sampling failed: sampler state corrupted" in o.error for o in finals)
    assert [o.ends_request for o in finals] == [False, False, True]
    assert not engine.has_work()
    assert_nothing_held(engine)


def test_choices_of_a_received_prompt_share_its_rows_and_prompt_logprobs(harness):
    h = harness(ARCHS[0])
    case = h.case(PROMPT, [make_image(64, 48, 6)], 8)
    engine = h.engine()
    engine.add_request("room", SamplingParams(n=2, max_new_tokens=8), room=41)
    assert engine.deliver_inputs(41, case.inputs) == []
    choices = by_choice(run_to_completion(engine)["room"])
    assert [tokens_of(choices[i]) for i in (0, 1)] == [case.expected] * 2
    text = h.case("a plain prompt", [], 1)
    logged = run_choices(engine, text.inputs, "logged", n=2, prompt_logprobs=1, max_new_tokens=2)
    firsts = [outs[0].prompt_logprobs for outs in logged.values()]
    assert len(firsts[0]) == len(text.inputs)
    assert firsts[0][1:] == firsts[1][1:]  # (the first entry's logprob is NaN in both)
    assert_nothing_held(engine)


def test_n_is_bounded():
    with pytest.raises(ValueError, match=r"n must be in \[1, 16\], got 17"):
        SamplingParams(n=17)
