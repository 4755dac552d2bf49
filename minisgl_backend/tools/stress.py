"""Stress harness for lifetime bugs: a "ghost reply", where a KV block or token row released by one
request is reused while an in-flight iteration still reads it, so one client gets text from another
request.

Thousands of requests — random prompts, greedy and seeded sampling, random arrival in bursts, random
aborts — go through an engine whose KV pool is small enough that blocks and token-table rows are
reused constantly. Every request is one of a few hundred templates, each run alone beforehand on a
serial engine; a completed output must equal its template's solo output exactly, and an aborted one
must be a prefix of it. With fenced reclaim the harness finds 0 mismatches; with
`debug_unsafe_reclaim=true` it must find some (proof that it can see the bug).
"""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from minisgl_backend import Engine, EngineConfig, RequestHandle, SamplingParams

# The engine shape the harness runs on (`minisgl stress`, the device check's stress stage): a pool
# small enough that blocks and rows are reused constantly (so a block released too early would be
# handed to another request while still read), and prompt-only batches (mixed_batches off) that do
# not wait for the copy stage: the widest race window.
STRESS_POOL: dict[str, Any] = {
    "num_blocks": 40,
    "block_size": 4,
    "chunk_size": 4,
    "max_num_batched_tokens": 64,
    "max_num_seqs": 4,
    "max_model_len": 64,
    "mixed_batches": False,
}


@dataclass
class StressReport:
    requests: int = 0
    completed: int = 0
    aborted: int = 0
    mismatches: int = 0
    wall_s: float = 0.0
    kv_after_drain: dict[str, int] = field(default_factory=dict)
    prefix_hit_tokens: int = 0
    prefix_evicted_blocks: int = 0
    examples: list[str] = field(default_factory=list)

    @property
    def leaked(self) -> bool:
        return self.kv_after_drain.get("FREE") != self.kv_after_drain.get("total")


def _templates(
    n: int, vocab: int, rng: random.Random, shared_prefixes: bool
) -> list[tuple[list[int], SamplingParams]]:
    # shared_prefixes: prompts grow from a few stems, so the prefix cache hits, evicts and reuses.
    stems = [[rng.randrange(3, vocab) for _ in range(rng.randint(8, 36))] for _ in range(6 * shared_prefixes)]
    out = []
    for i in range(n):
        prompt = rng.choice(stems)[:] if shared_prefixes else []
        prompt += [rng.randrange(3, vocab) for _ in range(rng.randint(1, 40 - len(prompt) // 2))]
        max_tokens = rng.randint(1, 24)
        if i % 2:
            params = SamplingParams(
                temperature=0.9, top_k=40, top_p=0.95, seed=rng.randrange(2**31), max_tokens=max_tokens
            )
        else:
            params = SamplingParams(temperature=0, max_tokens=max_tokens)
        out.append((prompt, params))
    return out


def run_stress(
    config: EngineConfig,
    num_requests: int,
    *,
    num_templates: int = 200,
    abort_prob: float = 0.1,
    seed: int = 0,
    shared_prefixes: bool = False,
    progress: bool = False,
) -> StressReport:
    rng = random.Random(seed)
    # The reference runs each request alone, serially, without the prefix cache.
    reference_cfg = config.replace(
        overlap=False, debug_unsafe_reclaim=False, debug_delay_ms=0.0, num_blocks=None, prefix_cache="off"
    )
    with Engine(reference_cfg) as ref:
        templates = _templates(num_templates, ref.vocab_size, rng, shared_prefixes)
        solo = [ref.generate([p], sp, use_tqdm=False)[0].token_ids for p, sp in templates]
        # Half the templates stop on a token they really draw: a finish the planner cannot foresee
        # (like EOS), so iterations planned past it are in flight when the request ends.
        for k in range(0, num_templates, 2):
            if len(solo[k]) > 2:
                prompt, sp = templates[k]
                sp = dataclasses.replace(sp, stop_token_ids=(solo[k][rng.randrange(1, len(solo[k]) - 1)],))
                templates[k] = (prompt, sp)
                solo[k] = ref.generate([prompt], sp, use_tqdm=False)[0].token_ids

    report = StressReport(requests=num_requests)
    results: list[tuple[int, Any]] = []
    lock = threading.Lock()
    with Engine(config) as eng:
        t0 = time.perf_counter()
        handles: list[tuple[int, RequestHandle]] = []
        for i in range(num_requests):
            k = rng.randrange(num_templates)
            handle = eng.submit(*templates[k])
            handles.append((k, handle))
            handle.add_done_callback(lambda h, k=k: _collect(lock, results, k, h))
            if rng.random() < abort_prob:  # abort a recent request at whatever stage it is in
                eng.abort(handles[rng.randrange(max(0, len(handles) - 32), len(handles))][1].request_id)
            if rng.random() < 0.1:  # random arrival: bursts separated by short gaps
                time.sleep(rng.uniform(0, 0.004))
            if progress and i % 1000 == 999:
                print(f"  submitted {i + 1}/{num_requests}", flush=True)
        for _, h in handles:
            h.result(timeout=600)
        report.wall_s = time.perf_counter() - t0
        metrics = eng.metrics()
        report.prefix_hit_tokens = int(metrics.get("prefix_hit_tokens", 0))
        report.prefix_evicted_blocks = int(metrics.get("prefix_evicted_blocks", 0))
        # Flushing the prefix cache must bring every block back: anything else is a leak.
        report.kv_after_drain = {**eng.drain(timeout=120, flush_cache=True), "total": eng.num_blocks}
    for k, out in results:
        expected = solo[k]
        if out.finish_reason == "abort":
            report.aborted += 1
            ok = out.token_ids == expected[: len(out.token_ids)]
        else:
            report.completed += 1
            ok = out.token_ids == expected
        if not ok:
            report.mismatches += 1
            if len(report.examples) < 5:
                report.examples.append(f"template {k}: got {out.token_ids[:8]}.. expected {expected[:8]}..")
    return report


def _collect(lock: threading.Lock, results: list, k: int, handle: RequestHandle) -> None:
    with lock:
        results.append((k, handle.result()))
