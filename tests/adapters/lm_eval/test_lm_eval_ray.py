"""lm-eval adapter with data_parallel_size=2 (Ray replicas) against the in-process engine: identical
results (deterministic mode, tiny model), prefix routing, run-order seeds, failures and Ray hygiene.

One local Ray cluster (num_cpus=2) for the module; the adapter must not shut down a cluster it did
not start. The test that the adapter shuts down its own cluster runs in a fresh interpreter."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("lm_eval", reason="the lm-eval adapter needs lm-eval installed")
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval_minisgl.model import MiniSGLLM  # noqa: E402
from lm_eval_minisgl.replicas import make_engine  # noqa: E402
from lm_eval_minisgl.seeds import RequestSeeds, derive_seed  # noqa: E402

from minisgl_backend import ConfigError, EngineConfig, SamplingParams  # noqa: E402
from minisgl_backend.cluster import ReplicaFailedError, prefix_groups, route  # noqa: E402
from minisgl_backend.errors import MissingExtraError  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.ray]  # slow tier: Ray replicas of the embedded model

ROOT = Path(__file__).resolve().parents[3]
ENGINE = dict(dtype="float32", deterministic=True, metrics_exact=True, stats_interval_s=0)
KILL_BOUND_S = 30.0  # documented: a dead replica is reported within seconds; this is the test's bound


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray", reason="data_parallel_size > 1 needs minisgl[ray]")
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def lm1(tiny_model_dir):
    lm = MiniSGLLM(pretrained=str(tiny_model_dir), num_threads=1, **ENGINE)
    yield lm
    lm.close()


@pytest.fixture(scope="module")
def lm2(tiny_model_dir, ray_cluster):
    lm = MiniSGLLM(pretrained=str(tiny_model_dir), data_parallel_size=2, **ENGINE)
    yield lm
    lm.close()
    assert ray_cluster.is_initialized()  # the fixture started the cluster: the adapter leaves it up


def _reset_seeds(*lms: MiniSGLLM) -> None:
    for lm in lms:
        lm._seeds = RequestSeeds(lm.engine.config.seed)


QUESTIONS = [
    "Question: which planet is known as the red planet, and why does it look that colour?\nAnswer:",
    "Question: what is the boiling point of water at sea level, in degrees Celsius?\nAnswer:",
    "Question: who wrote the play about a prince of Denmark who avenges his father?\nAnswer:",
    "Question: how many legs does a spider have, counting all of its walking legs?\nAnswer:",
]
CHOICES = [" Mars", " 100", " Shakespeare", " eight", " none of these"]


def _mc() -> list[Instance]:
    pairs = [(q, c) for q in QUESTIONS for c in CHOICES]
    return [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]


# ------------------------------------------------------------------------------- identical results
def test_loglikelihood_and_rolling_are_bitwise_identical_at_dp1_and_dp2(lm1, lm2):
    reqs = _mc()
    a, b = lm1.loglikelihood(reqs, disable_tqdm=True), lm2.loglikelihood(reqs, disable_tqdm=True)
    assert a == b
    docs = [Instance("loglikelihood_rolling", {}, (q * 6,), i) for i, q in enumerate(QUESTIONS)]
    assert lm1.loglikelihood_rolling(docs, disable_tqdm=True) == lm2.loglikelihood_rolling(
        docs, disable_tqdm=True
    )


def test_greedy_and_sampled_generations_are_identical_at_dp1_and_dp2(lm1, lm2):
    greedy = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": False}
    sampled = {"until": ["\n\n"], "max_gen_toks": 12, "do_sample": True, "temperature": 1.0}
    items = [(q, greedy) for q in QUESTIONS] + [(q, sampled) for q in QUESTIONS * 2]
    reqs = [Instance("generate_until", {}, item, i) for i, item in enumerate(items)]
    _reset_seeds(lm1, lm2)
    a = lm1.generate_until(reqs, disable_tqdm=True)
    b = lm2.generate_until(reqs, disable_tqdm=True)
    assert a == b
    n = len(QUESTIONS)
    # Unseeded repeats are seeded by position, not content: the same prompt samples differently.
    assert a[n : 2 * n] != a[2 * n :]
    # And a second run of the same requests continues the counter: new seeds, new samples.
    assert lm2.generate_until(reqs[n:], disable_tqdm=True) != b[n:]


def test_replicas_are_loaded_once_and_reused_by_every_request_type(lm2, ray_cluster):
    actors, pids = list(lm2.engine.actors), [i["pid"] for i in lm2.engine.infos]
    assert len(set(pids)) == 2 and all(i["num_threads"] == 1 for i in lm2.engine.infos)  # 2 cores // 2
    lm2.loglikelihood(_mc()[:5], disable_tqdm=True)
    lm2.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, ("a b c",), 0)], disable_tqdm=True)
    lm2.generate_until([Instance("generate_until", {}, ("Hi", {"max_gen_toks": 2}), 0)], disable_tqdm=True)
    assert lm2.engine.actors == actors
    assert [ray_cluster.get(a.info.remote())["pid"] for a in actors] == pids


def test_prefix_cache_hits_survive_the_split(lm1, lm2):
    def hits(lm):
        m0 = lm.engine.metrics()
        lm.loglikelihood(reqs, disable_tqdm=True)
        m1 = lm.engine.metrics()
        return m1.get("prefix_hit_tokens", 0) - m0.get("prefix_hit_tokens", 0)

    # Fresh contexts (nothing cached yet), two blocks and more each: hits come from sharing in the call.
    pairs = [("Again. " + q + " " + q, c) for q, c in _mc_pairs()]
    reqs = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    h1, h2 = hits(lm1), hits(lm2)
    assert h1 > 0 and h2 >= 0.9 * h1, (h1, h2)


def _mc_pairs():
    return [(q, c) for q in QUESTIONS for c in CHOICES]


# ------------------------------------------------------------------------------------------ routing
def test_route_keeps_shared_prefixes_on_one_replica_and_balances():
    block = 4
    stems = [[100 + q] * 12 for q in range(6)]  # six questions, 3 blocks of context each
    prompts = [stem + [c] for stem in stems for c in range(5)]  # five choices per question
    params = [SamplingParams(max_tokens=1)] * len(prompts)
    shares = route(prompts, params, 2, block)
    assert sorted(i for s in shares for i in s) == list(range(len(prompts)))
    for q in range(6):
        owners = {r for r, s in enumerate(shares) for i in s if i // 5 == q}
        assert len(owners) == 1, f"question {q} split over replicas {owners}"
    assert sorted(map(len, shares)) == [15, 15]  # 3 questions each
    # A stem shared by everything (a few-shot preamble) is split below it, by question.
    shared = [[7] * 8 + p for p in prompts]
    shares = route(shared, params, 2, block)
    assert sorted(map(len, shares)) == [15, 15]
    for q in range(6):
        assert len({r for r, s in enumerate(shares) for i in s if i // 5 == q}) == 1


def test_prefix_groups_stop_when_prompts_cannot_be_told_apart():
    prompts = [[1, 2, 3]] * 4 + [[9]]
    groups = prefix_groups(prompts, [3, 3, 3, 3, 1], block_size=2, cap=1)
    assert groups == [[0, 1, 2, 3], [4]]


# ------------------------------------------------------------------------------------------- seeds
def test_seeds_follow_run_order_not_content():
    assert derive_seed(1234, 0) == derive_seed(1234, 0) != derive_seed(1234, 1) != derive_seed(1235, 1)
    assert all(0 <= derive_seed(s, i) < 2**63 for s in (0, 2**63) for i in range(50))
    seeds = RequestSeeds(1234)
    same = SamplingParams(temperature=1.0)
    out = seeds.assign([same, same, SamplingParams(seed=5)]) + seeds.assign([same])
    assert [p.seed for p in out] == [derive_seed(1234, 0), derive_seed(1234, 1), 5, derive_seed(1234, 3)]
    assert RequestSeeds(None).assign([same])[0].seed is None  # seed=None asked for fresh draws


def test_missing_ray_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)
    with pytest.raises(MissingExtraError, match=r"pip install 'minisgl\[ray\]'"):
        make_engine(EngineConfig(), 2, None, None)


# ----------------------------------------------------------------------------------------- failures
def test_a_second_set_that_does_not_fit_the_cluster_fails_at_once(tiny_model_dir, lm2):
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match="needs 2 x .num_cpus=1"):  # lm2 holds both CPUs
        MiniSGLLM(pretrained=str(tiny_model_dir), data_parallel_size=2, **ENGINE)
    assert time.monotonic() - t0 < 15  # 5 s grace for resources being released, then the error


def test_a_killed_replica_fails_the_call_naming_it(lm2, ray_cluster):
    # Uses (and breaks) the module's replicas: keep it the last test that needs lm2.
    lm = lm2
    try:
        kw = {"until": ["<never>"], "max_gen_toks": 400, "do_sample": True, "temperature": 1.0}
        reqs = [Instance("generate_until", {}, (f"{i} {q}", kw), i) for i, q in enumerate(QUESTIONS * 30)]
        victim = lm.engine.actors[1]
        killed: list[float] = []

        def kill():
            killed.append(time.monotonic())
            ray_cluster.kill(victim)

        timer = threading.Timer(3.0, kill)
        timer.start()
        with pytest.raises(ReplicaFailedError, match="replica 1: its actor died") as err:
            lm.generate_until(reqs, disable_tqdm=True)
        timer.cancel()
        assert killed, "the call finished before the replica was killed: give it more work"
        assert time.monotonic() - killed[0] < KILL_BOUND_S
        assert err.value.replica == 1
        with pytest.raises(ReplicaFailedError):  # the set stays failed: no silent partial service
            lm.generate_until(reqs[:1], disable_tqdm=True)
    finally:
        lm.close()
    assert ray_cluster.is_initialized()  # not the adapter's cluster: still up


def test_a_hung_replica_is_reported_within_replica_timeout(tiny_model_dir, ray_cluster):
    # Runs after the kill test closed lm2, so the cluster's two CPUs are free again.
    lm = MiniSGLLM(pretrained=str(tiny_model_dir), data_parallel_size=2, replica_timeout_s=3, **ENGINE)
    pid = lm.engine.infos[0]["pid"]
    try:
        os.kill(pid, signal.SIGSTOP)  # the actor process stops answering (a hang, not a death)
        kw = {"until": ["\n"], "max_gen_toks": 4}
        reqs = [Instance("generate_until", {}, (f"{i} {q}", kw), i) for i, q in enumerate(QUESTIONS * 2)]
        t0 = time.monotonic()
        with pytest.raises(ReplicaFailedError, match="replica 0: no answer for 3 s"):
            lm.generate_until(reqs, disable_tqdm=True)
        assert time.monotonic() - t0 < 3 + 5
    finally:
        os.kill(pid, signal.SIGCONT)
        lm.close()


def test_adapter_started_cluster_is_shut_down_and_dp1_never_imports_ray(tiny_model_dir):
    code = f"""
import sys
from lm_eval_minisgl.model import MiniSGLLM
lm = MiniSGLLM(pretrained={str(tiny_model_dir)!r}, num_threads=1, dtype="float32")
lm.close()
assert "ray" not in sys.modules, "data_parallel_size=1 imported ray"
lm = MiniSGLLM(pretrained={str(tiny_model_dir)!r}, data_parallel_size=2, dtype="float32")
import ray
assert ray.is_initialized()
assert lm.loglikelihood([], disable_tqdm=True) == []
lm.close()
assert not ray.is_initialized(), "the adapter left its Ray cluster running"
print("OK")
"""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{ROOT / 'adapters'}"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=240
    )
    assert out.returncode == 0 and out.stdout.strip().endswith("OK"), out.stderr[-3000:]
