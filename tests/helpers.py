"""Plain helpers shared by test modules of several directories (fixtures live in the conftest.py files).

Shapes of small models and engines written once: a test module imports them instead of repeating the
literal, and states only what it changes.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

# One intra-op thread and no periodic stats line: what most engine fixtures run with.
QUIET = dict(num_threads=1, stats_interval_s=0)
# A small paged pool that chunks prompts (16 tokens) and splits them across blocks of 4.
SMALL_POOL = dict(num_blocks=256, block_size=4, chunk_size=16, max_num_batched_tokens=64, max_model_len=128)


def token_prompts(n: int, base: int = 0) -> list[list[int]]:
    """Token-id prompts of different lengths (3..40) so chunks and blocks fall in different places."""
    return [[100 + (base + i * 7 + j * 13) % 4000 for j in range(3 + (i * 11) % 38)] for i in range(n)]


def model_spec(**over: Any):
    """A one-layer fp32 Llama ModelSpec (GQA: 4 query heads on 2 KV heads of dim 8), with `over`."""
    from minisgl_backend.model.spec import ModelSpec

    shape = dict(vocab_size=10, hidden_size=32, intermediate_size=8, num_layers=1, head_dim=8)
    attention = dict(num_heads=4, num_kv_heads=2, rope_theta=10000.0, max_position_embeddings=64)
    plain = dict(rms_norm_eps=1e-5, tie_word_embeddings=False, qkv_bias=False, mlp_bias=False, qk_norm=False)
    return ModelSpec(**(shape | attention | plain | over))


def random_bf16_model(spec: Any) -> Any:
    """A CausalLM of `spec` with seeded random weights (norm weights too: away from the all-ones
    init), in bf16, not yet packed: what the kernel-level model tests run on."""
    import torch

    from minisgl_backend.model.llama import CausalLM

    torch.manual_seed(0)
    model = CausalLM(spec)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * 0.2 + (1.0 if p.dim() == 1 else 0.0))
    return model.to(torch.bfloat16)


def hf_tiny_config(**over: Any) -> dict[str, Any]:
    """Keyword arguments of a 2-layer transformers config (SmolLM2's vocabulary, hidden 64, GQA 4/2,
    untied, large random weights), with `over`."""
    shape = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    heads = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    rest = dict(tie_word_embeddings=False, rms_norm_eps=1e-6, initializer_range=0.2)
    return shape | heads | rest | over


def assert_drained(engine: Any, timeout: float = 60) -> dict:
    """drain(flush_cache=True): nothing running or waiting, every KV block FREE. Returns the counts."""
    counts = engine.drain(timeout=timeout, flush_cache=True)
    assert counts["running"] == counts["waiting"] == 0, counts
    assert counts["FREE"] == engine.num_blocks, counts
    return counts


@contextmanager
def drained_engine(model_dir: Any, **config: Any) -> Iterator[Any]:
    """An Engine on `model_dir` with `config`; on leaving, assert_drained before it closes."""
    from minisgl_backend import Engine, EngineConfig

    with Engine(EngineConfig(model=str(model_dir), **config)) as eng:
        yield eng
        assert_drained(eng)


def run_module(module: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m module args...` in a child interpreter, output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, timeout=timeout
    )


def run_minisgl(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The `minisgl` command line (`python -m minisgl_backend.cli args...`)."""
    return run_module("minisgl_backend.cli", *args, timeout=timeout)


def sampling_inputs(samples: tuple, scores: tuple = ()) -> Any:
    """The IterationInputs of a sampling stage test: `samples` and `scores` over logits rows 0.. (no
    forward inputs: the stage reads none)."""
    import torch

    from minisgl_backend.iteration import IterationInputs

    empty = torch.zeros(0, dtype=torch.int64)
    return IterationInputs(
        iteration=1,
        depends_on=0,
        table_rows=empty,
        positions=empty,
        slot_mapping=empty,
        prompt_writes=(),
        num_decode=0,
        decode_block_tables=None,
        decode_mask=None,
        prefill_chunks=(),
        logits_index=torch.arange(len(samples) + len(scores)),
        samples=samples,
        scores=scores,
    )
