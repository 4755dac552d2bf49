"""The defaults a GPU user expects, proven on the CPU: the dtype an `auto` config runs in, and the KV
pool sized from free device memory (pure functions: bytes in, blocks out)."""

from __future__ import annotations

import pytest
import torch

from minisgl_backend.config import EngineConfig, resolve_dtype
from minisgl_backend.errors import ConfigError
from minisgl_backend.kvcache.storage import kv_blocks_from_device_memory

GIB = 2**30


def test_auto_dtype_is_float32_on_cpu_and_the_checkpoints_on_cuda():
    assert resolve_dtype("auto", "cpu", "bfloat16") == "float32"
    assert resolve_dtype("auto", "cuda", "bfloat16") == "bfloat16"
    assert resolve_dtype("auto", "cuda", torch.float32) == "float32"  # transformers gives a torch.dtype
    assert resolve_dtype("auto", "cuda", "float16") == "bfloat16"  # not a dtype the model runs in
    assert resolve_dtype("auto", "cuda", None) == "bfloat16"  # config.json names none
    assert resolve_dtype("float32", "cuda", "bfloat16") == "float32"  # an explicit dtype wins
    assert resolve_dtype("bfloat16", "cpu", None) == "bfloat16"


def test_cpu_config_resolves_its_defaults_and_keeps_explicit_values():
    cfg = EngineConfig()
    assert (cfg.dtype, cfg.kv_cache_memory_gb, cfg.gpu_memory_utilization) == ("float32", 1.0, 0.9)
    cfg = EngineConfig(dtype="bfloat16", kv_cache_memory_gb=0.25)
    assert (cfg.dtype, cfg.kv_cache_memory_gb) == ("bfloat16", 0.25)


@pytest.mark.parametrize("bad", [0.0, 1.5, -0.1, float("nan")])
def test_gpu_memory_utilization_out_of_range_is_a_config_error(bad):
    with pytest.raises(ConfigError, match=r"gpu_memory_utilization.*\(0, 1\]"):
        EngineConfig(gpu_memory_utilization=bad)


def test_kv_blocks_take_the_share_left_after_what_is_in_use():
    per_block = 2 * 2**20  # 2 MiB
    # 80 GiB device, 10 GiB in use (weights): 0.9 x 80 - 10 = 62 GiB for the pool.
    assert kv_blocks_from_device_memory(70 * GIB, 80 * GIB, 0.9, per_block) == 62 * GIB // per_block
    # Other processes' memory counts as in use too: 40 GiB free leaves 72 - 40 = 32 GiB.
    assert kv_blocks_from_device_memory(40 * GIB, 80 * GIB, 0.9, per_block) == 32 * GIB // per_block
    # A partial block does not count.
    used = GIB - 5 * per_block // 2  # the 0.5 share of 2 GiB leaves two and a half blocks
    assert kv_blocks_from_device_memory(2 * GIB - used, 2 * GIB, 0.5, per_block) == 2
    assert kv_blocks_from_device_memory(80 * GIB, 80 * GIB, 1.0, per_block) == 80 * GIB // per_block


def test_kv_blocks_refuse_a_share_that_leaves_no_block():
    with pytest.raises(ConfigError, match="gpu_memory_utilization=0.5.*kv_cache_memory_gb or num_blocks"):
        kv_blocks_from_device_memory(30 * GIB, 80 * GIB, 0.5, 2**20)  # 50 GiB in use > 40 GiB share


def test_memory_the_allocator_holds_cached_counts_as_free(monkeypatch):
    """A pool sized after an earlier engine or model let go of device memory sees that memory as
    free, although torch's allocator keeps it reserved (the device's own count does not)."""
    from minisgl_backend import engine

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda dev: (10 * gib, 140 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda dev: 100 * gib)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda dev: 4 * gib)
    assert engine._device_free_bytes(torch.device("cuda")) == (106 * gib, 140 * gib)
