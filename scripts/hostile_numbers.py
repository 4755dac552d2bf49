"""Issue 26's hostile-client numbers, rerun: start `minisgl serve` (loopback, the given flags), then

- server RSS before and after a 50 MB prompt;
- /health latency and the pause of a neighbouring stream while a 50 MB prompt and a 5 MB /tokenize
  are handled;
- the server's thread count during a streamed request of 3,000 prompts (or its refusal) and of
  1,000 prompts (under the default --max-prompts).

    .venv/bin/python scripts/hostile_numbers.py [-- SERVE FLAGS ...]   # default: --set num_threads=1

Prints one line per figure. Needs httpx and psutil (the test extra).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time

import httpx
import psutil


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Watch:
    """/health polled and a neighbour chat stream read while `fn` runs: the worst /health latency
    and the longest gap between the neighbour's chunks."""

    def __init__(self, url: str) -> None:
        self.url = url

    def run(self, fn):
        stop = threading.Event()
        health: list[float] = []
        gaps: list[float] = []
        first = threading.Event()

        def poll() -> None:
            with httpx.Client(base_url=self.url, timeout=300) as c:
                while not stop.is_set():
                    t0 = time.perf_counter()
                    c.get("/health")
                    health.append(time.perf_counter() - t0)
                    time.sleep(0.02)

        def neighbour() -> None:
            req = {
                "messages": [{"role": "user", "content": "Write a long story about a lighthouse."}],
                "max_tokens": 400,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            }
            with httpx.Client(base_url=self.url, timeout=300) as c:
                with c.stream("POST", "/v1/chat/completions", json=req) as r:
                    last = None
                    for line in r.iter_lines():
                        now = time.perf_counter()
                        if line and last is not None and not stop.is_set():
                            gaps.append(now - last)
                        last = now
                        first.set()
                        if stop.is_set():
                            return

        threads = [threading.Thread(target=poll), threading.Thread(target=neighbour)]
        for t in threads:
            t.start()
        first.wait(120)
        time.sleep(1.0)  # a baseline of ordinary gaps first
        baseline = max(gaps) if gaps else 0.0
        t0 = time.perf_counter()
        result = fn()
        took = time.perf_counter() - t0
        time.sleep(0.5)
        stop.set()
        for t in threads:
            t.join(300)
        return result, took, max(health), baseline, max(gaps) if gaps else float("nan")


def main() -> int:
    flags = sys.argv[sys.argv.index("--") + 1 :] if "--" in sys.argv else ["--set", "num_threads=1"]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "minisgl_backend.cli", "serve", "--port", str(port), *flags],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the server did not start")
            time.sleep(0.5)
        ps = psutil.Process(proc.pid)
        watch = Watch(url)
        rss0 = ps.memory_info().rss

        def post(path: str, body: bytes):
            with httpx.Client(base_url=url, timeout=600) as c:
                r = c.post(path, content=body, headers={"content-type": "application/json"})
                return r.status_code, r.json().get("error", {}).get("code")

        big = json.dumps({"prompt": "word " * (10 * 1024 * 1024), "max_tokens": 2}).encode()  # 50 MiB
        res, took, health, base, gap = watch.run(lambda: post("/v1/completions", big))
        rss1 = ps.memory_info().rss
        print(
            f"50 MB prompt: {res} in {took:.2f} s; /health worst {health * 1000:.0f} ms; "
            f"neighbour stream gap {gap * 1000:.0f} ms (baseline worst {base * 1000:.0f} ms)"
        )
        print(f"server RSS: {rss0 / 2**30:.2f} GiB before, {rss1 / 2**30:.2f} GiB after the 50 MB prompt")
        tok = json.dumps({"prompt": "word " * (1024 * 1024)}).encode()  # 5 MiB
        res, took, health, base, gap = watch.run(lambda: post("/tokenize", tok))
        print(
            f"5 MB /tokenize: {res} in {took:.2f} s; /health worst {health * 1000:.0f} ms; "
            f"neighbour stream gap {gap * 1000:.0f} ms (baseline worst {base * 1000:.0f} ms)"
        )
        print(f"server RSS after both: {ps.memory_info().rss / 2**30:.2f} GiB")
        for count in (3000, 1000):
            peak = [ps.num_threads()]
            done = threading.Event()

            def sample(done: threading.Event = done, peak: list[int] = peak) -> None:
                while not done.is_set():
                    peak.append(ps.num_threads())
                    time.sleep(0.05)

            sampler = threading.Thread(target=sample)
            sampler.start()
            req = {"prompt": [f"Item {i}:" for i in range(count)], "max_tokens": 2, "stream": True}
            t0 = time.perf_counter()
            with httpx.Client(base_url=url, timeout=600) as c:
                with c.stream("POST", "/v1/completions", json=req) as r:
                    status = r.status_code
                    lines = sum(1 for ln in r.iter_lines() if ln)
            done.set()
            sampler.join()
            print(
                f"{count} prompts streamed: {status} ({lines} SSE lines, {time.perf_counter() - t0:.1f} s); "
                f"server threads {peak[0]} before, peak {max(peak)}"
            )
    finally:
        proc.terminate()
        proc.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
