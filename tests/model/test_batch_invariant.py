"""The measured facts the batch-invariant forward rests on, checked op by op (fast, no engine).

If a torch or BLAS upgrade changes a kernel choice, these fail before the grid tests do, and say which
op broke.
"""

from __future__ import annotations

import pytest
import torch

from minisgl_backend.arith import cdiv
from minisgl_backend.model import cpu_kernels
from minisgl_backend.model.batch_invariant import KV_SPLIT, TiledLinear, attend, tiles_for

# (out, in) of SmolLM2-135M's projections and LM head, and of the tiny test model.
SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (49152, 576), (128, 64), (64, 128)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiled_linear_rows_do_not_depend_on_the_batch(dtype):
    """A row through TiledLinear has the same bits at any batch size and position, with the tiles
    the probe accepted for that shape (the plain F.linear fails this on some CPUs: see below)."""
    g = torch.Generator().manual_seed(0)
    for n, k in SHAPES:
        lin = torch.nn.Linear(k, n, bias=False).to(dtype)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
            lin.__class__ = TiledLinear
            lin.tiles = tiles_for(lin.weight, None)
            target = torch.randn(1, k, generator=g).to(dtype)
            ref = lin(target)[0]
            for m in (2, 3, 5, 7, 13, 16, 40, 64, 100, 130, 300, 600):
                x = torch.randn(m, k, generator=g).to(dtype)
                pos = (7 * m // 3) % m  # somewhere inside, not always row 0
                x[pos] = target[0]
                assert torch.equal(lin(x)[pos], ref), (n, k, m, dtype, lin.tiles)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_row_is_the_same_alone_in_a_prefill_tile_and_in_a_decode_batch(dtype):
    """A query at position p: alone (decode row, keys up to p), among 37 other prefill queries over a
    longer context, and as one of 5 decode rows whose contexts are longer: bitwise equal."""
    g = torch.Generator().manual_seed(1)
    h, kvh, d, ctx = 9, 3, 64, 150
    k = torch.randn(1, kvh, 3 * KV_SPLIT, d, generator=g).to(dtype)
    v = torch.randn(1, kvh, 3 * KV_SPLIT, d, generator=g).to(dtype)
    q = torch.randn(1, 40, h, d, generator=g).to(dtype)
    pos = torch.arange(ctx - 40, ctx)[None]
    p = 25  # query index inside the tile
    width = cdiv(int(pos[0, p]) + 1, KV_SPLIT) * KV_SPLIT
    alone = attend(q[:, p : p + 1], k[:, :, :width], v[:, :, :width], pos[:, p : p + 1], d**-0.5)[0, 0]
    tile = attend(q[:, 3:], k, v, pos[:, 3:], d**-0.5)[0, p - 3]
    batch_q = q[0, p - 2 : p + 3, None]  # 5 decode rows, same K/V, other positions
    batch_pos = pos[0, p - 2 : p + 3, None].clone()
    batch_pos[[0, 1, 3, 4]] = ctx - 1
    rows = attend(batch_q, k.expand(5, -1, -1, -1), v.expand(5, -1, -1, -1), batch_pos, d**-0.5)[2, 0]
    assert torch.equal(alone, tile) and torch.equal(alone, rows)


@pytest.mark.skipif(not cpu_kernels.available(), reason="the native kernels do not run here")
@pytest.mark.parametrize(
    "family", [f for f in ("avx512bf16", "avx512", "avx2") if cpu_kernels.runs_family(f)]
)
def test_float32_linears_run_the_kernel_at_every_row_count(family):
    """A float32 model's linears stay Linear in the batch-invariant forward, on the float32 kernel
    at every row count (no tiles, no probe), and a row's bits are the same alone as among hundreds
    of rows, past the row count where the default forward hands float32 rows to the BLAS."""
    from minisgl_backend.model import batch_invariant
    from minisgl_backend.model.layers import Linear
    from tests.helpers import random_bf16_model
    from tests.kernels.test_layer_stack import _spec

    with cpu_kernels.family_override(family):
        model = random_bf16_model(_spec()).float()
        batch_invariant.enable(model)
        linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
        assert linears and all(type(m) is Linear and m.any_rows for m in linears)
        g = torch.Generator().manual_seed(5)
        for lin in (model.lm_head, model.model.layers[0].mlp.gate_up_proj):
            x = torch.randn(300, lin.weight.shape[1], generator=g)
            with torch.no_grad():
                y = lin(x)
                for at, m in ((0, 1), (299, 1), (7, 3), (40, cpu_kernels.F32_KERNEL_ROWS + 1), (10, 290)):
                    assert torch.equal(lin(x[at : at + m]), y[at : at + m]), (family, at, m)
