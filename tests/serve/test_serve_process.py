"""`minisgl serve` as a child process, observed from outside: its resident memory after a burst, and
its stop on SIGTERM with a request in flight."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from tests.serve.servers import serve_process  # noqa: E402

pytestmark = pytest.mark.slow

BIG_CHARS = 4 * 1024 * 1024  # --max-request-chars' default: the largest text /tokenize takes


def _text(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    return " ".join(rng.choice(words) for _ in range(n // 4))[:n]


def test_rss_returns_within_10_percent_of_its_baseline_after_a_burst(tiny_model_dir):
    """A burst of completions, chats and one /tokenize of 4 Mi characters: once it is over, the
    server's RSS is back within 10% of its value after start and warm-up (glibc keeps what the large
    request freed unless the server hands it back). RSS is polled while the server settles; no
    timing is asserted beyond a generous bound."""
    with serve_process(tiny_model_dir, "--set", "num_blocks=64", "--set", "max_num_seqs=16") as srv:
        big = _text(BIG_CHARS)

        def completion(i: int) -> int:
            body = {"prompt": f"Request {i}: " + _text(200, i), "max_tokens": 4, "logprobs": 5}
            return c.post("/v1/completions", json=body | {"user": f"user-{i}-" + "u" * 200}).status_code

        def chat(i: int) -> int:
            msgs = [{"role": "user", "content": _text(300, i)}]
            return c.post(
                "/v1/chat/completions", json={"messages": msgs, "max_tokens": 4, "n": 2}
            ).status_code

        def tokenize(text: str) -> int:
            return c.post("/tokenize", json={"prompt": text}).status_code

        with httpx.Client(base_url=srv.url, timeout=120) as c, ThreadPoolExecutor(8) as pool:
            # warm-up: each kind of request, and every tokenizer thread's first use
            assert set(pool.map(completion, range(4))) == {200}
            assert set(pool.map(chat, range(2))) == {200}
            assert set(pool.map(tokenize, [_text(20_000, i) for i in range(8)])) == {200}
            time.sleep(1)
            baseline = srv.rss_mb()

            burst = [pool.submit(tokenize, big)]
            burst += [pool.submit(completion, i) for i in range(60)]
            burst += [pool.submit(chat, i) for i in range(20)]
            assert {f.result() for f in burst} == {200}
            deadline = time.monotonic() + 30
            while (rss := srv.rss_mb()) > 1.10 * baseline and time.monotonic() < deadline:
                time.sleep(0.5)
        print(f"RSS {baseline:.0f} MB after warm-up, {rss:.0f} MB after the burst")
        assert rss <= 1.10 * baseline, f"RSS {baseline:.0f} MB after warm-up, {rss:.0f} MB after the burst"


def test_sigterm_does_not_wait_past_the_shutdown_timeout_for_a_tokenizer_job(tiny_model_dir):
    """SIGTERM with --shutdown-timeout 1 while a /tokenize of 24 Mi characters is being tokenised (many
    seconds of work): the request is still in flight at the deadline, gets a 503, and the process
    exits 0 without a traceback soon after, without waiting for the tokenizer to finish."""
    import signal
    import threading

    chars = 24 * 1024 * 1024
    flags = [
        "--shutdown-timeout",
        "1",
        "--max-request-chars",
        str(chars),
        "--max-body-bytes",
        str(chars + 4096),
    ]
    with serve_process(tiny_model_dir, *flags) as srv:
        answer: list = []
        # Built before the clock starts: making 24 Mi characters in Python takes seconds of its own,
        # which on a loaded machine could outlast the wait below and leave nothing in flight.
        body = json.dumps({"prompt": _text(chars)}).encode()
        sending = threading.Event()

        def tokenize() -> None:
            with httpx.Client(base_url=srv.url, timeout=120) as c:
                try:
                    sending.set()
                    answer.append(
                        c.post("/tokenize", content=body, headers={"content-type": "application/json"})
                    )
                except httpx.TransportError as e:
                    answer.append(e)

        client = threading.Thread(target=tokenize)
        client.start()
        assert sending.wait(60)
        time.sleep(3)  # the body is sent and parsed; tokenising it takes far longer
        srv.proc.send_signal(signal.SIGTERM)
        t0 = time.monotonic()
        out, err = srv.proc.communicate(timeout=120)
        exited_after = time.monotonic() - t0
        client.join(60)
    assert srv.proc.returncode == 0, err
    assert "Traceback" not in err and "Traceback" not in out, err
    assert "1 in flight" in err and "1 requests still in flight after 1 s" in err, err
    r = answer[0]
    assert isinstance(r, httpx.TransportError) or r.status_code == 503, r
    # the drain's second, then the engine's close; the tokenizer's remaining work is not waited for
    assert exited_after < 10, f"exited {exited_after:.1f} s after SIGTERM"
