"""Prometheus export of the server (`GET /metrics`), vLLM-style names under `minisgl:`.

With Ray replicas (`serve/ray_app.py`) each replica keeps its own `ServeMetrics`; the ingress
scrapes them all and `render_replicas` labels every series `replica="<index>"` (no sums: a sum of
gauges such as KV usage would mean nothing, and Prometheus sums labelled counters on its own).

Nothing here runs on the engine's hot path. Gauges and the prefix-cache counters are read from
`Engine.metrics()` (per-thread buffers, folded about once per second) when Prometheus
scrapes. Per-request counters and histograms are filled from each finished request's
`RequestOutput` (token counts, `timings`): the scheduler thread only posts the finished handle to a
queue that the event loop and the scrape fold (`ServerState.collect`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from minisgl_backend.types import RequestOutput

# Latency buckets (seconds), vLLM-like ranges.
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    60.0,
    120.0,
)


class _EngineCollector:
    """Scrape-time view of the engine's folded metrics (gauges and engine counters)."""

    def __init__(self, engine: Any, model_name: str) -> None:
        self._engine = engine
        self._labels = {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        g = GaugeMetricFamily(name, doc, labels=list(self._labels))
        g.add_metric(list(self._labels.values()), value)
        return g

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        c = CounterMetricFamily(name, doc, labels=list(self._labels))
        c.add_metric(list(self._labels.values()), value)
        return c

    def collect(self) -> Iterator[Any]:
        m = self._engine.metrics()
        blocks = max(1, self._engine.num_blocks)
        cached = m.get("prefix_cache_idle_blocks", 0.0)
        load = [
            ("num_requests_running", "Requests holding KV (prefilling or decoding).", m.get("running", 0.0)),
            ("num_requests_waiting", "Requests waiting for admission.", m.get("waiting", 0.0)),
            (
                "kv_cache_usage_perc",
                "Fraction of KV blocks held by requests (1 = full); cached blocks that none holds are apart.",
                max(0.0, m.get("kv_used_blocks", 0.0) - cached) / blocks,
            ),
        ]
        # Under vLLM's names too: load-aware routers (the Gateway API inference extension, llm-d)
        # scrape these three by name to pick a server.
        for prefix in ("minisgl", "vllm"):
            for name, doc, value in load:
                yield self._gauge(f"{prefix}:{name}", doc, value)
        yield self._gauge(
            "minisgl:kv_cache_cached_perc",
            "Fraction of KV blocks held only by the prefix cache (evicted when requests need them).",
            cached / blocks,
        )
        yield self._gauge(
            "minisgl:prefix_cache_blocks",
            "KV blocks held by the prefix cache.",
            m.get("prefix_cache_blocks", 0.0),
        )
        yield self._counter(
            "minisgl:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache.",
            m.get("prefix_query_tokens", 0.0),
        )
        yield self._counter(
            "minisgl:prefix_cache_hits",
            "Prompt tokens found in the prefix cache.",
            m.get("prefix_hit_tokens", 0.0),
        )
        yield self._counter(
            "minisgl:iterations", "Engine iterations (batches) run.", m.get("iterations", 0.0)
        )
        yield self._counter(
            "minisgl:prefill_tokens",
            "Prompt tokens computed (prefix-cache hits excluded).",
            m.get("prefill_tokens", 0.0),
        )
        yield self._counter(
            "minisgl:engine_stalls", "Times the progress watchdog failed the engine.", m.get("stalls", 0.0)
        )


class ServeMetrics:
    def __init__(self, engine: Any, model_name: str) -> None:
        disable_created_metrics()  # no `*_created` series (process-wide; vLLM does the same)
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter(
            "minisgl:prompt_tokens", "Prompt tokens of finished requests.", labels, registry=reg
        )
        self.generation_tokens = Counter(
            "minisgl:generation_tokens", "Generated tokens of finished requests.", labels, registry=reg
        )
        self.request_success = Counter(
            "minisgl:request_success",
            "Finished requests by finish reason.",
            labels + ["finished_reason"],
            registry=reg,
        )
        self.ttft = Histogram(
            "minisgl:time_to_first_token_seconds",
            "Time from arrival to the first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "minisgl:inter_token_latency_seconds",
            "Gaps between consecutive output tokens of a request (each gap, as committed by the engine).",
            labels,
            buckets=ITL_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "minisgl:e2e_request_latency_seconds",
            "Time from arrival to finish.",
            labels,
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        self.queue_time = Histogram(
            "minisgl:request_queue_time_seconds",
            "Time from arrival to admission (first scheduled), when the engine reports it.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        reg.register(_EngineCollector(engine, model_name))
        for reason in ("stop", "length", "abort"):
            self.request_success.labels(model_name, reason)  # present (at 0) before the first request

    def observe(self, out: RequestOutput) -> None:
        m = self.model_name
        n = sum(len(s.token_ids) for s in out.samples)  # every sample of an n > 1 request
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(m).inc(n)
        self.request_success.labels(m, out.finish_reason).inc()
        t = out.timings
        if t.first_token is not None:
            self.ttft.labels(m).observe(t.first_token - t.arrival)
        if t.finish is not None:
            self.e2e.labels(m).observe(t.finish - t.arrival)
            h = self.itl.labels(m)
            for gap in t.inter_token_latencies:
                h.observe(gap)
        if t.scheduled is not None:
            self.queue_time.labels(m).observe(t.scheduled - t.arrival)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _ReplicaCollector:
    """Every replica's metric families, each sample labelled `replica`, plus `minisgl:replica_up`
    (0 for a replica that did not answer the scrape, which then contributes no other series)."""

    def __init__(self, per_replica: Sequence[list[Metric] | None], model_name: str) -> None:
        self._per_replica = per_replica
        self._model_name = model_name

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for r, families in enumerate(self._per_replica):
            for fam in families or ():
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                for smp in fam.samples:
                    out.add_sample(smp.name, {**smp.labels, "replica": str(r)}, smp.value, smp.timestamp)
        yield from merged.values()
        up = GaugeMetricFamily(
            "minisgl:replica_up",
            "1 if the engine replica answered this scrape, else 0.",
            labels=["model_name", "replica"],
        )
        for r, families in enumerate(self._per_replica):
            up.add_metric([self._model_name, str(r)], 0.0 if families is None else 1.0)
        yield up


def render_replicas(per_replica: Sequence[list[Metric] | None], model_name: str) -> tuple[bytes, str]:
    """One exposition of all replicas' families (`ServeMetrics.registry.collect()` of each, None for
    one that did not answer)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_ReplicaCollector(per_replica, model_name))
    return generate_latest(registry), CONTENT_TYPE_LATEST
