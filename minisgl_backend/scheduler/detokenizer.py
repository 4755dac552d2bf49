"""Incremental detokenisation with stop strings (text after a stop string is never shown)."""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one delta at a time.

    Decodes a small window [prefix, end) and emits only the part past the previously read tokens,
    and nothing while the window ends in an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer, stop: Sequence[str], skip_special_tokens: bool) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._prefix = 0
        self._read = 0
        self.stop = tuple(stop)
        self._hold = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # chars of `text` already handed to streams

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip)

    def append(self, ids: Sequence[int]) -> bool:
        """Account for new tokens at the end of `ids` (all output ids).
        True if a stop string ended the text."""
        before = self._decode(ids[self._prefix : self._read])
        after = self._decode(ids[self._prefix :])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return False
        start = max(0, len(self.text) - self._hold)
        self.text += after[len(before) :]
        self._prefix, self._read = self._read, len(ids)
        hits = [i for i in (self.text.find(s, start) for s in self.stop) if i != -1]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

    def take_delta(self, finished: bool) -> str:
        """Text not yet streamed, holding back a tail that could still grow into a stop string."""
        end = len(self.text) if finished else max(self.emitted, len(self.text) - self._hold)
        delta = self.text[self.emitted : end]
        self.emitted = end
        return delta
