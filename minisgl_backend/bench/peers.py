"""`minisgl bench --scenario peers`: output tok/s of the default and deterministic configs on the
peer harness's workloads, the batch-1 decode step against the machine's weight-read rate, and the
prefill workload against the rate of the model's largest linear on this machine (the compute roof a
prefill can reach: linears are nearly all of its FLOPs)."""

from __future__ import annotations

import time
from typing import Any

import torch

from minisgl_backend.bench.load import CompetingLoad
from minisgl_backend.bench.measure import random_prompts, summarize
from minisgl_backend.config import EngineConfig
from minisgl_backend.engine import Engine
from minisgl_backend.model import cpu_kernels
from minisgl_backend.model.layers import MLP_PIECE_BYTES, Linear
from minisgl_backend.model.spec import ModelSpec
from minisgl_backend.types import SamplingParams

# The peers scenario: the workloads minisgl is compared with other CPU engines on (docs/performance.md,
# "How the figures are taken"): random-token prompts, greedy, ignore_eos; (requests, prompt tokens,
# new tokens). The last is prefill: one new token.
PEER_WORKLOADS = {
    "1 x 200 -> 96": (1, 200, 96),
    "8 x 200 -> 96": (8, 200, 96),
    "32 x 100 -> 64": (32, 100, 64),
    "32 x 512 -> 1 (prefill)": (32, 512, 1),
}
PEER_VARIANTS: dict[str, dict[str, Any]] = {"default": {}, "deterministic": {"deterministic": True}}
# With a competing load (bench_peers' `busy`): the default config beside it, and one thread beside it
# (what the engine must never fall below: the threads it adds have to pay for themselves).
BUSY_VARIANTS: dict[str, dict[str, Any]] = {"default, busy": {}, "1 thread, busy": {"num_threads": 1}}


def prefill_gflop(spec: ModelSpec, n: int, length: int) -> float:
    """GFLOP (2 per multiply-add) of the forward that prefills n prompts of `length` tokens and
    computes one token's logits each: every layer's linears and causal attention over every token,
    except the last layer past its K/V (qkv_proj only: DecoderLayer.forward's `keep`), and the LM
    head for one row per prompt. Sliding windows are not counted (a window only lowers it)."""
    h, kvh, d, hidden = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.hidden_size
    qkv = 2 * hidden * (h + 2 * kvh) * d
    rest = 2 * h * d * hidden + 3 * 2 * hidden * spec.intermediate_size  # o_proj, gate/up and down
    attend = 4 * h * d * length * (length + 1) // 2  # QK and PV, token p seeing keys 0..p
    full_layers = spec.num_layers - 1
    per_prompt = full_layers * (length * (qkv + rest) + attend) + length * qkv + rest + 4 * h * d * length
    return n * (per_prompt + 2 * hidden * spec.vocab_size) / 1e9


class LinearRoof:
    """GFLOP/s of the model's gate/up projection ([rows, hidden] x [hidden, 2 x intermediate], the
    largest share of a prefill's FLOPs) through Linear.forward as the engine runs it in this process
    (packed where the kernel family packs), random bf16 weights, at torch's thread count. `probe()`
    times it (best of `repeat` calls) and `best` keeps the highest rate probed: probed beside each
    timed prefill run, the roof follows the machine through the same moments as the runs it bounds,
    and a slow moment never lowers it. At most the rows the MLP computes in one piece
    (MLP_PIECE_BYTES): a larger output would come from fresh pages the kernel zeroes on every call,
    a cost the engine's MLP avoids, and a roof that paid it would sit below the linear's rate."""

    def __init__(self, spec: ModelSpec, rows: int = 1024) -> None:
        rows = max(1, min(rows, MLP_PIECE_BYTES // (2 * spec.intermediate_size * 2)))
        self.lin = Linear(spec.hidden_size, 2 * spec.intermediate_size, bias=False).to(torch.bfloat16)
        with torch.no_grad():
            self.lin.weight.normal_(0, 0.02)
            self.lin.pack()
        self.x = torch.randn(rows, spec.hidden_size, dtype=torch.bfloat16)
        self.gflop = 2 * rows * spec.hidden_size * 2 * spec.intermediate_size / 1e9
        self.best = 0.0

    def probe(self, repeat: int = 10) -> float:
        with torch.no_grad():
            self.lin(self.x)
            fastest = float("inf")
            for _ in range(repeat):
                t0 = time.perf_counter()
                self.lin(self.x)
                fastest = min(fastest, time.perf_counter() - t0)
        rate = self.gflop / fastest
        self.best = max(self.best, rate)
        return rate


def _speed(workload: str, row: dict[str, float], a: str, b: str) -> float:
    """How much faster variant a ran than b on a workload's row (prefill rows are seconds)."""
    return row[b] / row[a] if "prefill" in workload else row[a] / row[b]


def bench_peers(base: EngineConfig, repeat: int = 3, busy: int = 0) -> dict[str, Any]:
    """Each PEER_VARIANTS config on each PEER_WORKLOADS workload, measured as the peer harness
    measures vLLM and HF: a warm-up on 2 prompts, then the best of `repeat` full runs, with the
    prefix cache off (the runs repeat their prompts: with it on, prefill would be cache hits).
    Returns {"rows": workload -> {variant: output tok/s (prefill: seconds), "<variant> cost %"},
    "kernels": the kernel family, "decode": the batch-1 weight stream}: the default config's
    decode step at one request (its mean time per output token), the weight bytes a step reads,
    their ratio and the machine's streaming read rate measured beside it; "prefill": the prefill
    workload's GFLOP (prefill_gflop), the default config's GFLOP/s on it, and that against the
    rate of the model's largest linear (LinearRoof: the best of its probes after each run). With
    `busy` > 0, the BUSY_VARIANTS run too, each beside that many busy processes (CompetingLoad), and
    every row gets "busy / idle" (the default config's busy figure over its idle one, as a speed
    ratio) and "busy / 1 thread"."""
    base = base.replace(prefix_cache="off")
    variants = {name: (overrides, 0) for name, overrides in PEER_VARIANTS.items()}
    if busy:
        variants.update({name: (overrides, busy) for name, overrides in BUSY_VARIANTS.items()})
    rows: dict[str, dict[str, float]] = {name: {} for name in PEER_WORKLOADS}
    stream: dict[str, float] = {}
    compute: dict[str, float] = {}
    for variant, (overrides, load) in variants.items():
        with CompetingLoad(load), Engine(base.replace(**overrides)) as engine:
            for name, (n, input_len, output_len) in PEER_WORKLOADS.items():
                prompts = random_prompts(n, input_len, engine.vocab_size)
                params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
                engine.generate(prompts[:2], params, use_tqdm=False)
                prefill = output_len == 1
                roof = LinearRoof(engine.model_spec) if prefill and variant == "default" else None
                best, tpot = float("inf"), float("inf")
                for _ in range(repeat):
                    t0 = time.perf_counter()
                    outs = engine.generate(prompts, params, use_tqdm=False)
                    best = min(best, time.perf_counter() - t0)
                    if n == 1:
                        tpot = min(tpot, summarize(outs, best)["tpot_ms_mean"] / 1000)
                    if roof:  # the roof measured while the engine idles, after every run
                        roof.probe()
                rows[name][variant] = best if prefill else sum(len(o.token_ids) for o in outs) / best
                unit = "s" if prefill else "tok/s"
                print(f"  {variant} {name}: {rows[name][variant]:.2f} {unit}", flush=True)
                if n == 1 and variant == "default":
                    stream = {"step_ms": 1000 * tpot, "weight_bytes": engine.decode_weight_bytes}
                if roof:
                    work, linear = prefill_gflop(engine.model_spec, n, input_len), roof.best
                    compute = {"gflop": work, "gflop_per_s": work / best, "linear_gflop_per_s": linear}
                    compute["fraction_of_linear"] = work / best / linear
    if stream:
        stream["weights_gb_per_s"] = stream["weight_bytes"] / (stream["step_ms"] / 1000) / 1e9
        read = cpu_kernels.stream_read_gbps()
        if read:
            stream["stream_read_gb_per_s"] = read
            stream["fraction_of_read"] = stream["weights_gb_per_s"] / read
    for name, row in rows.items():
        for variant in PEER_VARIANTS:
            if variant != "default":  # a cost: the time it adds
                row[f"{variant} cost %"] = 100 * (1 - _speed(name, row, variant, "default"))
        if busy:
            row["busy / idle"] = _speed(name, row, "default, busy", "default")
            row["busy / 1 thread"] = _speed(name, row, "default, busy", "1 thread, busy")
    return {
        "rows": rows,
        "busy_processes": busy,
        "kernels": cpu_kernels.family(),
        "machine_kernels": cpu_kernels.machine_family(),
        "decode": stream,
        "prefill": compute,
    }
