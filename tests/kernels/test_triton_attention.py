"""The Triton attention kernels (model/triton_attention.py), on the CPU under Triton's interpreter
(on a GPU machine, on the GPU): paged decode and prefill/extend attention against the model's own
torch reference (layers.eager_attention over KVCache.gather, masked by chunk_mask), the kernels
behind the model's attention back-end, and an engine whose every attention runs them, against the
CPU engine on the layouts its scheduler produces.

Shapes are tiny: the interpreter runs each program of a launch in Python."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from minisgl_backend.arith import cdiv

if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed (pip install triton, or `make setup`)", allow_module_level=True)

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    # Triton reads it when triton.language and the kernels are first imported: set before both.
    os.environ["TRITON_INTERPRET"] = "1"

from minisgl_backend import SamplingParams  # noqa: E402
from minisgl_backend.iteration import PrefillChunk  # noqa: E402
from minisgl_backend.kvcache.storage import KVCache  # noqa: E402
from minisgl_backend.model import triton_attention as ta  # noqa: E402
from minisgl_backend.model.batch import ForwardBatch, chunk_mask, row_tables  # noqa: E402
from minisgl_backend.model.layers import eager_attention  # noqa: E402
from tests.helpers import drained_engine, model_spec, token_prompts  # noqa: E402

pytestmark = pytest.mark.gpu_sim
DEV = "cuda" if ON_GPU else "cpu"
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pool(blocks: int, bs: int, kvh: int, d: int, dtype: torch.dtype, seed: int) -> KVCache:
    kv = KVCache(1, blocks, bs, kvh, d, dtype, DEV)
    g = _gen(seed)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g).to(dtype))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g).to(dtype))
    return kv


def _tables(lengths: list[int], bs: int, blocks: int, seed: int) -> list[torch.Tensor]:
    """Disjoint, shuffled block ids per sequence (as the block pool hands them out after churn)."""
    perm = torch.randperm(blocks, generator=_gen(seed))
    out, used = [], 0
    for n in lengths:
        nb = cdiv(n, bs)
        out.append(perm[used : used + nb])
        used += nb
    assert used <= blocks, "the test's pool is too small for its sequences"
    return out


def _padded(tables: list[torch.Tensor]) -> torch.Tensor:
    """[T, width] zero-padded, as the scheduler pads decode block tables (with block 0)."""
    width = max(t.shape[0] for t in tables)
    return torch.stack([torch.cat([t, t.new_zeros(width - t.shape[0])]) for t in tables])


def _reference(q, kv, table, ctx_len, length, scale, window, cap):
    """The model's torch attention for `length` query rows at positions ctx_len - length ..
    ctx_len - 1 over the keys 0..ctx_len-1 of `table`: KVCache.gather, chunk_mask, eager_attention,
    in float64 (the reference is exact; the kernels round once, at the end)."""
    kr, vr = kv.gather(0, table.to(kv.k[0].device))
    kr, vr = kr[:ctx_len].double().cpu(), vr[:ctx_len].double().cpu()
    chunk = PrefillChunk(0, length, ctx_len, table.cpu())
    mask = chunk_mask(chunk, window)
    qr = q.double().cpu().transpose(0, 1)[None]
    o = eager_attention(qr, kr.transpose(0, 1)[None], vr.transpose(0, 1)[None], mask, scale, cap)
    return o[0].transpose(0, 1)


CASES = [(None, None), (5, None), (None, 30.0), (6, 2.0)]
CASE_IDS = ["full", "window5", "softcap30", "window6-softcap2"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window,cap", CASES, ids=CASE_IDS)
def test_decode_matches_the_torch_reference(dtype, window, cap):
    """Ragged decode rows (contexts of 1 to 23 keys, block size 4, GQA 3 query heads per KV head)
    through zero-padded tables: each row equals its context's reference."""
    bs, kvh, group, d = 4, 2, 3, 16
    h = kvh * group
    kv = _pool(48, bs, kvh, d, dtype, seed=1)
    ctx = [1, 4, 5, 9, 16, 23]
    tables = _tables(ctx, bs, 48, seed=2)
    q = torch.randn(len(ctx), h, d, generator=_gen(3)).to(dtype).to(DEV)
    pos = torch.tensor([n - 1 for n in ctx], device=DEV)
    scale = d**-0.5
    out = ta.paged_decode_attention(
        q, kv.k[0], kv.v[0], _padded(tables).to(DEV), pos, scale, window, cap, block_n=16
    )
    assert out.dtype == dtype and out.shape == q.shape
    for i, n in enumerate(ctx):
        ref = _reference(q[i : i + 1], kv, tables[i], n, 1, scale, window, cap)
        err = (out[i : i + 1].double().cpu() - ref).abs().max().item()
        assert err < TOL[dtype], f"row {i} (context {n}): max error {err}"


@pytest.mark.parametrize("bs,block_n", [(1, 16), (4, 16), (16, 16), (32, 16)])
def test_decode_tiles_cross_block_boundaries(bs, block_n):
    """A key tile spans several blocks (bs < tile), exactly one, or part of one (bs > tile); the
    contexts end on either side of a block boundary and of a tile boundary."""
    kvh, group, d = 1, 4, 16
    kv = _pool(128, bs, kvh, d, torch.float32, seed=4)
    ctx = sorted({bs, bs + 1, 2 * bs - 1, block_n, block_n + 1, 33})
    tables = _tables(ctx, bs, 128, seed=5)
    q = torch.randn(len(ctx), kvh * group, d, generator=_gen(6)).to(DEV)
    pos = torch.tensor([n - 1 for n in ctx], device=DEV)
    out = ta.paged_decode_attention(
        q, kv.k[0], kv.v[0], _padded(tables).to(DEV), pos, 0.25, None, None, block_n=block_n
    )
    for i, n in enumerate(ctx):
        ref = _reference(q[i : i + 1], kv, tables[i], n, 1, 0.25, None, None)
        assert (out[i : i + 1].double().cpu() - ref).abs().max() < TOL[torch.float32], f"context {n}"


def test_decode_rows_by_table_from_strided_views_at_odd_shapes():
    """Rows named by a row table (several rows of one sequence, as the last layer's kept rows are),
    read from a strided view (q is a view into the qkv projection): the same bits as the contiguous
    rows, and right for a head dim (24) and group (3) that are not powers of two."""
    bs, kvh, group, d = 4, 2, 3, 24
    h = kvh * group
    kv = _pool(40, bs, kvh, d, torch.float32, seed=7)
    tables = _tables([30, 11], bs, 40, seed=8)
    row_table = torch.tensor([0, 0, 1, 0], device=DEV)
    pos = torch.tensor([3, 29, 10, 16], device=DEV)
    q = torch.randn(4, h, d, generator=_gen(9)).to(DEV)
    wide = torch.cat([q.flatten(1), torch.randn(4, 5, device=DEV)], dim=1)
    strided = wide[:, : h * d].view(4, h, d)
    assert not strided.is_contiguous()
    padded = _padded(tables).to(DEV)
    out = ta.paged_decode_attention(q, kv.k[0], kv.v[0], padded, pos, 0.3, None, None, row_table, block_n=16)
    again = ta.paged_decode_attention(
        strided, kv.k[0], kv.v[0], padded, pos, 0.3, None, None, row_table, block_n=16
    )
    assert torch.equal(out, again)
    for i in range(4):
        t, p = int(row_table[i]), int(pos[i])
        ref = _reference(q[i : i + 1], kv, tables[t], p + 1, 1, 0.3, None, None)
        assert (out[i : i + 1].double().cpu() - ref).abs().max() < TOL[torch.float32], f"row {i}"


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
def test_decode_reads_no_key_outside_a_rows_span(window):
    """NaN in every key and value a row must not see (past its position, in the padded tail of its
    table's last block, before its window) leaves its output as it was: those slots are never read
    (a masked score still multiplies its value, so a read would spread the NaN)."""
    bs, kvh, d = 4, 2, 16
    kv = _pool(32, bs, kvh, d, torch.float32, seed=10)
    ctx = [6, 13]
    tables = _tables([16, 16], bs, 32, seed=11)  # each table holds 16 slots, more than its context
    q = torch.randn(2, 4, d, generator=_gen(12)).to(DEV)
    pos = torch.tensor([n - 1 for n in ctx], device=DEV)
    padded = _padded(tables).to(DEV)
    clean = ta.paged_decode_attention(q, kv.k[0], kv.v[0], padded, pos, 0.25, window, None, block_n=16)
    for t, n in zip(tables, ctx):
        for j in range(16):
            if j >= n or (window is not None and j <= n - 1 - window):
                kv.k[0][t[j // bs], j % bs] = float("nan")
                kv.v[0][t[j // bs], j % bs] = float("nan")
    out = ta.paged_decode_attention(q, kv.k[0], kv.v[0], padded, pos, 0.25, window, None, block_n=16)
    assert torch.equal(out, clean)


def _chunk_batch(dtype, seed):
    """Three prompt chunks flattened into one batch (rows 0..), as the scheduler lays them out: a
    first chunk (no prefix), a later chunk whose prefix ends inside a block, and a later chunk that
    starts on a block boundary and spans several query tiles; lengths not multiples of the tile."""
    bs, kvh, group, d = 4, 2, 2, 16
    h = kvh * group
    kv = _pool(64, bs, kvh, d, dtype, seed)
    specs = [(0, 11), (7, 9), (20, 37)]  # (prefix, length)
    tables = _tables([p + n for p, n in specs], bs, 64, seed + 1)
    chunks, start = [], 0
    for (prefix, length), table in zip(specs, tables):
        chunks.append(PrefillChunk(start, length, prefix + length, table.to(DEV)))
        start += length
    q = torch.randn(start, h, d, generator=_gen(seed + 2)).to(dtype).to(DEV)
    return kv, chunks, q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("window,cap", CASES, ids=CASE_IDS)
def test_prefill_matches_the_torch_reference(dtype, window, cap):
    kv, chunks, q = _chunk_batch(dtype, seed=20)
    scale = q.shape[-1] ** -0.5
    out = torch.full_like(q, float("nan"))
    for c in chunks:
        ta.paged_prefill_attention(
            q, kv.k[0], kv.v[0], c.block_table, c.start, c.length, c.ctx_len, scale, window, cap, out, 16, 16
        )
    for c in chunks:
        rows = slice(c.start, c.start + c.length)
        ref = _reference(q[rows], kv, c.block_table, c.ctx_len, c.length, scale, window, cap)
        err = (out[rows].double().cpu() - ref).abs().max().item()
        assert err < TOL[dtype], f"chunk {c.start}:{c.length} (context {c.ctx_len}): max error {err}"


@pytest.mark.parametrize("window", [None, 6], ids=["full", "window6"])
def test_prefill_skips_tiles_no_query_of_a_tile_sees(window):
    """A query tile reads no key past its last query's position (the causal blocks above the
    diagonal) and, in a sliding-window layer, none before its first query's window: NaN there leaves
    the tile's rows as they were, and reaches only the rows that do see those keys."""
    kv, chunks, q = _chunk_batch(torch.float32, seed=30)
    c = chunks[2]  # prefix 20, 37 rows: tiles of 16 rows at positions 20-35, 36-51, 52-56
    scale = 0.25

    def run() -> torch.Tensor:
        out = torch.zeros_like(q)
        return ta.paged_prefill_attention(
            q, kv.k[0], kv.v[0], c.block_table, c.start, c.length, c.ctx_len, scale, window, None, out, 16, 16
        )[c.start : c.start + c.length]

    clean = run()
    table, bs = c.block_table, kv.block_size
    poisoned = [36] if window is None else [20]  # the first key past tile 0 / before tile 2's window
    for j in poisoned:
        kv.k[0][table[j // bs], j % bs] = float("nan")
        kv.v[0][table[j // bs], j % bs] = float("nan")
    out = run()
    if window is None:
        assert torch.equal(out[:16], clean[:16]), "tile 0 read a key past its last query"
        assert out[16].isnan().any(), "the query at the poisoned position must see it"
    else:
        assert torch.equal(out[32:], clean[32:]), "tile 2 read a key before its first query's window"
        assert out[0].isnan().any(), "the query at the poisoned position must see it"


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window5"])
def test_backend_matches_the_cpu_attention_on_a_mixed_batch(window):
    """Attention.forward over the Triton back-end against the CPU paths (the native paged kernel,
    and the torch gather + SDPA path) on one mixed batch: three decode rows, then a first and a later
    prompt chunk; every row, and the kept rows of a last layer."""
    from minisgl_backend.model.layers import Attention
    from minisgl_backend.model.llama import build_rotary

    spec = model_spec(sliding_window=window)
    attn = Attention(spec, 0)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    bs, kvh, d = 4, spec.num_kv_heads, spec.head_dim
    kv = _pool(40, bs, kvh, d, torch.float32, seed=40)
    ctx = [3, 9, 14]  # decode rows: contexts including the new token
    chunk_specs = [(0, 7), (10, 6)]  # (prefix, length)
    tables = _tables(ctx + [p + n for p, n in chunk_specs], bs, 40, seed=41)
    positions, slots, chunks, start = [], [], [], len(ctx)
    for n, t in zip(ctx, tables):
        positions.append(n - 1)
        slots.append(int(t[(n - 1) // bs]) * bs + (n - 1) % bs)
    for (prefix, length), t in zip(chunk_specs, tables[len(ctx) :]):
        chunks.append(PrefillChunk(start, length, prefix + length, t))
        for p in range(prefix, prefix + length):
            positions.append(p)
            slots.append(int(t[p // bs]) * bs + p % bs)
        start += length
    n = len(positions)
    pos = torch.tensor(positions, device=DEV)
    dec_tables = _padded(tables[: len(ctx)]).to(DEV)
    keys = torch.arange(dec_tables.shape[1] * bs, device=DEV)
    batch = ForwardBatch(
        input_ids=torch.zeros(n, dtype=torch.int64, device=DEV),
        positions=pos,
        slot_mapping=torch.tensor(slots, device=DEV),
        num_decode=len(ctx),
        decode_block_tables=dec_tables,
        decode_mask=(keys[None, :] <= pos[: len(ctx), None])[:, None, None, :],
        prefill_chunks=tuple(c._replace(block_table=c.block_table.to(DEV)) for c in chunks),
        logits_index=torch.tensor([0, 2, 9, n - 1], device=DEV),
    )
    attn = attn.to(DEV)
    x = torch.randn(n, spec.hidden_size, generator=_gen(42)).to(DEV)
    rope = build_rotary(spec).to(DEV)[0](pos, torch.float32)
    from minisgl_backend.model.batch import decode_window

    with torch.no_grad():
        masks = [chunk_mask(c, window) for c in batch.prefill_chunks]
        plain = attn(x, rope, batch, kv, masks, decode_window(batch, window, bs))
        triton_out = attn(x, rope, batch, kv, [], None, backend=ta.TritonAttention())
        kept = attn(x, rope, batch, kv, [], None, keep=batch.logits_index, backend=ta.TritonAttention())
        from minisgl_backend.model import cpu_kernels

        # The native paged kernel runs on the CPU only, and only where it is built (the device check
        # runs these tests on a machine with the tracker alone).
        if not ON_GPU and cpu_kernels.available():
            native = attn(x, rope, batch, kv, [], None, rows=row_tables(batch))
            assert (triton_out - native).abs().max() < 1e-5
    assert (triton_out - plain).abs().max() < 1e-5
    assert torch.equal(kept, triton_out[batch.logits_index])


def test_the_backend_is_chosen_once_at_load(monkeypatch):
    """On the CPU the default keeps the CPU paths (the layer loop under the native layer stack);
    MINISGL_ATTENTION=triton puts the kernels under every layer; torch keeps them off; anything else
    is refused."""
    from minisgl_backend.errors import ConfigError
    from minisgl_backend.model import cpu_kernels
    from minisgl_backend.model.layer_stack import LayerStackForward
    from minisgl_backend.model.layers import PagedAttention, TorchAttention
    from minisgl_backend.model.llama import CausalLM, LayerLoop
    from minisgl_backend.model.loader import attention_backend, forward_strategy

    model = CausalLM(model_spec())
    cpu_default = PagedAttention if cpu_kernels.available() else TorchAttention
    monkeypatch.delenv("MINISGL_ATTENTION", raising=False)
    assert isinstance(attention_backend(model), cpu_default)
    default = forward_strategy(model, deterministic=False)
    assert isinstance(default, LayerStackForward) and isinstance(default.inner.attention, cpu_default)
    monkeypatch.setenv("MINISGL_ATTENTION", "torch")
    assert isinstance(attention_backend(model), cpu_default)
    monkeypatch.setenv("MINISGL_ATTENTION", "triton")
    forced = forward_strategy(model, deterministic=False)
    assert isinstance(forced, LayerLoop) and isinstance(forced.attention, ta.TritonAttention)
    monkeypatch.setenv("MINISGL_ATTENTION", "flash")
    with pytest.raises(ConfigError, match="MINISGL_ATTENTION"):
        attention_backend(model)


@pytest.mark.skipif(ON_GPU, reason="compares against the CPU engine")
def test_an_engine_on_the_kernels_matches_the_cpu_engine(tiny_model_dir, monkeypatch):
    """The whole engine with every attention on the Triton kernels (the interpreter) against the CPU
    engine, on what its scheduler lays out: ragged prompts in chunks of 8 over blocks of 4, decode
    rows mixed with later chunks, 5 new tokens each. The same greedy tokens, and logprobs within
    float32 noise."""
    cfg = dict(
        dtype="float32",
        num_blocks=128,
        block_size=4,
        chunk_size=8,
        max_num_batched_tokens=24,
        max_model_len=64,
        num_threads=1,
        stats_interval_s=0,
    )
    prompts = token_prompts(4)
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=0)

    def run() -> list:
        with drained_engine(tiny_model_dir, **cfg) as eng:
            return eng.generate(prompts, params, use_tqdm=False)

    monkeypatch.delenv("MINISGL_ATTENTION", raising=False)
    cpu = run()
    monkeypatch.setenv("MINISGL_ATTENTION", "triton")
    kernels = run()
    assert all(o.logprobs and len(o.token_ids) == 5 for o in cpu + kernels)
    for a, b in zip(cpu, kernels):
        assert a.token_ids == b.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < 1e-4
