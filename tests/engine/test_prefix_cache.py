"""Prefix cache: the radix tree over the block state machine, and the engine reusing
shared prompt prefixes without changing any output."""

import pytest

from minisgl_backend import Engine, EngineConfig, SamplingParams
from minisgl_backend.kvcache.block_pool import BlockPool, BlockState
from minisgl_backend.kvcache.prefix_cache import PrefixCache
from minisgl_backend.tools.stress import run_stress

BS = 4


def _written(pool: BlockPool, n: int) -> list[int]:
    blocks = pool.allocate(n)
    for b in blocks:
        pool.write_completed(b)
    return blocks


def test_match_returns_longest_cached_prefix_at_block_granularity():
    pool = BlockPool(8)
    cache = PrefixCache(pool, BS)
    blocks = _written(pool, 3)
    tokens = list(range(12))
    assert cache.insert(tokens, blocks) == 3
    assert [pool.refcount[b] for b in blocks] == [2, 2, 2]  # the owner's and the tree's
    assert cache.match(tokens + [99], 5) == blocks
    assert cache.match(tokens[:7], 5) == blocks[:1]  # a partial block never matches
    assert cache.match(tokens, 2) == blocks[:2]  # capped by the caller's limit
    assert cache.match([0, 1, 2, 9] + tokens[4:], 3) == []  # divergence in the first block
    # A second copy of the same prefix adds nothing; the tree keeps its own blocks.
    assert cache.insert(tokens, _written(pool, 3)) == 0


def test_eviction_takes_lru_unreferenced_leaves_and_fences_them():
    pool = BlockPool(8)
    cache = PrefixCache(pool, BS)
    a, b = _written(pool, 2), _written(pool, 2)
    cache.insert(list(range(8)), a)
    cache.insert(list(range(100, 108)), b)
    pool.release(a + b, fence=0)  # the owners finished: only the tree holds them
    cache.match(list(range(8)), 2)  # `a` is now the most recently used prefix
    held = cache.match(list(range(100, 104)), 1)
    pool.share(held[0])  # a running request reads b's first block
    cache.match(list(range(8)), 2)
    # b[1] is the LRU evictable leaf; b[0] is referenced, so a's leaf goes next, then a's root.
    assert cache.evict(3, fence=7) == 3
    assert pool.state[b[0]] == BlockState.READ_ONLY and pool.refcount[b[0]] == 2
    assert all(pool.state[x] == BlockState.PENDING_RECLAIM for x in (b[1], *a))
    assert pool.retire(6) == 0  # iteration 7 may still read them
    assert pool.retire(7) == 3
    assert cache.evict(5, fence=8) == 0  # b[0] is still read
    assert cache.num_blocks == 1
    pool.check_invariants()


def _tiny(tiny_model_dir, **kw) -> EngineConfig:
    # One thread: the cached runs are compared token for token with uncached ones, and on a loaded
    # machine a float32 forward may change its thread count (and with it its last bits) mid-test.
    base = dict(
        model=str(tiny_model_dir),
        num_blocks=128,
        block_size=BS,
        chunk_size=16,
        seed=3,
        metrics_exact=True,
        num_threads=1,
    )
    return EngineConfig(**{**base, **kw})


STEM = list(range(200, 260))
PROMPTS = [STEM + [400 + i, 500 + i] for i in range(10)] + [STEM[:20] + [7, 8, 9], [11, 12, 13]]
PARAMS = [SamplingParams(temperature=0, max_tokens=6), SamplingParams(temperature=0.8, seed=5, max_tokens=6)]


@pytest.fixture(scope="module")
def no_cache_outputs(tiny_model_dir):
    with Engine(_tiny(tiny_model_dir, prefix_cache="off")) as eng:
        return {
            i: [o.token_ids for o in eng.generate(PROMPTS, p, use_tqdm=False)] for i, p in enumerate(PARAMS)
        }


@pytest.mark.parametrize("mode,overlap", [("sync", True), ("async", True), ("async", False)])
def test_cached_prefixes_change_no_output(tiny_model_dir, no_cache_outputs, mode, overlap):
    with Engine(_tiny(tiny_model_dir, prefix_cache=mode, overlap=overlap)) as eng:
        for rnd in range(2):  # the second round finds every prefix cached
            for i, p in enumerate(PARAMS):
                outs = eng.generate(PROMPTS, p, use_tqdm=False)
                assert [o.token_ids for o in outs] == no_cache_outputs[i], (mode, rnd, i)
        counts = eng.drain(timeout=60)
        m = eng.metrics()
        # Round 1 computes the stem once (the others wait for it); later ones reuse all its blocks.
        assert m["prefix_hits"] >= 4 * len(PROMPTS) - 8, m
        assert m["prefix_hit_tokens"] >= 0.6 * m["prefix_query_tokens"], m
        assert counts["cached"] > 0 and counts["READ_ONLY"] == counts["cached"]
        assert counts["FREE"] + counts["cached"] == eng.num_blocks
        assert eng.drain(timeout=60, flush_cache=True)["FREE"] == eng.num_blocks


def test_prompt_logprobs_are_scored_with_a_cached_context(tiny_model_dir):
    """lm-eval's multiple choice: choices share the question; the scored span is never skipped."""
    question = list(range(300, 341))
    choices = [[50 + i, 60 + i, 70 + i] for i in range(4)]
    params = [
        SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2, prompt_logprobs_start=len(question))
    ]
    prompts = [question + c for c in choices]
    results = {}
    for mode in ("off", "async"):
        with Engine(_tiny(tiny_model_dir, prefix_cache=mode)) as eng:
            outs = eng.generate(prompts, params * len(prompts), use_tqdm=False)
            results[mode] = [[lp.logprob for lp in o.prompt_logprobs[len(question) :]] for o in outs]
            hits = eng.metrics().get("prefix_hit_tokens", 0)
    assert hits >= 3 * 40  # three choices reuse the question's 10 full blocks (the last query row stays)
    for off, on in zip(results["off"], results["async"]):
        assert len(on) == 3 and on == pytest.approx(off, rel=1e-5, abs=1e-5)  # float32 sums in other orders


@pytest.mark.slow
def test_eviction_under_pressure_keeps_every_output_correct(tiny_model_dir):
    """Shared-prefix templates through a 40-block pool: cached blocks are evicted and reused while
    other requests read them; every output still equals its solo, cache-off run."""
    cfg = EngineConfig(
        model=str(tiny_model_dir),
        num_blocks=40,
        block_size=BS,
        chunk_size=4,
        max_num_batched_tokens=64,
        max_num_seqs=4,
        max_model_len=64,
        prefix_cache="async",
    )
    report = run_stress(cfg, 400, num_templates=40, shared_prefixes=True, seed=4)
    assert report.mismatches == 0, report.examples
    assert report.prefix_hit_tokens > 500 and report.prefix_evicted_blocks > 0, report
    assert not report.leaked, report.kv_after_drain


def test_yaml_off_is_off(tmp_path):
    (tmp_path / "c.yaml").write_text("prefix_cache: off\n")  # YAML 1.1 reads a bare off as false
    assert EngineConfig.from_yaml(tmp_path / "c.yaml").prefix_cache == "off"
    with pytest.raises(Exception, match="prefix_cache must be"):
        EngineConfig(prefix_cache="radix")


def test_deterministic_mode_makes_cached_prefixes_bitwise_invisible(tiny_model_dir):
    """With the batch-invariant forward, K/V computed in another request's chunks equal our own to
    the bit: token ids and every logprob are identical with and without the cache."""
    params = SamplingParams(temperature=0.8, seed=9, max_tokens=6, logprobs=0)
    results, hits = {}, 0
    for mode in ("off", "sync", "async"):
        with Engine(_tiny(tiny_model_dir, prefix_cache=mode, deterministic=True)) as eng:
            outs = eng.generate(PROMPTS, params, use_tqdm=False)
            results[mode] = [(o.token_ids, [lp.logprob for lp in o.logprobs]) for o in outs]
            hits += eng.metrics().get("prefix_hit_tokens", 0)
    assert hits > 0
    assert results["sync"] == results["off"] and results["async"] == results["off"]
