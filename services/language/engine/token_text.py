"""Each reported token's text and bytes, for log-probabilities (the gateway has no tokenizer).

A token's ``text`` is the token decoded alone (special tokens kept), as other serving APIs give
it: a byte-level BPE token holding part of a UTF-8 character decodes to U+FFFD. Its ``bytes``
are the token's own bytes, so a client can join the bytes of consecutive tokens into the
characters they split:

* byte-level BPE (GPT-2, Qwen): the token's string from the vocabulary maps back to bytes
  through the inverse of the GPT-2 byte-to-unicode table;
* SentencePiece byte fallback: ``<0xHH>`` is the byte ``HH``; ``▁`` is a space;
* added (special) tokens and anything else: the UTF-8 of the decoded text.

Only the ids a request reports are looked up, and each once: ``TokenTexts`` keeps what it
computed (at most one entry per vocabulary id).
"""

from __future__ import annotations

import re
from typing import NamedTuple

from services.language.engine.sampling import TokenLogprob, TopLogprob

BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
METASPACE = "\u2581"


def unicode_to_bytes() -> dict[str, int]:
    """The inverse of GPT-2's byte-to-unicode table: the character a byte-level BPE vocabulary
    writes for each byte value. Printable Latin-1 bytes stand for themselves; the other 68 byte
    values are shifted to code points 256 and up, in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


class TokenText(NamedTuple):
    text: str  # the token decoded alone
    raw: bytes  # the token's own bytes


def is_byte_level(tokenizer) -> bool:
    """Whether ``tokenizer`` (a fast tokenizer) decodes with a byte-level decoder."""
    decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    # NOTE: the decoder's own JSON (a Sequence lists its parts), not the whole tokenizer's
    return decoder is not None and '"ByteLevel"' in decoder.__getstate__().decode()


class TokenTexts:
    """Text and bytes of token ids of one tokenizer, computed on first use and kept."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.byte_level = is_byte_level(tokenizer)
        self.byte_of = unicode_to_bytes()
        self.added = {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
        self._known: dict[int, TokenText] = {}

    def __call__(self, token_id: int) -> TokenText:
        found = self._known.get(token_id)
        if found is None:
            found = self._known[token_id] = self._compute(token_id)
        return found

    def label(self, lp: TokenLogprob) -> TokenLogprob:
        """``lp`` with the text and bytes of its token and of its top tokens."""
        top = [TopLogprob(t.token_id, t.logprob, *self(t.token_id)) for t in lp.top]
        return TokenLogprob(lp.token_id, lp.logprob, top, *self(lp.token_id))

    def _compute(self, token_id: int) -> TokenText:
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if token_id in self.added or not isinstance(piece, str):
            return TokenText(text, text.encode())
        if self.byte_level and all(ch in self.byte_of for ch in piece):
            return TokenText(text, bytes(self.byte_of[ch] for ch in piece))
        fallback = BYTE_FALLBACK.match(piece)
        if fallback is not None:
            return TokenText(text, bytes([int(fallback.group(1), 16)]))
        return TokenText(text, piece.replace(METASPACE, " ").encode())
