"""`minisgl bench-serve`: many concurrent streaming clients against a server.

Arrivals are closed-loop (`--concurrency` clients, each sends its next request when the previous one
ends) or Poisson (`--request-rate` requests/s, at most `--concurrency` in flight). Each request is a
streamed `/v1/completions` of random token ids (a seeded pool of `--num-prompts` distinct prompts,
drawn with replacement), greedy, `ignore_eos`. With `--disconnect-prob p` a client hangs up after
its first chunk. Definitions follow SGLang's / vLLM's serving benchmarks: TTFT = time to the first
streamed token; TPOT per request = (latency - TTFT) / (output tokens - 1), averaged over requests;
ITL = every gap between streamed chunks, pooled; req/s and output tok/s over the wall time of the run.

`--check` sends every distinct prompt once more *alone* (nothing else in flight) and compares each
completed response with that solo reference. Greedy outputs are batch-independent only in
deterministic mode (`--set deterministic=true`) or on a model whose greedy choices are well separated
(the tiny random one); otherwise near-ties may flip. Without `--url`, the bench starts its own
server in this process (engine from --model / --config / --set) and, at the end, drains the engine
and reports whether every KV block is FREE and how many hung-up requests the server aborted.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from minisgl_backend.bench.thread_cpu import NATIVE


@dataclass
class Result:
    index: int
    prompt: int  # index into the prompt pool
    text: str = ""
    ttft: float | None = None
    latency: float | None = None
    gaps: list[float] = field(default_factory=list)
    output_tokens: int = 0
    finish_reason: str | None = None
    disconnected: bool = False
    error: str | None = None


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _stats(name: str, xs: list[float]) -> dict[str, float]:
    ms = [1000 * x for x in xs]
    return {
        f"{name}_mean_ms": statistics.fmean(ms) if ms else float("nan"),
        f"{name}_median_ms": _pct(ms, 50),
        f"{name}_p99_ms": _pct(ms, 99),
    }


async def _one(client: Any, res: Result, body: dict[str, Any], hang_up: bool) -> None:
    t0 = time.perf_counter()
    last = t0  # the time of the latest text chunk
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                ev = json.loads(data)
                if "error" in ev:
                    res.error = str(ev["error"])
                    return
                if ev.get("usage"):
                    res.output_tokens = ev["usage"]["completion_tokens"]
                for c in ev.get("choices", []):
                    if c.get("text"):
                        now = time.perf_counter()
                        if res.ttft is None:
                            res.ttft = now - t0
                        else:
                            res.gaps.append(now - last)
                        last = now
                        res.text += c["text"]
                        if hang_up:
                            res.disconnected = True
                            return  # leaving the block closes the connection mid-stream
                    if c.get("finish_reason"):
                        res.finish_reason = c["finish_reason"]
        res.latency = time.perf_counter() - t0
    except Exception as e:  # noqa: BLE001 - reported per request
        res.error = f"{type(e).__name__}: {e}"


async def _run(
    url: str,
    api_key: str | None,
    model: str | None,
    prompts: list[list[int]],
    plan: list[tuple[int, bool]],
    output_len: int,
    concurrency: int,
    request_rate: float,
    seed: int,
) -> tuple[list[Result], float]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    results = [Result(i, p) for i, (p, _) in enumerate(plan)]
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600, limits=limits) as client:

        def body(i: int) -> dict[str, Any]:
            p = plan[i][0]
            return {
                "model": model,
                "prompt": prompts[p],
                "max_tokens": output_len,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
                "user": f"bench-{i}",
            }

        t0 = time.perf_counter()
        if request_rate == float("inf"):  # closed loop
            nxt = iter(range(len(plan)))

            async def worker() -> None:
                for i in nxt:
                    await _one(client, results[i], body(i), plan[i][1])

            await asyncio.gather(*(worker() for _ in range(concurrency)))
        else:  # Poisson arrivals, capped at `concurrency` in flight
            rng = random.Random(seed + 1)
            sem = asyncio.Semaphore(concurrency)
            tasks = []

            async def send(i: int) -> None:
                async with sem:
                    await _one(client, results[i], body(i), plan[i][1])

            for i in range(len(plan)):
                tasks.append(asyncio.create_task(send(i)))
                await asyncio.sleep(rng.expovariate(request_rate))
            await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    return results, wall


async def _solo(
    url: str, api_key: str | None, model: str | None, prompts: list[list[int]], output_len: int
) -> list[str]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    refs = []
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=600) as client:
        for p in prompts:  # one at a time: each runs alone
            r = await client.post(
                "/v1/completions",
                json={
                    "model": model,
                    "prompt": p,
                    "max_tokens": output_len,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            )
            r.raise_for_status()
            refs.append(r.json()["choices"][0]["text"])
    return refs


def _metric(text: str, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def _scrape(url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    r = httpx.get(f"{url}/metrics", headers=headers, timeout=30)
    return r.text if r.status_code == 200 else ""


def workload(
    num_requests: int,
    num_prompts: int,
    input_len: int,
    disconnect_prob: float,
    seed: int,
    vocab: int,
    random_lengths: bool = True,
) -> tuple[list[list[int]], list[tuple[int, bool]]]:
    """(the prompt pool, the plan: per request, which prompt and whether its client hangs up), seeded."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(num_prompts):
        n = rng.randrange(max(1, input_len // 2), input_len * 3 // 2 + 1) if random_lengths else input_len
        prompts.append([rng.randrange(3, vocab) for _ in range(n)])
    plan = [(rng.randrange(num_prompts), rng.random() < disconnect_prob) for _ in range(num_requests)]
    return prompts, plan


def offline_baseline(engine: Any, row: dict[str, Any], num_prompts: int, input_len: int, seed: int) -> None:
    """The same requests (every one completed: no hang-ups), the same closed loop of
    `row["concurrency"]` clients, on the same engine called in-process (Engine.submit from client
    threads, no HTTP, no server threads): its req/s and output tok/s go into `row` beside the
    served run's, with their ratio, which is what the server's own threads (event loop, tokenizer
    pool, detokenising, SSE framing) cost the engine. Where the served run's CPU split is in the row
    (`bench_serve_in_child`), the offline run's goes beside it: CPU seconds per 1,000 output tokens,
    by thread role."""
    from minisgl_backend.bench import thread_cpu
    from minisgl_backend.bench.configs import run_closed_loop

    prompts, plan = workload(row["requests"], num_prompts, input_len, 0.0, seed, engine.vocab_size)
    output_len = row["output_len"]
    before = thread_cpu.Sample()
    offline = run_closed_loop(engine, [prompts[i] for i, _ in plan], output_len, row["concurrency"])
    after = thread_cpu.Sample()
    split = after.since(before)
    row["offline_req_per_s"] = offline["req_per_s"]
    row["offline_output_tok_per_s"] = offline["output_tok_per_s"]
    row["served_over_offline"] = row["output_tok_per_s"] / offline["output_tok_per_s"]
    if "served_cpu_s" in row and split:
        row["offline_cpu_s"] = split
        row["offline_waited_s"] = after.waited_since(before)
        row["offline_cpu_s_per_1k_tokens"] = (
            1000
            * thread_cpu.server_seconds(split)
            / max(offline["output_tok_per_s"] * offline["wall_s"], 1.0)
        )
        row["served_cpu_over_offline"] = (
            row["served_cpu_s_per_1k_tokens"] / row["offline_cpu_s_per_1k_tokens"]
        )


def engine_counts(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """What the engine did between two `Engine.metrics()` snapshots: iterations and forward time
    (the same requests should take as many iterations served as offline; a longer forward is CPU
    taken from it by other work on the machine)."""
    keys = ("iterations", "forward_s", "sample_s", "prefill_tokens", "decode_tokens")
    return {k: round(after.get(k, 0.0) - before.get(k, 0.0), 3) for k in keys}


# The line a client process prints when its timed run has ended (the server samples its CPU then).
_MEASURED = "measured"


def bench_serve_in_child(url: str, **kw: Any) -> dict[str, Any]:
    """`bench_serve` with its clients in a process of their own, so that their parsing and HTTP work
    is not counted as the server's, neither in CPU nor in the interpreter lock they would share
    with the server's threads; this process's CPU seconds per thread role over the timed run go
    into the row (`served_cpu_s`, and per 1,000 output tokens of the server's own threads)."""
    from minisgl_backend.bench import thread_cpu

    child = subprocess.Popen(
        [sys.executable, "-m", "minisgl_backend.bench.serve"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        child.stdin.write(json.dumps({"url": url, **kw}) + "\n")
        child.stdin.flush()
        if child.stdout.readline().strip() != "ready":
            raise RuntimeError("the benchmark's client process did not start (its error is above)")
        before, client_before = thread_cpu.Sample(), thread_cpu.process_seconds(child.pid)
        child.stdin.write("go\n")
        child.stdin.flush()
        line = child.stdout.readline().strip()
        after, client_after = thread_cpu.Sample(), thread_cpu.process_seconds(child.pid)
        if line != _MEASURED:
            raise RuntimeError("the benchmark's client process failed during the run (its error is above)")
        row: dict[str, Any] = json.loads(child.stdout.readline())
    finally:
        child.stdin.close()
        if child.wait(timeout=60) != 0:
            raise RuntimeError(f"the benchmark's client process exited with {child.returncode}")
    split = after.since(before)
    if split:
        row["served_cpu_s"] = split
        row["served_waited_s"] = after.waited_since(before)
        tokens = max(row["output_tokens"], 1)
        row["served_cpu_s_per_1k_tokens"] = 1000 * thread_cpu.server_seconds(split) / tokens
        # On one machine the clients' CPU is taken from the cores the forward runs on.
        row["client_cpu_s"] = round(client_after - client_before, 3)
    return row


def _client_main() -> None:
    """The client process of `bench_serve_in_child`: the arguments as a JSON line on stdin, then
    `ready`; the run starts at `go` and `measured` is printed when it ends; then the row."""
    kw = json.loads(sys.stdin.readline())
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return
    row = bench_serve(**kw, on_measured=lambda: print(_MEASURED, flush=True))
    print(json.dumps(row), flush=True)


def bench_serve(
    url: str,
    *,
    api_key: str | None = None,
    model: str | None = None,
    num_requests: int = 200,
    num_prompts: int = 64,
    input_len: int = 64,
    output_len: int = 32,
    concurrency: int = 32,
    request_rate: float = float("inf"),
    disconnect_prob: float = 0.0,
    check: bool = False,
    seed: int = 0,
    vocab: int = 49152,
    random_lengths: bool = True,
    on_measured: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """Run the benchmark against `url` (the server's root, e.g. http://127.0.0.1:8000).
    `on_measured` is called as soon as the timed run ends, before `check`'s solo runs."""
    spec = (num_requests, num_prompts, input_len, disconnect_prob, seed, vocab, random_lengths)
    prompts, plan = workload(*spec)
    before = _scrape(url, api_key)
    results, wall = asyncio.run(
        _run(url, api_key, model, prompts, plan, output_len, concurrency, request_rate, seed)
    )
    if on_measured is not None:
        on_measured()
    after = _scrape(url, api_key)
    done = [r for r in results if not r.disconnected and r.error is None]
    row: dict[str, Any] = {
        "requests": num_requests,
        "completed": len(done),
        "disconnected": sum(r.disconnected for r in results),
        "errors": sum(r.error is not None for r in results),
        "wall_s": wall,
        "req_per_s": len(done) / wall,
        "output_tok_per_s": sum(r.output_tokens for r in done) / wall,
        "output_tokens": sum(r.output_tokens for r in done),
        "concurrency": concurrency,
        "request_rate": request_rate,
        "output_len": output_len,
    }
    row.update(_stats("ttft", [r.ttft for r in done if r.ttft is not None]))
    row.update(
        _stats(
            "tpot",
            [
                (r.latency - r.ttft) / (r.output_tokens - 1)
                for r in done
                if r.latency is not None and r.ttft is not None and r.output_tokens > 1
            ],
        )
    )
    row.update(_stats("itl", [g for r in done for g in r.gaps]))
    row["disconnected_ids"] = [r.index for r in results if r.disconnected]
    if before and after:  # may miss aborts the server had not folded into /metrics yet
        row["server_aborted"] = _metric(
            after, "minisgl:request_success_total", finished_reason="abort"
        ) - _metric(before, "minisgl:request_success_total", finished_reason="abort")
    if check:
        refs = asyncio.run(_solo(url, api_key, model, prompts, output_len))
        bad = [r for r in done if r.text != refs[r.prompt]]
        row["mismatches"] = len(bad)
        row["mismatch_examples"] = [
            {"request": r.index, "prompt": r.prompt, "got": r.text[:80], "solo": refs[r.prompt][:80]}
            for r in bad[:3]
        ]
    row["error_examples"] = [r.error for r in results if r.error][:3]
    return row


def format_row(row: dict[str, Any]) -> str:
    lines = [
        f"requests {row['requests']}: completed {row['completed']}, disconnected {row['disconnected']}, "
        f"errors {row['errors']}, wall {row['wall_s']:.1f} s",
        f"throughput: {row['req_per_s']:.2f} req/s, {row['output_tok_per_s']:.1f} output tok/s",
    ]
    for name in ("ttft", "tpot", "itl"):
        lines.append(
            f"{name.upper():5s} mean {row[f'{name}_mean_ms']:.1f} ms, "
            f"median {row[f'{name}_median_ms']:.1f} ms, "
            f"p99 {row[f'{name}_p99_ms']:.1f} ms"
        )
    if "disconnects_aborted" in row:
        lines.append(
            f"disconnected: {row['disconnected']}, aborted on the server {row['disconnects_aborted']}, "
            f"finished before the hang-up was seen {row['disconnects_finished']}, "
            f"unaccounted {row['disconnects_unaccounted']}"
        )
    elif "server_aborted" in row:
        lines.append(
            f"server aborted {row['server_aborted']:.0f} requests per /metrics "
            f"(disconnected clients: {row['disconnected']})"
        )
    if "mismatches" in row:
        lines.append(
            f"check: {row['mismatches']} of {row['completed']} completed responses differ from their solo "
            "reference"
        )
        lines += [f"  mismatch: {ex}" for ex in row["mismatch_examples"]]
    if "served_over_offline" in row:
        lines.append(
            f"offline (same requests, in-process): {row['offline_req_per_s']:.2f} req/s, "
            f"{row['offline_output_tok_per_s']:.1f} output tok/s; served / offline "
            f"{row['served_over_offline']:.2f}"
        )
    if "served_cpu_over_offline" in row:
        lines.append(
            f"server CPU per 1,000 output tokens: served {row['served_cpu_s_per_1k_tokens']:.3f} s, "
            f"offline {row['offline_cpu_s_per_1k_tokens']:.3f} s; served / offline "
            f"{row['served_cpu_over_offline']:.3f}"
        )
        for name, split in (("served", row["served_cpu_s"]), ("offline", row["offline_cpu_s"])):
            lines.append(f"  {name} CPU s by thread: " + ", ".join(f"{r} {v:.2f}" for r, v in split.items()))
        lines.append(f"  the client process (on this machine's cores too): {row['client_cpu_s']:.2f} CPU s")
        sw, ow = row.get("served_waited_s") or {}, row.get("offline_waited_s") or {}
        if sw and ow:
            kernels = ("compute", NATIVE)  # the compute thread and the kernels' pool
            served_wait, offline_wait = (sum(w.get(r, 0.0) for r in kernels) for w in (sw, ow))
            lines.append(
                f"  the forward's threads runnable but kept off a CPU: served {served_wait:.2f} s, "
                f"offline {offline_wait:.2f} s"
            )
    if "served_engine" in row:
        se, oe = row["served_engine"], row["offline_engine"]
        lines.append(
            f"engine: served {se['iterations']:.0f} iterations, {se['prefill_tokens']:.0f} prefill tokens, "
            f"forward {se['forward_s']:.2f} s; offline {oe['iterations']:.0f} iterations, "
            f"{oe['prefill_tokens']:.0f} prefill tokens, forward {oe['forward_s']:.2f} s"
        )
    if "kv_after_drain" in row:
        lines.append(f"KV after drain: {row['kv_after_drain']} (all FREE: {row['kv_all_free']})")
    lines += [f"  error: {e}" for e in row["error_examples"]]
    return "\n".join(lines)


if __name__ == "__main__":
    _client_main()
