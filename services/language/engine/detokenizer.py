"""Incremental detokenization with stop strings.

Text is released only when it is stable: decoding does not end in an incomplete UTF-8 sequence
(``\ufffd``), and the tail that could still grow into a stop string is held back.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, stop: tuple[str, ...] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = tuple(s for s in stop if s)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # full decoded text so far (stop string removed once hit)
        self.num_sent_chars = 0
        self.stopped = False

    def add(self, token_id: int, final: bool = False) -> str:
        """Append a token; returns the newly released text (all the rest when ``final``)."""
        if not self.stopped:
            self.token_ids.append(token_id)
            text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
            search_from = max(0, self.num_sent_chars - self._hold)
            for s in self.stop:
                at = text.find(s, search_from)
                if at >= 0:
                    text, self.stopped = text[:at], True
            self.text = text
        if final or self.stopped:
            end = len(self.text)
        else:
            end = len(self.text.rstrip("\ufffd")) - self._hold
        if end <= self.num_sent_chars:
            return ""
        delta = self.text[self.num_sent_chars : end]
        self.num_sent_chars = end
        return delta
