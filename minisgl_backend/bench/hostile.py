"""`python -m minisgl_backend.bench.hostile`: what one hostile client costs everyone else.

It starts a server in this process (the tiny random model unless `--model`), then runs each hostile
case while two probe loops measure, for as long as the case is in flight, the latency of `/health`
and of a 1-token completion, as any other client would see them. After each case it waits until the
engine is idle and reads the process's resident memory (VmRSS). The cases, each bounded in size:

- `3 many prompts`: prompts each within the context whose total is over --max-request-chars, and a
  chat whose tool-call arguments are (400s, before anything is tokenised);
- `3 /tokenize`: one text at the limit (tokenised in full: 200) beside two over it (400);
- `4 token ids`: 1,024 token-id prompts (a few thousand ids each where the context allows; the last id
  out of the vocabulary, so every id is checked before the 400);
- `4 chat n=32`: n=32 with top_logprobs=20 (a large answer, built off the event loop);
- `5 8 x n=128`: one request of 8 prompts x n=128 sequences, then a 1-token request once it is queued
  (its latency is the `beside` figure; the big request is then dropped by its client, which aborts
  it); `--fcfs` repeats it on an engine with `scheduling_policy=fcfs`, for contrast;
- `8 drain`: a second server over the same engine, stopped as by SIGTERM with a shutdown timeout
  while a request is in flight: the probes go to that server and get 503s, the request in flight
  finishes in full, a new one gets a 503, and the server stops by itself;
- `9 burst`: 200 requests, each with its own `user` tag, then RSS against its value before the burst.

The client runs in the same process as the server, so the RSS figures include its buffers too; the
end figure is read after the engine drained (prefix cache flushed), against the one after warm-up.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import math
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from minisgl_backend.bench.serve import _pct

PROBE_INTERVAL_S = 0.05
ONE_TOKEN = {"prompt": "Hi", "max_tokens": 1, "temperature": 0}


def rss_mb() -> float | None:
    """This process's resident memory in MB, or None off Linux."""
    from minisgl_backend.serve.heap import rss_bytes

    rss = rss_bytes()
    return None if rss is None else rss / 2**20


def trimmed_rss_mb() -> float | None:
    """RSS after asking the C allocator to hand its free memory back (glibc's malloc_trim): the
    difference from `rss_mb()` is memory freed but kept for reuse, not memory still held."""
    from minisgl_backend.serve.heap import malloc_trim

    return rss_mb() if malloc_trim() else None


@dataclass
class Sizes:
    """How big each case is: the full run, or `quick()` for a test."""

    id_prompts: int = 1024
    ids_per_prompt: int = 4000  # capped by the context
    chat_n: int = 32
    chat_tokens: int = 200
    big_prompts: int = 8
    big_n: int = 128
    big_tokens: int = 16
    drain_tokens: int = 300
    burst: int = 200
    burst_concurrency: int = 32
    burst_tokens: int = 8
    wait_s: float = 120.0  # the most any one request of a case is waited for

    @classmethod
    def quick(cls) -> Sizes:
        return cls(
            id_prompts=64,
            ids_per_prompt=512,
            chat_n=8,
            chat_tokens=16,
            big_prompts=4,
            big_n=16,
            big_tokens=8,
            # long enough that the late request and the probes meet the server while it drains
            # even when a loaded machine delays them: a tiny model decodes a few dozen in a blink
            drain_tokens=400,
            burst=40,
            burst_concurrency=8,
            burst_tokens=4,
            wait_s=60.0,
        )


@dataclass
class Outcome:
    """What a case saw: the status of each hostile request ("cancelled" when its client dropped it),
    whether they were the expected ones, a note, and any figures of its own."""

    codes: Counter = field(default_factory=Counter)
    ok: bool = True
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Case:
    name: str
    run: Callable[[], Awaitable[Outcome]]  # measured, with the probes running beside it
    probe_url: str | None = None  # the probes' server, when not the main one
    after: Callable[[Outcome], Awaitable[None]] | None = None  # once the probes stopped
    report: Callable[[dict[str, Any]], None] | None = None  # given the row, its RSS read


@dataclass
class Ctx:
    engine: Any
    srv: Any  # the main BackgroundServer
    client: Any  # httpx.AsyncClient of the hostile requests (absolute URLs)
    probes: Any  # httpx.AsyncClient of the probes
    sizes: Sizes
    rng: random.Random

    @property
    def url(self) -> str:
        return str(self.srv.url)

    @property
    def limits(self) -> Any:
        return self.srv.app.state.server.limits


def _status(r: Any) -> str:
    """The status, with the error's code when there is one ("400 request_too_long")."""
    if r.status_code < 400:
        return str(r.status_code)
    try:
        return f"{r.status_code} {r.json()['error']['code']}"
    except (ValueError, KeyError, TypeError):
        return str(r.status_code)


def _codes(*responses: Any) -> Counter:
    return Counter(_status(r) for r in responses)


async def _post(ctx: Ctx, path: str, body: Any, url: str | None = None) -> Any:
    """POST a prepared body (bytes: sent as they are, so the client spends no time encoding it in the
    measured window)."""
    target = (url or ctx.url) + path
    if isinstance(body, bytes):
        return await ctx.client.post(target, content=body, headers={"Content-Type": "application/json"})
    return await ctx.client.post(target, json=body)


# ---------------------------------------------------------------------------------------------- probes
async def _probe(
    client: Any, method: str, url: str, body: Any, out: list[float], codes: Counter, stop: Any
) -> None:
    """Send one request after another until `stop` (at least one), recording each answer's latency."""
    while True:
        t = time.perf_counter()
        try:
            r = await client.request(method, url, json=body)
        except Exception as e:  # noqa: BLE001 - a probe that got no answer is counted, not raised
            codes[type(e).__name__] += 1
        else:
            out.append(time.perf_counter() - t)
            codes[_status(r)] += 1
        if stop.is_set():
            return
        try:
            await asyncio.wait_for(stop.wait(), PROBE_INTERVAL_S)
        except TimeoutError:
            pass
        if stop.is_set():
            return


async def _measure(ctx: Ctx, case: Case) -> dict[str, Any]:
    url = case.probe_url or ctx.url
    stop = asyncio.Event()
    health: list[float] = []
    one: list[float] = []
    probe_codes: Counter = Counter()
    probes = [
        asyncio.create_task(_probe(ctx.probes, "GET", f"{url}/health", None, health, probe_codes, stop)),
        asyncio.create_task(
            _probe(ctx.probes, "POST", f"{url}/v1/completions", ONE_TOKEN, one, probe_codes, stop)
        ),
    ]
    t0 = time.perf_counter()
    try:
        outcome = await case.run()
    finally:
        stop.set()
        await asyncio.gather(*probes)
    wall = time.perf_counter() - t0
    if case.after is not None:
        await case.after(outcome)
    await _settle(ctx)
    row: dict[str, Any] = {
        "case": case.name,
        "codes": dict(sorted(outcome.codes.items())),
        "probe_codes": dict(sorted(probe_codes.items())),
        "health_p50_ms": 1000 * _pct(health, 50),
        "health_max_ms": 1000 * max(health, default=math.nan),
        "one_token_p50_ms": 1000 * _pct(one, 50),
        "one_token_max_ms": 1000 * max(one, default=math.nan),
        "health_samples": len(health),
        "one_token_samples": len(one),
        "wall_s": wall,
        "rss_mb": rss_mb(),
        "ok": outcome.ok,
        "note": outcome.note,
    }
    row.update(outcome.extra)
    if case.report is not None:
        case.report(row)
    return row


async def _settle(ctx: Ctx, flush: bool = False) -> None:
    """Wait until the engine is idle and the server has folded every finished request, then collect
    garbage: what is left is what the server keeps."""
    await asyncio.to_thread(ctx.engine.drain, ctx.sizes.wait_s, flush)
    backend = ctx.srv.app.state.server.backend
    deadline = time.monotonic() + 10
    while not backend.done.empty() and time.monotonic() < deadline:
        await asyncio.sleep(0.02)  # the server's loop folds them as they finish
    gc.collect()


# ---------------------------------------------------------------------------------------------- cases
def _text(n: int, rng: random.Random) -> str:
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"]
    out: list[str] = []
    size = 0
    while size < n:
        w = rng.choice(words)
        out.append(w)
        size += len(w) + 1
    return " ".join(out)[:n]


async def case_many_prompts(ctx: Ctx) -> Case:
    """Prompts each within the context, over --max-request-chars together; and one chat whose tool
    call's arguments are over it. Both 400 before any tokenising."""
    state = ctx.srv.app.state.server
    limit = state.limits.max_request_chars
    per = min(state.backend.max_model_len * state.max_token_chars - 1, 70_000)
    count = limit // per + 1
    text = _text(per, ctx.rng)
    prompts = json.dumps({"prompt": [text] * count, "max_tokens": 1}).encode()
    args = json.dumps({"x": _text(limit + 1, ctx.rng)})
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": args}}
    chat = json.dumps(
        {
            "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "ok"},
                {"role": "user", "content": "and?"},
            ],
            "max_tokens": 1,
        }
    ).encode()

    async def run() -> Outcome:
        rs = await asyncio.gather(
            *(_post(ctx, "/v1/completions", prompts) for _ in range(2)),
            _post(ctx, "/v1/chat/completions", chat),
        )
        return Outcome(
            _codes(*rs),
            ok=[_status(r) for r in rs[:2]] == ["400 request_too_long"] * 2 and rs[2].status_code == 400,
            note=f"{count} prompts x {per} chars (limit {limit}); tool-call arguments {len(args)} chars",
        )

    return Case("3 many prompts", run)


async def case_tokenize(ctx: Ctx) -> Case:
    """/tokenize of a text at --max-request-chars (tokenised in full) beside two over it."""
    limit = ctx.limits.max_request_chars
    at = json.dumps({"prompt": _text(limit, ctx.rng)}).encode()
    over = json.dumps({"prompt": _text(2 * limit, ctx.rng)}).encode()

    async def run() -> Outcome:
        rs = await asyncio.gather(
            _post(ctx, "/tokenize", at), _post(ctx, "/tokenize", over), _post(ctx, "/tokenize", over)
        )
        count = rs[0].json().get("count") if rs[0].status_code == 200 else None
        return Outcome(
            _codes(*rs),
            ok=[_status(r) for r in rs] == ["200"] + ["400 request_too_long"] * 2,
            note=f"{limit} chars: {count} tokens; beside it 2 x {2 * limit} chars",
        )

    return Case("3 /tokenize", run)


async def case_token_ids(ctx: Ctx) -> Case:
    """Many long token-id prompts whose very last id is outside the vocabulary: every id is checked
    (off the event loop) before the 400."""
    s, state = ctx.sizes, ctx.srv.app.state.server
    vocab = state.backend.vocab_size
    per = min(s.ids_per_prompt, state.backend.max_model_len - 1)
    # under the body limit: each id is at most 7 bytes of JSON with its separator
    count = min(s.id_prompts, state.limits.max_prompts, state.limits.max_body_bytes // (7 * per + 2))
    prompts = [[ctx.rng.randrange(3, vocab) for _ in range(per)] for _ in range(count)]
    prompts[-1][-1] = vocab
    body = json.dumps({"prompt": prompts, "max_tokens": 1}).encode()
    del prompts

    async def run() -> Outcome:
        r = await _post(ctx, "/v1/completions", body)
        return Outcome(
            _codes(r),
            ok=r.status_code == 400,
            note=f"{count} prompts x {per} ids, {len(body) / 2**20:.1f} MiB; the last id out of range",
        )

    return Case("4 token ids", run)


async def case_chat_n(ctx: Ctx) -> Case:
    """A chat answer of n samples with top_logprobs=20: a large JSON built on a worker thread."""
    s = ctx.sizes
    body = {
        "messages": [{"role": "user", "content": "Tell me a story."}],
        "n": s.chat_n,
        "max_tokens": s.chat_tokens,
        "logprobs": True,
        "top_logprobs": 20,
        "ignore_eos": True,
        "temperature": 1,
        "seed": 0,
    }

    async def run() -> Outcome:
        r = await _post(ctx, "/v1/chat/completions", body)
        return Outcome(
            _codes(r),
            ok=r.status_code == 200,
            note=f"n={s.chat_n} x {s.chat_tokens} tokens: a {len(r.content) / 2**20:.1f} MiB answer",
        )

    return Case(f"4 chat n={s.chat_n}", run)


def big_request_case(ctx: Ctx, label: str) -> Case:
    """One request of many prompts x n sequences; once it is queued, a 1-token request whose latency
    is what fair admission is for. The big request is then dropped by its client (the server aborts
    it), which bounds the case whatever the policy."""
    s = ctx.sizes
    backend = ctx.srv.app.state.server.backend
    big = {
        "prompt": [f"Tell me story number {i}." for i in range(s.big_prompts)],
        "n": s.big_n,
        "max_tokens": s.big_tokens,
        "temperature": 1,
        "ignore_eos": True,
    }

    async def run() -> Outcome:
        task = asyncio.create_task(_post(ctx, "/v1/completions", big))
        deadline = time.monotonic() + s.wait_s
        while len(backend.live) < s.big_prompts and not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        t = time.perf_counter()
        codes: Counter = Counter()
        try:
            r = await asyncio.wait_for(_post(ctx, "/v1/completions", ONE_TOKEN), s.wait_s)
            beside = time.perf_counter() - t
            codes["beside " + _status(r)] += 1
            ok = r.status_code == 200
        except TimeoutError:
            beside, ok = math.nan, False
            codes["beside timeout"] += 1
        if task.done():
            failed = task.exception()
            codes["big " + (type(failed).__name__ if failed else _status(task.result()))] += 1
        else:
            task.cancel()  # the client hangs up: the server aborts the request's sequences
            codes["big cancelled"] += 1
            try:
                await task
            except asyncio.CancelledError:
                pass
        return Outcome(
            codes,
            ok=ok,
            note=f"{s.big_prompts} x n={s.big_n} = {s.big_prompts * s.big_n} sequences of "
            f"{s.big_tokens} tokens; the 1-token request beside it: {1000 * beside:.0f} ms",
            extra={"beside_ms": 1000 * beside},
        )

    return Case(f"5 {s.big_prompts} x n={s.big_n} ({label})", run)


async def case_big(ctx: Ctx) -> Case:
    return big_request_case(ctx, ctx.engine.config.scheduling_policy)


async def case_drain(ctx: Ctx) -> Case:
    """A second server over the same engine, stopped as by SIGTERM with a shutdown timeout while a
    request is in flight: it drains (503 to everything new, /health included) and stops by itself."""
    from minisgl_backend.serve.server import start_in_thread

    s = ctx.sizes
    srv = start_in_thread(ctx.engine, limits=ctx.limits, shutdown_timeout=s.wait_s)
    body = {"prompt": "Hi", "max_tokens": s.drain_tokens, "temperature": 0, "ignore_eos": True}
    inflight = asyncio.create_task(_post(ctx, "/v1/completions", body, url=srv.url))
    deadline = time.monotonic() + s.wait_s
    while not srv.state.live and not inflight.done() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    srv.server.handle_exit(signal.SIGTERM, None)
    while not srv.app.state.drain.draining and time.monotonic() < deadline:
        await asyncio.sleep(0.01)

    async def run() -> Outcome:
        late = await _post(ctx, "/v1/completions", ONE_TOKEN, url=srv.url)
        r = await inflight
        got = r.json()["usage"]["completion_tokens"] if r.status_code == 200 else None
        retry = late.headers.get("retry-after")
        return Outcome(
            _codes(r, late),
            ok=r.status_code == 200 and got == s.drain_tokens and late.status_code == 503,
            note=f"in flight: {r.status_code}, {got} of {s.drain_tokens} tokens; a new request: "
            f"{late.status_code}, Retry-After {retry}",
        )

    async def after(outcome: Outcome) -> None:
        await asyncio.to_thread(srv.thread.join, s.wait_s)
        stopped = not srv.thread.is_alive()
        srv.stop()  # nothing left to do once it stopped by itself
        outcome.ok = outcome.ok and stopped
        outcome.note += f"; stopped by itself: {'yes' if stopped else 'NO'}"
        outcome.extra["stopped_by_itself"] = stopped

    return Case("8 drain", run, probe_url=srv.url, after=after)


async def case_burst(ctx: Ctx) -> Case:
    """Many requests, each with its own `user` tag; nothing of them may stay once they end."""
    s = ctx.sizes
    before = rss_mb()
    sem = asyncio.Semaphore(s.burst_concurrency)

    async def one(i: int) -> Any:
        body = {
            "prompt": f"Request {i}: " + _text(200, ctx.rng),
            "max_tokens": s.burst_tokens,
            "temperature": 1,
            "logprobs": 5,
            "user": f"hostile-user-{i}-" + "u" * 200,
        }
        async with sem:
            return await _post(ctx, "/v1/completions", body)

    async def run() -> Outcome:
        codes = _codes(*await asyncio.gather(*(one(i) for i in range(s.burst))))
        return Outcome(codes, ok=set(codes) == {"200"}, extra={"rss_before_mb": before})

    def report(row: dict[str, Any]) -> None:
        after = row["rss_mb"]
        if before and after:
            row["rss_ratio"] = after / before
            row["note"] = f"RSS {before:.0f} -> {after:.0f} MB over the burst (x{after / before:.3f})"

    return Case(f"9 burst of {s.burst}", run, report=report)


CASES: list[Callable[[Ctx], Awaitable[Case]]] = [
    case_many_prompts,
    case_tokenize,
    case_token_ids,
    case_chat_n,
    case_big,
    case_drain,
    case_burst,
]


# ---------------------------------------------------------------------------------------------- the run
async def _warm(ctx: Ctx) -> None:
    """One of each kind of request: what a server allocates at first use is in the baseline."""
    await ctx.probes.get(f"{ctx.url}/health")
    await _post(ctx, "/v1/completions", {**ONE_TOKEN, "logprobs": 5})
    await _post(
        ctx, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    )
    await _post(ctx, "/tokenize", {"prompt": "hello"})
    await _settle(ctx)


async def _serve_and_run(engine: Any, limits: Any, sizes: Sizes, cases: list, seed: int) -> dict[str, Any]:
    import httpx

    from minisgl_backend.serve.server import start_in_thread

    srv = start_in_thread(engine, limits=limits)
    timeout = httpx.Timeout(sizes.wait_s + 60)
    many = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    try:
        async with (
            httpx.AsyncClient(timeout=timeout, limits=many) as client,
            httpx.AsyncClient(timeout=timeout) as probes,
        ):
            ctx = Ctx(engine, srv, client, probes, sizes, random.Random(seed))
            await _warm(ctx)
            out: dict[str, Any] = {"rss_start_mb": rss_mb(), "rows": []}
            for make in cases:
                case = await make(ctx)
                out["rows"].append(await _measure(ctx, case))
            await _settle(ctx, flush=True)
            out["rss_end_mb"] = rss_mb()
            out["rss_end_trimmed_mb"] = trimmed_rss_mb()
            return out
    finally:
        srv.stop()


def bench_hostile(
    config: Any, *, quick: bool = False, fcfs: bool = False, limits: Any = None, seed: int = 0
) -> dict[str, Any]:
    """Serve `config`'s engine in this process and run every case against it (smaller with `quick`);
    `fcfs`: then the 8 x n=128 case again on an engine with `scheduling_policy=fcfs`. `limits`: the
    server's ServeLimits (default: the defaults, with --max-request-chars at 256 Ki when `quick`)."""
    from dataclasses import replace

    from minisgl_backend.engine import Engine
    from minisgl_backend.serve.guard import ServeLimits

    sizes = Sizes.quick() if quick else Sizes()
    if limits is None:
        limits = ServeLimits(max_request_chars=256 * 1024) if quick else ServeLimits()
    t0 = time.perf_counter()
    out: dict[str, Any] = {"rss_before_start_mb": rss_mb()}
    with Engine(config) as engine:
        out.update(asyncio.run(_serve_and_run(engine, limits, sizes, CASES, seed)))
    if fcfs:
        with Engine(replace(config, scheduling_policy="fcfs")) as engine:
            other = asyncio.run(_serve_and_run(engine, limits, sizes, [case_big], seed))
        for row in other["rows"]:
            row["rss_mb"] = None  # another engine's: not comparable with the rows above
        out["rows"] += other["rows"]
    out["rss_end_ratio"] = (
        out["rss_end_mb"] / out["rss_start_mb"] if out["rss_end_mb"] and out["rss_start_mb"] else None
    )
    out["wall_s"] = time.perf_counter() - t0
    out["ok"] = all(r["ok"] for r in out["rows"])
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.0f}"


def format_table(result: dict[str, Any]) -> str:
    def codes(c: dict[str, int]) -> str:
        return ", ".join(f"{k} x{v}" for k, v in c.items())

    def mb(x: float | None) -> str:
        return "-" if x is None else f"{x:.0f}"

    lines = [
        "| case | hostile requests | probes | /health p50 / max ms | 1-token p50 / max ms | RSS MB after "
        "| note |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        flag = "" if r["ok"] else " (UNEXPECTED)"
        lines.append(
            f"| {r['case']}{flag} | {codes(r['codes'])} | {codes(r['probe_codes'])} | "
            f"{_ms(r['health_p50_ms'])} / {_ms(r['health_max_ms'])} | "
            f"{_ms(r['one_token_p50_ms'])} / {_ms(r['one_token_max_ms'])} | {mb(r['rss_mb'])} | {r['note']} |"
        )
    ratio = result.get("rss_end_ratio")
    lines.append(
        f"RSS: {mb(result['rss_before_start_mb'])} MB before the engine, {mb(result['rss_start_mb'])} MB "
        f"after start and warm-up, {mb(result['rss_end_mb'])} MB at the end after a drain"
        + (f" (x{ratio:.3f})" if ratio else "")
        + f", {mb(result['rss_end_trimmed_mb'])} MB once the allocator gave back its free memory"
        + f"; {result['wall_s']:.0f} s in all"
    )
    return "\n".join(lines)


def engine_config(model: str | None, sets: list[str], base: dict[str, Any]) -> Any:
    """The EngineConfig of a server benchmark's flags: `--model` (the tiny random model when None),
    then `--set KEY=VALUE` items over `base`."""
    import yaml

    from minisgl_backend.config import EngineConfig
    from minisgl_backend.errors import MiniSGLError

    defaults = dict(base)
    if model:
        defaults["model"] = model
    else:
        from minisgl_backend.tools.tiny import make_tiny_llama

        defaults["model"] = str(make_tiny_llama())
    overrides = {}
    for item in sets:
        key, sep, value = item.partition("=")
        if not sep:
            raise MiniSGLError(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip()] = yaml.safe_load(value)
    return EngineConfig.resolve(None, overrides, defaults=defaults)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine flags every server benchmark takes, `--model` and `--set`: what `engine_config`
    reads, declared once so that their spelling and help stay the same across the benchmarks."""
    p.add_argument(
        "--model", help="alias, Hugging Face directory or .gguf path (default: the tiny random model)"
    )
    p.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="an engine field (repeatable)"
    )


def report(result: dict[str, Any], table: str, json_path: str | None) -> int:
    """A server benchmark's ending: its table on stdout, its results in `json_path` when given, and
    the exit status (0 when the run found nothing wrong, else 1)."""
    print(table)
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if result["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m minisgl_backend.bench.hostile",
        description="hostile requests against a server in this process, with /health and 1-token "
        "latency beside each, and RSS after each",
    )
    add_engine_args(p)
    p.add_argument("--quick", action="store_true", help="every case smaller (seconds, for a test)")
    p.add_argument(
        "--fcfs",
        action="store_true",
        help="then the 8 x n=128 case again with scheduling_policy=fcfs, for contrast",
    )
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)

    config = engine_config(args.model, args.set, {"stats_interval_s": 0})
    result = bench_hostile(config, quick=args.quick, fcfs=args.fcfs)
    return report(result, format_table(result), args.json)


if __name__ == "__main__":
    sys.exit(main())
