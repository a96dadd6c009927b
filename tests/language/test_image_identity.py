"""Image identity in radix keys: equal pad ids of different images never share KV."""

from __future__ import annotations

import json
import types

import numpy as np
import pytest

from common.multimodal import pad_id_for
from services.language.engine.sampling import SamplingParams
from services.language.image_identity import ImageRef, image_keys, parse_images
from services.language.inputs import PromptInputs
from tests.language.conftest import make_image, run_to_completion, tokens_of

VOCAB = 400
DIGEST_A = bytes(range(1, 33))


def colliding(digest: bytes) -> bytes:
    """Another hash whose pad id equals ``digest``'s: the same low 30 bits, other high bits."""
    changed = bytearray(digest)
    changed[5] ^= 0xFF
    changed[7] ^= 0x5A
    assert pad_id_for(bytes(changed), VOCAB) == pad_id_for(digest, VOCAB)
    return bytes(changed)


def prompt(*runs: tuple[bytes, int] | int) -> np.ndarray:
    """Fill ids: ints are text tokens, (digest, n) is an image of n tokens."""
    ids: list[int] = []
    for run in runs:
        if isinstance(run, tuple):
            ids += [pad_id_for(run[0], VOCAB)] * run[1]
        else:
            ids.append(run)
    return np.array(ids, dtype=np.int64)


def extra(*images: tuple[str, int]) -> bytes:
    return json.dumps({"hashes": [h for h, _ in images], "tokens": [n for _, n in images]}).encode()


def test_parse_images_reads_the_encoders_extra():
    refs = parse_images(extra((DIGEST_A.hex(), 4), ("ab" * 8, 2)))
    assert refs == (ImageRef(DIGEST_A[:8], 4), ImageRef(bytes([0xAB] * 8), 2))
    assert parse_images(json.dumps({"hashes": [], "tokens": []}).encode()) == ()


@pytest.mark.parametrize(
    "raw",
    [
        b"",
        b"not json",
        b"[1, 2]",
        json.dumps({"tokens": [4]}).encode(),
        json.dumps({"hashes": ["ab" * 8]}).encode(),
        json.dumps({"hashes": ["ab" * 8], "tokens": [4, 5]}).encode(),
        json.dumps({"hashes": ["abcd"], "tokens": [4]}).encode(),  # fewer than 64 bits
        json.dumps({"hashes": ["zz" * 8], "tokens": [4]}).encode(),
        json.dumps({"hashes": ["ab" * 8], "tokens": [0]}).encode(),
        json.dumps({"hashes": ["ab" * 8], "tokens": ["4"]}).encode(),
    ],
)
def test_parse_images_rejects_malformed_extra(raw):
    assert parse_images(raw) is None


def test_image_keys_follow_the_hashes():
    digest_b = colliding(DIGEST_A)
    fill = prompt(1, 2, (DIGEST_A, 3), 5, (digest_b, 2), 6)
    refs = (ImageRef(DIGEST_A[:8], 3), ImageRef(digest_b[:8], 2))
    keys, problem = image_keys(fill, VOCAB, refs)
    assert problem == ""
    assert keys[[0, 1, 5, 8]].tolist() == [0, 0, 0, 0]
    assert set(keys[2:5].tolist()) == {refs[0].key} and set(keys[6:8].tolist()) == {refs[1].key}
    assert refs[0].key != refs[1].key  # equal pad ids, different images


@pytest.mark.parametrize(
    ("refs", "problem"),
    [
        (None, "no image hashes"),
        ((ImageRef(DIGEST_A[:8], 2),), "cover 2 tokens"),
        ((ImageRef(bytes(8), 3),), "does not derive from its hash"),
    ],
)
def test_image_keys_that_do_not_fit_are_random(refs, problem):
    fill = prompt(1, (DIGEST_A, 3), 5)
    keys, reason = image_keys(fill, VOCAB, refs)
    assert problem in reason
    assert keys[0] == keys[4] == 0 and keys[1] == keys[2] == keys[3] != 0
    again, _ = image_keys(fill, VOCAB, refs)
    assert again[1] != keys[1]  # fresh each time: such tokens never match anything


def test_one_item_in_several_runs_gets_one_key():
    """A Qwen3-VL video: its frame groups are runs of its pad id with timestamp text between."""
    fill = prompt(1, (DIGEST_A, 2), 5, (DIGEST_A, 1))
    keys, reason = image_keys(fill, VOCAB, (ImageRef(DIGEST_A[:8], 3),))
    assert reason == ""
    key = ImageRef(DIGEST_A[:8], 3).key
    assert keys.tolist() == [0, key, key, 0, key]


def test_received_prompt_carries_its_images():
    fill = prompt(1, (DIGEST_A, 2), 3)
    aux = types.SimpleNamespace(mrope_delta=0, extra=extra((DIGEST_A.hex(), 2)))
    received = types.SimpleNamespace(
        fill_ids=fill.astype(np.int32),
        positions=np.zeros((3, 4), np.int32),
        image_rows=np.zeros((2, 8), np.float32),
        aux=aux,
        transfer_s=0.0,
        num_transfers=1,
    )
    inputs = PromptInputs.from_received(received, 0)
    assert inputs.images == (ImageRef(DIGEST_A[:8], 2),)


# ---- the engine ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def h(harness):
    return harness("qwen2_5_vl")


def with_images(inputs: PromptInputs, rows, images) -> PromptInputs:
    return PromptInputs(
        inputs.fill_ids, inputs.positions, rows, inputs.mrope_delta, inputs.num_deepstack, images
    )


def test_colliding_pad_ids_do_not_share_kv(h):
    """Prompt B has A's fill ids (its image's pad id collides with A's) but another image."""
    case_a = h.case("what is in the picture", [make_image(64, 48, 21)], 8)
    case_b = h.case("what is in the picture", [make_image(64, 48, 22)], 8)
    assert case_a.expected != case_b.expected  # the rows differ, so do the answers
    [image_a] = case_a.inputs.images
    image_b = ImageRef(colliding(image_a.digest + bytes(24))[:8], image_a.num_tokens)
    inputs_b = with_images(case_a.inputs, case_b.inputs.image_rows, (image_b,))
    vocab = h.ref.config.text_config.vocab_size
    first_image_token = int((case_a.inputs.fill_ids >= vocab).nonzero()[0])

    engine = h.engine()
    outputs = {}
    for rid, inputs in (("a", case_a.inputs), ("b", inputs_b), ("a-again", case_a.inputs)):
        engine.add_request(rid, SamplingParams(max_new_tokens=8), inputs)
        outputs[rid] = run_to_completion(engine)[rid]
    assert tokens_of(outputs["a"]) == case_a.expected
    assert outputs["b"][-1].num_cached_tokens == first_image_token  # stops before the image
    assert tokens_of(outputs["b"]) == case_b.expected
    assert outputs["a-again"][-1].num_cached_tokens >= 0.9 * len(case_a.inputs)  # still hits
    assert tokens_of(outputs["a-again"]) == case_a.expected
    engine.cache_manager.cache.check_integrity()


def test_prompt_without_hashes_is_never_shared(h):
    case = h.case("what is in the picture", [make_image(64, 48, 23)], 8)
    unknown = with_images(case.inputs, case.inputs.image_rows, None)
    vocab = h.ref.config.text_config.vocab_size
    first_image_token = int((case.inputs.fill_ids >= vocab).nonzero()[0])
    engine = h.engine()
    for rid, inputs in (("known", case.inputs), ("unknown", unknown), ("unknown2", unknown)):
        engine.add_request(rid, SamplingParams(max_new_tokens=8), inputs)
        outs = run_to_completion(engine)[rid]
        assert tokens_of(outs) == case.expected
        if rid != "known":
            assert outs[-1].num_cached_tokens == first_image_token
    engine.cache_manager.cache.check_integrity()
