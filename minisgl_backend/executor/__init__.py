"""Executors: one interface (executor/base.py), a back-end per device type, chosen here only."""

from __future__ import annotations

import torch

from minisgl_backend.config import EngineConfig
from minisgl_backend.errors import ConfigError, DeviceUnavailableError
from minisgl_backend.executor.base import DualWorkerExecutor
from minisgl_backend.executor.tracker import InflightTracker, make_tracker
from minisgl_backend.metrics import Metrics, Tracer


def check_device(device: str) -> torch.device:
    """The configured device, or DeviceUnavailableError when this machine cannot run on it."""
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailableError(
                f"device {device!r}: CUDA is not available to this torch build ({torch.__version__}) "
                "or no GPU is visible; use device 'cpu'"
            )
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise DeviceUnavailableError(
                f"device {device!r}: only {torch.cuda.device_count()} CUDA device(s) are visible"
            )
    return dev


def make_executor(
    config: EngineConfig, tracker: InflightTracker, metrics: Metrics, tracer: Tracer
) -> DualWorkerExecutor:
    """The executor for `config.device`. The engine and scheduler never look at the device type."""
    dev = check_device(config.device)
    if dev.type == "cuda":
        from minisgl_backend.executor.cuda import CUDAExecutor

        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        total_gb = torch.cuda.get_device_properties(dev).total_memory / 2**30
        if (
            config.num_blocks is None
            and config.kv_cache_memory_gb is not None
            and config.kv_cache_memory_gb > total_gb
        ):
            raise ConfigError(
                f"kv_cache_memory_gb must be at most the memory of {dev} ({total_gb:.1f} GiB), "
                f"got {config.kv_cache_memory_gb}"
            )
        copied = make_tracker(config.callback_impl, tracker.max_inflight)
        return CUDAExecutor(
            dev,
            tracker,
            copied,
            metrics,
            tracer,
            debug_delay_ms=config.debug_delay_ms,
            decode_graphs=bool(config.cuda_graphs),
        )
    from minisgl_backend.executor.cpu import CPUExecutor

    return CPUExecutor(tracker, metrics, tracer, debug_delay_ms=config.debug_delay_ms)
