"""Engine configuration: one frozen dataclass handed to every constructor."""

from __future__ import annotations

import dataclasses
import importlib.resources
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from minisgl_backend.errors import ConfigError
from minisgl_backend.validation import SEED_LIMIT, Spec, machine_memory_gb, validate_fields

DEFAULT_MODEL = "smollm2-135m-instruct"
REPO_ROOT = Path(__file__).resolve().parents[1]  # source / editable checkout: configs/ lives here
PACKAGE_CONFIGS = "configs"  # a wheel carries a copy of configs/ here, inside the package (setup.py)


def checkout_root() -> Path | None:
    """The repository this package runs from (a source or editable install), None in a wheel install."""
    return REPO_ROOT if (REPO_ROOT / "pyproject.toml").is_file() else None


def package_configs() -> Path:
    """The configs/ copy shipped as package data (present in a wheel install only)."""
    return Path(str(importlib.resources.files("minisgl_backend") / PACKAGE_CONFIGS))


def config_dir(kind: str) -> Path:
    """The directory of one kind of shipped config (`engine`, `determinism`, `tasks`): the checkout's
    configs/KIND where there is one, else the installed package's copy."""
    root = checkout_root()
    if root is not None and (root / "configs" / kind).is_dir():
        return root / "configs" / kind
    return package_configs() / kind


PRESET_DIR = config_dir("engine")  # where bare preset names are looked up (at import time)


CPU_KV_CACHE_GB = 1.0  # the KV pool of a CPU run when neither num_blocks nor kv_cache_memory_gb is set
MODEL_DTYPES = ("float32", "bfloat16")  # what the model's weights and KV cache can be held in


def resolve_dtype(dtype: str, device_type: str, checkpoint_dtype: object = None) -> str:
    """The dtype an engine runs in. An explicit `dtype` wins. `auto` is float32 on a CPU (its kernels'
    reference precision). On CUDA it is the checkpoint's `torch_dtype` (config.json) when that is one
    the model runs in, and bfloat16 otherwise: a float16 checkpoint runs in bfloat16 (the same bytes,
    float32's range) and a checkpoint that names none is a GPU's usual inference dtype."""
    if dtype != "auto":
        return dtype
    if device_type == "cpu":
        return "float32"
    name = str(checkpoint_dtype).removeprefix("torch.") if checkpoint_dtype is not None else None
    return name if name in MODEL_DTYPES else "bfloat16"


@dataclass(frozen=True)
class EngineConfig:
    """Every knob of the engine. See docs/configuration.md for the meaning of each field."""

    # --- model ---
    model: str = DEFAULT_MODEL
    dtype: str = "auto"  # auto | float32 | bfloat16 (auto: float32 on a CPU; see resolve_dtype)
    device: str = "cpu"
    max_model_len: int | None = None  # None = model's max_position_embeddings, capped by the KV pool
    # --- paged KV cache: one preallocated pool of fixed-size blocks ---
    block_size: int = 16
    num_blocks: int | None = None  # None = derived from kv_cache_memory_gb
    kv_cache_memory_gb: float | None = None  # None = 1 GiB on a CPU; on CUDA, gpu_memory_utilization
    gpu_memory_utilization: float = 0.9  # CUDA: share of device memory this engine may hold
    # --- scheduler: batch sizes and chunked prefill ---
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting_requests: int | None = None  # Engine.submit past this many waiting raises QueueFullError
    chunk_size: int | None = 256  # None = whole-prompt prefill (no chunking)
    mixed_batches: bool = True  # prefill chunks and decode rows share one batch
    scheduling_policy: str = "fair"  # fair (owners take turns at admission) | fcfs (arrival order)
    # --- prefix cache: reuse the K/V of a shared prompt prefix ---
    prefix_cache: str = "async"  # off | sync (insert on the completion path) | async (insert while idle)
    # --- overlap scheduling: plan the next iterations while the current ones run ---
    overlap: bool = True  # plan and post-process on the scheduler thread while iterations run
    max_inflight: int = 4  # iterations submitted but not finished (overlap=False means 1)
    callback_impl: str = "native"  # completion callbacks: native (csrc/) | python
    debug_unsafe_reclaim: bool = False  # DEBUG: free blocks/rows at release, ignoring fences (leaks)
    debug_delay_ms: float = 0.0  # DEBUG: random delay up to this in the copy stage (widens races)
    # --- bookkeeping kept off the hot path: metrics, logs, tracing ---
    metrics_exact: bool = False  # exact metric totals under a lock (profiling) instead of ~1 s folds
    stats_interval_s: float = 10.0  # period of the one-line stats log; 0 turns it off
    stall_timeout_s: float = 60.0  # watchdog: fail the engine after this long without progress; 0 = off
    trace: bool = False  # record scheduler / compute / copy spans per iteration (Engine.tracer)
    # --- determinism ---
    deterministic: bool = False  # batch-invariant forward: logits independent of batching and chunking
    # --- sampling: every request draws from its own keyed noise ---
    seed: int | None = None  # seeds unseeded requests reproducibly; None = fresh random seeds
    # --- limits ---
    max_logprobs: int = (
        20  # most `logprobs` / `prompt_logprobs` alternatives a request may ask for (vLLM's default)
    )
    # --- runtime ---
    num_threads: int | None = None  # torch intra-op threads; None = torch default
    weight_dtype: str | None = None  # None = dtype; int8 = weight-only int8 for decode (bf16, CPU)
    cuda_graphs: bool | None = None  # decode batches replay CUDA graphs at buckets; None = on a GPU only
    switch_interval_ms: float | None = None  # Python's GIL switch interval while running; None = leave it

    def __post_init__(self) -> None:
        if isinstance(self.model, os.PathLike):
            object.__setattr__(self, "model", os.fspath(self.model))
        given: object = self.prefix_cache
        if given is False:  # YAML 1.1 reads a bare `off` as false
            object.__setattr__(self, "prefix_cache", "off")
        validate_fields(self, _SPECS, ConfigError)
        try:
            device_type = torch.device(self.device).type
        except (RuntimeError, TypeError, ValueError):
            device_type = None
        if device_type not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if device_type == "cpu":
            # A CPU run reads no checkpoint dtype and no device memory: its defaults are fixed here, so
            # every reader of the config sees concrete values.
            if self.dtype == "auto":
                object.__setattr__(self, "dtype", "float32")
            if self.kv_cache_memory_gb is None:
                object.__setattr__(self, "kv_cache_memory_gb", CPU_KV_CACHE_GB)
        if self.cuda_graphs is None and device_type == "cuda":
            # Left None on a CPU (off), so that a CPU config replaced onto a GPU turns them on.
            object.__setattr__(self, "cuda_graphs", True)
        mem = machine_memory_gb()
        if (
            device_type == "cpu"
            and mem is not None
            and self.kv_cache_memory_gb is not None
            and self.kv_cache_memory_gb > mem
        ):
            raise ConfigError(
                f"kv_cache_memory_gb must be > 0 and at most this machine's memory "
                f"({mem:.1f} GiB), got {self.kv_cache_memory_gb}"
            )

        if device_type == "cuda" and self.deterministic:
            raise ConfigError(
                "deterministic: true is proven for the CPU kernels only (batch-invariant linears and "
                "attention, tested on the CPU); on CUDA it is not, so it is refused rather than promised: "
                "set deterministic: false (the keyed sampler still keeps the output distribution "
                "independent of batching)"
            )
        if self.cuda_graphs and device_type != "cuda":
            raise ConfigError(
                f"cuda_graphs: true needs device: cuda (got device={self.device!r}); on a CPU the forward "
                "runs eagerly, so set cuda_graphs: false"
            )
        if self.weight_dtype == "int8" and (
            device_type != "cpu" or self.dtype != "bfloat16" or self.deterministic
        ):
            raise ConfigError(
                "weight_dtype: int8 is the bf16 CPU decode path: it needs dtype: bfloat16, device: cpu and "
                f"deterministic: false (got dtype={self.dtype!r}, device={self.device!r}, "
                f"deterministic={self.deterministic})"
            )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> EngineConfig:
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ConfigError(
                f"unknown engine config key(s) {unknown}; valid keys: {', '.join(cls.field_names())}"
            )
        return cls(**values)

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> EngineConfig:
        """Load a YAML preset (a flat mapping of field names), then apply keyword overrides."""
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"engine config file not found: {path}")
        return cls.from_dict({**_read_preset(path), **overrides})

    @classmethod
    def resolve(
        cls,
        preset: str | os.PathLike[str] | None = None,
        overrides: Mapping[str, Any] | None = None,
        *,
        defaults: Mapping[str, Any] | None = None,
        model: str | os.PathLike[str] | None = None,
    ) -> EngineConfig:
        """The one way the CLI and the adapters build an EngineConfig.

        Precedence, lowest first: the `preset` (a path or a bare name, see `resolve_preset`), then
        `defaults` (a command's or adapter's own defaults), then `overrides` (what the user gave:
        flags, --set, model_args, engine_config), then `model` when not None. Unknown keys in any
        layer raise ConfigError naming the valid keys.
        """
        values = load_preset(preset) if preset is not None else {}
        values.update(defaults or {})
        values.update(overrides or {})
        if model is not None:
            values["model"] = model
        return cls.from_dict(values)

    def replace(self, **changes: Any) -> EngineConfig:
        return self.from_dict({**dataclasses.asdict(self), **changes})


def resolve_preset(ref: str | os.PathLike[str], preset_dir: Path | None = None) -> Path:
    """A preset's file: the path as given (relative to the working directory), else relative to the
    repository, else a bare name under configs/engine/ (`serial` -> configs/engine/serial.yaml; the
    checkout's where there is one, else the installed package's: `config_dir`)."""
    ref = os.fspath(ref)
    preset_dir = preset_dir or config_dir("engine")
    root = checkout_root()
    candidates = [Path(ref), *([root / ref] if root else []), preset_dir / f"{ref}.yaml"]
    if ref.startswith("configs/engine/"):  # the repository's spelling, also in a wheel install
        candidates.append(preset_dir / ref.removeprefix("configs/engine/"))
    candidates = list(dict.fromkeys(candidates))
    for path in candidates:
        if path.is_file():
            return path
    names = ", ".join(sorted(p.stem for p in preset_dir.glob("*.yaml"))) or "none"
    raise ConfigError(
        f"engine config {ref!r} not found (looked at: {', '.join(map(str, candidates))}; presets: {names})"
    )


def load_preset(ref: str | os.PathLike[str]) -> dict[str, Any]:
    """The key/value mapping of a preset (found by `resolve_preset`), not yet checked against the fields."""
    return _read_preset(resolve_preset(ref))


def _read_preset(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of config keys, got {type(data).__name__}")
    return data


# What every field accepts (minisgl_backend/validation.py): types are exact, ranges named in errors.
_SPECS: dict[str, Spec] = {
    "model": Spec("str", note="alias, Hugging Face directory or .gguf path"),
    "dtype": Spec("choice", choices=("auto", *MODEL_DTYPES)),
    "device": Spec("str", note="'cpu', 'cuda' or 'cuda:N'"),
    "max_model_len": Spec("int", lo=1, optional=True, note="None = the model's limit"),
    "block_size": Spec("int", lo=1, hi=65536),
    "num_blocks": Spec("int", lo=1, optional=True, note="None = sized from kv_cache_memory_gb"),
    "kv_cache_memory_gb": Spec(
        "float",
        lo=0,
        lo_open=True,
        optional=True,
        note="None = 1 GiB on a CPU; on CUDA by gpu_memory_utilization",
    ),
    "gpu_memory_utilization": Spec("float", lo=0, hi=1, lo_open=True),
    "max_num_seqs": Spec("int", lo=1),
    "max_waiting_requests": Spec("int", lo=1, optional=True, note="None = unbounded"),
    "max_num_batched_tokens": Spec("int", lo=1),
    "chunk_size": Spec("int", lo=1, optional=True, note="None = whole-prompt prefill"),
    "mixed_batches": Spec("bool"),
    "scheduling_policy": Spec("choice", choices=("fair", "fcfs")),
    "prefix_cache": Spec("choice", choices=("off", "sync", "async")),
    "overlap": Spec("bool"),
    "max_inflight": Spec("int", lo=1),
    "callback_impl": Spec("choice", choices=("native", "python")),
    "debug_unsafe_reclaim": Spec("bool"),
    "debug_delay_ms": Spec("float", lo=0),
    "metrics_exact": Spec("bool"),
    "stats_interval_s": Spec("float", lo=0, note="0 = off"),
    "stall_timeout_s": Spec("float", lo=0, note="0 turns the watchdog off"),
    "trace": Spec("bool"),
    "deterministic": Spec("bool"),
    "seed": Spec("int", lo=0, hi=SEED_LIMIT, hi_open=True, optional=True),
    "max_logprobs": Spec("int", lo=0),
    "num_threads": Spec("int", lo=1, optional=True, note="None = torch default"),
    "weight_dtype": Spec("choice", choices=("int8",), optional=True, note="None = dtype"),
    "cuda_graphs": Spec("bool", optional=True, note="None = on a GPU, off on a CPU"),
    "switch_interval_ms": Spec("float", lo=0, lo_open=True, optional=True, note="None = the process's own"),
}
