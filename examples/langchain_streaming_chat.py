"""Streaming chat on the embedded model, offline: tokens are printed as the engine produces them.

python examples/langchain_streaming_chat.py
"""

from __future__ import annotations

from langchain_core.messages import HumanMessage, SystemMessage
from langchain_minisgl import ChatMiniSGL


def main(question: str = "Write a haiku about the sea.") -> list[str]:
    chat = ChatMiniSGL(temperature=0, max_tokens=48, engine_config={"dtype": "bfloat16"})
    messages = [SystemMessage("You are a poet."), HumanMessage(question)]
    pieces: list[str] = []
    full = None
    for chunk in chat.stream(messages):
        print(chunk.content, end="", flush=True)
        pieces.append(chunk.content)
        full = chunk if full is None else full + chunk
    print(
        f"\n[{full.usage_metadata['output_tokens']} tokens, "
        f"finish: {full.response_metadata['finish_reason']}]"
    )
    return pieces


if __name__ == "__main__":
    main()
