"""The last layer runs past its K/V only for the rows that need logits (DecoderLayer.forward's `keep`):
the logits of those rows and every K/V the batch writes are the same bits as when every row of the
batch asks for logits, on mixed batches (decode rows and prefill chunks, first and later chunks),
for the default and the deterministic forward, under every kernel family this machine runs. The
default forward is checked where its linears are row-invariant (packed, or the avx2 family's kernel);
elsewhere it makes no such promise (oneDNN's bits depend on the row count), and the deterministic one
does."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from minisgl_backend.arith import cdiv
from minisgl_backend.iteration import PrefillChunk
from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.model import cpu_kernels
from minisgl_backend.model.batch import ForwardBatch
from minisgl_backend.model.llama import CausalLM
from minisgl_backend.model.loader import forward_strategy
from tests.helpers import model_spec, random_bf16_model

BLOCK = 4
FAMILIES = [f for f in cpu_kernels.FAMILIES if cpu_kernels.runs_family(f)]


def _model(deterministic: bool) -> CausalLM:
    spec = model_spec(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3, head_dim=32)
    model = random_bf16_model(spec)
    model.pack_weights()
    model.forward_strategy = forward_strategy(model, deterministic)
    return model


def _batch(step: int, tables: torch.Tensor, all_rows: bool) -> ForwardBatch:
    """Step 0: first chunks of sequences 0 (10 of 13 tokens) and 1 (whole, 7 tokens). Step 1: a
    decode row of sequence 1, the last 3 tokens of sequence 0, and the whole of sequence 2 (9)."""
    decode = [] if step == 0 else [(1, 7)]  # (sequence, position)
    chunks = [(0, 0, 10), (1, 0, 7)] if step == 0 else [(0, 10, 13), (2, 0, 9)]  # (sequence, from, to)
    final = {1: 7, 0: 13, 2: 9}  # prompt lengths: a chunk ending there needs its last row's logits
    pos = torch.cat(
        [torch.tensor([p for _, p in decode], dtype=torch.int64)] + [torch.arange(a, b) for _, a, b in chunks]
    )
    row_seq = torch.tensor([s for s, _ in decode] + [s for s, a, b in chunks for _ in range(a, b)])
    slots = tables[row_seq, pos // BLOCK] * BLOCK + pos % BLOCK
    ids = torch.randint(0, 96, (len(pos),), generator=torch.Generator().manual_seed(step))
    b = len(decode)
    dec_tables = dec_mask = None
    if b:
        dec_tables = tables[[s for s, _ in decode]]
        keys = torch.arange(dec_tables.shape[1] * BLOCK)
        dec_mask = (keys[None, :] <= pos[:b, None])[:, None, None, :]
    parts, want, start = [], list(range(b)), b
    for s, a, e in chunks:
        parts.append(PrefillChunk(start, e - a, e, tables[s][: cdiv(e, BLOCK)]))
        if e == final[s]:
            want.append(start + e - a - 1)
        start += e - a
    index = torch.arange(len(pos)) if all_rows else torch.tensor(want)
    return ForwardBatch(ids, pos, slots, b, dec_tables, dec_mask, tuple(parts), index)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("family", FAMILIES)
def test_logit_rows_and_kv_are_the_bits_of_the_full_last_layer(family, deterministic):
    with cpu_kernels.family_override(family):
        # linears whose kernel takes every row count (packed, or the avx2 family's): elsewhere few rows
        # take another kernel than many, and only the deterministic forward is row-invariant
        if not deterministic and not (cpu_kernels.packs() or cpu_kernels.kernel_row_limit() is None):
            pytest.skip(f"the default forward under {family} is not row-invariant: nothing to compare")
        model = _model(deterministic)
        s = model.spec
        tables = torch.arange(3 * 4).view(3, 4)  # 3 sequences x 4 blocks of 4 slots
        caches = [
            KVCache(s.num_layers, 12, BLOCK, s.num_kv_heads, s.head_dim, torch.bfloat16, "cpu")
            for _ in range(2)
        ]
        for step in range(2):
            full = model(_batch(step, tables, all_rows=True), caches[0])
            wanted = _batch(step, tables, all_rows=False)
            kept = model(wanted, caches[1])
            assert kept.shape[0] == wanted.logits_index.numel() < full.shape[0]
            assert torch.equal(kept, full[wanted.logits_index]), f"step {step}: logits differ"
            for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
                assert torch.equal(a, b), f"step {step}: the K/V written differ"


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("family", FAMILIES)
def test_deferred_residual_adds_give_the_bits_of_whole_layers(family, deterministic, monkeypatch):
    """DecoderLayers.run hands each layer's MLP output to the next layer's input norm, which adds it
    as it reads the rows: logits and every K/V written are the same bits as layer after layer, each
    adding its own MLP output, on mixed batches (decode rows, first and later chunks)."""
    from minisgl_backend.model.layers import DecoderLayers

    def whole_layers(self, x, attend, keep):
        for layer in self[:-1]:
            x = layer(x, attend)
        return self[-1](x, attend, keep)

    with cpu_kernels.family_override(family):
        model = _model(deterministic)
        s = model.spec
        tables = torch.arange(3 * 4).view(3, 4)
        caches = [
            KVCache(s.num_layers, 12, BLOCK, s.num_kv_heads, s.head_dim, torch.bfloat16, "cpu")
            for _ in range(2)
        ]
        for step in range(2):
            deferred = model(_batch(step, tables, all_rows=False), caches[0])
            with monkeypatch.context() as m:
                m.setattr(DecoderLayers, "run", whole_layers)
                whole = model(_batch(step, tables, all_rows=False), caches[1])
            assert torch.equal(deferred, whole), f"step {step}: logits differ"
            for a, b in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
                assert torch.equal(a, b), f"step {step}: the K/V written differ"


def test_prefill_forward_runs_the_linear_work_the_peers_bench_counts():
    """bench/peers.prefill_gflop (the `minisgl bench --scenario peers` compute roof line) against the
    multiply-adds the forward's linears actually run, counted by a hook on every Linear call: the
    last layer takes only the logit rows past its qkv_proj."""
    from minisgl_backend.bench.peers import prefill_gflop
    from minisgl_backend.model.layers import Linear

    model = _model(deterministic=False)
    # The layer loop, whose Linear calls the hooks see: the native layer stack, which runs the same
    # linears on the same rows (tests/kernels/test_layer_stack.py), calls them from one native call.
    model.forward_strategy = getattr(model.forward_strategy, "inner", model.forward_strategy)
    s = model.spec
    n, length = 2, 9
    counted = []
    hooks = [
        m.register_forward_hook(
            lambda mod, inp, out: counted.append(2 * inp[0].shape[0] * mod.weight.numel())
        )
        for m in model.modules()
        if isinstance(m, Linear)
    ]
    kv = KVCache(s.num_layers, 12, BLOCK, s.num_kv_heads, s.head_dim, torch.bfloat16, "cpu")
    tables = torch.arange(12).view(2, 6)
    pos = torch.cat([torch.arange(length)] * n)
    slots = torch.cat(
        [tables[i][torch.arange(length) // BLOCK] * BLOCK + torch.arange(length) % BLOCK for i in range(n)]
    )
    chunks = tuple(
        PrefillChunk(i * length, length, length, tables[i][: cdiv(length, BLOCK)]) for i in range(n)
    )
    ids = torch.randint(0, 96, (n * length,), generator=torch.Generator().manual_seed(0))
    model(
        ForwardBatch(ids, pos, slots, 0, None, None, chunks, torch.tensor([length - 1, 2 * length - 1])), kv
    )
    for h in hooks:
        h.remove()
    h, d = s.num_heads, s.head_dim
    attention = n * 4 * h * d * ((s.num_layers - 1) * length * (length + 1) // 2 + length)
    # The MLP's gate/up runs as linear_packed_silu where packed, outside Linear.forward's hook.
    gate_up = 2 * s.hidden_size * 2 * s.intermediate_size * n * ((s.num_layers - 1) * length + 1)
    unhooked = gate_up if model.model.layers[0].mlp.gate_up_proj.gated else 0
    assert (sum(counted) + unhooked + attention) / 1e9 == pytest.approx(
        prefill_gflop(s, n, length), rel=1e-12
    )


def test_peers_bench_roof_is_the_gate_up_call_and_its_best_probe(monkeypatch):
    """bench/peers.LinearRoof, the compute roof `minisgl bench --scenario peers` sets the prefill
    against: one probe's GFLOP are those of the model's gate/up projection (counted as above), and
    the roof is the fastest of the probes taken beside the runs, never the latest or the first."""
    from minisgl_backend.bench import peers

    s = _model(deterministic=False).spec
    roof = peers.LinearRoof(s, rows=8)
    counted = []
    roof.lin.register_forward_hook(
        lambda mod, inp, out: counted.append(2 * inp[0].shape[0] * mod.weight.numel())
    )
    roof.probe(repeat=1)
    assert counted and roof.gflop == counted[0] / 1e9
    assert roof.lin.weight.shape == (2 * s.intermediate_size, s.hidden_size)
    roof = peers.LinearRoof(s, rows=8)
    ticks = iter([0.0, 0.2, 1.0, 1.1, 2.0, 2.4])  # calls of 0.2 s, 0.1 s, 0.4 s
    real, me = time.perf_counter, threading.get_ident()
    # The clock is the time module's own: other threads still running (an engine of an earlier
    # test on its way out) keep the real one and take no tick.
    monkeypatch.setattr(
        peers.time, "perf_counter", lambda: next(ticks) if threading.get_ident() == me else real()
    )
    rates = [roof.probe(repeat=1) for _ in range(3)]
    assert rates[1] == max(rates) and abs(roof.best - roof.gflop / 0.1) < 1e-9 * roof.best


def test_peers_bench_roof_runs_no_more_rows_than_one_mlp_piece(monkeypatch):
    """The roof times the gate/up projection at most at the rows the MLP runs in one piece: past
    MLP_PIECE_BYTES its output would come from freshly zeroed pages on every call (about 7% of a
    1B-shaped gate/up at 1024 rows), a cost the engine never pays, and the roof would sit low."""
    from minisgl_backend.bench import peers

    s = _model(deterministic=False).spec
    piece_rows = 5
    monkeypatch.setattr(peers, "MLP_PIECE_BYTES", piece_rows * 2 * s.intermediate_size * 2)
    assert peers.LinearRoof(s, rows=8).x.shape[0] == piece_rows
    assert peers.LinearRoof(s, rows=3).x.shape[0] == 3


@pytest.mark.parametrize("family", FAMILIES)
def test_mlp_in_row_pieces_gives_the_bits_of_one_call(family, monkeypatch):
    """Past MLP_PIECE_BYTES of intermediate, the MLP runs its rows in pieces (so the allocator reuses
    its buffers instead of mapping fresh pages every layer): every row, the last partial piece's
    included, gets the bits of the whole call wherever the linears are row-invariant."""
    from minisgl_backend.model import layers

    with cpu_kernels.family_override(family):
        if not (cpu_kernels.packs() or cpu_kernels.kernel_row_limit() is None):
            pytest.skip(f"{family}'s linears are not row-invariant: nothing to compare")
        mlp = _model(deterministic=False).model.layers[0].mlp
        x = torch.randn(50, mlp.gate_up_proj.weight.shape[1], generator=torch.Generator().manual_seed(3))
        x = x.bfloat16()
        whole = mlp(x)
        width = (1 if mlp.fused() else 2) * mlp.intermediate_size  # the widest intermediate of a row
        monkeypatch.setattr(layers, "MLP_PIECE_BYTES", width * 2 * 7)  # 7 bf16 rows a piece
        calls = []
        mlp.down_proj.register_forward_hook(lambda mod, inp, out: calls.append(inp[0].shape[0]))
        pieces = mlp(x)
        assert calls == [7] * 7 + [1]
        assert torch.equal(pieces, whole)


@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("softcap", [None, 4.0], ids=["plain", "softcapped"])
@pytest.mark.parametrize("family", FAMILIES)
def test_float32_logits_are_the_model_dtype_logits_widened(family, softcap, deterministic):
    # What the CPU executor asks for (the packed LM head writes float32 itself; soft-capped logits and
    # the deterministic forward's tiled head convert): the same values as the bf16 logits, so the
    # draw and the logprobs cannot tell which they got.
    with cpu_kernels.family_override(family):
        shape = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2, head_dim=32)
        spec = model_spec(**shape, final_softcap=softcap)
        model = random_bf16_model(spec)
        model.pack_weights()
        model.forward_strategy = forward_strategy(model, deterministic)
        tables = torch.arange(3 * 4).view(3, 4)
        got = []
        for float32 in (False, True):
            kv = KVCache(spec.num_layers, 12, BLOCK, spec.num_kv_heads, spec.head_dim, torch.bfloat16, "cpu")
            got.append([model(_batch(step, tables, False), kv, float32_logits=float32) for step in (0, 1)])
        for bf16, wide in zip(*got):
            assert bf16.dtype == torch.bfloat16 and wide.dtype == torch.float32
            assert torch.equal(bf16.float(), wide)
