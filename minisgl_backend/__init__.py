"""minisgl: a small LLM inference engine with continuous batching over a paged KV cache."""

from minisgl_backend.config import EngineConfig
from minisgl_backend.engine import Engine
from minisgl_backend.errors import (
    ConfigError,
    DeviceUnavailableError,
    EmptyPromptError,
    EngineDeadError,
    EngineStalledError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    InvariantError,
    MiniSGLError,
    ModelLoadError,
    ModelNotFoundError,
    PromptTooLongError,
    QueueFullError,
    ReentrantCallError,
    RequestFailedError,
)
from minisgl_backend.handle import RequestHandle
from minisgl_backend.kvcache.block_pool import BlockState
from minisgl_backend.types import RequestOutput, RequestTimings, SamplingParams, StreamDelta, TokenLogprob

__all__ = [
    "BlockState",
    "ConfigError",
    "DeviceUnavailableError",
    "EmptyPromptError",
    "Engine",
    "EngineConfig",
    "EngineDeadError",
    "EngineStalledError",
    "InvalidRequestError",
    "InvalidSamplingParamsError",
    "InvariantError",
    "MiniSGLError",
    "ModelLoadError",
    "ModelNotFoundError",
    "PromptTooLongError",
    "QueueFullError",
    "ReentrantCallError",
    "RequestFailedError",
    "RequestHandle",
    "RequestOutput",
    "RequestTimings",
    "SamplingParams",
    "StreamDelta",
    "TokenLogprob",
]
