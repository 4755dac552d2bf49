"""Logprobs in OpenAI's chat shape, shared by `minisgl serve` and the LangChain adapter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from minisgl_backend.types import TokenLogprob


class TokenText:
    """Per-token strings for logprobs (decoded one by one, as OpenAI shows them), cached."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        s = self._cache.get(token_id)
        if s is None:
            s = self._cache[token_id] = self._tok.decode([token_id], skip_special_tokens=False)
        return s


def chat_logprobs(text: TokenText, lps: Sequence[TokenLogprob]) -> dict[str, Any]:
    """OpenAI's chat logprobs object: {"content": [{token, logprob, bytes, top_logprobs}]}."""

    def entry(tid: int, v: float) -> dict[str, Any]:
        s = text(tid)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}

    return {
        "content": [
            {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps
        ],
        "refusal": None,
    }
