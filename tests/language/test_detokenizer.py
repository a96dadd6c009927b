"""Incremental detokenization: the streamed text equals the full decode, in O(new tokens).

Three kinds of tokenizer: the tiny test checkpoint's byte-level BPE (every non-ASCII byte its own
token), the real Qwen2 tokenizer (byte-level BPE, 151k tokens, multi-byte characters split over
tokens) and a SentencePiece-style one (Metaspace with byte fallback, as Llama's).
"""

from __future__ import annotations

import random

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from common.models.tokenizers import build_qwen2_tokenizer
from services.language.engine.detokenizer import IncrementalDetokenizer, text_of_ids

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "héllo wörld, naïve café — 中文字符 and 日本語のテキスト 🙂🚀 done",
    "emoji run: 👩‍💻👨‍👩‍👧 and accents àéîõü ÀÉÎÕÜ",
    "  leading spaces, tabs\tand\nnew lines\n\n end ",
]


def metaspace_tokenizer() -> PreTrainedTokenizerFast:
    """A SentencePiece-like BPE: ``▁`` for spaces, <0xNN> byte tokens for unknown characters."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for b in range(256):
        vocab[f"<0x{b:02X}>"] = len(vocab)
    pieces = list("abcdefghijklmnopqrstuvwxyzTHEQ.,!?-'") + ["▁"]
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("i", "n"), ("▁", "q")]
    for piece in pieces + [a + b for a, b in merges]:
        vocab.setdefault(piece, len(vocab))
    tok = Tokenizer(models.BPE(vocab, merges, byte_fallback=True, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )


@pytest.fixture(scope="module", params=["test_bpe", "qwen2", "metaspace"])
def tokenizer(request, tiny_model_dir):
    if request.param == "test_bpe":
        return AutoTokenizer.from_pretrained(str(tiny_model_dir("qwen2_5_vl")))
    if request.param == "qwen2":
        return build_qwen2_tokenizer()
    return metaspace_tokenizer()


def full_decode(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True)


def stream(tokenizer, ids: list[int], stop: tuple[str, ...] = ()) -> tuple[list[str], bool]:
    """The pieces ``add`` released, token by token (the last call is final), and ``stopped``."""
    detok = IncrementalDetokenizer(tokenizer, stop)
    pieces = []
    for i, token in enumerate(ids):
        pieces.append(detok.add(token, final=i == len(ids) - 1))
        if detok.stopped:
            break
    return pieces, detok.stopped


def test_streamed_text_equals_full_decode_of_real_text(tokenizer):
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        pieces, _ = stream(tokenizer, ids)
        assert "".join(pieces) == full_decode(tokenizer, ids), text
        assert len(pieces) == len(ids)


def test_streamed_text_equals_full_decode_of_random_tokens(tokenizer):
    """Random ids: split characters, invalid byte sequences, special tokens in between.

    NOTE: byte-fallback decoding turns a whole run of byte tokens into U+FFFD when the run is
    not valid UTF-8, rewriting bytes that were valid on their own: the stream keeps them. So
    for the Metaspace tokenizer random ids avoid byte tokens (valid text covers them above).
    """
    rng = random.Random(1234)
    special = tokenizer.all_special_ids
    vocab = [
        i for i in range(len(tokenizer)) if not tokenizer.convert_ids_to_tokens(i).startswith("<0x")
    ]
    for _ in range(150):
        ids = [rng.choice(vocab) for _ in range(rng.randrange(1, 40))]
        if special and rng.random() < 0.3:
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        pieces, _ = stream(tokenizer, ids)
        assert "".join(pieces) == full_decode(tokenizer, ids), ids


def test_multibyte_characters_are_released_whole(tokenizer):
    ids = tokenizer("中文 🙂 é", add_special_tokens=False).input_ids
    pieces, _ = stream(tokenizer, ids)
    assert all("\ufffd" not in piece for piece in pieces)
    assert "".join(pieces) == full_decode(tokenizer, ids)


def test_text_is_released_as_soon_as_it_is_stable(tokenizer):
    text = "the quick brown fox jumps over the lazy dog"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    pieces, _ = stream(tokenizer, ids)
    # ASCII: every token's text comes out at its own step, nothing waits for the end.
    assert all(pieces), pieces
    assert "".join(pieces) == full_decode(tokenizer, ids)


def test_stop_strings_across_token_boundaries(tokenizer):
    rng = random.Random(7)
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False).input_ids
        full = full_decode(tokenizer, ids)
        for _ in range(20):
            start = rng.randrange(len(full) - 1)
            stop = full[start : start + rng.randrange(2, 6)]
            pieces, stopped = stream(tokenizer, ids, (stop, "never-there-xyz"))
            assert stopped
            assert "".join(pieces) == full[: full.index(stop)], stop
            assert all(stop not in piece for piece in pieces)


def test_stop_string_tail_is_held_back_then_released(tokenizer):
    ids = tokenizer("abc abd abe", add_special_tokens=False).input_ids
    full = full_decode(tokenizer, ids)
    pieces, stopped = stream(tokenizer, ids, ("abx",))
    assert not stopped and "".join(pieces) == full
    # "ab" could begin the stop string: it never ends a released piece before the last step.
    assert all(not piece.endswith(("a", "ab")) for piece in pieces[:-1])


def test_unchecked_tokens_release_a_stop_string_as_text(tokenizer):
    ids = tokenizer("one two one two three", add_special_tokens=False).input_ids
    full = full_decode(tokenizer, ids)
    first = len(tokenizer("one two", add_special_tokens=False).input_ids)
    for checked_from, expected in ((0, "one "), (first, "one two one ")):
        detok = IncrementalDetokenizer(tokenizer, ("two",))
        pieces = [
            detok.add(token, final=i == len(ids) - 1, check_stop=i >= checked_from)
            for i, token in enumerate(ids)
        ]
        assert detok.stopped and "".join(pieces) == expected == full[: len(expected)]


class CountingTokenizer:
    """Records how many tokens each decode call was given."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.sizes: list[int] = []

    def decode(self, ids, **kwargs) -> str:
        self.sizes.append(len(ids))
        return self.tokenizer.decode(ids, **kwargs)


def test_each_step_decodes_a_short_window(tokenizer):
    text = " ".join(TEXTS * 6)
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) > 300
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, ("zzzz",))
    out = "".join(detok.add(t, final=i == len(ids) - 1) for i, t in enumerate(ids))
    assert out == full_decode(tokenizer, ids)
    # the window is the context token plus the tokens of at most one character
    assert max(counting.sizes) <= 8
    assert len(counting.sizes) == 2 * len(ids)


def test_text_of_ids_is_the_tokenizers_decode(tokenizer):
    """The direct call on the Rust tokenizer decodes as ``decode(..., skip_special_tokens=True)``
    does, special tokens and all, on every kind of tokenizer here."""
    rng = random.Random(0)
    special = tokenizer.all_special_ids
    ids = tokenizer(" ".join(TEXTS), add_special_tokens=False).input_ids
    decode = text_of_ids(tokenizer)
    for _ in range(200):
        start = rng.randrange(len(ids))
        window = ids[start : start + rng.randrange(1, 12)]
        window.insert(rng.randrange(len(window) + 1), rng.choice(special))
        assert decode(window) == full_decode(tokenizer, window)
    random_ids = [rng.randrange(len(tokenizer)) for _ in range(64)]
    assert decode(random_ids) == full_decode(tokenizer, random_ids)
