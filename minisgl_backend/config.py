"""Engine configuration: one frozen dataclass handed to every constructor."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from minisgl_backend.errors import ConfigError

DEFAULT_MODEL = "smollm2-135m-instruct"


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of the engine. See README "Configuration" for the meaning of each field."""

    # --- model ---
    model: str = DEFAULT_MODEL
    dtype: str = "float32"  # float32 | bfloat16
    device: str = "cpu"
    max_model_len: int | None = None  # None = model's max_position_embeddings, capped by the KV pool
    # --- paged KV cache (S4) ---
    block_size: int = 16
    num_blocks: int | None = None  # None = derived from kv_cache_memory_gb
    kv_cache_memory_gb: float = 1.0
    # --- scheduler (S3, S12) ---
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting_requests: int | None = None  # Engine.submit past this many waiting raises QueueFullError
    chunk_size: int | None = 256  # None = whole-prompt prefill (no chunking)
    mixed_batches: bool = True  # prefill chunks and decode rows share one batch
    # --- prefix cache (S1, S9) ---
    prefix_cache: str = "async"  # off | sync (insert on the completion path) | async (insert while idle)
    # --- overlap scheduling (S11-S14, S18) ---
    overlap: bool = True  # plan and post-process on the scheduler thread while iterations run
    max_inflight: int = 4  # iterations submitted but not finished (overlap=False means 1)
    callback_impl: str = "native"  # completion callbacks: native (csrc/) | python
    debug_unsafe_reclaim: bool = False  # DEBUG: free blocks/rows at release, ignoring fences (ghost bug)
    debug_delay_ms: float = 0.0  # DEBUG: random delay up to this in the copy stage (widens races)
    # --- relaxed bookkeeping (S9) ---
    metrics_exact: bool = False  # exact metric totals under a lock (profiling) instead of ~1 s folds
    stats_interval_s: float = 10.0  # period of the one-line stats log; 0 turns it off
    stall_timeout_s: float = 60.0  # watchdog: fail the engine after this long without progress; 0 = off
    trace: bool = False  # record scheduler / compute / copy spans per iteration (Engine.tracer)
    # --- determinism (G3) ---
    deterministic: bool = False  # batch-invariant forward: logits independent of batching and chunking
    # --- sampling (S8) ---
    seed: int | None = None  # seeds unseeded requests reproducibly; None = fresh random seeds
    # --- runtime ---
    num_threads: int | None = None  # torch intra-op threads; None = torch default

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(msg)

        if self.dtype not in ("float32", "bfloat16"):
            bad(f"dtype must be 'float32' or 'bfloat16', got {self.dtype!r}")
        try:
            device_type = torch.device(self.device).type
        except (RuntimeError, TypeError):
            device_type = None
        if device_type not in ("cpu", "cuda"):
            bad(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.block_size < 1:
            bad(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            bad(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory_gb <= 0:
            bad(f"kv_cache_memory_gb must be > 0, got {self.kv_cache_memory_gb}")
        if self.max_num_seqs < 1:
            bad(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_waiting_requests is not None and (
                isinstance(self.max_waiting_requests, bool) or not isinstance(self.max_waiting_requests, int)
                or self.max_waiting_requests < 1):
            bad(f"max_waiting_requests must be a positive int or None, got {self.max_waiting_requests!r}")
        if self.max_num_batched_tokens < 1:
            bad(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.chunk_size is not None and self.chunk_size < 1:
            bad(f"chunk_size must be >= 1 or None, got {self.chunk_size}")
        if self.max_inflight < 1:
            bad(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.prefix_cache is False:  # YAML 1.1 reads a bare `off` as false
            object.__setattr__(self, "prefix_cache", "off")
        if self.prefix_cache not in ("off", "sync", "async"):
            bad(f"prefix_cache must be 'off', 'sync' or 'async', got {self.prefix_cache!r}")
        if self.callback_impl not in ("native", "python"):
            bad(f"callback_impl must be 'native' or 'python', got {self.callback_impl!r}")
        if self.stats_interval_s < 0:
            bad(f"stats_interval_s must be >= 0, got {self.stats_interval_s}")
        if not self.stall_timeout_s >= 0:  # also rejects NaN
            bad(f"stall_timeout_s must be >= 0 (0 turns the watchdog off), got {self.stall_timeout_s}")
        if self.debug_delay_ms < 0:
            bad(f"debug_delay_ms must be >= 0, got {self.debug_delay_ms}")
        if not isinstance(self.deterministic, bool):  # a truthy string must not silently turn it on
            bad(f"deterministic must be true or false, got {self.deterministic!r}")
        if self.max_model_len is not None and self.max_model_len < 1:
            bad(f"max_model_len must be >= 1 or None, got {self.max_model_len}")

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> "EngineConfig":
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ConfigError(
                f"unknown engine config key(s) {unknown}; valid keys: {', '.join(cls.field_names())}"
            )
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> "EngineConfig":
        """Load a YAML preset (a flat mapping of field names), then apply keyword overrides."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"engine config file not found: {path}")
        data = yaml.safe_load(path.read_text()) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
        return cls.from_dict({**data, **overrides})

    def replace(self, **changes: Any) -> "EngineConfig":
        return self.from_dict({**dataclasses.asdict(self), **changes})
