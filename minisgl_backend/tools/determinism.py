"""The determinism check (`minisgl determinism`): one request set under a grid of scheduling configs.

The engine promises that scheduling never changes a request's output. The check runs the same requests
(each prompt once per sampling mode: greedy, seeded, scored) under every point of a config grid, each point
in a fresh engine with its own shuffled arrival order, arrival bursts and random co-running "filler"
requests (so batch composition differs), and counts, per request, how many distinct outputs it
produced: token ids, and token ids plus logprobs compared bitwise (float32 bytes of the sampled
token's logprob and of its top alternatives, and of the prompt's logprobs where a mode asks for
`prompt_logprobs`, as lm-eval's loglikelihood requests do). Fillers are never compared.

Grid YAML (`configs/determinism/default.yaml`): `base` (EngineConfig overrides at every point),
`compare_within` (fields whose values legitimately change the numbers, e.g. dtype: outputs are
compared only between points that agree on them), `axes` (scheduling fields; the grid is their
cartesian product), `max_points`, `fillers`, `seed`, `prefill_check`. Any EngineConfig field may be
an axis, and so may `replicas`: a point with `replicas: N` splits the requests (fillers included)
over N engines as lm-eval's `data_parallel_size=N` splits a batch (`cluster/routing.py`, route),
each engine with its share of the threads and serving its share alone, one engine after another; the
outputs are then compared with the other points' like any other.

Prompts YAML (`configs/determinism/prompts.yaml`): `prompts`, `sampling` (mode name -> SamplingParams
fields, `prompt_logprobs` among them), `max_tokens`, `logprobs`.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import random
import struct
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from minisgl_backend.config import EngineConfig, config_dir
from minisgl_backend.engine import Engine
from minisgl_backend.errors import ConfigError, InvalidSamplingParamsError
from minisgl_backend.types import RequestOutput, SamplingParams, TokenLogprob

CONFIG_DIR = config_dir("determinism")  # the checkout's, else the installed package's copy
DEFAULT_GRID = CONFIG_DIR / "default.yaml"
DEFAULT_PROMPTS = CONFIG_DIR / "prompts.yaml"

Prompt = str | list[int]


def _load_mapping(path: str | Path, what: str) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(data).__name__}")
    return data


def _check_keys(data: dict[str, Any], valid: Sequence[str], where: str) -> None:
    unknown = sorted(set(data) - set(valid))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; valid keys: {', '.join(valid)}")


REPLICAS = "replicas"  # the one axis that is not an EngineConfig field


def _engine_fields(values: Any, where: str, lists: bool, extra: Sequence[str] = ()) -> dict[str, Any]:
    """A mapping of EngineConfig fields (and `extra` keys; to lists of values when `lists`), checked."""
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ConfigError(f"{where}: expected a mapping of EngineConfig fields, got {type(values).__name__}")
    _check_keys(values, [*EngineConfig.field_names(), *extra], where)
    if lists:
        for key, vals in values.items():
            if not isinstance(vals, list) or not vals:
                raise ConfigError(f"{where}.{key}: expected a non-empty list of values, got {vals!r}")
    return dict(values)


@dataclass(frozen=True)
class Grid:
    """Which engine configs to run (see the module docstring for the YAML keys)."""

    base: dict[str, Any] = field(default_factory=dict)
    compare_within: dict[str, list[Any]] = field(default_factory=dict)
    axes: dict[str, list[Any]] = field(default_factory=dict)
    max_points: int | None = None  # a seeded sample of the axes' product; None = all of it
    fillers: int = 4  # random co-running requests added at every point
    seed: int = 0  # arrival orders, bursts, fillers and the point sample derive from it
    prefill_check: bool = True  # decode logprobs vs a fresh prefill of the same tokens, once per group

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "grid") -> Grid:
        _check_keys(data, [f.name for f in dataclasses.fields(cls)], where)
        grid = cls(
            base=_engine_fields(data.get("base"), f"{where}.base", lists=False),
            compare_within=_engine_fields(data.get("compare_within"), f"{where}.compare_within", lists=True),
            axes=_engine_fields(data.get("axes"), f"{where}.axes", lists=True, extra=[REPLICAS]),
            **{k: data[k] for k in ("max_points", "fillers", "seed", "prefill_check") if k in data},
        )
        overlap = sorted(set(grid.axes) & set(grid.compare_within))
        if overlap:
            raise ConfigError(f"{where}: {overlap} appear in both axes and compare_within")
        if grid.max_points is not None and (not isinstance(grid.max_points, int) or grid.max_points < 1):
            raise ConfigError(f"{where}.max_points must be a positive int or null, got {grid.max_points!r}")
        bad = [n for n in grid.axes.get(REPLICAS, []) if type(n) is not int or n < 1]
        if bad:
            raise ConfigError(f"{where}.axes.{REPLICAS}: expected replica counts (ints >= 1), got {bad}")
        if not isinstance(grid.fillers, int) or grid.fillers < 0:
            raise ConfigError(f"{where}.fillers must be an int >= 0, got {grid.fillers!r}")
        return grid

    @classmethod
    def from_yaml(cls, path: str | Path) -> Grid:
        return cls.from_dict(_load_mapping(path, "grid"), where=str(path))

    def groups(self) -> list[dict[str, Any]]:
        keys = list(self.compare_within)
        return [dict(zip(keys, vals)) for vals in itertools.product(*self.compare_within.values())]

    def points(self) -> list[dict[str, Any]]:
        """The axes' cartesian product (or a seeded sample of it that keeps the first point)."""
        keys = list(self.axes)
        points = [dict(zip(keys, vals)) for vals in itertools.product(*self.axes.values())]
        if self.max_points is not None and len(points) > self.max_points:
            rest = random.Random(self.seed).sample(points[1:], self.max_points - 1)
            points = [points[0]] + rest
        return points

    def config(self, group: dict[str, Any], point: dict[str, Any], overrides: dict[str, Any]) -> EngineConfig:
        """The engine config of one grid point: base, then `overrides` (e.g. --set), group, point
        (without its replica count)."""
        fields = {k: v for k, v in point.items() if k != REPLICAS}
        return EngineConfig.from_dict({**self.base, **overrides, **group, **fields})


@dataclass(frozen=True)
class RequestSpec:
    name: str  # "<prompt index>/<sampling mode>"
    prompt: Prompt
    params: SamplingParams


@dataclass(frozen=True)
class Workload:
    """The compared request set: every prompt under every sampling mode."""

    requests: tuple[RequestSpec, ...]

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "prompts") -> Workload:
        _check_keys(data, ["prompts", "sampling", "max_tokens", "logprobs"], where)
        prompts = data.get("prompts")
        if not isinstance(prompts, list) or not prompts:
            raise ConfigError(f"{where}.prompts: expected a non-empty list of strings or token-id lists")
        for i, p in enumerate(prompts):
            if not (isinstance(p, str) and p) and not (
                isinstance(p, list) and p and all(isinstance(t, int) for t in p)
            ):
                raise ConfigError(
                    f"{where}.prompts[{i}]: expected a non-empty string or list of token ids, got {p!r}"
                )
        modes = data.get("sampling", {"greedy": {"temperature": 0}})
        if not isinstance(modes, dict) or not modes:
            raise ConfigError(f"{where}.sampling: expected a mapping of mode name -> SamplingParams fields")
        common = {
            "max_tokens": data.get("max_tokens", 16),
            "logprobs": data.get("logprobs", 0),
            "ignore_eos": True,
        }
        requests = []
        for mode, fields in modes.items():
            if not isinstance(fields, dict):
                raise ConfigError(f"{where}.sampling.{mode}: expected a mapping of SamplingParams fields")
            for i, prompt in enumerate(prompts):
                values = {**common, **fields}
                if values.get("seed") is not None:
                    values["seed"] += i  # one seed per prompt, fixed across grid points
                try:
                    params = SamplingParams.from_dict(values)
                except InvalidSamplingParamsError as e:
                    raise ConfigError(f"{where}.sampling.{mode}: {e}") from e
                requests.append(RequestSpec(f"{i}/{mode}", prompt, params))
        return cls(tuple(requests))

    @classmethod
    def from_yaml(cls, path: str | Path) -> Workload:
        return cls.from_dict(_load_mapping(path, "prompts"), where=str(path))


# ---------------------------------------------------------------- fingerprints and comparison
def _lp_bytes(lps: Sequence[TokenLogprob | None]) -> bytes:
    """The float32 bytes of every logprob (sampled token and top alternatives) with their ids."""
    out = bytearray()
    for lp in lps:
        if lp is None:
            continue
        out += struct.pack("<if", lp.token_id, lp.logprob)
        for tok, val in lp.top:
            out += struct.pack("<if", tok, val)
    return bytes(out)


@dataclass(frozen=True)
class Fingerprint:
    """What is compared of one output: token ids, and the logprobs bit for bit, of every sample
    (one for n = 1), and the prompt's logprobs where the request asked for them (what lm-eval's
    loglikelihood requests read: a cached or replicated prefix must not move them either)."""

    token_ids: tuple[tuple[int, ...], ...]
    logprobs: tuple[bytes, ...]
    prompt_logprobs: bytes = b""

    @classmethod
    def of(cls, out: RequestOutput) -> Fingerprint:
        return cls(
            tuple(tuple(s.token_ids) for s in out.samples),
            tuple(_lp_bytes(s.logprobs or []) for s in out.samples),
            _lp_bytes(out.prompt_logprobs or []),
        )


@dataclass(frozen=True)
class RequestReport:
    group: str
    name: str
    points: int
    distinct_tokens: int
    distinct_outputs: int  # token ids and logprobs bitwise
    prefill_match: bool | None = None  # decode logprobs == a fresh prefill's (None: not checked)


def compare(group: str, runs: dict[str, dict[str, Fingerprint]]) -> list[RequestReport]:
    """runs[point label][request name] -> one report per request: distinct outputs over the points."""
    names = sorted({n for fps in runs.values() for n in fps})
    reports = []
    for name in names:
        fps = [fps[name] for fps in runs.values() if name in fps]
        reports.append(RequestReport(group, name, len(fps), len({f.token_ids for f in fps}), len(set(fps))))
    return reports


@dataclass
class DeterminismReport:
    requests: list[RequestReport]
    points_run: int
    wall_s: float
    configs: list[dict[str, Any]]  # one per point run: group + point overrides

    @property
    def num_differing(self) -> int:
        return sum(r.distinct_outputs > 1 for r in self.requests)

    @property
    def num_prefill_mismatch(self) -> int:
        return sum(r.prefill_match is False for r in self.requests)

    @property
    def ok(self) -> bool:
        return self.num_differing == 0 and self.num_prefill_mismatch == 0

    def format_table(self) -> str:
        head = f"{'group':<24}{'request':<16}{'points':>7}{'tokens':>8}{'outputs':>9}{'prefill==decode':>17}"
        lines = [head, "-" * len(head)]
        for r in self.requests:
            pre = "-" if r.prefill_match is None else ("yes" if r.prefill_match else "NO")
            lines.append(
                f"{r.group:<24}{r.name:<16}{r.points:>7}{r.distinct_tokens:>8}{r.distinct_outputs:>9}{pre:>17}"
            )
        lines.append(
            f"summary: {len(self.requests)} requests x {self.points_run} grid points; "
            f"{self.num_differing} with more than one distinct output "
            f"({sum(r.distinct_tokens > 1 for r in self.requests)} in token ids); "
            f"{self.num_prefill_mismatch} decode-vs-prefill logprob mismatches; {self.wall_s:.1f}s"
        )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "num_differing": self.num_differing,
            "num_prefill_mismatch": self.num_prefill_mismatch,
            "points_run": self.points_run,
            "wall_s": self.wall_s,
            "configs": self.configs,
            "requests": [dataclasses.asdict(r) for r in self.requests],
        }


# ---------------------------------------------------------------- running
def _fillers(
    rng: random.Random, n: int, vocab: int, max_tokens: int, max_len: int
) -> list[tuple[Prompt, SamplingParams]]:
    """Random co-running requests: random token prompts and lengths, unseeded random sampling
    (so seeded requests of the set are batched with unseeded ones)."""
    return [
        (
            [rng.randrange(100, vocab - 1) for _ in range(rng.randrange(1, max(2, min(96, max_len))))],
            SamplingParams(temperature=1.0, max_tokens=rng.randrange(1, 2 * max_tokens + 1), ignore_eos=True),
        )
        for _ in range(n)
    ]


Item = tuple[str | None, Prompt, SamplingParams]  # (name in the set, or None for a filler; prompt; params)


def _items(workload: Workload, rng: random.Random, num_fillers: int, vocab: int, max_len: int) -> list[Item]:
    max_tokens = max(r.params.max_tokens for r in workload.requests)
    items: list[Item] = [(r.name, r.prompt, r.params) for r in workload.requests]
    items += [(None, p, sp) for p, sp in _fillers(rng, num_fillers, vocab, max_tokens, max_len)]
    return items


def run_point(
    engine: Engine, workload: Workload, rng: random.Random, num_fillers: int
) -> dict[str, RequestOutput]:
    """Submit the set plus fillers in a shuffled order, in random bursts; the set's outputs by name."""
    return _submit(engine, _items(workload, rng, num_fillers, engine.vocab_size, engine.max_model_len), rng)


def run_replicas(
    cfg: EngineConfig, n: int, workload: Workload, rng: random.Random, num_fillers: int
) -> dict[str, RequestOutput]:
    """The set plus fillers split over `n` engines as lm-eval's data-parallel replicas split a batch
    (route: prompts that share a stem on one replica, balanced by load), each engine with 1/n of the
    threads (at least one) serving its share alone; the set's outputs by name. The first engine also
    gives the vocabulary and context limit the fillers are drawn for."""
    from minisgl_backend.cluster.routing import route
    from minisgl_backend.model.cpu_threads import usable_cpus

    threads = max(1, (cfg.num_threads or usable_cpus()[0]) // n)
    cfg = cfg.replace(num_threads=threads)
    outs: dict[str, RequestOutput] = {}
    shares: list[list[Item]] | None = None
    for r in range(n):
        with Engine(cfg) as engine:
            if shares is None:
                items = _items(workload, rng, num_fillers, engine.vocab_size, engine.max_model_len)
                ids = [p if isinstance(p, list) else engine.tokenizer.encode(p) for _, p, _ in items]
                split = route(ids, [sp for _, _, sp in items], n, cfg.block_size)
                shares = [[items[i] for i in share] for share in split]
            if shares[r]:
                outs.update(_submit(engine, shares[r], rng))
    return outs


def _submit(engine: Engine, items: list[Item], rng: random.Random) -> dict[str, RequestOutput]:
    items = list(items)
    rng.shuffle(items)
    handles = []
    i = 0
    while i < len(items):  # bursts: later arrivals join batches already running
        burst = rng.randrange(1, 5)
        handles += [(name, engine.submit(prompt, params)) for name, prompt, params in items[i : i + burst]]
        i += burst
        time.sleep(rng.uniform(0, 0.01))
    outs = {name: h.result() for name, h in handles}
    engine.drain()  # also checks KV accounting after every point
    return {name: out for name, out in outs.items() if name is not None}


def prefill_matches(engine: Engine, workload: Workload, outputs: dict[str, RequestOutput]) -> dict[str, bool]:
    """For each request: do its generated tokens' logprobs equal those a fresh prefill of
    prompt + output assigns to the same tokens (prompt logprobs), bit for bit?"""
    specs = [
        s
        for s in workload.requests
        if outputs[s.name].logprobs is not None
        and len(outputs[s.name].prompt_token_ids) + len(outputs[s.name].token_ids) <= engine.max_model_len
    ]
    prompts, params = [], []
    for spec in specs:  # all at once: the fresh prefills share batches, which must not matter either
        out = outputs[spec.name]
        prompts.append(list(out.prompt_token_ids) + list(out.token_ids))
        params.append(
            SamplingParams(
                max_tokens=1,
                prompt_logprobs=spec.params.logprobs or 0,
                prompt_logprobs_start=len(out.prompt_token_ids),
            )
        )
    fresh = engine.generate(prompts, params, use_tqdm=False)
    return {
        spec.name: _lp_bytes((f.prompt_logprobs or [])[len(outputs[spec.name].prompt_token_ids) :])
        == _lp_bytes(outputs[spec.name].logprobs or [])
        for spec, f in zip(specs, fresh)
    }


def _label(values: dict[str, Any]) -> str:
    return " ".join(f"{k}={json.dumps(v)}" for k, v in values.items()) or "(base)"


def run_check(
    grid: Grid,
    workload: Workload,
    overrides: dict[str, Any] | None = None,
    progress: Callable[[str], None] | None = None,
) -> DeterminismReport:
    """Run `workload` at every grid point (every group x every point) and compare per group."""
    overrides = dict(overrides or {})
    _check_keys(overrides, EngineConfig.field_names(), "overrides")
    groups, points = grid.groups(), grid.points()
    total, done = len(groups) * len(points), 0
    reports: list[RequestReport] = []
    configs: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    if progress:
        progress(
            f"{total} grid points ({len(groups)} group(s) x {len(points)}), each a fresh engine running "
            f"{len(workload.requests)} requests + {grid.fillers} fillers"
        )
    for group in groups:
        runs: dict[str, dict[str, Fingerprint]] = {}
        prefill: dict[str, bool] = {}
        checked = False
        for j, point in enumerate(points):
            cfg = grid.config(group, point, overrides)
            rng = random.Random(f"{grid.seed}/{_label(group)}/{j}")
            t0 = time.perf_counter()
            replicas = point.get(REPLICAS, 1)
            if replicas > 1:
                outs = run_replicas(cfg, replicas, workload, rng, grid.fillers)
            else:
                with Engine(cfg) as engine:
                    outs = run_point(engine, workload, rng, grid.fillers)
                    if grid.prefill_check and not checked:  # once per group, on one engine
                        prefill, checked = prefill_matches(engine, workload, outs), True
            runs[f"{j}: {_label(point)}"] = {name: Fingerprint.of(o) for name, o in outs.items()}
            done += 1
            configs.append({**group, **point})
            if progress:
                elapsed = time.perf_counter() - t_start
                eta = f", about {elapsed / done * (total - done):.0f}s left" if done < total else ""
                progress(
                    f"[{done}/{total}] {_label({**group, **point})}: {time.perf_counter() - t0:.1f}s{eta}"
                )
        reports += [
            dataclasses.replace(r, prefill_match=prefill.get(r.name)) if prefill else r
            for r in compare(_label(group), runs)
        ]
    return DeterminismReport(reports, total, time.perf_counter() - t_start, configs)


def print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
