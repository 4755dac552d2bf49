"""No host sync in a GPU forward, proven on the CPU. A sync (`.item()`, `.tolist()`, `.cpu()`,
`bool(t)`, `int(t)`, a device synchronize) stalls the compute worker until the GPU drains, so the
next iteration's launches no longer overlap this one's kernels.

- The forward a GPU runs with the torch attention path (LayerLoop without a back-end) runs on
  `torch.device("meta")` tensors for decode, mixed and later-chunk batches: a meta tensor has no
  values, so any read of one on the host raises.
- An AST scan of the model package and the CUDA executor finds every `.item()`, `.tolist()`,
  `.cpu()`, synchronize and blocking fetch call outside a short allow-list, each entry with its reason.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from minisgl_backend.iteration import PrefillChunk
from minisgl_backend.kvcache.storage import KVCache
from minisgl_backend.model.batch import ForwardBatch
from minisgl_backend.model.llama import CausalLM, LayerLoop, build_rotary
from tests.helpers import model_spec

pytestmark = pytest.mark.gpu_sim

META = torch.device("meta")
BLOCK = 4


def _meta_model(**spec_over) -> tuple[CausalLM, KVCache]:
    spec = model_spec(num_layers=2, **spec_over)
    with META:
        model = CausalLM(spec)
        model.model.rotary = build_rotary(spec)
    model.forward_strategy = LayerLoop()  # the GPU's torch attention path
    kv = KVCache(spec.num_layers, 16, BLOCK, spec.num_kv_heads, spec.head_dim, torch.float32, META)
    return model, kv


def _t(n: int | tuple[int, ...], dtype=torch.int64) -> torch.Tensor:
    return torch.empty(n, dtype=dtype, device=META)


def _batch(num_decode: int, chunks: list[tuple[int, int]], ctx_blocks: int = 3) -> ForwardBatch:
    """num_decode decode rows, then prompt chunks given as (length, ctx_len)."""
    prefill, start = [], num_decode
    for length, ctx in chunks:
        prefill.append(PrefillChunk(start, length, ctx, _t(-(-ctx // BLOCK))))
        start += length
    n = start
    decode = num_decode > 0
    return ForwardBatch(
        input_ids=_t(n),
        positions=_t(n),
        slot_mapping=_t(n),
        num_decode=num_decode,
        decode_block_tables=_t((num_decode, ctx_blocks)) if decode else None,
        decode_mask=_t((num_decode, 1, 1, ctx_blocks * BLOCK), torch.bool) if decode else None,
        prefill_chunks=tuple(prefill),
        logits_index=_t(num_decode + len(chunks)),
    )


BATCHES = {
    "decode": _batch(3, []),
    "mixed": _batch(2, [(5, 5), (3, 3)]),
    "later-chunk": _batch(0, [(4, 10)]),
    "mixed-later-chunk": _batch(1, [(4, 10), (2, 2)]),
}
SPECS = {"plain": {}, "window-softcap": dict(sliding_window=5, attn_softcap=30.0, final_softcap=20.0)}


@pytest.mark.parametrize("spec", SPECS, ids=list(SPECS))
@pytest.mark.parametrize("name", BATCHES, ids=list(BATCHES))
def test_forward_on_meta_tensors_reads_nothing_on_the_host(name: str, spec: str) -> None:
    model, kv = _meta_model(**SPECS[spec])
    batch = BATCHES[name]
    logits = model(batch, kv)
    assert logits.device == META and logits.shape == (batch.logits_index.shape[0], model.spec.vocab_size)


@pytest.mark.parametrize(
    "read",
    [
        lambda t: t.max().item(),
        lambda t: t.tolist(),
        lambda t: t.cpu(),
        lambda t: bool(t.any()),
        lambda t: int(t.max()),
    ],
    ids=["item", "tolist", "cpu", "bool", "int"],
)
def test_every_host_read_of_a_meta_tensor_raises(read) -> None:
    """The premise of the meta forward: each kind of host sync fails on a meta tensor."""
    with pytest.raises((RuntimeError, NotImplementedError)):
        read(BATCHES["mixed"].positions)


# ------------------------------------------------------------------------ the source scan

ROOT = Path(__file__).resolve().parents[2] / "minisgl_backend"
SCANNED = sorted((ROOT / "model").glob("*.py")) + [ROOT / "executor" / f for f in ("cuda.py", "graphs.py")]
SYNCS = {"item", "tolist", "cpu", "synchronize", "event_synchronize", "to_host"}
# (file, function, call): why this sync is not on the per-iteration launch path.
ALLOWED = {
    ("executor/cuda.py", "attach", "synchronize"): "once at start-up: loading ran on another stream",
    ("executor/cuda.py", "attach", "event_synchronize"): "once at start-up: the clock's reference event",
    ("executor/cuda.py", "_fetch", "to_host"): "on the copy worker, rarely: rows the reduction left open",
    (
        "executor/graphs.py",
        "capture",
        "synchronize",
    ): "once at start-up: each bucket's warm-up before capture",
}


def host_syncs(path: Path) -> list[tuple[str, str, int]]:
    """(enclosing function, called attribute, line) of every call of a SYNCS attribute in `path`."""
    found: list[tuple[str, str, int]] = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr in SYNCS
            ):
                found.append((func, child.func.attr, child.lineno))
            visit(child, name)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_no_host_sync_in_the_model_or_the_cuda_executor_outside_the_allow_list() -> None:
    seen = set()
    bad = []
    for path in SCANNED:
        rel = path.relative_to(ROOT).as_posix()
        for func, attr, line in host_syncs(path):
            key = (rel, func, attr)
            seen.add(key)
            if key not in ALLOWED:
                bad.append(f"{rel}:{line} {func}() calls .{attr}()")
    assert not bad, "host syncs outside the allow-list:\n" + "\n".join(bad)
    assert seen >= set(ALLOWED), f"stale allow-list entries: {set(ALLOWED) - seen}"


def test_the_scan_finds_a_sync(tmp_path: Path) -> None:
    src = tmp_path / "m.py"
    src.write_text("def f(t):\n    n = t.max().item()\n    return t.tolist()\n")
    assert host_syncs(src) == [("f", "item", 2), ("f", "tolist", 3)]
