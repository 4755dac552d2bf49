"""Servers and checks shared by the serve test modules (the `client` fixture: conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# The tiny model's engine behind a server: a tight KV pool (64 blocks of 16 tokens for up to 16 running
# requests), so concurrent clients preempt each other; overlap and the prefix cache on (the defaults).
TINY_ENGINE = dict(num_blocks=64, max_num_seqs=16, num_threads=1, stats_interval_s=0, seed=0)


@contextmanager
def serving(config: Any, *, key: str, model: str, **server: Any) -> Iterator[Any]:
    """An Engine of `config` served on a free port of 127.0.0.1 by a background thread (start_in_thread
    with `server`'s further arguments); on exit the server stops, then the engine closes."""
    from minisgl_backend import Engine
    from minisgl_backend.serve import start_in_thread

    engine = Engine(config)
    srv = start_in_thread(engine, api_key=key, model_name=model, **server)
    yield srv
    srv.stop()
    engine.close()


def assert_serves(client: Any, model: str) -> None:
    """The server still answers a plain completion, in full."""
    r = client.post(
        "/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    )
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def checked_bench(url: str, *, key: str, model: str, **bench: Any) -> tuple[dict, str]:
    """`minisgl bench-serve --check` against `url`: no request failed and every completed response
    equals its solo reference. Returns the row and its printed form."""
    from minisgl_backend.bench.serve import bench_serve, format_row

    row = bench_serve(url, api_key=key, model=model, check=True, **bench)
    text = format_row(row)
    assert row["errors"] == 0 and row["mismatches"] == 0, text
    return row, text


def streamed_chat(client: Any, model: str, messages: list, max_tokens: int) -> tuple[str, list]:
    """A greedy streamed chat completion through the OpenAI client, usage included: its text (the
    first chunk carrying the assistant role) and its chunks."""
    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    return "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices), chunks


def streamed_completion(client: Any, model: str, prompt: str, max_tokens: int) -> str:
    """The text of a greedy streamed completion through the OpenAI client."""
    stream = client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True
    )
    return "".join(ch.choices[0].text for ch in stream if ch.choices)
