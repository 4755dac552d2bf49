"""The host logic of CUDA-graph decode (executor/graphs.py), run eagerly on the CPU: decode batches of
ragged sizes through their bucket's static buffers give the logits of the same batch run as it is,
and the padding rows write only the padding block.

Bitwise under the batch-invariant forward (its rows do not depend on the row count); within a
tolerance under the default forward, whose linears' bits depend on the row count of the call."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from minisgl_backend.executor.graphs import DecodeGraphs, decode_buckets
from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.model.batch import ForwardBatch
from minisgl_backend.model.llama import CausalLM, LayerLoop, build_rotary
from minisgl_backend.model.loader import forward_strategy
from tests.helpers import model_spec

pytestmark = pytest.mark.gpu_sim

BLOCK, MAX_BLOCKS, REAL_BLOCKS = 4, 6, 48
PAD = REAL_BLOCKS  # the pool's last block: no request's


def test_buckets() -> None:
    assert decode_buckets(1) == [1]
    assert decode_buckets(6) == [1, 2, 4, 6]
    assert decode_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert decode_buckets(20) == [1, 2, 4, 8, 16, 20]
    with pytest.raises(ValueError, match="max_num_seqs"):
        decode_buckets(0)


def _model(**spec_over) -> CausalLM:
    spec = model_spec(num_layers=2, vocab_size=64, **spec_over)
    torch.manual_seed(0)
    model = CausalLM(spec)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.3 + (1.0 if p.dim() == 1 else 0.0))
    model.model.rotary = build_rotary(spec)
    return model.eval()


def _kv(model: CausalLM) -> KVCache:
    s = model.spec
    kv = KVCache(s.num_layers, REAL_BLOCKS + 1, BLOCK, s.num_kv_heads, s.head_dim, torch.float32, "cpu")
    g = torch.Generator().manual_seed(1)
    for t in (*kv.k, *kv.v):
        t.copy_(torch.randn(t.shape, generator=g))
    return kv


def _decode_batch(n: int, seed: int) -> ForwardBatch:
    """n decode rows with ragged contexts, each over its own blocks (block 0 included: a real
    request's block, so padding rows that wrote it would be caught)."""
    g = torch.Generator().manual_seed(seed)
    ctx = torch.randint(1, MAX_BLOCKS * BLOCK + 1, (n,), generator=g)
    nb = int(-(-int(ctx.max()) // BLOCK))
    blocks = torch.randperm(REAL_BLOCKS, generator=g)[: n * MAX_BLOCKS].view(n, MAX_BLOCKS)
    tables = torch.zeros(n, nb, dtype=torch.int64)  # padded with block 0, as the scheduler does
    for i, c in enumerate(ctx.tolist()):
        used = -(-c // BLOCK)
        tables[i, :used] = blocks[i, :used]
    pos = ctx - 1
    slots = tables[torch.arange(n), pos // BLOCK] * BLOCK + pos % BLOCK
    mask = (torch.arange(nb * BLOCK)[None, :] < ctx[:, None])[:, None, None, :]
    return ForwardBatch(
        input_ids=torch.randint(0, 64, (n,), generator=g),
        positions=pos,
        slot_mapping=slots,
        num_decode=n,
        decode_block_tables=tables,
        decode_mask=mask,
        prefill_chunks=(),
        logits_index=torch.arange(n),
    )


# Sizes in an order that reuses buckets with fewer rows than before (stale rows must be re-padded).
SIZES = [5, 3, 8, 1, 7, 2, 4, 6]


def _check(model: CausalLM, exact: bool) -> None:
    kv_plain = _kv(model)
    graphs = DecodeGraphs(model, _kv(model), decode_buckets(8), MAX_BLOCKS, PAD)
    for i, n in enumerate(SIZES):
        batch = _decode_batch(n, seed=i)
        assert graphs.bucket_for(batch) == next(b for b in (1, 2, 4, 8) if b >= n)
        before = [t.clone() for t in (*graphs.kv.k, *graphs.kv.v)]
        want = model(batch, kv_plain)
        got = graphs.run(batch)
        if exact:
            assert torch.equal(got, want), n
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        # Slots written by this step: the batch's own and the padding block's, nothing else.
        allowed = set(batch.slot_mapping.tolist()) | set(range(PAD * BLOCK, (PAD + 1) * BLOCK))
        for old, new in zip(before, (*graphs.kv.k, *graphs.kv.v)):
            changed = (old != new).flatten(2).any(-1).view(-1).nonzero().flatten().tolist()
            assert set(changed) <= allowed, (n, sorted(set(changed) - allowed))
    # Every real block of both pools agrees: the padding rows touched no request's KV.
    for a, b in zip((*kv_plain.k, *kv_plain.v), (*graphs.kv.k, *graphs.kv.v)):
        torch.testing.assert_close(a[:PAD], b[:PAD], rtol=0 if exact else 1e-4, atol=0 if exact else 1e-4)


def test_buckets_match_the_plain_forward_bitwise_under_the_batch_invariant_forward() -> None:
    model = _model()
    model.forward_strategy = forward_strategy(model, deterministic=True)
    _check(model, exact=True)


@pytest.mark.parametrize("spec", [{}, dict(sliding_window=6, attn_softcap=20.0)], ids=["plain", "window"])
def test_buckets_match_the_plain_forward_under_the_default_forward(spec) -> None:
    model = _model(**spec)
    model.forward_strategy = forward_strategy(model, deterministic=False)
    _check(model, exact=False)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")
def test_buckets_match_the_plain_forward_on_the_triton_decode_kernel() -> None:
    """The attention a GPU runs (under Triton's interpreter here)."""
    from minisgl_backend.model.triton_attention import TritonAttention

    model = _model()
    model.forward_strategy = LayerLoop(TritonAttention())
    kv_plain = _kv(model)
    graphs = DecodeGraphs(model, _kv(model), [2, 4], MAX_BLOCKS, PAD)
    for i, n in enumerate([3, 1]):
        batch = _decode_batch(n, seed=10 + i)
        torch.testing.assert_close(graphs.run(batch), model(batch, kv_plain), rtol=1e-5, atol=1e-5)


def test_batches_that_fit_no_bucket_are_left_to_the_eager_forward() -> None:
    model = _model()
    graphs = DecodeGraphs(model, _kv(model), [1, 2, 4], MAX_BLOCKS, PAD)
    assert graphs.bucket_for(_decode_batch(5, 0)) is None  # more rows than the largest bucket
    wide = _decode_batch(2, 0)
    wide = wide._replace(decode_block_tables=torch.zeros(2, MAX_BLOCKS + 1, dtype=torch.int64))
    assert graphs.bucket_for(wide) is None
    mixed = _decode_batch(2, 0)._replace(num_decode=1)
    assert graphs.bucket_for(mixed) is None
    with pytest.raises(ValueError, match="bucket_for"):
        graphs.run(mixed)
    with pytest.raises(ValueError, match="pad_block"):
        DecodeGraphs(model, _kv(model), [1], MAX_BLOCKS, REAL_BLOCKS + 1)


def test_cuda_graphs_are_on_by_default_on_a_gpu_and_refused_on_a_cpu() -> None:
    """Unset, they are on for a CUDA device (also for a CPU config replaced onto one) and off on a
    CPU; false turns them off on a GPU; true on a CPU is a ConfigError."""
    from minisgl_backend.config import EngineConfig
    from minisgl_backend.errors import ConfigError

    assert not EngineConfig().cuda_graphs
    assert EngineConfig(device="cuda").cuda_graphs is True
    assert EngineConfig().replace(device="cuda").cuda_graphs is True
    assert EngineConfig(device="cuda", cuda_graphs=False).cuda_graphs is False
    with pytest.raises(ConfigError, match="cuda_graphs: true needs device: cuda"):
        EngineConfig(cuda_graphs=True)
