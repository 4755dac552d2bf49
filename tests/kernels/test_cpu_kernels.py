"""The native CPU kernels (csrc/cpu/ via minisgl_backend/model/cpu_kernels.py) against the
torch expressions they replace: fp32 within 1e-6, bf16 within bf16 rounding (bitwise where the kernel
rounds the same steps), the few-row and AMX linears' bits independent of the other rows and the thread
count, and bad block tables refused. The kernels that come in two widths (the few-row linear, the FMA
attention, the row-wise ops) are tested at each this CPU runs: AVX-512 (the avx512 family) and AVX2
(avx2). Skipped (with the reason) where the extension is not built or the CPU lacks AVX2; the
AVX-512, AMX and AVX512-BF16 tests also where it lacks those."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from minisgl_backend.arith import cdiv
from minisgl_backend.model import cpu_kernels
from minisgl_backend.model.rope import apply_rotary
from tests.helpers import model_spec

pytestmark = pytest.mark.skipif(
    not cpu_kernels.available(),
    reason="minisgl_backend.native._kernels not built, disabled, or this CPU lacks AVX2",
)

# The vector codes of the few-row linear, the FMA attention and the row-wise ops: the avx512 family's
# (16 lanes), avx512bf16's (the same, its bf16 roundings on AVX512-BF16's conversions: the amx family
# runs it too) and avx2's (8 lanes).
VECTOR_FAMILIES = [f for f in ("avx512bf16", "avx512", "avx2") if cpu_kernels.runs_family(f)]


@pytest.fixture(params=VECTOR_FAMILIES)
def vector_family(request):
    """Each kernel width this CPU runs, for the test."""
    with cpu_kernels.family_override(request.param):
        yield request.param


@pytest.fixture
def torch_only(monkeypatch):
    """Run a block with the kernels off: every wrapper takes its torch path."""

    def off():
        monkeypatch.setattr(cpu_kernels, "_ACTIVE", cpu_kernels.KernelFamily.named("torch"))

    return off


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("n,k", [(576, 576), (192, 1536), (7, 37), (49, 64), (1, 33), (3, 17)])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_matches_float32_reference_and_is_row_independent(vector_family, n, k, bias):
    """The few-row kernel at each width, with N and K that are not whole tiles or k-steps: within bf16
    rounding of a float32 reference, and a row's bits the same alone as beside 1-3 others and at one
    thread as at several."""
    g = _gen()
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    for m in range(1, cpu_kernels.MAX_KERNEL_ROWS + 1):
        x = torch.randn(m, k, generator=g).bfloat16()
        y = cpu_kernels.linear(x, w, b)
        ref = x.float() @ w.float().t() + (0 if b is None else b.float())
        # bf16 output: one rounding of a float32 sum (the ordering differs from the reference's)
        assert (y.float() - ref).abs().max() <= ref.abs().max() * 2**-7 + 1e-6
        assert (y.float() - F.linear(x, w, b).float()).abs().max() <= ref.abs().max() * 2**-6 + 1e-6
        alone = torch.cat([cpu_kernels.linear(x[i : i + 1], w, b) for i in range(m)])
        assert torch.equal(y, alone), "a row's bits must not depend on the rows beside it"
        with _threads(1):
            assert torch.equal(cpu_kernels.linear(x, w, b), y), "bits depend on the thread count"


@pytest.mark.parametrize("n,k", [(576, 576), (192, 1536), (7, 37), (49, 64), (1, 33), (3, 17), (5, 80)])
@pytest.mark.parametrize("bias", [False, True])
def test_float32_linear_matches_a_float64_reference_and_is_row_independent(vector_family, n, k, bias):
    """Float32 rows over float32 weights (a float32 model's decode steps) take the kernel up to
    F32_KERNEL_ROWS rows, at each width, with N and K that are not whole tiles or k-steps: within
    float32 rounding of a float64 reference, and a row's bits the same alone as among the others
    and at one thread as at several."""
    g = _gen(7)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g) if bias else None
    x = torch.randn(cpu_kernels.F32_KERNEL_ROWS, k, generator=g)
    ref = x.double() @ w.double().t() + (0 if b is None else b.double())
    # a float32 dot product of k terms is within ~k ulps of the exact sum of the absolute terms
    bound = (x.double().abs() @ w.double().abs().t() + (0 if b is None else b.double().abs())) * k * 2**-23
    for m in (1, 2, 3, 4, 5, 9, cpu_kernels.F32_KERNEL_ROWS):
        y = cpu_kernels.linear(x[:m], w, b)
        assert y.dtype == torch.float32 and y.shape == (m, n)
        assert ((y.double() - ref[:m]).abs() <= bound[:m]).all()
        alone = torch.cat([cpu_kernels.linear(x[i : i + 1], w, b) for i in range(m)])
        assert torch.equal(y, alone), "a row's bits must not depend on the rows beside it"
        with _threads(1):
            assert torch.equal(cpu_kernels.linear(x[:m], w, b), y), "bits depend on the thread count"


def test_float32_rows_take_the_kernel_up_to_its_row_limit(vector_family, monkeypatch):
    """Which float32 calls the kernel serves: 1..F32_KERNEL_ROWS contiguous rows over a contiguous
    float32 weight; more rows, a transposed weight or the torch family take F.linear."""
    calls = []

    class Counting:
        def __getattr__(self, name):
            fn = getattr(native, name)
            if name != "linear_f32":
                return fn
            return lambda x, *a: calls.append(x.shape[0]) or fn(x, *a)

    native = cpu_kernels._native
    monkeypatch.setattr(cpu_kernels, "_native", Counting())
    g = _gen(8)
    w = torch.randn(40, 24, generator=g)
    for m in (1, cpu_kernels.F32_KERNEL_ROWS, cpu_kernels.F32_KERNEL_ROWS + 1):
        cpu_kernels.linear(torch.randn(m, 24, generator=g), w)
    cpu_kernels.linear(torch.randn(2, 40, generator=g), w.t())  # not contiguous: torch
    assert calls == [1, cpu_kernels.F32_KERNEL_ROWS]
    with cpu_kernels.family_override("torch"):
        cpu_kernels.linear(torch.randn(2, 24, generator=g), w)
    assert calls == [1, cpu_kernels.F32_KERNEL_ROWS]


@pytest.mark.parametrize("family", ["avx2", "avx512"])
@pytest.mark.parametrize("n,k", [(576, 576), (7, 37), (1, 33)])
def test_linear_without_a_native_bf16_library_runs_every_row_count_with_each_rows_bits(family, n, k):
    """Where torch's bf16 matmul has no bf16 dot products to run on (the avx2 family; the avx512
    family on a CPU without AVX512-BF16), it converts its operands on every call and runs 2-4x below
    the kernel at every row count, so the family's linear runs its kernel at any row count: within
    bf16 rounding of a float32 reference, and a row's bits the same alone as among 5-300 rows at any
    offset and at one thread, so the batch-invariant forward keeps such a Linear as it is."""
    if not cpu_kernels.runs_family(family):
        pytest.skip(f"this CPU does not run the {family} family")
    from minisgl_backend.model.batch_invariant import _row_invariant
    from minisgl_backend.model.layers import Linear

    g = _gen(13)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    x = torch.randn(300, k, generator=g).bfloat16()
    with cpu_kernels.family_override(family, library_bf16=False):
        assert cpu_kernels.kernel_row_limit() is None and cpu_kernels.linear_row_invariant(w, b)
        y = cpu_kernels.linear(x, w, b)
        ref = x.float() @ w.float().t() + b.float()
        assert (y.float() - ref).abs().max() <= ref.abs().max() * 2**-7 + 1e-6
        for m, at in ((1, 0), (1, 299), (5, 3), (9, 40), (37, 250), (260, 20)):
            part = cpu_kernels.linear(x[at : at + m], w, b)
            assert torch.equal(part, y[at : at + m]), (
                f"rows {at}..{at + m} alone differ from the batch of 300"
            )
        with _threads(1):
            assert torch.equal(cpu_kernels.linear(x, w, b), y), "bits depend on the thread count"
        assert _row_invariant(Linear(k, n).bfloat16()) and not _row_invariant(Linear(k, n))  # fp32: tiled
    with cpu_kernels.family_override(family, library_bf16=True):
        # the avx2 family's kernel keeps every row count; AVX-512 stops where oneDNN's bf16 wins
        limit = None if family == "avx2" else cpu_kernels.MAX_KERNEL_ROWS
        assert cpu_kernels.kernel_row_limit() == limit
        assert cpu_kernels.linear_row_invariant(w, b) is (limit is None)


def test_the_library_runs_bf16_on_dot_products_only_where_the_cpu_and_onednn_have_them():
    """library_bf16: the CPU's AVX512-BF16 decides, and oneDNN capped below its bf16 ISA (the
    variable torch's oneDNN reads, by either name) counts as without it."""
    has = cpu_kernels._native is not None and cpu_kernels._native.has_avx512_bf16()
    assert cpu_kernels.library_bf16({}) is has
    assert cpu_kernels.library_bf16({"ONEDNN_MAX_CPU_ISA": "avx512_core_bf16"}) is has
    assert cpu_kernels.library_bf16({"ONEDNN_MAX_CPU_ISA": "ALL"}) is has
    assert not cpu_kernels.library_bf16({"ONEDNN_MAX_CPU_ISA": "avx512_core"})
    assert not cpu_kernels.library_bf16({"DNNL_MAX_CPU_ISA": "AVX2"})


def _threads(n: int):
    return cpu_kernels.threads_override(n)


def test_linear_beyond_kernel_rows_is_torch(vector_family):
    """Beyond MAX_KERNEL_ROWS the AVX-512 families run F.linear on bf16 rows, and every family
    beyond F32_KERNEL_ROWS on float32 rows."""
    g = _gen(1)
    w = torch.randn(64, 96, generator=g).bfloat16()
    x = torch.randn(cpu_kernels.MAX_KERNEL_ROWS + 1, 96, generator=g).bfloat16()
    if cpu_kernels.kernel_row_limit() is not None:
        assert torch.equal(cpu_kernels.linear(x, w), F.linear(x, w))
    many = torch.randn(cpu_kernels.F32_KERNEL_ROWS + 1, 96, generator=g)
    assert torch.equal(cpu_kernels.linear(many, w.float()), F.linear(many, w.float()))
    # a non-contiguous input gives the bits of its contiguous copy
    wide = torch.randn(2, 192, generator=g).bfloat16()[:, ::2]
    assert torch.equal(cpu_kernels.linear(wide, w), cpu_kernels.linear(wide.contiguous(), w))


# The kernel families that pack (AMX tiles, AVX512-BF16 panels) and this machine runs: each is tested.
PACKING = [f for f in ("amx", "avx512bf16") if cpu_kernels.runs_family(f)]


NO_PACKING = pytest.param(None, marks=pytest.mark.skip(reason="this CPU has neither AMX nor AVX512-BF16"))


@pytest.fixture(params=PACKING or [NO_PACKING])
def packing(request):
    """A packing kernel family, for the block."""
    with cpu_kernels.family_override(request.param):
        yield request.param


# (2048, 1024): a pack of 4 MB, which lives in its own huge-page mapping (pages.huge_page_empty);
# (3072, 576) with 600 rows: AMX's panel order over several weight panels and row chunks; (300, 2200)
# with 600 rows: K so long that AMX's panels cover it range by range, each row block's sums kept
@pytest.mark.parametrize(
    "n,k,rows",
    [(576, 576, 300), (960, 1536, 300), (49, 64, 300), (7, 37, 300), (1, 33, 300), (100, 2, 300)]
    + [(2048, 1024, 300), (3072, 576, 600), (300, 2200, 600)],
)
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_reference_and_is_row_invariant(packing, n, k, rows, bias):
    """The packed kernels: within bf16 rounding of a float32 reference, at row counts across their
    tiles (AMX: 16-row tiles, 32-row blocks, and past 32 rows the panel order over packed rows in
    512-row chunks, K in parts, and in ranges where K is long; AVX512-BF16: 6-row tiles, 96-row
    chunks, K blocks beyond 6 rows) and K, N that are not whole tiles or pairs; a row's bits are the
    same alone, at any offset in any batch, and at any thread count."""
    g = _gen(11)
    w = (torch.randn(n, k, generator=g) * 0.05).bfloat16()
    b = torch.randn(n, generator=g).bfloat16() if bias else None
    packed = cpu_kernels.pack(w)
    x = torch.randn(rows, k, generator=g).bfloat16()
    y = cpu_kernels.linear_packed(x, packed, (n, k), b)
    ref = x.float() @ w.float().t() + (0 if b is None else b.float())
    assert (y.float() - ref).abs().max() <= ref.abs().max() * 2**-7 + 1e-6
    spans = ((1, 0), (1, rows - 1), (2, 7), (3, 13), (16, 5), (17, 40), (33, 250), (260, 20), (40, rows - 40))
    for m, at in spans + (((100, 480),) if rows > 580 else ()):
        part = cpu_kernels.linear_packed(x[at : at + m], packed, (n, k), b)
        assert torch.equal(part, y[at : at + m]), f"rows {at}..{at + m} alone differ from the batch of {rows}"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_kernels.linear_packed(x, packed, (n, k), b), y), (
            "bits depend on the thread count"
        )
    finally:
        torch.set_num_threads(threads)
    # any leading dims, and zero rows
    assert torch.equal(cpu_kernels.linear_packed(x[:6].view(2, 3, k), packed, (n, k), b), y[:6].view(2, 3, n))
    assert cpu_kernels.linear_packed(x[:0], packed, (n, k), b).shape == (0, n)


def test_a_rows_bits_hold_across_the_float32_range(packing):
    """A decode step's few rows take another path through the packed kernel than a prompt's rows
    (AMX: weights streamed and staged, row by row rather than in panels). Over values spanning
    float32's range (denormal inputs, products below the smallest normal, zeros, sums that cancel), a
    row alone or in a pair still has the bits it has inside a batch of 40."""
    g = _gen(5)

    def wide(rows, k, lo, hi):  # each row at its own scale 2^lo..2^hi, its elements within 2^+-8 of it
        scale = torch.randint(lo, hi, (rows, 1), generator=g) + torch.randint(-8, 9, (rows, k), generator=g)
        v = torch.randn(rows, k, generator=g) * torch.exp2(scale.float())
        v[torch.rand(rows, k, generator=g) < 0.1] = 0
        return v.bfloat16()

    # rows of x down to bf16's denormals, weights around one: outputs from ordinary sums down to
    # sums of products below float32's smallest normal, which the tile unit reads and writes as zero
    n, k = 96, 200
    w, x = wide(n, k, -20, 20), wide(40, k, -135, 0)
    packed = cpu_kernels.pack(w)
    y = cpu_kernels.linear_packed(x, packed, (n, k))
    assert torch.isfinite(y).all()
    for at in range(0, 39, 3):
        for m in (1, 2):
            part = cpu_kernels.linear_packed(x[at : at + m], packed, (n, k))
            assert torch.equal(part.view(torch.int16), y[at : at + m].view(torch.int16)), (
                f"rows {at}..{at + m} alone differ from the batch"
            )


def test_packed_linear_layer_holds_its_weight_once(packing):
    """Linear.pack() moves the weight into the pack: `weight` keeps only its shape (meta), dense()
    reads the same bits back, the layer computes what the unpacked layer computed, unpack() gives
    the weight back for a change that pack() then reaches, and quantize_int8 repacks the dequantized
    weight itself; fp32 layers do not pack."""
    from minisgl_backend.model.layers import Linear

    torch.manual_seed(3)
    lin = Linear(64, 32, bias=False).bfloat16()
    original = lin.weight.detach().clone()
    x = torch.randn(5, 64).bfloat16()
    with torch.inference_mode():
        unpacked = lin(x)
        assert lin.pack()
        assert lin.weight.is_meta and lin.weight.shape == (32, 64), "the pack replaces the weight"
        assert torch.equal(lin.dense(), original)
        first = lin(x)
        assert torch.equal(first, cpu_kernels.linear_packed(x, cpu_kernels.pack(original), (32, 64)))
        assert torch.allclose(first.float(), unpacked.float(), atol=0.05)
        lin.unpack()
        assert not lin.weight.is_meta and lin.packed is None and torch.equal(lin.weight, original)
        lin.weight.mul_(2)
        lin.pack()
        assert not torch.equal(lin(x), first)
        lin.quantize_int8()
        assert lin.weight.is_meta and lin.packed is not None
        wide = torch.randn(cpu_kernels.MAX_KERNEL_ROWS + 3, 64).bfloat16()  # beyond the int8 kernel's rows
        assert torch.equal(
            lin(wide), cpu_kernels.linear_packed(wide, cpu_kernels.pack(lin.dense()), (32, 64))
        )
    assert not Linear(64, 32).pack()


@pytest.mark.skipif(not cpu_kernels.available(), reason="no native kernels on this machine")
@pytest.mark.parametrize("layout", ["amx", "amx-gated", "dpbf16", "dpbf16-gated"])
@pytest.mark.parametrize(
    "n,k", [(64, 64), (7, 37), (100, 2), (128, 96), (49, 33), (2048, 64), (100, 80), (192, 80)]
)
def test_packed_rows_read_back_every_layout(layout, n, k):
    """packed_rows inverts each pack layout bit for bit (zero-padded tiles and panels, odd K, a
    gated [gate | up] weight; (100, 80) and (192, 80): whole tiles and panels, which both packs
    gather, beside edge ones they move element by element): whatever the CPU, since packing and
    reading back are plain index moves (only the matmuls over the AMX layout need the tile unit)."""
    native = cpu_kernels._native
    gated = layout.endswith("-gated")
    if gated and n % 64:
        pytest.skip("a gated pack takes gate rows in whole panels")
    g = _gen(n * 1000 + k)
    w = torch.randn(n, k, generator=g).bfloat16()
    ids = torch.randint(0, n, (3, 5), generator=g)
    rows = torch.empty(ids.numel(), k, dtype=torch.bfloat16)
    flat = ids.reshape(-1).contiguous()
    if layout.startswith("amx"):
        packed = torch.empty(native.packed_amx_elems(n, k), dtype=torch.bfloat16)
        native.pack_amx(w, packed, gated, 2)
        native.packed_rows_amx(packed, n, k, gated, flat, rows, 2)
    else:
        packed = torch.empty(native.packed_dpbf16_elems(n, k), dtype=torch.bfloat16)
        native.pack_dpbf16(w, packed, gated, 2)
        native.packed_rows_dpbf16(packed, n, k, gated, flat, rows, 2)
    assert torch.equal(rows.reshape(3, 5, k), w[ids])


def test_packed_rows_refuses_an_id_out_of_range(packing):
    w = torch.randn(40, 64).bfloat16()
    packed = cpu_kernels.pack(w)
    assert torch.equal(cpu_kernels.packed_rows(packed, (40, 64), torch.tensor([39, 0])), w[[39, 0]])
    with pytest.raises(IndexError, match="out of range"):
        cpu_kernels.packed_rows(packed, (40, 64), torch.tensor([40]))


def _attention_case(dtype, seed=0):
    g = _gen(seed)
    b, h, kvh, d, bs, pool = 5, 6, 2, 16, 4, 40
    k = torch.randn(pool, bs, kvh, d, generator=g).to(dtype)
    v = torch.randn(pool, bs, kvh, d, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 7, 12, 18])
    nb = int(pos.max()) // bs + 1
    tables = torch.stack([torch.randperm(pool, generator=g)[:nb] for _ in range(b)])
    q = torch.randn(b, h, d, generator=g).to(dtype)
    return q, k, v, tables, pos, bs


def _attention_reference(q, k, v, tables, pos, bs, scale, window, cap):
    """Float64 attention of each query over its keys, gathered slot by slot."""
    b, h, d = q.shape
    group = h // k.shape[2]
    out = torch.empty(b, h, d, dtype=torch.float64)
    for i in range(b):
        keys = torch.arange(int(pos[i]) + 1)
        kk = k[tables[i][keys // bs], keys % bs].double()
        vv = v[tables[i][keys // bs], keys % bs].double()
        for head in range(h):
            s = kk[:, head // group] @ q[i, head].double() * scale
            if cap:
                s = torch.tanh(s / cap) * cap
            if window:
                s[keys <= pos[i] - window] = float("-inf")
            out[i, head] = torch.softmax(s, 0) @ vv[:, head // group]
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize("window,cap", [(None, None), (5, None), (None, 30.0)])
def test_decode_attention_matches_reference(vector_family, dtype, tol, window, cap):
    q, k, v, tables, pos, bs = _attention_case(dtype)
    scale = q.shape[-1] ** -0.5
    out = cpu_kernels.decode_attention(q, k, v, tables, pos, scale, window, cap)
    ref = _attention_reference(q, k, v, tables, pos, bs, scale, window, cap)
    assert out.dtype == dtype
    assert (out.double() - ref).abs().max() < tol
    # rows of a wider tensor (as q is a view into the qkv projection): the same bits
    wide = torch.cat([q.flatten(1), torch.randn(q.shape[0], 7).to(dtype)], dim=1)
    strided = wide[:, : q[0].numel()].view(q.shape)
    assert torch.equal(cpu_kernels.decode_attention(strided, k, v, tables, pos, scale, window, cap), out)


# (kernel family, attention scorer): the AVX-512 families' three scorers and avx2's FMA one.
SCORER_CASES = [
    pytest.param(f, s, id=f"{f}-{s}")
    for f, s in (("avx512", "fma"), ("avx512", "amx"), ("avx512", "dp"), ("avx2", "fma"))
    if cpu_kernels.runs_family(f)
]


@pytest.fixture
def scorer_family(family, scorer):
    """The block under `family`, skipped where it does not run `scorer`."""
    with cpu_kernels.family_override(family):
        if not cpu_kernels.scorer_runs(scorer):
            pytest.skip(f"this CPU does not run the {scorer} scorer")
        yield


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 1e-2)])
@pytest.mark.parametrize(
    "window,cap,d,bs,group",
    [
        (None, None, 64, 4, 3),
        (None, None, 64, 16, 3),
        (None, None, 96, 16, 4),
        (7, 30.0, 128, 16, 7),
        (7, None, 16, 4, 3),
        (None, 30.0, 16, 4, 7),
        (None, None, 8, 4, 3),
        (5, 30.0, 24, 4, 2),
        (None, None, 12, 4, 3),
    ],
)
@pytest.mark.parametrize("family,scorer", SCORER_CASES)
def test_paged_attention_rows_do_not_depend_on_the_call(
    dtype, tol, window, cap, d, bs, group, family, scorer, scorer_family
):
    """Rows of prefill chunks (many rows on one table, in blocks) and decode rows (one per table):
    each row's output has the same bits alone as in any call and at any thread count, and matches the
    float64 reference. Under the AVX-512 families d=8, 12 and 24 take the scalar path, the others the
    AVX-512 blocks; under avx2 every d but 12 takes its 8-lane blocks. In either, blocks of few query
    vectors go one vector at a time, larger ones a register of vectors at a time (attend_vectors /
    attend_lanes), which must agree bit for bit. With scorer "amx", bf16 scores of d=64/128 come from
    the AMX tile unit, read from the pool in place (block size 16) or staged (block size 4); with
    "dp", from vdpbf16ps (AVX512-BF16), read in place. A group of 7 query heads per KV head is the
    most a decode row sums over V on the few-vector path, in two (avx2: three) register groups."""
    g = _gen(21)
    kvh, pool = 2, 64
    h = kvh * group
    k = torch.randn(pool, bs, kvh, d, generator=g).to(dtype)
    v = torch.randn(pool, bs, kvh, d, generator=g).to(dtype)
    nb = cdiv(45, bs)
    tables = torch.stack([torch.randperm(pool, generator=g)[:nb] for _ in range(3)])
    # 37 rows of a chunk on table 0 at positions 3..39, then decode rows on tables 1 and 2
    row_table = torch.tensor([0] * 37 + [1, 2])
    pos = torch.cat([torch.arange(3, 40), torch.tensor([17, 44])])
    q = torch.randn(39, h, d, generator=g).to(dtype)
    scale = d**-0.5

    def attend(rows: slice) -> torch.Tensor:
        return cpu_kernels.paged_attention(
            q[rows], k, v, tables, row_table[rows], pos[rows], scale, window, cap, scorer=scorer
        )

    out = attend(slice(None))
    for r in (0, 15, 16, 17, 36, 37, 38):
        assert torch.equal(attend(slice(r, r + 1)), out[r : r + 1]), (
            f"row {r} alone differs from the batched call"
        )
    # a shifted chunk (rows 5.. of the same chunk first in the call) gives the same bits
    assert torch.equal(attend(slice(5, 37)), out[5:37])
    with _threads(1):
        assert torch.equal(attend(slice(None)), out), "bits depend on the thread count"
    ref = _attention_reference(q, k, v, tables[row_table], pos, bs, scale, window, cap)
    if scorer in ("dp", "amx") and dtype == torch.bfloat16:
        tol *= 2  # their V sums take the probabilities rounded to bf16 (as SDPA's bf16 math path does)
    assert (out.double() - ref).abs().max() < tol


@pytest.mark.parametrize("window", [None, 20])
@pytest.mark.parametrize("family,scorer", SCORER_CASES)
def test_a_block_of_few_rows_scores_each_row_over_its_own_keys(window, family, scorer, scorer_family):
    """Two rows of one chunk whose last keys fall in different 16-key tiles (positions 47 and 48),
    too few query vectors for the lanes path: the block scores both rows over the union of their
    tiles, and each row must see only its own keys there, as it does alone."""
    g = _gen(5)
    kvh, group, d, bs, pool = 2, 3, 64, 16, 16
    k = torch.randn(pool, bs, kvh, d, generator=g).bfloat16()
    v = torch.randn(pool, bs, kvh, d, generator=g).bfloat16()
    tables = torch.randperm(pool, generator=g)[:4][None]
    pos = torch.tensor([47, 48])
    q = torch.randn(2, kvh * group, d, generator=g).bfloat16()
    row_table = torch.zeros(2, dtype=torch.int64)

    def attend(rows: slice) -> torch.Tensor:
        return cpu_kernels.paged_attention(
            q[rows], k, v, tables, row_table[rows], pos[rows], d**-0.5, window, None, scorer=scorer
        )

    out = attend(slice(None))
    for r in (0, 1):
        assert torch.equal(attend(slice(r, r + 1)), out[r : r + 1]), f"row {r} differs beside the other"
    ref = _attention_reference(q, k, v, tables[row_table], pos, bs, d**-0.5, window, None)
    assert (out.double() - ref).abs().max() < 2e-2


def test_decode_attention_matches_the_torch_path(vector_family):
    """The native decode attention against the torch back-end's (fp32, GQA, paged)."""
    from minisgl_backend.kvcache.storage import KVCache
    from minisgl_backend.model.layers import Attention

    spec = model_spec()
    attn = Attention(spec, 0)
    kv = KVCache(1, 12, 4, 2, 8, torch.float32, "cpu")
    g = _gen(3)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=g))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=g))
    q = torch.randn(3, 4, 8, generator=g)
    pos = torch.tensor([2, 9, 5])
    tables = torch.tensor([[3, 0, 0], [7, 1, 11], [4, 2, 0]])
    mask = (torch.arange(12)[None, :] <= pos[:, None])[:, None, None, :]
    native = cpu_kernels.decode_attention(
        q, kv.k[0], kv.v[0], tables, pos, attn.scale, attn.window, attn.softcap
    )
    assert native is not None
    plain = attn._decode_attention(q, tables, mask, kv)
    assert (native - plain).abs().max() < 1e-6


def test_decode_attention_refuses_out_of_range_tables(vector_family):
    q, k, v, tables, pos, _ = _attention_case(torch.float32)
    with pytest.raises(IndexError, match="outside the tables or the pool"):
        cpu_kernels.decode_attention(q, k, v, tables[:, :1], pos, 1.0, None, None)
    with pytest.raises(IndexError):  # a row naming a table that is not there
        cpu_kernels.paged_attention(q, k, v, tables, torch.arange(5) + 1, pos, 1.0, None, None)
    bad = tables.clone()
    bad[-1, 0] = k.shape[0]  # one past the pool
    with pytest.raises(IndexError):
        cpu_kernels.decode_attention(q, k, v, bad, pos, 1.0, None, None)


@pytest.mark.parametrize("gemma", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_fused_add(vector_family, gemma, dtype, torch_only):
    from minisgl_backend.model.layers import GemmaRMSNorm, RMSNorm

    g = _gen(4)
    norm = (GemmaRMSNorm if gemma else RMSNorm)(96, 1e-6).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(96, generator=g))
    x = torch.randn(7, 96, generator=g).to(dtype)
    add = torch.randn(7, 96, generator=g).to(dtype)
    with torch.inference_mode():
        h, total = norm.add_and_norm(x, add)
        alone = norm(x)
        torch_only()
        ref_h, ref_total = norm.add_and_norm(x, add)
        ref_alone = norm(x)
    assert torch.equal(total, ref_total)  # the same single rounding of x + add
    tol = 1e-6 if dtype == torch.float32 else 2**-7  # bf16: the sum of squares is ordered differently
    for got, ref in ((h, ref_h), (alone, ref_alone)):
        assert ((got.float() - ref.float()).abs() <= tol * (1 + ref.float().abs())).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rot", [16, 8])  # 8: partial rotary over half of each head
def test_rope_matches_apply_rotary(vector_family, dtype, rot, torch_only):
    g = _gen(5)
    qkv = torch.randn(6, 3 * 4 * 16, generator=g).to(dtype)
    q = qkv[:, : 4 * 16].view(6, 4, 16)  # a strided view, as Attention.qkv makes
    angles = torch.randn(6, 1, rot, generator=g)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    native = apply_rotary(q.clone(), cos, sin)
    torch_only()
    ref = apply_rotary(q.clone(), cos, sin)
    if dtype == torch.bfloat16:
        assert torch.equal(native, ref)  # the same three roundings per element
    else:
        assert (native - ref).abs().max() < 1e-6


def test_bf16_rounding_of_special_values_matches_torch(vector_family, torch_only):
    """The kernels' float32 -> bf16 rounding on the values where a shortcut would show: NaN (kept a
    quiet NaN), infinities, subnormals (kept, not flushed), ties (to even) and the largest finite
    values (rounding up to inf), through RoPE's products and sums, bitwise against torch."""
    g = _gen(11)
    tiny = torch.finfo(torch.bfloat16).smallest_normal
    special = torch.tensor(
        [float("nan"), float("inf"), -float("inf"), 0.0, -0.0, tiny / 4, -tiny / 3, 3.3895e38, -3.3895e38]
    )
    x = torch.randn(12, 3, 32, generator=g)
    x.view(-1)[: special.numel() * 20 : 20] = special
    x.view(-1)[1::7] *= 2.0**-120  # products landing among the float32 and bf16 subnormals
    x[5, 1] *= 2.0**-128  # a whole head of subnormals: both terms of each sum subnormal too
    x = x.to(torch.bfloat16)
    angles = torch.randn(12, 1, 32, generator=g)
    angles[0, 0, :4] = torch.tensor([0.0, torch.pi / 2, torch.pi, torch.pi / 4])
    cos, sin = angles.cos().to(torch.bfloat16), angles.sin().to(torch.bfloat16)
    native = apply_rotary(x.clone(), cos, sin)
    torch_only()
    ref = apply_rotary(x.clone(), cos, sin)
    same = (native.view(torch.int16) == ref.view(torch.int16)) | (native.isnan() & ref.isnan())
    assert same.all(), f"{(~same).sum().item()} elements differ, e.g. {native[~same][:4]} vs {ref[~same][:4]}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rowwise_rows_do_not_depend_on_the_call(vector_family, dtype):
    """RMSNorm (+ add, both forms), RoPE and SiLU x up: each row's bits the same alone as in a
    batch of 40 (the kernels go multi-threaded from 32 rows) and at one thread as at several, with
    dims that are not whole vectors or pairs (each width's tails)."""
    g = _gen(9)
    x, add = (torch.randn(40, 100, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(100, generator=g).to(dtype)
    qk = torch.randn(40, 5, 24, generator=g).to(dtype)
    angles = torch.randn(40, 1, 20, generator=g)  # partial rotary: 20 of 24
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    gate_up = (torch.randn(40, 2 * 70, generator=g) * 4).to(dtype)

    def run(rows: slice) -> list[torch.Tensor]:
        rotated = qk[rows].clone()
        assert cpu_kernels.rope_(rotated, cos[rows], sin[rows])
        normed = [
            t for gemma in (False, True) for t in cpu_kernels.rms_norm(x[rows], w, 1e-6, gemma, add[rows])
        ]
        return [
            *normed,
            cpu_kernels.rms_norm(x[rows], w, 1e-6, False)[0],
            rotated,
            cpu_kernels.silu_and_mul(gate_up[rows]),
        ]

    full = run(slice(None))
    for r in (0, 17, 39):
        for got, want in zip(run(slice(r, r + 1)), full):
            assert torch.equal(got, want[r : r + 1]), f"row {r} alone differs from the batch of 40"
    with _threads(1):
        assert all(torch.equal(a, b) for a, b in zip(run(slice(None)), full)), (
            "bits depend on the thread count"
        )


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-6), (torch.bfloat16, 2**-7)])
def test_silu_and_mul(vector_family, dtype, tol):
    g = _gen(6)
    gate_up = (torch.randn(5, 2 * 40, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    ref = (F.silu(gate) * up).float()
    assert ((cpu_kernels.silu_and_mul(gate_up).float() - ref).abs() <= tol * (1 + ref.abs())).all()


def test_env_switch_turns_the_kernels_off():
    code = "from minisgl_backend.model import cpu_kernels as c; print(c.available())"
    env = {**os.environ, "MINISGL_CPU_KERNELS": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("n,k", [(576, 576), (7, 37), (49, 1536)])
def test_int8_linear_matches_its_dequantized_weight(n, k):
    from minisgl_backend.model.layers import Linear

    torch.manual_seed(7)
    lin = Linear(k, n, bias=True).bfloat16()
    exact = lin.weight.detach().clone()
    lin.quantize_int8()
    assert lin.qweight.dtype == torch.int8 and lin.qscale.shape == (n,)
    # the dequantized weight is within half a quantisation step (+ bf16 rounding) of the original
    step = lin.qscale[:, None]
    assert ((lin.weight.float() - exact.float()).abs() <= step / 2 + exact.float().abs() * 2**-8).all()
    g = _gen(8)
    with torch.inference_mode():
        for m in (1, 3, cpu_kernels.MAX_KERNEL_ROWS, cpu_kernels.MAX_KERNEL_ROWS + 2):
            x = torch.randn(m, k, generator=g).bfloat16()
            ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())
            got = lin(x).float()
            assert (got - ref).abs().max() <= ref.abs().max() * 2**-7 + 1e-3


def test_int8_config_is_the_bf16_cpu_decode_path():
    from minisgl_backend import EngineConfig
    from minisgl_backend.errors import ConfigError

    EngineConfig(dtype="bfloat16", weight_dtype="int8")
    for bad in ({"dtype": "float32"}, {"dtype": "bfloat16", "deterministic": True}):
        with pytest.raises(ConfigError, match="weight_dtype: int8"):
            EngineConfig(weight_dtype="int8", **bad)
    with pytest.raises(ConfigError, match="weight_dtype"):
        EngineConfig(dtype="bfloat16", weight_dtype="int4")


@pytest.mark.slow
def test_int8_engine_scores_close_to_bf16_and_frees_every_block(tiny_model_dir):
    """weight_dtype=int8 on the tiny model: prompt logprobs near the bf16 engine's, greedy decode
    runs through the int8 kernel, and every block is FREE after drain."""
    from minisgl_backend import Engine, EngineConfig, SamplingParams

    prompts = [[5, 9, 13, 17, 21, 25, 29, 33], [7, 7, 7, 100, 200, 300]]
    params = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0)
    runs = {}
    for wd in (None, "int8"):
        cfg = EngineConfig(
            model=str(tiny_model_dir), dtype="bfloat16", weight_dtype=wd, stats_interval_s=0, num_threads=1
        )
        with Engine(cfg) as eng:
            runs[wd] = eng.generate(prompts, params, use_tqdm=False)
            counts = eng.drain(timeout=60, flush_cache=True)
            assert counts["FREE"] == eng.num_blocks, counts
            assert counts["running"] == counts["waiting"] == 0
    for a, b in zip(runs[None], runs["int8"]):
        assert len(b.token_ids) == 6
        deltas = [abs(x.logprob - y.logprob) for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:])]
        assert max(deltas) < 0.25, deltas


def _family_in_subprocess(**env: str) -> subprocess.CompletedProcess:
    code = "from minisgl_backend.model import cpu_kernels as c; print(c.family())"
    return subprocess.run(
        [sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True, timeout=120
    )


@pytest.mark.slow
def test_kernel_family_switch_caps_the_family_and_names_the_valid_ones():
    """MINISGL_KERNELS forces a lower family (never a higher one than the CPU runs); MINISGL_AMX=0
    caps it below AMX; a value that is no family is an error naming the valid ones."""
    assert _family_in_subprocess(MINISGL_KERNELS="avx512").stdout.strip() == "avx512"
    assert _family_in_subprocess(MINISGL_KERNELS="avx2").stdout.strip() == "avx2"
    assert _family_in_subprocess(MINISGL_KERNELS="amx").stdout.strip() == cpu_kernels.machine_family()
    no_amx = _family_in_subprocess(MINISGL_AMX="0", MINISGL_KERNELS="").stdout.strip()
    assert no_amx == ("avx512bf16" if cpu_kernels.machine_family() == "amx" else cpu_kernels.machine_family())
    bad = _family_in_subprocess(MINISGL_KERNELS="sse2")
    assert bad.returncode != 0 and "valid: amx, avx512bf16, avx512, avx2, torch" in bad.stderr
    with pytest.raises(ValueError, match="does not run here"):
        with cpu_kernels.family_override("nonsense"):
            pass


def test_one_variable_chooses_the_family_and_the_old_switches_are_its_aliases():
    """family_from_env: MINISGL_KERNELS caps the family, MINISGL_AMX=0 is MINISGL_KERNELS=avx512bf16
    and MINISGL_CPU_KERNELS=0 is MINISGL_KERNELS=torch (the lower cap wins); any other alias value
    is an error naming the valid ones."""
    best = cpu_kernels.machine_family()
    lower = lambda name: max(name, best, key=cpu_kernels.FAMILIES.index)  # noqa: E731
    assert cpu_kernels.family_from_env({}) == best
    assert cpu_kernels.family_from_env({"MINISGL_KERNELS": "AVX2 "}) == lower("avx2")
    assert cpu_kernels.family_from_env({"MINISGL_AMX": "0"}) == lower("avx512bf16")
    assert cpu_kernels.family_from_env({"MINISGL_AMX": "1", "MINISGL_CPU_KERNELS": "1"}) == best
    assert cpu_kernels.family_from_env({"MINISGL_CPU_KERNELS": "0"}) == "torch"
    assert cpu_kernels.family_from_env({"MINISGL_KERNELS": "avx2", "MINISGL_AMX": "0"}) == lower("avx2")
    with pytest.raises(
        ValueError, match=r"MINISGL_AMX='off': valid values are 0 \(MINISGL_KERNELS=avx512bf16\)"
    ):
        cpu_kernels.family_from_env({"MINISGL_AMX": "off"})
    with pytest.raises(ValueError, match="valid: amx, avx512bf16, avx512, avx2, torch"):
        cpu_kernels.family_from_env({"MINISGL_KERNELS": "sse2"})


def test_the_family_is_one_immutable_object():
    """The process runs one KernelFamily, which nothing changes; family_override swaps in another for
    its block and puts the same object back."""
    import dataclasses

    before = cpu_kernels.active()
    with pytest.raises(dataclasses.FrozenInstanceError):
        before.isa = cpu_kernels.ISA_AVX2  # type: ignore[misc]
    with cpu_kernels.family_override("torch"):
        inside = cpu_kernels.active()
        assert inside == cpu_kernels.KernelFamily.named("torch") and not cpu_kernels.available()
        assert (inside.native, inside.packs) == (False, None)
    assert cpu_kernels.active() is before
    assert cpu_kernels.KernelFamily.named("avx2").lanes == 8
    assert cpu_kernels.KernelFamily.named("avx512bf16").packs == "dpbf16"
    with pytest.raises(ValueError, match="'sse2' is not a kernel family; valid: amx, avx512bf16"):
        cpu_kernels.KernelFamily.named("sse2")


def test_machine_family_is_the_best_the_cpu_runs(monkeypatch):
    """machine_family() from the CPU probes: AVX2 + FMA without AVX-512 is the avx2 family, neither
    is torch (as is a build without the extension)."""

    class Cpu:
        def __init__(self, avx512: bool, avx2: bool) -> None:
            self.has_avx512 = self.has_avx512_bf16 = lambda: avx512
            self.has_avx2 = lambda: avx2
            self.has_amx = lambda: False

    cases = ((Cpu(True, True), "avx512bf16"), (Cpu(False, True), "avx2"), (Cpu(False, False), "torch"))
    for cpu, family in cases:
        monkeypatch.setattr(cpu_kernels, "_native", cpu)
        assert cpu_kernels.machine_family() == family
    monkeypatch.setattr(cpu_kernels, "_native", None)
    assert cpu_kernels.machine_family() == "torch"


def test_avx2_family_runs_no_avx512_only_kernel():
    """Under avx2 every wrapper runs the 8-lane kernels or torch: the int8 linear, the packed linears
    and the AMX / vdpbf16ps scorers decline (None, or ValueError for a scorer asked by name)."""
    if not cpu_kernels.runs_family("avx2"):
        pytest.skip("this CPU does not run the avx2 family")
    g = _gen(12)
    x, w = torch.randn(2, 64, generator=g).bfloat16(), torch.randn(32, 64, generator=g).bfloat16()
    q, k, v, tables, pos, _ = _attention_case(torch.bfloat16)
    with cpu_kernels.family_override("avx2"):
        assert cpu_kernels.isa() == cpu_kernels.ISA_AVX2 and cpu_kernels.lanes() == 8
        assert not (cpu_kernels.avx512_available() or cpu_kernels.amx_available() or cpu_kernels.packs())
        assert cpu_kernels.pack(w) is None and cpu_kernels.pack_kind() == 0
        qw, qs = torch.ones(32, 64, dtype=torch.int8), torch.ones(32)
        assert cpu_kernels.linear_int8(x, qw, qs, None) is None
        assert cpu_kernels.default_scorer() == "fma"
        assert [s for s in cpu_kernels.SCORERS if cpu_kernels.scorer_runs(s)] == ["fma"]
        with pytest.raises(ValueError, match="does not run under kernel family avx2"):
            cpu_kernels.paged_attention(q, k, v, tables, torch.arange(5), pos, 1.0, None, None, scorer="dp")


@pytest.mark.parametrize("family", VECTOR_FAMILIES)
def test_stream_read_probe_reads(family):
    """minisgl bench's read-rate probe (the batch-1 weight stream is reported against it)."""
    with cpu_kernels.family_override(family):
        assert cpu_kernels.stream_read_gbps(megabytes=64, repeat=2) > 0.5


@pytest.mark.skipif(not cpu_kernels.runs_family("amx"), reason="no AMX tile unit on this CPU")
def test_tile_unit_probe_measures_the_unit_and_only_under_amx():
    """bench.linear --tile-roof's probe: a positive rate with the tiles kept and loaded, None under a
    family without the tile unit, and a typed error for operands shorter than four tiles."""
    x = torch.randn(8 * 2048).bfloat16()
    with cpu_kernels.family_override("amx"):
        assert cpu_kernels.tile_tflops(x, rounds=4096) > 0.05
        assert cpu_kernels.tile_tflops(x, load=True, rounds=4096) > 0.05
        with pytest.raises(ValueError, match="operands"):
            cpu_kernels.tile_tflops(x[:2047], rounds=4096)
    with cpu_kernels.family_override("avx512bf16"):
        assert cpu_kernels.tile_tflops(x) is None


def test_packed_linear_outputs_keep_their_subnormals(packing):
    """The packed GEMMs round their outputs with vcvtneps2bf16 (the AVX512-BF16 GEMM, both families'
    fused SiLU x up), which flushes float32 subnormals to zero: a vector holding one must take the
    exact rounding instead. Outputs that are a subnormal bias (rows of zeros), and SiLU x up of tiny
    gates and ups (silu(g) = g / 2 exactly, then a product below the smallest normal), bitwise
    against torch's."""
    g = _gen(41)
    tiny = torch.finfo(torch.float32).smallest_normal
    w = (torch.randn(64, 32, generator=g) * 0.1).bfloat16()
    bias = (torch.randn(64, generator=g) * tiny / 3).bfloat16()  # float32 subnormals, kept by bf16
    bias[::5] = torch.randn(13, generator=g).bfloat16()  # most vectors mix normal and subnormal lanes
    x = torch.randn(9, 32, generator=g).bfloat16()
    x[::2] = 0.0
    gate_up = torch.zeros(64, 32).bfloat16()
    gate_up[:32, 0] = (torch.rand(32, generator=g) * 2.0**-64 + 2.0**-66).bfloat16()  # tiny gates
    gate_up[32:, 0] = (torch.rand(32, generator=g) * 2.0**-64 + 2.0**-66).bfloat16()  # tiny ups
    ones = torch.ones(3, 32).bfloat16()
    with torch.inference_mode():
        out = cpu_kernels.linear_packed(x, cpu_kernels.pack(w), w.shape, bias)
        act = cpu_kernels.linear_packed_silu(ones, cpu_kernels.pack(gate_up, gated=True), gate_up.shape)
    ref = F.linear(x.float(), w.float(), bias.float())
    assert torch.equal(out[::2], bias.expand(5, -1))  # zero rows: the bias, subnormals and all
    assert ((out.float() - ref).abs() <= 2**-7 * ref.abs() + 1e-30).all()
    gate, up = F.linear(ones, gate_up).chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert (want[0].float().abs() < tiny).any() and (want[0] != 0).all()  # the case this test is for
    assert torch.equal(act, want)
    # Normal gates whose SiLU (g / 2) is subnormal, times normal ups: the rounding of SiLU takes the
    # exact path too, not only the product's. (A subnormal sum itself never reaches the epilogue: the
    # tile unit and vdpbf16ps flush them to zero.)
    gate_up[:32, 0] = torch.tensor([tiny * 1.5, -tiny * 1.25, tiny * 1.875, -tiny * 1.125] * 8).bfloat16()
    gate_up[32:, 0] = (torch.rand(32, generator=g) + 0.5).bfloat16()
    with torch.inference_mode():
        act = cpu_kernels.linear_packed_silu(ones, cpu_kernels.pack(gate_up, gated=True), gate_up.shape)
    gate, up = gate_up[:, 0].expand(3, -1).chunk(2, dim=-1)  # the sums, one term each
    want = F.silu(gate) * up
    assert (gate[0].float().abs() >= tiny).all() and (F.silu(gate[0]).float().abs() < tiny).all()
    assert torch.equal(act, want)


@pytest.mark.parametrize("n,k", [(100, 64), (49, 96)])
def test_widened_packed_linear_stores_the_bf16_outputs_values(packing, n, k):
    """widen=True (the LM head's float32 logits): exactly the values of the bf16 outputs, bit for
    bit (AMX's own float32 stores; the AVX512-BF16 kernel's outputs converted), at row counts on both
    of AMX's paths (rows streamed up to 32, panels beyond), over N that is not whole tiles, with a
    bias, and on outputs that are subnormal, infinite or NaN."""
    g = _gen(43)
    tiny = torch.finfo(torch.float32).smallest_normal
    w = (torch.randn(n, k, generator=g) * 0.1).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    bias[::3] = (torch.randn(len(bias[::3]), generator=g) * tiny / 3).bfloat16()  # subnormal outputs
    packed = cpu_kernels.pack(w)
    for rows in (1, 5, 32, 33, 300):
        x = torch.randn(rows, k, generator=g).bfloat16()
        x[::4] = 0.0  # rows whose outputs are the bias
        if rows > 2:
            x[1, 3] = float("inf")
            x[2, 5] = float("nan")
        for b in (None, bias):
            y = cpu_kernels.linear_packed(x, packed, (n, k), b)
            wide = cpu_kernels.linear_packed(x, packed, (n, k), b, widen=True)
            assert wide.dtype == torch.float32 and wide.shape == y.shape
            assert torch.equal(y.float().view(torch.int32), wide.view(torch.int32)), f"{rows} rows"


@pytest.mark.skipif(not cpu_kernels.runs_family("amx"), reason="no AMX tile unit on this CPU")
@pytest.mark.parametrize("inter,h,bias", [(1536, 576, False), (96, 33, True), (64, 2200, False)])
def test_whole_mlp_has_the_bits_of_its_two_linears(inter, h, bias):
    """AMX's one-call MLP (its SiLU x up rows written straight into the down projection's packed row
    layout) gives, row by row, the bits of linear_packed_silu then linear_packed, at row counts on
    both sides of its 32-row threshold, across 16-row tiles and 512-row chunks, H not a whole k-step
    and a bias; fewer rows or other families decline (None)."""
    g = _gen(37)
    w = (torch.randn(2 * inter, h, generator=g) * 0.1).bfloat16()
    d = (torch.randn(h, inter, generator=g) * 0.1).bfloat16()
    b = torch.randn(h, generator=g).bfloat16() if bias else None
    x = torch.randn(600, h, generator=g).bfloat16()
    with cpu_kernels.family_override("amx"):
        gated, down = cpu_kernels.pack(w, gated=True), cpu_kernels.pack(d)
        for m in (33, 47, 64, 600):
            whole = cpu_kernels.mlp_packed(x[:m], gated, down, d.shape, b)
            steps = cpu_kernels.linear_packed(
                cpu_kernels.linear_packed_silu(x[:m], gated, w.shape), down, d.shape, b
            )
            assert whole is not None and torch.equal(whole, steps), f"{m} rows"
        assert cpu_kernels.mlp_packed(x[:32], gated, down, d.shape, b) is None
    with cpu_kernels.family_override("avx512"):
        assert cpu_kernels.mlp_packed(x, gated, down, d.shape, b) is None


@pytest.mark.parametrize("inter,k", [(1536, 576), (64, 96), (96, 33), (256, 1536)])
def test_fused_gate_up_silu_has_the_bits_of_the_linear_then_silu_and_mul(packing, inter, k):
    """The MLP path of both packing families: linear_packed_silu over the gated pack gives, row by
    row, the bits of linear_packed then silu_and_mul (what the model ran before the fusion), at row
    counts across their tiles, chunks and K blocks (AMX: both row orders, K in parts)."""
    g = _gen(31)
    w = (torch.randn(2 * inter, k, generator=g) * 0.1).bfloat16()
    x = torch.randn(600, k, generator=g).bfloat16()
    gated, plain = cpu_kernels.pack(w, gated=True), cpu_kernels.pack(w)
    for m in (1, 5, 7, 32, 97, 200, 600):
        fused = cpu_kernels.linear_packed_silu(x[:m], gated, w.shape)
        two_steps = cpu_kernels.silu_and_mul(cpu_kernels.linear_packed(x[:m], plain, w.shape))
        assert torch.equal(fused, two_steps), f"{m} rows"
    with cpu_kernels.family_override("avx512"):
        assert (
            cpu_kernels.pack(w, gated=True) is None
            and cpu_kernels.linear_packed_silu(x, gated, w.shape) is None
        )
