"""An LCEL chain (prompt | chat model | parser) on the embedded model, offline.

    python examples/langchain_lcel_chain.py

`batch` sends every question into the engine's continuous batch at once.
"""

from __future__ import annotations

from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_minisgl import ChatMiniSGL


def main(countries: tuple[str, ...] = ("France", "Italy", "Japan")) -> list[str]:
    prompt = ChatPromptTemplate.from_messages(
        [
            ("system", "You answer in one short sentence."),
            ("human", "What is the capital of {country}?"),
        ]
    )
    llm = ChatMiniSGL(temperature=0, max_tokens=32, engine_config={"dtype": "bfloat16"})
    chain = prompt | llm | StrOutputParser()
    answers = chain.batch([{"country": c} for c in countries])
    for country, answer in zip(countries, answers):
        print(f"{country}: {answer}")
    return answers


if __name__ == "__main__":
    main()
