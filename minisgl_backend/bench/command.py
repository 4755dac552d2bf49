"""The bodies of `minisgl bench` (the default engine-vs-HF run, `--scenario
overlap-table|prefix|peers|memory|sampling`, `--sweep`) and `minisgl bench-serve`: the command line
parses the flags and hands them here with a way to build the engine config from them."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from typing import Any

import yaml

from minisgl_backend.config import EngineConfig
from minisgl_backend.errors import MiniSGLError

# `args`'s engine flags over `base` (a dict of EngineConfig fields, or None): the CLI's own rules.
ConfigFromFlags = Callable[[dict[str, Any] | None], EngineConfig]

PREFIX_COLUMNS = [
    "prefill_tokens",
    "prefix_token_hit_rate",
    "prefix_request_hit_rate",
    "prefix_evicted_blocks",
    "prefix_insert_ms",
]


def run_bench(args: argparse.Namespace, config: ConfigFromFlags) -> int:
    """`minisgl bench`: prints a table (and writes --json)."""
    if (args.trace or args.plot) and not (args.scenario or args.sweep):
        raise MiniSGLError(
            "--trace and --plot record the timeline of --scenario or --sweep runs; give one of them"
        )
    if args.busy < 0:
        raise MiniSGLError(f"--busy is a count of busy processes (0 or more), got {args.busy}")
    base: dict[str, Any] | None = None
    if args.shape:
        from minisgl_backend.tools.tiny import cached_random_llama

        if args.model:
            raise MiniSGLError("give --model or --shape, not both")
        path = cached_random_llama(args.shape)
        base = {"model": str(path), "dtype": "bfloat16"}
    if args.scenario == "memory":
        if args.sweep or args.trace or args.plot or args.busy:
            raise MiniSGLError("--scenario memory takes none of --sweep, --trace, --plot, --busy")
        from minisgl_backend.bench.memory import bench_memory, format_memory

        result = bench_memory(config(base), repeat=args.repeat or 3)
        print(format_memory(result))
    elif args.scenario == "sampling":
        if args.sweep or args.trace or args.plot or args.busy:
            raise MiniSGLError("--scenario sampling takes none of --sweep, --trace, --plot, --busy")
        from minisgl_backend.bench.measure import format_table
        from minisgl_backend.bench.sampling import bench_sampling

        result = bench_sampling(config(base), repeat=args.repeat or 2)
        print(format_table(result["rows"], columns=list(next(iter(result["rows"].values())))))
        print(f"kernels: {result['kernels']}; draws over a vocabulary of {result['vocab']}")
    elif args.scenario == "peers":
        if args.sweep or args.trace or args.plot:
            raise MiniSGLError("--scenario peers takes none of --sweep, --trace, --plot")
        result = _peers(args, config(base))
    elif args.scenario or args.sweep:
        result = _configs(args, config(base))
    else:
        result = _offline(args, config(base))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
        if not args.scenario and not args.sweep:
            print(f"wrote {args.json}")
    return 0


def _peers(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    from minisgl_backend.bench.measure import format_table
    from minisgl_backend.bench.peers import bench_peers

    result = bench_peers(config, repeat=args.repeat or 3, busy=args.busy)
    rows = result["rows"]
    print(format_table(rows, columns=list(next(iter(rows.values())))))
    print(f"kernels: {result['kernels']} (this CPU runs up to {result['machine_kernels']})")
    if args.busy:
        print(f"busy: beside {args.busy} busy process(es), each one CPU's worth of work")
    if result["decode"]:
        print("batch-1 decode: " + ", ".join(f"{k} {v:.3g}" for k, v in result["decode"].items()))
    if result["prefill"]:
        print("prefill: " + ", ".join(f"{k} {v:.3g}" for k, v in result["prefill"].items()))
    return result


def _configs(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    from minisgl_backend.bench.configs import (
        OVERLAP_TABLE,
        PREFIX_TABLE,
        bench_configs,
        mixed_prompts,
        shared_prefix_prompts,
    )
    from minisgl_backend.bench.measure import format_table

    if args.sweep:
        key, _, values = args.sweep.partition("=")
        if key not in EngineConfig.field_names() or not values:
            raise MiniSGLError(
                f"--sweep expects FIELD=v1,v2,... with an EngineConfig field, got {args.sweep!r}"
            )
        # None as the config's own docs write it, beside YAML's null
        variants = {
            f"{key}={v}": {key: None if v.strip() == "None" else yaml.safe_load(v)} for v in values.split(",")
        }
        for overrides in variants.values():
            config.replace(**overrides)  # every value checked before the first run, not after
    else:
        variants = PREFIX_TABLE if args.scenario == "prefix" else OVERLAP_TABLE
    # interleaved (a, b, a, b): drift on a shared machine hits every variant alike
    if (args.repeat or 1) > 1:
        variants = {f"{name} #{i + 1}": ov for i in range(args.repeat) for name, ov in variants.items()}
    prefix = args.scenario == "prefix"
    if args.plot:
        from minisgl_backend.tools.plot import require_matplotlib

        require_matplotlib()  # before minutes of benchmarking, not after
    events: list[dict[str, Any]] | None = [] if args.trace or args.plot else None

    def measure(names: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        return bench_configs(
            config,
            names,
            args.num_requests,
            args.output_len,
            args.concurrency,
            trace_events=events,
            workload=shared_prefix_prompts if prefix else mixed_prompts,
        )

    rows = measure(variants)
    if args.busy:  # the same variants again beside the competing load
        from minisgl_backend.bench.load import CompetingLoad

        with CompetingLoad(args.busy):
            rows.update(measure({f"{name}, busy": ov for name, ov in variants.items()}))
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump({"traceEvents": events}, f)
        print(f"wrote {args.trace} (open in chrome://tracing or ui.perfetto.dev)")
    if args.plot and events is not None:
        from minisgl_backend.tools.plot import plot_utilisation

        plot_utilisation(events, args.plot)
        print(f"wrote {args.plot} (compute / scheduler busy over time, one row per config)")
    print(format_table(rows, extra=PREFIX_COLUMNS if prefix else []))
    return {
        "workload": {
            "num_requests": args.num_requests,
            "output_len": args.output_len,
            "concurrency": args.concurrency,
            "prompts": "4 shared 512-token stems + 32 own tokens" if prefix else "64 tokens, every 4th 768",
            "busy_processes": args.busy,
        },
        "results": rows,
    }


def _offline(args: argparse.Namespace, config: EngineConfig) -> dict[str, Any]:
    from minisgl_backend.bench.measure import format_table
    from minisgl_backend.bench.offline import bench

    result = bench(
        config,
        args.num_requests,
        args.input_len,
        args.output_len,
        hf=not args.no_hf,
        hf_batch_size=args.hf_batch_size,
        busy=args.busy,
    )
    print(format_table(result["results"]))
    print(f"KV blocks after drain: {result['kv_blocks_after_drain']}")
    return result


def run_bench_serve(args: argparse.Namespace, config: ConfigFromFlags) -> int:
    """`minisgl bench-serve`: prints a row (and writes --json); 1 when a request failed, a response
    differed from its solo run or (own server) a KV block or a hung-up request was unaccounted for."""
    from minisgl_backend.bench.serve import bench_serve, format_row
    from minisgl_backend.serve.server import _require_extra

    _require_extra()
    if args.offline_baseline and (args.url or args.request_rate != float("inf") or args.disconnect_prob):
        raise MiniSGLError(
            "--offline-baseline runs the same closed loop in-process on this server's engine: it takes "
            "no --url, --request-rate or --disconnect-prob"
        )
    kw = dict(
        api_key=args.api_key,
        model=args.served_model_name,
        num_requests=args.num_requests,
        num_prompts=args.num_prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        concurrency=args.concurrency,
        request_rate=args.request_rate,
        disconnect_prob=args.disconnect_prob,
        check=args.check,
        seed=args.seed,
    )
    if args.url:
        row = bench_serve(args.url.rstrip("/").removesuffix("/v1"), **kw)
    else:  # our own server in this process: the engine can be drained and its blocks checked at the end
        from minisgl_backend.engine import Engine
        from minisgl_backend.serve.server import start_in_thread

        # Exact engine counters (not folded once a second): the served and offline runs' forward
        # time is compared.
        base: dict[str, Any] = {"stats_interval_s": 0, "metrics_exact": bool(args.offline_baseline)}
        if args.tiny:
            from minisgl_backend.tools.tiny import make_tiny_llama

            base["model"] = str(make_tiny_llama())
        engine = Engine(config(base))
        try:
            srv = start_in_thread(engine, api_key=args.api_key, model_name=args.served_model_name)
            # A server keeps nothing of a request once it ends; the bench asks for records of them
            # to tell how each hung-up request ended (aborted, or finished first).
            srv.state.keep_finished(args.num_requests)
            try:
                if args.offline_baseline:  # warm: the served run pays no first-use cost the offline one skips
                    from minisgl_backend.bench.configs import run_closed_loop

                    run_closed_loop(engine, [[101, 102, 103]] * args.concurrency, 4, args.concurrency)
                if args.offline_baseline:  # clients apart: their work is not the server's
                    from minisgl_backend.bench.serve import (
                        bench_serve_in_child,
                        engine_counts,
                        offline_baseline,
                    )

                    # Each run starts from an empty prefix cache: the offline run must not find the
                    # prompts the served one left there (nor the served run the warm-up's).
                    engine.drain(timeout=120, flush_cache=True)
                    m0 = engine.metrics()
                    row = bench_serve_in_child(srv.url, vocab=engine.vocab_size, **kw)
                    m1 = engine.metrics()
                    engine.drain(timeout=120, flush_cache=True)
                    m2 = engine.metrics()
                    offline_baseline(engine, row, args.num_prompts, args.input_len, args.seed)
                    row["served_engine"] = engine_counts(m0, m1)
                    row["offline_engine"] = engine_counts(m2, engine.metrics())
                else:
                    row = bench_serve(srv.url, vocab=engine.vocab_size, **kw)
                counts = engine.drain(timeout=120, flush_cache=True)
                srv.state.collect()
                finished = {r.user: r for r in list(srv.state.finished)}
            finally:
                srv.stop()
            row["kv_after_drain"] = counts
            row["kv_all_free"] = counts["FREE"] == engine.num_blocks
            reasons = [
                getattr(finished.get(f"bench-{i}"), "finish_reason", None) for i in row["disconnected_ids"]
            ]
            row["disconnects_aborted"] = reasons.count("abort")
            row["disconnects_finished"] = sum(r in ("stop", "length") for r in reasons)
            row["disconnects_unaccounted"] = reasons.count(None)
        finally:
            engine.close()
    print(format_row(row))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(row, f, indent=2)
    failed = (
        row["errors"] > 0
        or row.get("mismatches", 0) > 0
        or row.get("kv_all_free") is False
        or row.get("disconnects_unaccounted", 0) > 0
    )
    return 1 if failed else 0
