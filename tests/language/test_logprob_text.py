"""Token text and bytes of reported log-probabilities, and prompt log-probabilities.

Token text: a byte-level BPE token that is a whole multi-byte character, one that is a single
byte of such a character (its text U+FFFD, its bytes the raw byte), a SentencePiece byte-fallback
token (``<0xE2>``), a special token. Prompt log-probabilities: equal to the log-softmax of
transformers' full forward (fp32) on the tiny checkpoint, whatever the prefill chunking and
whether the prompt is in the radix cache.
"""

from __future__ import annotations

import math

import pytest
import torch

from services.language.engine.sampling import SamplingParams
from services.language.engine.token_text import TokenTexts, unicode_to_bytes
from services.language.inputs import PromptInputs
from tests.language.conftest import run_to_completion

ARCH = "qwen2_5_vl"
PROMPT = "The quick brown fox jumps over the lazy dog. What is in this picture?"
TOL = 1e-4


def byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=["<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["café déjà vu é é é"] * 50, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>")


def byte_fallback_tokenizer():
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "▁a": 1, "▁": 2, "a": 3, **{f"<0x{b:02X}>": 4 + b for b in range(256)}}
    merges = [("▁", "a")]
    tok = Tokenizer(models.BPE(vocab, merges, unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_unicode_to_bytes_is_gpt2_table():
    table = unicode_to_bytes()
    assert sorted(table.values()) == list(range(256))
    assert table["A"] == ord("A") and table["Ġ"] == ord(" ") and table["Ã"] == 0xC3


def test_byte_level_tokens_whole_character_partial_byte_and_special():
    tokenizer = byte_level_tokenizer()
    texts = TokenTexts(tokenizer)
    assert texts.byte_level
    whole = tokenizer.convert_tokens_to_ids("Ã©")  # "é": both of its UTF-8 bytes
    assert texts(whole) == ("é", "é".encode())
    partial = tokenizer.convert_tokens_to_ids("Ã")  # 0xC3, the first byte of "é" alone
    assert texts(partial) == ("\ufffd", b"\xc3")
    word = tokenizer.encode("café")
    assert b"".join(texts(t).raw for t in word).decode() == "café"
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert texts(end) == ("<|im_end|>", b"<|im_end|>")
    assert texts(whole) is texts(whole)  # computed once


def test_byte_fallback_tokens():
    tokenizer = byte_fallback_tokenizer()
    texts = TokenTexts(tokenizer)
    assert not texts.byte_level
    ids = tokenizer.encode("a€", add_special_tokens=False)  # € = E2 82 AC, not in the vocabulary
    assert ids[0] == 1 and ids[1:] == [4 + 0xE2, 4 + 0x82, 4 + 0xAC]
    assert texts(ids[1]).raw == b"\xe2"
    assert b"".join(texts(t).raw for t in ids).decode() == " a€"
    assert texts(1) == (" a", b" a")


@pytest.fixture(scope="module")
def prompt_case(harness):
    h = harness(ARCH)
    ids = h.ref.tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        out = h.ref.model(input_ids=ids, attention_mask=torch.ones_like(ids))
    expected = torch.log_softmax(out.logits[0].float(), dim=-1)  # row i predicts token i + 1
    return h, ids[0].tolist(), expected


def check_prompt_logprobs(entries, ids, expected, num_top):
    assert [e.token_id for e in entries] == ids
    assert math.isnan(entries[0].logprob) and entries[0].top == []
    for i, entry in enumerate(entries[1:], start=1):
        assert abs(entry.logprob - float(expected[i - 1, ids[i]])) <= TOL, i
        values, top = torch.topk(expected[i - 1], num_top)
        assert [t.token_id for t in entry.top] == top.tolist(), i
        assert all(abs(t.logprob - float(v)) <= TOL for t, v in zip(entry.top, values, strict=True))
        best = entry.top[0]
        if best.token_id == ids[i]:
            assert (entry.token, entry.token_bytes) == (best.token, best.token_bytes)


@pytest.mark.parametrize("chunk_size", [512, 7], ids=["one-chunk", "chunked"])
def test_prompt_logprobs_equal_transformers_full_forward(prompt_case, chunk_size):
    h, ids, expected = prompt_case
    engine = h.engine(chunk_size=chunk_size)
    inputs = PromptInputs.from_text_ids(ids, engine.model_config.hidden_size)
    for attempt in range(2):  # the second time the prompt is in the radix cache
        params = SamplingParams(max_new_tokens=2, prompt_logprobs=3, logprobs=True)
        engine.add_request(f"p{attempt}", params, inputs)
        outs = run_to_completion(engine)[f"p{attempt}"]
        entries = [e for o in outs for e in o.prompt_logprobs]
        check_prompt_logprobs(entries, ids, expected, 3)
        assert outs[-1].num_cached_tokens == 0  # every prompt row computed by the request
        tokenizer = engine.tokenizer
        for e in entries:
            assert e.token == tokenizer.decode([e.token_id], skip_special_tokens=False)
        first = outs[0].logprobs[0]
        assert abs(first.logprob - float(expected[-1, first.token_id])) <= TOL
    engine.add_request("plain", SamplingParams(max_new_tokens=2), inputs)
    plain = run_to_completion(engine)["plain"]
    assert plain[-1].num_cached_tokens > 0  # others still reuse the cached prompt
    assert all(not o.prompt_logprobs for o in plain)


def test_real_qwen2_tokenizer_bytes_rebuild_the_text():
    """On the real Qwen2 vocabulary (151,669 ids) the tokens' bytes join into the text, a rare
    character split over byte tokens included, and whole tokens' texts are their bytes."""
    from common.models.tokenizers import build_qwen2_tokenizer

    tokenizer = build_qwen2_tokenizer()
    texts = TokenTexts(tokenizer)
    text = "日本語 café 🙂 𝔘𝔫𝔦 <|im_end|>"
    ids = tokenizer.encode(text)
    assert b"".join(texts(t).raw for t in ids) == text.encode()
    partial = [t for t in ids if "\ufffd" in texts(t).text]  # parts of a character
    assert partial
    for t in partial:
        with pytest.raises(UnicodeDecodeError):
            texts(t).raw.decode()
    for t in set(ids) - set(partial):
        assert texts(t).raw.decode() == texts(t).text
