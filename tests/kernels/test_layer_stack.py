"""The native layer stack (model/layer_stack.py) against the layer-by-layer forward it replaces, on
decode, prefill and mixed batches: the same logits and the same K/V written, bit for bit, on tiny
random-weight models (Llama; bias and sliding windows; Qwen3's q/k norm), for packed (AMX or
AVX512-BF16), unpacked (few-row kernel), int8 and batch-invariant bf16 models and default and
batch-invariant float32 ones, under every native kernel
family this machine runs (avx2 included: its 8-lane kernels, no packing, int8 weights read
dequantized); batches it does not take fall back to the layer loop. Skipped where the native kernels
do not run (no AVX2 or not built)."""

from __future__ import annotations

import pytest
import torch

from minisgl_backend.arith import cdiv
from minisgl_backend.iteration import PrefillChunk
from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.model import cpu_kernels, layers
from minisgl_backend.model.batch import ForwardBatch
from minisgl_backend.model.layer_stack import LayerStack, LayerStackForward
from minisgl_backend.model.layers import Linear
from minisgl_backend.model.llama import CausalLM
from minisgl_backend.model.loader import forward_strategy
from minisgl_backend.model.spec import ModelSpec
from tests.helpers import model_spec, random_bf16_model

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="minisgl_backend.native._kernels not built, disabled, or this CPU lacks AVX2",
)

BLOCK, BLOCKS_PER_SEQ = 16, 4
NATIVE_FAMILIES = [f for f in cpu_kernels.FAMILIES if f != "torch" and cpu_kernels.runs_family(f)]
# The avx512 family a second time with torch's bf16 matmul on the other side of library_bf16: its
# few-row kernel then has the other row limit, so both of its stacks run here.
FAMILY_CASES = [(f, None) for f in NATIVE_FAMILIES] + (
    [("avx512", not cpu_kernels.library_bf16())] if "avx512" in NATIVE_FAMILIES else []
)


@pytest.fixture(
    autouse=True,
    params=FAMILY_CASES,
    ids=[f if lib is None else f"{f}-library-bf16-{lib}" for f, lib in FAMILY_CASES],
)
def family(request):
    """Every test under each native kernel family this machine runs (packing, the stack's linears
    and attention scorer follow it)."""
    name, library_bf16 = request.param
    with cpu_kernels.family_override(name, library_bf16):
        yield name


CONTEXTS = [5, 17, 30, 9, 23]  # prompt lengths of the sequences that then decode together


def _spec(**over) -> ModelSpec:
    """model_spec() wider and three layers deep (hidden 64, head dim 32, context 256), with `over`."""
    wide = dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=3, head_dim=32)
    return model_spec(**(wide | {"max_position_embeddings": 256} | over))


def _model(spec: ModelSpec, mode: str) -> CausalLM:
    model = random_bf16_model(spec)
    if mode.startswith("float32"):
        model = model.float()
    if mode == "int8":
        model.quantize_int8()
    if mode not in ("unpacked", "float32", "float32-deterministic"):
        model.pack_weights()
    model.forward_strategy = forward_strategy(model, mode.endswith("deterministic"))  # as the engine's loader
    return model


def _stacked(model: CausalLM) -> LayerStackForward:
    forward = model.forward_strategy
    assert isinstance(forward, LayerStackForward)
    return forward


def _stack(model: CausalLM, kv: KVCache) -> LayerStack | None:
    return _stacked(model).stack(model, kv)


def _prefilled(model: CausalLM, rows: int) -> tuple[KVCache, torch.Tensor]:
    s = model.spec
    kv = KVCache(
        s.num_layers,
        rows * BLOCKS_PER_SEQ,
        BLOCK,
        s.num_kv_heads,
        s.head_dim,
        model.lm_head.weight.dtype,
        "cpu",
    )
    tables = torch.randperm(rows * BLOCKS_PER_SEQ, generator=torch.Generator().manual_seed(1)).view(rows, -1)
    g = torch.Generator().manual_seed(2)
    for r in range(rows):
        n = CONTEXTS[r]
        pos = torch.arange(n)
        slots = tables[r][pos // BLOCK] * BLOCK + pos % BLOCK
        chunk = PrefillChunk(0, n, n, tables[r][: cdiv(n, BLOCK)])
        ids = torch.randint(0, s.vocab_size, (n,), generator=g)
        model(ForwardBatch(ids, pos, slots, 0, None, None, (chunk,), pos[-1:]), kv)
    return kv, tables


def _decode_batch(tables: torch.Tensor, step: int, seed: int) -> ForwardBatch:
    rows = tables.shape[0]
    pos = torch.tensor(CONTEXTS[:rows]) + step
    nb = int(pos.max()) // BLOCK + 1
    keys = torch.arange(nb * BLOCK)
    mask = (keys[None, :] <= pos[:, None])[:, None, None, :]
    slots = tables[torch.arange(rows), pos // BLOCK] * BLOCK + pos % BLOCK
    ids = torch.randint(0, 96, (rows,), generator=torch.Generator().manual_seed(seed))
    return ForwardBatch(ids, pos, slots, rows, tables[:, :nb].contiguous(), mask, (), torch.arange(rows))


def _copy(kv: KVCache) -> KVCache:
    twin = KVCache(len(kv.k), kv.num_blocks, kv.block_size, *kv.k[0].shape[2:], kv.k[0].dtype, "cpu")
    for dst, src in zip(twin.k + twin.v, kv.k + kv.v):
        dst.copy_(src)
    return twin


# Every case runs packed, unpacked (the few-row kernel), int8 and batch-invariant bf16 models, and
# float32 ones (default and batch-invariant), of three layer kinds.
MODES = pytest.mark.parametrize(
    "mode", ["packed", "unpacked", "int8", "deterministic", "float32", "float32-deterministic"]
)
LAYER_KINDS = pytest.mark.parametrize(
    "over",
    [
        {},
        {"qkv_bias": True, "mlp_bias": True, "sliding_window": 6, "sliding_layers": (True, False, True)},
        {"qk_norm": True, "model_type": "qwen3"},
    ],
    ids=["llama", "bias+window", "qk-norm"],
)


def _case_model(mode: str, over: dict) -> CausalLM:
    """The model of one (mode, layer kind) case; skipped where another case covers it."""
    # linears whose kernel takes every row count: packed, or a few-row kernel without a row limit
    any_rows = cpu_kernels.packs() or cpu_kernels.kernel_row_limit() is None
    if mode == "packed" and not cpu_kernels.packs():
        pytest.skip("this kernel family packs nothing: the unpacked case covers it")
    if mode == "deterministic" and not any_rows:
        pytest.skip("the deterministic forward tiles this family's linears: the stack does not run it")
    return _model(_spec(**over), mode)


def _takes(mode: str, rows: int) -> bool:
    """Whether the stack takes a batch of `rows` rows of a `mode` model: any row count where its
    linears are packed or their few-row kernel has no row limit (int8 too: beyond the int8 kernel's
    rows it reads the dequantized weight, as Linear.forward does), else only the few-row kernel's;
    float32: up to the float32 kernel's rows, any number in the batch-invariant forward."""
    if mode.startswith("float32"):
        return mode == "float32-deterministic" or rows <= cpu_kernels.F32_KERNEL_ROWS
    packed = mode != "unpacked" and cpu_kernels.packs()
    return packed or cpu_kernels.kernel_row_limit() is None or rows <= cpu_kernels.MAX_KERNEL_ROWS


def _as_the_loop(
    model: CausalLM, batch: ForwardBatch, kv: KVCache, loop_kv: KVCache, label: str
) -> torch.Tensor:
    """The batch through the model's strategy over kv and through the layer loop over loop_kv (a copy
    of it): the same logits and the same K/V written, bit for bit. Returns the logits."""
    stacked = _stacked(model)
    native = model(batch, kv)
    model.forward_strategy = stacked.inner
    plain = model(batch, loop_kv)
    model.forward_strategy = stacked
    assert torch.equal(native, plain), f"{label}: logits differ"
    for layer in range(model.spec.num_layers):
        assert torch.equal(kv.k[layer], loop_kv.k[layer]) and torch.equal(kv.v[layer], loop_kv.v[layer]), (
            label
        )
    return native


@MODES
@LAYER_KINDS
@pytest.mark.parametrize("rows", [1, 3, 5])
def test_layer_stack_has_the_layer_loops_bits(mode, over, rows):
    model = _case_model(mode, over)
    kv, tables = _prefilled(model, rows)
    loop_kv = _copy(kv)
    for step in range(3):
        batch = _decode_batch(tables, step, seed=10 + step)
        assert _stacked(model).stack(model, kv).runs(batch) == _takes(mode, rows)
        _as_the_loop(model, batch, kv, loop_kv, f"step {step}")


def _chunks_batch(
    tables: torch.Tensor,
    spans: list[tuple[int, int, int]],
    decode: list[tuple[int, int]],
    logits: str,
    seed: int,
) -> ForwardBatch:
    """A batch of `decode` rows (sequence, position) and then one prompt chunk per (sequence, first
    position, length) of `spans`, each chunk reading its sequence's table up to its end. logits:
    "last" (each decode row and each chunk's last row, as the engine asks), "every" (every row: a
    loglikelihood request) or "none" (chunks in the middle of their prompts)."""
    pos = [p for _, p in decode] + [p for _, start, length in spans for p in range(start, start + length)]
    seq = [r for r, _ in decode] + [r for r, _, length in spans for _ in range(length)]
    positions, rows = torch.tensor(pos), torch.tensor(seq)
    slots = tables[rows, positions // BLOCK] * BLOCK + positions % BLOCK
    nd, chunks, start = len(decode), [], len(decode)
    for r, first, length in spans:
        end = first + length
        chunks.append(PrefillChunk(start, length, end, tables[r][: cdiv(end, BLOCK)]))
        start += length
    dec_tables = dec_mask = None
    if nd:
        dpos = positions[:nd]
        nb = int(dpos.max()) // BLOCK + 1
        dec_tables = tables[rows[:nd], :nb].contiguous()
        dec_mask = (torch.arange(nb * BLOCK)[None, :] <= dpos[:, None])[:, None, None, :]
    n = len(pos)
    keep = {
        "last": torch.tensor(list(range(nd)) + [c.start + c.length - 1 for c in chunks]),
        "every": torch.arange(n),
        "none": torch.zeros(0, dtype=torch.int64),
    }[logits]
    ids = torch.randint(0, 96, (n,), generator=torch.Generator().manual_seed(seed))
    return ForwardBatch(ids, positions, slots, nd, dec_tables, dec_mask, tuple(chunks), keep)


@MODES
@LAYER_KINDS
@pytest.mark.parametrize("piece", [5, 16, 33])
def test_the_stack_has_the_layer_loops_bits_on_prompt_chunks(mode, over, piece, monkeypatch):
    """Prefill and mixed batches through the stack (first chunks, later chunks beside decode rows,
    logits at the last rows, at every row and at none; the MLP in pieces of 5 rows, of 16 (whole
    tiles: under AMX the norm writes them in the packed layout, the last piece a few rows) or of 33,
    past the 32 rows from which AMX runs the whole MLP in one call) against the layer loop on a copy
    of the pool: the same logits and the same K/V, bit for bit."""
    model = _case_model(mode, over)
    mlp = model.model.layers[0].mlp
    width = (1 if mlp.fused() else 2) * mlp.intermediate_size  # the widest intermediate of a row
    monkeypatch.setattr(layers, "MLP_PIECE_BYTES", piece * width * model.lm_head.weight.element_size())
    s = model.spec
    kv = KVCache(
        s.num_layers, 3 * BLOCKS_PER_SEQ, BLOCK, s.num_kv_heads, s.head_dim, model.lm_head.weight.dtype, "cpu"
    )
    loop_kv = _copy(kv)
    tables = torch.randperm(3 * BLOCKS_PER_SEQ, generator=torch.Generator().manual_seed(1)).view(3, -1)
    batches = [
        _chunks_batch(tables, [(0, 0, 11), (1, 0, 20), (2, 0, 7)], [], "last", seed=1),
        _chunks_batch(tables, [(0, 11, 15), (1, 20, 3)], [(2, 7)], "last", seed=2),
        _chunks_batch(tables, [(0, 26, 14)], [(2, 8), (1, 23)], "every", seed=3),
        _chunks_batch(tables, [(1, 24, 2), (2, 9, 2)], [], "none", seed=4),
        _chunks_batch(tables, [(2, 11, 1)], [(0, 40), (1, 26)], "last", seed=5),
        _chunks_batch(tables, [(0, 41, 23), (1, 27, 37), (2, 12, 10)], [], "last", seed=6),
    ]
    for i, batch in enumerate(batches):
        assert _stacked(model).stack(model, kv).runs(batch) == _takes(mode, batch.input_ids.shape[0])
        logits = _as_the_loop(model, batch, kv, loop_kv, f"batch {i}")
        assert logits.shape == (batch.logits_index.shape[0], s.vocab_size)


def test_layer_stack_is_skipped_where_it_does_not_run():
    """Without packs the AVX-512 few-row kernel bounds the rows a batch may have, and the float32
    kernel's rows a float32 model's; Gemma models get no stack."""
    model = _model(_spec(), "unpacked")
    kv, tables = _prefilled(model, 2)
    stack = _stack(model, kv)
    small = _chunks_batch(tables, [(1, 17, 2)], [(0, 5)], "last", seed=3)
    large = _chunks_batch(tables, [(1, 17, 4)], [(0, 5)], "last", seed=3)
    assert stack.runs(small)
    assert stack.runs(large) == (cpu_kernels.kernel_row_limit() is None)
    f32 = _model(_spec(), "float32")
    f32_kv, f32_tables = _prefilled(f32, 2)
    f32_stack = _stack(f32, f32_kv)
    assert f32_stack is not None and f32_stack.runs(large)
    wide = _chunks_batch(f32_tables, [(1, 17, cpu_kernels.F32_KERNEL_ROWS)], [(0, 5)], "last", seed=3)
    assert not f32_stack.runs(wide)
    assert _stack(f32, _copy(kv)) is None  # a bf16 pool under a float32 model
    assert _stack(_model(_spec(gemma=True), "packed"), kv) is None


def test_layer_stack_is_rebuilt_when_the_weights_change():
    """The stack points into the weights: after quantize_int8 replaces them it is built again, and
    still gives the layer loop's bits."""
    model = _model(_spec(), "unpacked")
    kv, tables = _prefilled(model, 1)
    before = _stack(model, kv)
    assert before is not None and _stack(model, kv) is before
    model.quantize_int8()
    after = _stack(model, kv)
    assert after is not None and after is not before
    loop_kv = _copy(kv)
    batch = _decode_batch(tables, 0, seed=5)
    native = model(batch, kv)
    model.forward_strategy = _stacked(model).inner
    assert torch.equal(native, model(batch, loop_kv))


def test_layer_stack_refuses_a_slot_outside_the_pool():
    model = _model(_spec(), "unpacked")
    kv, tables = _prefilled(model, 1)
    batch = _decode_batch(tables, 0, seed=4)
    bad = batch._replace(slot_mapping=torch.tensor([kv.num_blocks * BLOCK]))
    with pytest.raises(IndexError, match="slot"):
        model(bad, kv)


def test_decode_weight_bytes_count_what_a_one_row_step_reads():
    """CausalLM.decode_weight_bytes (minisgl bench's batch-1 weight stream): the packed copies where
    packed (zero-padded to whole tiles), the weights where not, int8 weights and scales after
    quantize_int8."""
    model = _model(_spec(), "packed")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    plain = sum(lin.weight.numel() * 2 for lin in linears)
    if cpu_kernels.packs():
        assert model.decode_weight_bytes() == sum(lin.packed.numel() * 2 for lin in linears) >= plain
    else:
        assert model.decode_weight_bytes() == plain
    model.quantize_int8()
    assert model.decode_weight_bytes() == sum(lin.qweight.numel() + 4 * lin.qscale.numel() for lin in linears)
