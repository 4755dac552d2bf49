"""Logprobs in OpenAI's chat shape, shared by `minisgl serve` and the LangChain adapter."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from minisgl_backend.types import TokenLogprob


def _byte_level_chars() -> dict[str, int]:
    """The printable character byte-level BPE vocabularies (GPT-2's, Llama 3's, SmolLM2's) write
    for each byte, inverted: character -> byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


_BYTE_LEVEL = _byte_level_chars()
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte tokens


class TokenText:
    """Per-token strings for logprobs (decoded one by one, as OpenAI shows them), and their bytes,
    cached."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return s

    def bytes(self, token_id: int) -> list[int]:
        """The token's own bytes. A token holding part of a character (an emoji is several) decodes
        alone to U+FFFD; its bytes come from its vocabulary entry instead, so that a client joining
        the bytes of consecutive tokens gets the text back."""
        b = self._bytes.get(token_id)
        if b is None:
            s = self(token_id)
            b = list(s.encode("utf-8"))
            if "\ufffd" in s:
                piece = self._tok.convert_ids_to_tokens(token_id)
                m = _BYTE_FALLBACK.fullmatch(piece or "")
                if m is not None:
                    b = [int(m.group(1), 16)]
                elif piece and all(c in _BYTE_LEVEL for c in piece):
                    b = [_BYTE_LEVEL[c] for c in piece]
            self._bytes[token_id] = b
        return b


def chat_logprobs(text: TokenText, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(tid: int, v: float) -> dict[str, Any]:
        return {"token": text(tid), "logprob": v, "bytes": text.bytes(tid)}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
        ],
        "refusal": None,
    }
