"""The measuring stages of scripts/gpu_check.sh that run Python (`python -m minisgl_backend.bench.gpu_check
STAGE ...`); on a GPU they measure, and with tiny shapes on the CPU (GPU_CHECK_SMALL=1) they run the
same code so the script itself is tested:

- `forward`: one decode step of a random-weight model of realistic shape at several batch sizes, and
  one later prefill chunk, under each attention back-end (the Triton kernels and the torch path):
  device time per forward, host time to issue it, kernels per forward (from torch's profiler, on a
  GPU), and how far the two back-ends' logits differ (their agreement is the kernels' check on the
  device itself). Each decode case runs again through CUDA-graph replay at its batch size
  (executor/graphs.py; eagerly over the same static buffers on the CPU): its time, and its logits'
  difference from the eager forward's. A case that fails (a kernel that does not compile, a capture
  broken by a host sync) is a row holding its error; the other cases still run.
- `overlap`: the design's table on one random-weight model directory: the serial loop, overlap with
  prefill chunks of 128 and 768, one iteration in flight, the Python completion callbacks, and the
  768 row again with seeded sampling instead of greedy draws; on a GPU also the serial and the 768
  rows with their decode batches replayed as CUDA graphs, and rows with a shorter GIL switch
  interval. A row that fails on the device holds its error, and the other rows still run.
- `stress`: block lifetimes under overlap on the device (the stress harness with fenced reclaim
  and with the unsafe debug switch, which it must catch) and the serial loop against the overlap
  scheduler on the same greedy prompts; exits 1 unless all of that held.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

from minisgl_backend.arith import cdiv
from minisgl_backend.iteration import PrefillChunk
from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.model.batch import ForwardBatch
from minisgl_backend.model.llama import CausalLM, LayerLoop, build_rotary
from minisgl_backend.model.spec import ModelSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def random_model(shape: str, dtype: torch.dtype, device: str) -> CausalLM:
    """A Llama of tools.tiny's `shape` with random weights made on the device (no file: an 8B model
    is made in seconds where writing it would take minutes)."""
    from transformers import LlamaConfig

    from minisgl_backend.tools.tiny import SHAPES

    cfg = LlamaConfig(vocab_size=49152, tie_word_embeddings=False, rms_norm_eps=1e-5, **SHAPES[shape])
    spec = ModelSpec.from_hf_config(cfg)
    with torch.device("meta"):
        model = CausalLM(spec).to(dtype)
    model = model.to_empty(device=device).eval()
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    model.model.rotary = build_rotary(spec).to(device)
    return model


def _kv(model: CausalLM, blocks: int, block_size: int) -> KVCache:
    spec, dev = model.spec, model.device
    dtype = model.lm_head.weight.dtype
    kv = KVCache(spec.num_layers, blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype, dev)
    gen = torch.Generator(device=dev).manual_seed(1)
    for t in kv.k + kv.v:  # keys of a real context: attention is not over zeros
        t.normal_(0.0, 1.0, generator=gen)
    return kv


def decode_batch(batch: int, ctx: int, block_size: int, device: str) -> tuple[ForwardBatch, int]:
    """`batch` decode rows, each at context `ctx` (its new token included) in its own blocks; and
    the number of blocks they use."""
    nb = cdiv(ctx, block_size)
    tables = torch.arange(batch * nb, device=device).view(batch, nb)
    pos = torch.full((batch,), ctx - 1, device=device)
    slots = tables[:, (ctx - 1) // block_size] * block_size + (ctx - 1) % block_size
    keys = torch.arange(nb * block_size, device=device)
    fb = ForwardBatch(
        input_ids=torch.randint(100, 4000, (batch,), device=device),
        positions=pos,
        slot_mapping=slots,
        num_decode=batch,
        decode_block_tables=tables,
        decode_mask=(keys[None, :] <= pos[:, None])[:, None, None, :],
        prefill_chunks=(),
        logits_index=torch.arange(batch, device=device),
    )
    return fb, batch * nb


def chunk_batch(prefix: int, length: int, block_size: int, device: str) -> tuple[ForwardBatch, int]:
    """One later prompt chunk of `length` tokens after a cached prefix of `prefix` tokens."""
    ctx = prefix + length
    nb = cdiv(ctx, block_size)
    table = torch.arange(nb, device=device)
    pos = torch.arange(prefix, ctx, device=device)
    fb = ForwardBatch(
        input_ids=torch.randint(100, 4000, (length,), device=device),
        positions=pos,
        slot_mapping=table[pos // block_size] * block_size + pos % block_size,
        num_decode=0,
        decode_block_tables=None,
        decode_mask=None,
        prefill_chunks=(PrefillChunk(0, length, ctx, table),),
        logits_index=torch.tensor([length - 1], device=device),
    )
    return fb, nb


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _kernels_per_forward(model: CausalLM, fb: ForwardBatch, kv: KVCache) -> int | None:
    """Device kernels one forward launches (None off a GPU, or where the profiler fails)."""
    if model.device.type != "cuda":
        return None
    try:
        from torch.autograd import DeviceType
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(fb, kv)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == DeviceType.CUDA)
    except Exception:  # noqa: BLE001 - a missing profiler must not cost the stage its numbers
        return None


def _time_steps(
    run: Callable[[], torch.Tensor], device: str, steps: int
) -> tuple[torch.Tensor, dict[str, float]]:
    """`run()` once as a warm-up (Triton compiles its kernels on first use), then `steps` times in a
    row: the warm-up's logits, and per run the wall time until the device is done (`ms`) and the
    host's time to issue it (`host_issue_ms`). The eager and the graph forward are timed alike, so
    their rows compare."""
    logits = run()
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        run()
    issued = time.perf_counter()
    _sync(device)
    done = time.perf_counter()
    return logits, {"ms": 1000 * (done - t0) / steps, "host_issue_ms": 1000 * (issued - t0) / steps}


def time_forward(model: CausalLM, fb: ForwardBatch, kv: KVCache, steps: int) -> dict[str, Any]:
    logits, times = _time_steps(lambda: model(fb, kv), str(model.device), steps)
    return {**times, "logits": logits.float()}


def time_graphs(model: CausalLM, fb: ForwardBatch, kv: KVCache, steps: int, pad_block: int) -> dict[str, Any]:
    """time_forward for the decode batch `fb` replayed as a CUDA graph of its own size (captured
    here), or run at that bucket eagerly off a GPU: DecodeGraphs' static buffers either way."""
    from minisgl_backend.executor.graphs import DecodeGraphs

    assert fb.decode_block_tables is not None  # a decode batch
    n = fb.input_ids.shape[0]
    graphs = DecodeGraphs(model, kv, [n], fb.decode_block_tables.shape[1], pad_block)
    device = str(model.device)
    if device.startswith("cuda"):
        graphs.capture(torch.cuda.Stream())
    logits, times = _time_steps(lambda: graphs.run(fb), device, steps)
    return {**times, "captured": graphs.captured, "logits": logits.float()}


def _measured(
    rows: list[dict[str, Any]], row: dict[str, Any], measure: Callable[[], dict[str, Any]]
) -> torch.Tensor | None:
    """Run one measurement into `row` (appended to `rows` either way) and return its logits; a case
    that raises (a kernel that fails to compile, a capture that a host sync breaks) becomes a row
    with its `error` and returns None, so one broken case costs the stage no other numbers."""
    rows.append(row)
    try:
        r = measure()
    except Exception as e:  # noqa: BLE001 - recorded in the row; the next case runs
        row["error"] = f"{type(e).__name__}: {e}"[:500]
        print(json.dumps(row), flush=True)
        return None
    logits = r.pop("logits")
    row.update(r)
    return logits


def backends(device: str) -> dict[str, LayerLoop]:
    out = {"torch": LayerLoop()}
    try:
        from minisgl_backend.model.triton_attention import TritonAttention
    except ImportError:
        return out
    if device.startswith("cuda") or os.environ.get("TRITON_INTERPRET") == "1":
        out["triton"] = LayerLoop(TritonAttention())
    return out


def forward_rows(
    shapes: list[str],
    batches: list[int],
    ctx: int,
    chunk: int,
    device: str,
    dtype: str,
    steps: int,
    block_size: int = 16,
) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    # Kernels are counted only once every case is timed: a process that has run torch's profiler
    # keeps its CUDA activity tracing attached, and that slows every later launch on the host.
    to_count: list[tuple[dict[str, Any], CausalLM, LayerLoop, ForwardBatch, KVCache]] = []
    for shape in shapes:
        model = random_model(shape, DTYPES[dtype], device)
        cases = [(f"decode B={b} ctx={ctx}", decode_batch(b, ctx, block_size, device)) for b in batches]
        cases.append((f"chunk {chunk} after {chunk}", chunk_batch(chunk, chunk, block_size, device)))
        for name, (fb, blocks) in cases:
            kv = _kv(model, blocks + 1, block_size)  # the last block: the graphs' padding rows
            ref = None  # the torch path's logits, which the kernels' must match
            for backend, strategy in backends(device).items():
                model.forward_strategy = strategy
                row: dict[str, Any] = {"shape": shape, "case": name, "backend": backend}
                logits = _measured(rows, row, partial(time_forward, model, fb, kv, steps))
                if logits is None:
                    continue
                to_count.append((row, model, strategy, fb, kv))
                if ref is None:
                    ref = logits
                else:
                    row["max_logit_diff_vs_torch"] = float((logits - ref).abs().max())
                    row["argmax_agree_vs_torch"] = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
                print(json.dumps(row), flush=True)
                if fb.num_decode:
                    row = {"shape": shape, "case": f"{name} graph", "backend": backend}
                    g = _measured(rows, row, partial(time_graphs, model, fb, kv, steps, pad_block=blocks))
                    if g is not None:
                        row["max_logit_diff_vs_eager"] = float((g - logits).abs().max())
                        print(json.dumps(row), flush=True)
    for row, model, strategy, fb, kv in to_count:
        model.forward_strategy = strategy
        row["kernels"] = _kernels_per_forward(model, fb, kv)
    counted = [{k: r[k] for k in ("shape", "case", "backend", "kernels")} for r, *_ in to_count]
    print(json.dumps({"kernels_per_forward": counted}), flush=True)
    return rows


def overlap_variants(chunks: list[int], graphs: bool = False) -> dict[str, dict[str, Any]]:
    """The design's rows: serial, overlap per chunk size, then at the largest chunk one iteration in
    flight and the Python completion callbacks; with `graphs` (a GPU), the serial loop and the
    largest chunk again with their decode batches replayed as CUDA graphs."""
    big = max(chunks)
    # Every row names its graphs: on a GPU they are on unless a config turns them off.
    rows: dict[str, dict[str, Any]] = {
        "serial, no chunking": {
            "overlap": False,
            "chunk_size": None,
            "mixed_batches": False,
            "max_inflight": 1,
            "cuda_graphs": False,
        }
    }
    for c in chunks:
        rows[f"overlap, chunk {c}"] = {
            "overlap": True,
            "chunk_size": c,
            "mixed_batches": True,
            "max_inflight": 4,
            "cuda_graphs": False,
        }
    rows[f"overlap, chunk {big}, max_inflight 1"] = rows[f"overlap, chunk {big}"] | {"max_inflight": 1}
    rows[f"overlap, chunk {big}, python callbacks"] = rows[f"overlap, chunk {big}"] | {
        "callback_impl": "python"
    }
    if graphs:
        # The serial loop replays the same graphs, so the graph rows compare with each other: eager
        # launches cost the host more than the device's work, and overlap cannot hide a host bound.
        rows["serial, cuda graphs"] = rows["serial, no chunking"] | {"cuda_graphs": True}
        rows[f"overlap, chunk {big}, cuda graphs"] = rows[f"overlap, chunk {big}"] | {"cuda_graphs": True}
        # A thread that wants the GIL waits up to the switch interval (5 ms by default) for a busy
        # one; the engine's threads hand each iteration on, so the interval may set the step's pace.
        for name, ms in (
            ("serial, cuda graphs", 0.5),
            (f"overlap, chunk {big}", 0.5),
            (f"overlap, chunk {big}, cuda graphs", 0.5),
            (f"overlap, chunk {big}, cuda graphs", 0.1),
        ):
            rows[f"{name}, switch {ms} ms"] = rows[name] | {"switch_interval_ms": ms}
    return rows


def overlap_rows(args: argparse.Namespace) -> dict[str, Any]:
    from minisgl_backend.bench.configs import bench_configs
    from minisgl_backend.bench.measure import format_table
    from minisgl_backend.config import EngineConfig

    chunks = [int(c) for c in args.chunks.split(",")]
    base = EngineConfig(
        model=args.model,
        dtype=args.dtype,
        device=args.device,
        kv_cache_memory_gb=args.kv_gb,
        max_num_batched_tokens=max(2048, max(chunks)),
        stats_interval_s=0,
    )
    events: list[dict[str, Any]] | None = [] if (args.trace or args.plot) else None
    variants = overlap_variants(chunks, graphs=args.device.startswith("cuda"))
    # keep_going: a variant that fails on the device is a row with its error, not the stage's end.
    n, out_len, conc = args.num_requests, args.output_len, args.concurrency
    rows = bench_configs(base, variants, n, out_len, conc, events, keep_going=True)
    big = max(chunks)
    sampled = {f"overlap, chunk {big}, sampled": variants[f"overlap, chunk {big}"]}
    sampling = {"temperature": 0.8, "top_p": 0.9, "top_k": 50, "seed": 1234}
    rows |= bench_configs(
        base, sampled, n, out_len, conc, events, sampling=sampling, first_pid=len(rows), keep_going=True
    )
    print(format_table(rows))
    if args.trace:
        with open(args.trace, "w") as f:
            json.dump({"traceEvents": events}, f)
    if args.plot and events is not None:
        try:
            from minisgl_backend.tools.plot import plot_utilisation

            plot_utilisation(events, args.plot)
        except ImportError as e:
            print(f"no plot: {e}")
    return {"device": args.device, "chunks": chunks, "rows": rows}


def stress_rows(args: argparse.Namespace) -> dict[str, Any]:
    """Lifetimes and scheduling on this device, on the tiny test model in float32 (made once in
    `args.model` with `args.tokenizer`): the stress harness (tools/stress.py) with fenced reclaim,
    where no completed request may differ from its solo run and every block must be FREE after the
    drain, and with the unsafe debug switch, where the harness must find mismatches (its proof that
    it sees the bug on this device); then the serial loop and the overlap scheduler on the same
    greedy prompts, which must give the same tokens (their logprobs' largest difference is kept).
    `ok` says whether all of that held."""
    from minisgl_backend.bench.measure import random_prompts
    from minisgl_backend.config import EngineConfig
    from minisgl_backend.engine import Engine
    from minisgl_backend.tools.stress import STRESS_POOL, run_stress
    from minisgl_backend.tools.tiny import make_tiny_llama
    from minisgl_backend.types import SamplingParams

    model = make_tiny_llama(Path(args.model), tokenizer=args.tokenizer)
    base = EngineConfig(
        model=str(model), device=args.device, dtype="float32", overlap=True, stats_interval_s=0, **STRESS_POOL
    )
    result: dict[str, Any] = {"device": args.device}
    runs = {"fenced": {}, "unsafe": {"debug_unsafe_reclaim": True, "debug_delay_ms": 2.0}}
    for name, overrides in runs.items():
        r = run_stress(base.replace(**overrides), args.requests, seed=1)
        result[name] = {
            "requests": r.requests,
            "completed": r.completed,
            "aborted": r.aborted,
            "mismatches": r.mismatches,
            "kv_after_drain": r.kv_after_drain,
            "leaked": r.leaked,
            "wall_s": round(r.wall_s, 2),
            "examples": r.examples[:3],
        }
        print(f"stress {name}: {json.dumps(result[name])}", flush=True)

    params = SamplingParams(temperature=0, max_tokens=16, logprobs=1, ignore_eos=True)
    outs = {}
    orders: dict[str, dict[str, Any]] = {"serial": {"overlap": False}, "overlap": {"max_inflight": 4}}
    for name, overrides in orders.items():
        cfg = base.replace(num_blocks=256, max_num_seqs=8, mixed_batches=True, **overrides)
        with Engine(cfg) as engine:
            prompts = random_prompts(16, 24, engine.vocab_size, seed=2)
            outs[name] = engine.generate(prompts, params, use_tqdm=False)
    same = all(a.token_ids == b.token_ids for a, b in zip(outs["serial"], outs["overlap"]))
    diff = max(
        abs(x.logprob - y.logprob)
        for a, b in zip(outs["serial"], outs["overlap"])
        for x, y in zip(a.logprobs or [], b.logprobs or [])
    )
    result["serial_vs_overlap"] = {"prompts": len(prompts), "same_tokens": same, "max_logprob_diff": diff}
    print(f"serial vs overlap: {json.dumps(result['serial_vs_overlap'])}", flush=True)
    fenced, unsafe = result["fenced"], result["unsafe"]
    result["ok"] = fenced["mismatches"] == 0 and not fenced["leaked"] and unsafe["mismatches"] > 0 and same
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minisgl_backend.bench.gpu_check")
    sub = p.add_subparsers(dest="stage", required=True)
    f = sub.add_parser("forward", help="decode-step and prefill-chunk micro-numbers per attention back-end")
    f.add_argument("--shapes", default="1b")
    f.add_argument("--batches", default="1,16,64")
    f.add_argument("--ctx", type=int, default=512)
    f.add_argument("--chunk", type=int, default=768)
    f.add_argument("--steps", type=int, default=10)
    o = sub.add_parser("overlap", help="the design's overlap table on one model directory")
    o.add_argument("--model", required=True)
    o.add_argument("--chunks", default="128,768")
    o.add_argument("--kv-gb", type=float, default=8.0)
    o.add_argument("--num-requests", type=int, default=96)
    o.add_argument("--output-len", type=int, default=64)
    o.add_argument("--concurrency", type=int, default=16)
    o.add_argument("--trace")
    o.add_argument("--plot")
    st = sub.add_parser("stress", help="block lifetimes under overlap, and serial vs overlap, on the device")
    st.add_argument("--model", required=True, help="where the tiny test model is made (once)")
    st.add_argument("--tokenizer", help="its tokenizer files (default: the embedded model's)")
    st.add_argument("--requests", type=int, default=1000, help="requests per stress run")
    for s in (f, o, st):
        s.add_argument("--device", default="cuda")
        s.add_argument("--json", required=True)
    for s in (f, o):
        s.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    args = p.parse_args(argv)
    torch.manual_seed(0)
    if args.stage == "forward":
        with torch.inference_mode():
            result: Any = forward_rows(
                args.shapes.split(","),
                [int(b) for b in args.batches.split(",")],
                args.ctx,
                args.chunk,
                args.device,
                args.dtype,
                args.steps,
            )
    elif args.stage == "overlap":
        result = overlap_rows(args)
    else:
        result = stress_rows(args)
    with open(args.json, "w") as fh:
        json.dump(result, fh, indent=2)
    return 0 if not isinstance(result, dict) or result.get("ok", True) else 1


if __name__ == "__main__":
    raise SystemExit(main())
