"""A reasoning model's trace (`<think>...</think>` at the start of a reply, as Qwen3 and DeepSeek-R1
write it) split from its answer, whole or while it streams: shared by `minisgl serve
--reasoning-parser` (the message's `reasoning`) and the LangChain adapter (`reasoning_content`)."""

from __future__ import annotations

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
# vLLM's names (`--reasoning-parser`) for the formats split here: each writes its trace this way.
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def split_reasoning(text: str) -> tuple[str, str | None]:
    """(answer, reasoning): a reply that opens with <think>...</think> has that part moved out."""
    stripped = text.lstrip()
    if not stripped.startswith(THINK_OPEN):
        return text, None
    body, sep, answer = stripped[len(THINK_OPEN) :].partition(THINK_CLOSE)
    if not sep:  # cut before the reasoning ended (max_tokens): all of it is reasoning
        return "", body.strip()
    return answer.lstrip(), body.strip()


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `tag` (it may still grow into it)."""
    return max((k for k in range(1, len(tag)) if text.endswith(tag[:k])), default=0)


class ReasoningStreamSplitter:
    """Streamed text -> (answer delta, reasoning delta), holding back what may still be a tag."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = "start"  # start -> (thinking -> answer) | answer

    def feed(self, delta: str) -> tuple[str, str]:
        self._buf += delta
        answer = reasoning = ""
        while self._buf:
            if self._state == "start":
                head = self._buf.lstrip()
                if len(head) < len(THINK_OPEN) and THINK_OPEN.startswith(head):
                    break  # may still become <think>
                if head.startswith(THINK_OPEN):
                    self._buf, self._state = head[len(THINK_OPEN) :], "thinking"
                else:
                    self._state = "answer"
            elif self._state == "thinking":
                i = self._buf.find(THINK_CLOSE)
                if i >= 0:
                    reasoning += self._buf[:i]
                    self._buf, self._state = self._buf[i + len(THINK_CLOSE) :].lstrip(), "answer"
                    continue
                keep = _partial_tag(self._buf, THINK_CLOSE)
                reasoning += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                break
            else:
                answer, self._buf = answer + self._buf, ""
        return answer, reasoning

    def finish(self) -> tuple[str, str]:
        """Whatever is held back: reasoning if the reply is still thinking, else answer text."""
        rest, self._buf = self._buf, ""
        return ("", rest) if self._state == "thinking" else (rest, "")
