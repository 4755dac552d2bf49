"""The determinism check (`minisgl determinism`) and the batch-invariant mode (`deterministic: true`).

Grids on the tiny model (fp32 and bf16) and a smaller one on the embedded SmolLM2: with the mode on,
every request has exactly one distinct output (token ids and logprobs bitwise) and decode logprobs
equal a fresh prefill's; with it off, the same grid finds requests that differ (negative control),
and an injected one-bit perturbation is found, so the check cannot pass vacuously.
"""

from __future__ import annotations

import dataclasses
import json
import random
import subprocess

import pytest
import torch

from minisgl_backend import Engine, EngineConfig, SamplingParams
from minisgl_backend.errors import ConfigError
from minisgl_backend.model import cpu_kernels
from minisgl_backend.tools.determinism import (
    DEFAULT_GRID,
    DEFAULT_PROMPTS,
    Fingerprint,
    Grid,
    Workload,
    compare,
    run_check,
    run_point,
)
from tests.helpers import run_minisgl

# Small pools (start-up allocates the KV cache) and one intra-op thread: these grids start many
# engines, and on a shared machine with few cores an OpenMP team of several threads stalls whenever
# another process holds one of its cores (a spin-waiting team waits for its slowest thread).
_BASE = {"stats_interval_s": 0, "num_blocks": 96, "block_size": 16, "max_model_len": 512, "num_threads": 1}

TINY_GRID = {
    "fillers": 4,
    "base": _BASE,
    "compare_within": {"dtype": ["float32", "bfloat16"]},
    "axes": {
        "chunk_size": [None, 3, 16],
        "max_num_batched_tokens": [8, 512],
        "max_num_seqs": [2, 16],
        "overlap": [True, False],
        "block_size": [16, 12],  # 12 does not divide the attention split: the other gather path
    },
    "max_points": 5,
}

TINY_PROMPTS = {
    "max_tokens": 10,
    "logprobs": 2,
    "sampling": {"greedy": {"temperature": 0}, "seeded": {"temperature": 0.9, "top_p": 0.95, "seed": 5}},
    "prompts": [
        "The capital of France is",
        "a b c d e f g h i j k l m n o p q r s t u v w x y z",
        list(range(300, 340)),
        "Hi",
    ],
}


def _check(grid: dict, model: str, deterministic: bool, workload: dict = TINY_PROMPTS, **grid_changes):
    g = Grid.from_dict({**grid, **grid_changes})
    return run_check(g, Workload.from_dict(workload), {"model": model, "deterministic": deterministic})


@pytest.fixture(scope="module")
def tiny_reports(tiny_model_dir):
    on = _check(TINY_GRID, str(tiny_model_dir), True)
    off = _check(TINY_GRID, str(tiny_model_dir), False, prefill_check=False)
    return on, off


@pytest.mark.slow
def test_tiny_grid_deterministic_mode_gives_one_output_per_request(tiny_reports):
    on, _ = tiny_reports
    print(on.format_table())
    assert on.points_run == 10 and len(on.requests) == 2 * 8  # 2 dtypes x (4 prompts x 2 modes)
    assert {c["block_size"] for c in on.configs} == {16, 12} and {c["chunk_size"] for c in on.configs} >= {
        None,
        3,
    }
    assert all(r.points == 5 for r in on.requests)
    assert on.num_differing == 0 and all(r.distinct_outputs == 1 for r in on.requests)
    # Decode logprobs (and top alternatives) are bitwise those of a fresh prefill of the same tokens.
    assert all(r.prefill_match is True for r in on.requests)
    assert on.ok


# The kernel families this machine runs beside the process's own (which the grid above uses), and
# avx512 with torch's bf16 matmul on the other side of library_bf16 (its linears' other row limit).
OTHER_FAMILIES = [
    (f, None) for f in cpu_kernels.FAMILIES if cpu_kernels.runs_family(f) and f != cpu_kernels.family()
] + ([("avx512", not cpu_kernels.library_bf16())] if cpu_kernels.runs_family("avx512") else [])


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,library_bf16", OTHER_FAMILIES or [pytest.param(None, None, marks=pytest.mark.skip("none"))]
)
def test_tiny_grid_is_deterministic_under_every_kernel_family(tiny_model_dir, family, library_bf16):
    """The bf16 grid (the dtype whose linears and attention scorer change with the family) under
    each other family this CPU runs: one output per request, decode == prefill bitwise."""
    with cpu_kernels.family_override(family, library_bf16):
        on = _check(
            TINY_GRID, str(tiny_model_dir), True, compare_within={"dtype": ["bfloat16"]}, max_points=3
        )
    assert on.points_run == 3 and on.ok
    assert all(r.distinct_outputs == 1 and r.prefill_match for r in on.requests)


@pytest.mark.slow
def test_tiny_grid_negative_control_finds_differences(tiny_reports):
    on, off = tiny_reports
    print(off.format_table())
    assert off.configs == on.configs  # the very same grid points
    assert off.num_differing > 0 and not off.ok
    assert all(r.prefill_match is None for r in off.requests)


def _two_runs(model_dir, prompts: dict) -> dict[str, dict[str, Fingerprint]]:
    """The request set run twice on one deterministic engine, at two arrival orders."""
    workload = Workload.from_dict(prompts)
    with Engine(EngineConfig(model=str(model_dir), deterministic=True, **_BASE)) as engine:
        return {
            str(i): {
                n: Fingerprint.of(o) for n, o in run_point(engine, workload, random.Random(i), 3).items()
            }
            for i in range(2)
        }


def test_injected_one_bit_perturbation_is_detected(tiny_model_dir):
    """Two real runs at different arrival orders agree; flipping one logprob bit in one run is a
    second distinct output for exactly that request (the comparison does not pass vacuously)."""
    runs = _two_runs(tiny_model_dir, TINY_PROMPTS)
    assert all(r.distinct_outputs == 1 for r in compare("g", runs))
    victim = runs["1"]["2/seeded"]
    flipped = bytearray(victim.logprobs[0])  # its one sample (n = 1)
    flipped[5] ^= 1  # low mantissa bit of the first logprob (bytes 4..7 are its float32)
    runs["1"]["2/seeded"] = dataclasses.replace(victim, logprobs=(bytes(flipped),))
    reports = {r.name: r for r in compare("g", runs)}
    assert reports["2/seeded"].distinct_outputs == 2 and reports["2/seeded"].distinct_tokens == 1
    assert sum(r.distinct_outputs > 1 for r in reports.values()) == 1


SCORED_PROMPTS = {
    **TINY_PROMPTS,
    "sampling": {
        **TINY_PROMPTS["sampling"],
        "scored": {"temperature": 0, "max_tokens": 1, "prompt_logprobs": 2},
    },
}


def test_prompt_logprobs_are_compared_bitwise(tiny_model_dir):
    """A `prompt_logprobs` mode (lm-eval's loglikelihood request) puts the prompt's logprobs in the
    fingerprint: two real runs agree, and one flipped bit in one prompt logprob is a second output
    with the same tokens."""
    runs = _two_runs(tiny_model_dir, SCORED_PROMPTS)
    assert all(r.distinct_outputs == 1 for r in compare("g", runs))
    victim = runs["1"]["1/scored"]
    assert len(victim.prompt_logprobs) > 8 * 3 * 10  # 25 scored prompt tokens x (token + 2 alternatives)
    flipped = bytearray(victim.prompt_logprobs)
    flipped[-1] ^= 1  # the last alternative's float32, one bit
    runs["1"]["1/scored"] = dataclasses.replace(victim, prompt_logprobs=bytes(flipped))
    reports = {r.name: r for r in compare("g", runs)}
    assert reports["1/scored"].distinct_outputs == 2 and reports["1/scored"].distinct_tokens == 1
    assert sum(r.distinct_outputs > 1 for r in reports.values()) == 1


def test_seeded_request_keeps_its_output_beside_unseeded_ones(tiny_model_dir):
    seeded = SamplingParams(temperature=1.0, seed=123, max_tokens=12, logprobs=1, ignore_eos=True)
    unseeded = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    cfg = EngineConfig(model=str(tiny_model_dir), deterministic=True, chunk_size=4, **_BASE)
    with Engine(cfg) as engine:
        alone = engine.generate(["Once upon a time"], seeded, use_tqdm=False)[0]
        mixed = engine.generate(
            ["lorem ipsum", "Once upon a time", "x" * 40, "What is 2+2?"],
            [unseeded, seeded, unseeded, unseeded],
            use_tqdm=False,
        )[1]
    assert mixed.token_ids == alone.token_ids and mixed.seed == alone.seed == 123
    assert mixed.logprobs == alone.logprobs


@pytest.mark.slow
def test_embedded_model_grid(smollm_dir):
    """The embedded SmolLM2 (fp32): 3 scheduling configs, mode on -> one output per request and
    decode == prefill bitwise; mode off -> the same grid finds differing logprobs."""
    grid = {
        "fillers": 2,
        "base": _BASE,
        "max_points": None,
        "axes": {"chunk_size": [None, 7], "max_num_seqs": [3, 16]},
    }
    prompts = {**TINY_PROMPTS, "max_tokens": 6, "prompts": TINY_PROMPTS["prompts"][:3]}
    on = _check(grid, str(smollm_dir), True, prompts)
    off = _check(grid, str(smollm_dir), False, prompts, prefill_check=False)
    print(on.format_table(), off.format_table(), sep="\n")
    assert on.ok and all(r.distinct_outputs == 1 and r.prefill_match for r in on.requests)
    assert off.num_differing > 0


# ---------------------------------------------------------------------------------------------- config errors
def test_shipped_grid_and_prompts_load():
    grid, workload = Grid.from_yaml(DEFAULT_GRID), Workload.from_yaml(DEFAULT_PROMPTS)
    assert grid.base["deterministic"] is True and "dtype" in grid.compare_within
    assert len(grid.points()) == grid.max_points and grid.points()[0] == {
        k: v[0] for k, v in grid.axes.items()
    }
    assert {r.name.split("/")[1] for r in workload.requests} == {"greedy", "seeded", "scored"}
    seeded = [r for r in workload.requests if r.name.endswith("seeded")]
    assert len({r.params.seed for r in seeded}) == len(seeded)  # one fixed seed per prompt
    assert all(r.params.prompt_logprobs for r in workload.requests if r.name.endswith("scored"))


@pytest.mark.parametrize(
    "data, message",
    [
        ({"axes": {"chunksize": [1]}}, "unknown key(s) ['chunksize']"),
        ({"axes": {"chunk_size": 16}}, "expected a non-empty list"),
        ({"base": {"no_such": 1}}, "valid keys: model"),
        ({"grid": {}}, "unknown key(s) ['grid']"),
        (
            {"axes": {"dtype": ["float32"]}, "compare_within": {"dtype": ["float32"]}},
            "both axes and compare_within",
        ),
        ({"max_points": 0}, "max_points"),
    ],
)
def test_bad_grid_is_a_typed_error(data, message):
    with pytest.raises(ConfigError) as err:
        Grid.from_dict(data)
    assert message in str(err.value)


def test_bad_yaml_and_bad_prompts_are_typed_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("axes: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        Grid.from_yaml(bad)
    with pytest.raises(ConfigError, match="not found"):
        Workload.from_yaml(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="prompts"):
        Workload.from_dict({"prompts": []})
    with pytest.raises(ConfigError, match="unknown sampling parameter"):
        Workload.from_dict({"prompts": ["hi"], "sampling": {"x": {"temprature": 1}}})


@pytest.mark.slow
def test_cli_exit_codes(tiny_model_dir, tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(json.dumps({"fillers": 2, "base": _BASE, "axes": {"chunk_size": [None, 3]}}))
    prompts = tmp_path / "prompts.yaml"
    prompts.write_text(json.dumps({**TINY_PROMPTS, "max_tokens": 4}))
    out = tmp_path / "report.json"

    def cli(*extra: str) -> subprocess.CompletedProcess:
        return run_minisgl(
            "determinism",
            "--grid",
            str(grid),
            "--prompts",
            str(prompts),
            "--model",
            str(tiny_model_dir),
            *extra,
        )

    r = cli("--set", "deterministic=true", "--json", str(out))
    assert r.returncode == 0, r.stderr
    assert "[2/2]" in r.stderr and "0 with more than one distinct output" in r.stdout
    assert json.loads(out.read_text())["ok"] is True
    r = cli("--set", "deterministic=false")
    assert r.returncode == 1, r.stdout + r.stderr
    r = cli("--set", "chunksize=3")
    assert r.returncode == 2 and "chunksize" in r.stderr


REPLICA_GRID = {
    "fillers": 3,
    "prefill_check": False,
    # num_threads unset: the replicas split the CPUs the process may use (two on the CI machines)
    "base": {**{k: v for k, v in _BASE.items() if k != "num_threads"}, "prefix_cache": "async"},
    "compare_within": {"dtype": ["bfloat16"]},
    "axes": {"replicas": [1, 2]},
}


def _counting_engines(monkeypatch, change_second=None):
    """Engine, as the determinism tool builds it, recording each one's config and how many requests
    it was given (and changing the second one's config with `change_second`)."""
    import minisgl_backend.tools.determinism as det

    built: list[EngineConfig] = []
    served: list[int] = []

    class Counted(Engine):
        def __init__(self, config, **kw):
            if change_second and len(built) == 1:
                config = config.replace(**change_second)
            built.append(config)
            served.append(0)
            self._slot = len(served) - 1
            super().__init__(config, **kw)

        def submit(self, *a, **kw):
            served[self._slot] += 1
            return super().submit(*a, **kw)

    monkeypatch.setattr(det, "Engine", Counted)
    return built, served


def test_replica_axis_splits_the_requests_over_engines_and_agrees(tiny_model_dir, monkeypatch):
    """`replicas: 2` serves the set on two engines of one thread each (the split lm-eval's
    data-parallel replicas use), and every request's output equals the one engine's bit for bit."""
    built, served = _counting_engines(monkeypatch)
    report = _check(REPLICA_GRID, str(tiny_model_dir), True)
    assert report.points_run == 2 and [c["replicas"] for c in report.configs] == [1, 2]
    from minisgl_backend.model.cpu_threads import usable_cpus

    share = max(1, usable_cpus()[0] // 2)
    assert [c.num_threads for c in built] == [None, share, share]
    assert served[0] == served[1] + served[2] == 8 + 3 and min(served) > 0  # the set and its fillers
    assert report.ok and all(r.distinct_outputs == 1 and r.points == 2 for r in report.requests)


def test_replicas_give_one_engine_s_prompt_logprobs(tiny_model_dir, monkeypatch):
    """lm-eval's loglikelihood path on replicas: scored requests (prompt logprobs), with the prefix
    cache on, get the one engine's bits on two replicas."""
    _, served = _counting_engines(monkeypatch)
    report = _check(REPLICA_GRID, str(tiny_model_dir), True, workload=SCORED_PROMPTS)
    assert len(served) == 3 and min(served) > 0
    scored = [r for r in report.requests if r.name.endswith("/scored")]
    assert len(scored) == 4 and report.ok and all(r.points == 2 for r in scored)


def test_replica_axis_sees_a_replica_that_computes_differently(tiny_model_dir, monkeypatch):
    """The second replica in float32 while the rest runs bf16: the requests it serves get a second
    output (so the axis compares what each replica really computed)."""
    _counting_engines(monkeypatch, change_second={"dtype": "float32"})
    report = _check(REPLICA_GRID, str(tiny_model_dir), True)
    assert not report.ok and 0 < report.num_differing < len(report.requests)


def test_replica_counts_are_checked():
    with pytest.raises(ConfigError, match="replica counts"):
        Grid.from_dict({"axes": {"replicas": [2, 0]}})


# torch ops that hand a product's summation order to a BLAS or oneDNN (which pick their kernels by
# CPU model, shape, thread count and, on some CPUs, the data's alignment).
LIBRARY_PRODUCTS = {
    "mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "mv", "addmv", "dot", "einsum",
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention_for_cpu",
}  # fmt: skip

# (family, library_bf16, dtype, whether the forward may call the library): where the native
# kernels take every product; and bf16 under avx512 beside a bf16 oneDNN, whose linears past the
# few-row kernel's rows are fixed-tile library calls (so the check sees library calls where they are).
_NATIVE_PRODUCTS = [
    (family, library_bf16, dtype, family == "avx512" and dtype == "bfloat16" and library_bf16)
    for family in ("avx512bf16", "avx512", "avx2")
    if cpu_kernels.runs_family(family)
    for library_bf16 in ((False, True) if family == "avx512" else (None,))
    for dtype in ("float32", "bfloat16")
]


@pytest.mark.parametrize(
    "family,library_bf16,dtype,library",
    _NATIVE_PRODUCTS or [pytest.param(*[None] * 4, marks=pytest.mark.skip("no native kernels"))],
)
def test_the_deterministic_forward_leaves_no_product_to_a_library(
    tiny_model_dir, monkeypatch, family, library_bf16, dtype, library
):
    """With the native kernels, every product of the deterministic forward (projections, MLP,
    attention, LM head) runs on the engine's own kernels, whose summation order their code fixes:
    none is left to the BLAS or oneDNN, whose kernel choice can follow the CPU model, the thread
    count or the data's alignment, so a replica with another history could get other bits.
    Prompts past the float32 kernel's default 32 rows, prefix reuse and decode steps."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from minisgl_backend.model.llama import CausalLM

    seen: set[str] = set()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.add(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    forward = CausalLM.forward

    def recorded(self, *args, **kwargs):
        with Record():
            return forward(self, *args, **kwargs)

    monkeypatch.setattr(CausalLM, "forward", recorded)
    with cpu_kernels.family_override(family, library_bf16):
        config = EngineConfig(model=str(tiny_model_dir), deterministic=True, dtype=dtype, **_BASE)
        with Engine(config) as engine:
            g = torch.Generator().manual_seed(3)
            prompts = [torch.randint(10, 1000, (n,), generator=g).tolist() for n in (70, 9, 40)]
            params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
            engine.generate(prompts + [prompts[0][:50] + [5, 6, 7]], params, use_tqdm=False)
    assert seen, "the recorder saw the forward's ops"
    called = seen & LIBRARY_PRODUCTS
    assert bool(called) is library, f"{family} {dtype}: library products {sorted(called)}"
