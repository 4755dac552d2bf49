"""Paired throughput comparison of engines on fixed workloads, for a machine whose speed moves.

On a shared host the same run can take much more or much less time from one minute to the next, so
two engines measured one after the other (each loaded, warmed up and timed in its own sitting) give
a ratio that says as much about those minutes as about the engines. Here every engine is loaded once,
in its own process, and they take turns: each round runs every workload once on each engine, the
engines' order flipped every round, so the two runs of a pair are seconds apart and see the same
machine. The ratio is taken within each round (the first engine's wall time over the other's: above
1 means the other is faster) and summarised over the rounds by its median and range; each engine's
own best time is printed beside it.

    .venv/bin/python scripts/peers_paired.py --rounds 5 \\
        --side "vllm-cpu=/tmp/peers/vllm/bin/python vllm /tmp/peers/llama1b" \\
        --side "minisgl=.venv/bin/python minisgl model=/tmp/peers/llama1b" \\
        --side "deterministic=.venv/bin/python minisgl model=/tmp/peers/llama1b,deterministic=true" \\
        /tmp/wl8.json /tmp/wlp.json

A side is `NAME=PYTHON KIND [SPEC]`: `vllm` (SPEC: the model directory; vLLM's CPU build wants
VLLM_TARGET_DEVICE=cpu and its thread binding in the environment) or `minisgl` (SPEC: comma-separated
EngineConfig fields, values parsed as YAML). Both run bf16 and greedy with ignore_eos and the prefix
cache off: the rounds repeat the same prompts, and a cache would turn every run after the first into
cache hits. Workloads are the peer harness's JSON files ({"prompts": [[token ids]...],
"max_tokens": n}). Each engine warms up on a workload's first two prompts before its first round.
While one engine runs, the others wait on their input, idle; the coordinator pauses `--settle`
seconds before each run so that threads still spinning from the run before have gone to sleep.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, TextIO


def _load_minisgl(spec: str) -> Any:
    import yaml

    from minisgl_backend import Engine, EngineConfig, SamplingParams

    overrides = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"minisgl spec expects KEY=VALUE items, got {item!r}")
        overrides[key.strip()] = yaml.safe_load(value)
    config = EngineConfig.resolve(
        None, overrides, defaults={"dtype": "bfloat16", "prefix_cache": False, "stats_interval_s": 0}
    )
    engine = Engine(config)

    def generate(prompts: list[list[int]], max_tokens: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        return sum(len(out.token_ids) for out in engine.generate(prompts, params))

    return generate, engine.close


def _load_vllm(spec: str) -> Any:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(model=spec, dtype="bfloat16", max_model_len=2048, seed=0, enable_prefix_caching=False)

    def generate(prompts: list[list[int]], max_tokens: int) -> int:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        return sum(len(out.outputs[0].token_ids) for out in outs)

    return generate, lambda: None


LOADERS = {"minisgl": _load_minisgl, "vllm": _load_vllm}


def serve(kind: str, spec: str, inp: TextIO = sys.stdin, out: TextIO = sys.stdout) -> None:
    """One engine's process: load, say ready, then time one run per workload path read from `inp`."""
    generate, close = LOADERS[kind](spec)
    warmed: set[str] = set()
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in inp:
        path = line.strip()
        if not path:
            continue
        with open(path) as f:
            workload = json.load(f)
        if path not in warmed:
            generate(workload["prompts"][:2], workload["max_tokens"])
            warmed.add(path)
        start = time.perf_counter()
        tokens = generate(workload["prompts"], workload["max_tokens"])
        print(json.dumps({"s": time.perf_counter() - start, "tokens": tokens}), file=out, flush=True)
    close()


@dataclass
class Side:
    name: str
    command: list[str]
    proc: subprocess.Popen[str] | None = None
    log: Any = None

    @classmethod
    def parse(cls, text: str) -> Side:
        name, sep, rest = text.partition("=")
        words = rest.split(None, 2)
        if not sep or not name or len(words) < 2 or words[1] not in LOADERS:
            raise SystemExit(
                f"--side expects NAME=PYTHON KIND [SPEC] with KIND one of {sorted(LOADERS)}, got {text!r}"
            )
        spec = words[2] if len(words) > 2 else ""
        return cls(name, [words[0], os.path.abspath(__file__), "--serve", words[1], spec])

    def start(self) -> None:
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(
            self.command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True, bufsize=1
        )

    def reply(self) -> dict[str, Any]:
        """The next JSON line the engine prints (libraries may print other lines first)."""
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        self.log.seek(0)
        tail = self.log.read()[-3000:]
        raise SystemExit(f"side {self.name!r} exited (code {self.proc.wait()}); its stderr ends:\n{tail}")

    def run(self, path: str) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(path + "\n")
        self.proc.stdin.flush()
        return self.reply()

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.stdin:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


@dataclass
class Record:
    workload: str
    round: int
    order: list[str]
    seconds: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, int] = field(default_factory=dict)


def round_order(names: list[str], rnd: int) -> list[str]:
    """The engines' order in round `rnd`: as given in even rounds, reversed in odd ones, so no engine
    always runs first after the pause or last before the next workload."""
    return list(names) if rnd % 2 == 0 else list(reversed(names))


def summarize(records: list[Record], names: list[str]) -> list[dict[str, Any]]:
    """Per workload: each engine's best and median wall time and tokens/s at its best, and each other
    engine's paired speed ratio against the first (the first's time over its own, in the same round)
    as the median and range over the rounds."""
    rows = []
    for workload in dict.fromkeys(r.workload for r in records):
        mine = [r for r in records if r.workload == workload]
        row: dict[str, Any] = {"workload": workload, "rounds": len(mine), "sides": {}}
        for name in names:
            times = [r.seconds[name] for r in mine]
            best = min(times)
            entry = {
                "best_s": round(best, 3),
                "median_s": round(statistics.median(times), 3),
                "tok_per_s": round(mine[0].tokens[name] / best, 1),
            }
            if name != names[0]:
                ratios = [r.seconds[names[0]] / r.seconds[name] for r in mine]
                entry["ratio_median"] = round(statistics.median(ratios), 3)
                entry["ratio_range"] = [round(min(ratios), 3), round(max(ratios), 3)]
            row["sides"][name] = entry
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], names: list[str]) -> str:
    head = ["workload", "rounds"] + [f"{n} best s" for n in names]
    head += [f"{n} / {names[0]} (range)" for n in names[1:]]
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for row in rows:
        cells = [row["workload"], str(row["rounds"])]
        cells += [f"{row['sides'][n]['best_s']:.3f}" for n in names]
        for n in names[1:]:
            s = row["sides"][n]
            cells.append(f"{s['ratio_median']:.2f}x ({s['ratio_range'][0]:.2f}-{s['ratio_range'][1]:.2f})")
        lines.append(" | ".join(cells))
    return "\n".join(lines)


def compare(sides: list[Side], workloads: list[str], rounds: int, settle: float) -> list[Record]:
    names = [s.name for s in sides]
    by_name = {s.name: s for s in sides}
    for side in sides:  # one at a time: two engines loading together would each slow the other
        side.start()
        side.reply()
    records = []
    for rnd in range(rounds):
        for path in workloads:
            record = Record(os.path.basename(path), rnd, round_order(names, rnd))
            for name in record.order:
                time.sleep(settle)
                result = by_name[name].run(os.path.abspath(path))
                record.seconds[name], record.tokens[name] = result["s"], result["tokens"]
            records.append(record)
            print(json.dumps(record.__dict__), file=sys.stderr, flush=True)
    return records


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("workloads", nargs="*", help="workload JSON files")
    parser.add_argument("--side", action="append", default=[], help="NAME=PYTHON KIND [SPEC] (two or more)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--settle", type=float, default=1.0, help="seconds of idle before each run")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON, not a table")
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "SPEC"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(*args.serve)
        return 0
    sides = [Side.parse(text) for text in args.side]
    if len(sides) < 2 or len({s.name for s in sides}) != len(sides):
        parser.error("give two or more --side entries with distinct names")
    if not args.workloads or args.rounds < 1:
        parser.error("give one or more workload files and --rounds >= 1")
    try:
        records = compare(sides, args.workloads, args.rounds, args.settle)
    finally:
        for side in sides:
            side.stop()
    names = [s.name for s in sides]
    rows = summarize(records, names)
    print(json.dumps(rows, indent=1) if args.json else table(rows, names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
