"""Servers and checks shared by the serve test modules (the `client` fixture: conftest.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]

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


@dataclass
class ServeProcess:
    """A `minisgl serve` child process listening (once started) on `url`."""

    proc: subprocess.Popen
    url: str

    def rss_mb(self) -> float:
        """The child's resident memory (VmRSS) in MB."""
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        raise AssertionError("no VmRSS line")

    def wait_serving(self, timeout: float = 120) -> None:
        """Returns once /health answers 200; fails if the process exits or `timeout` passes first."""
        import httpx

        deadline = time.monotonic() + timeout
        while True:  # the process is starting: poll its health endpoint
            assert self.proc.poll() is None, self.proc.communicate()
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "the server did not start"
            time.sleep(0.2)

    def kill(self) -> None:
        """Kills the process if it is still running (and reaps it)."""
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.communicate()


def start_serve(model_dir: Any, *flags: str) -> ServeProcess:
    """`minisgl serve` of `model_dir` (one torch thread, no stats log) with `flags`, on a free port of
    127.0.0.1, started but not waited for (`wait_serving`): a test can start several at once. Its
    output is captured (`proc.communicate()`)."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "adapters"), os.environ.get("PYTHONPATH", "")]),
    }
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "minisgl_backend.cli",
        "serve",
        "--port",
        str(port),
        "--model",
        str(model_dir),
    ]
    cmd += ["--set", "num_threads=1", "--set", "stats_interval_s=0", *flags]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    return ServeProcess(proc, f"http://127.0.0.1:{port}")


@contextmanager
def serve_process(model_dir: Any, *flags: str, start_timeout: float = 120) -> Iterator[ServeProcess]:
    """`start_serve(model_dir, *flags)`, yielded once /health answers; killed on exit if it is still
    running."""
    srv = start_serve(model_dir, *flags)
    try:
        srv.wait_serving(start_timeout)
        yield srv
    finally:
        srv.kill()


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
