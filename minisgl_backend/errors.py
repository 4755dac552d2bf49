"""Typed errors. Every user mistake maps to one of these, with a message naming the problem."""


class MiniSGLError(Exception):
    """Base class of every error this package raises on purpose."""


class ConfigError(MiniSGLError, ValueError):
    """An engine config value or key is invalid."""


class DeviceUnavailableError(ConfigError):
    """The configured device (e.g. `cuda`) is valid but this machine or this torch build lacks it."""


class MissingExtraError(MiniSGLError, ImportError):
    """An optional feature needs a package extra that is not installed; the message names it."""


class ModelNotFoundError(MiniSGLError, FileNotFoundError):
    """The model reference is neither a known alias, a Hugging Face directory nor a .gguf file."""


class InvalidRequestError(MiniSGLError, ValueError):
    """A request cannot be served as given (bad prompt or bad sampling parameters)."""


class EmptyPromptError(InvalidRequestError):
    """The prompt has no tokens."""


class PromptTooLongError(InvalidRequestError):
    """The prompt does not fit the model's context (max_model_len)."""


class InvalidSamplingParamsError(InvalidRequestError):
    """A sampling parameter is out of range or unknown."""


class QueueFullError(MiniSGLError, RuntimeError):
    """The waiting queue holds `max_waiting_requests` requests already: retry later (HTTP 503)."""


class EngineDeadError(MiniSGLError, RuntimeError):
    """The engine stopped (closed, or its scheduler thread failed); the cause is chained."""


class EngineStalledError(MiniSGLError, RuntimeError):
    """The scheduler kept running iterations without moving any request forward for
    `stall_timeout_s` (a livelock); the progress watchdog stops the engine rather than spin."""


class RequestFailedError(MiniSGLError, RuntimeError):
    """One request failed while it was sampled or scored (its logits processor raised or returned an
    unusable row, or its draw had no candidate token). Only that request ends; the cause is chained
    (`__cause__`) and named in the message. The engine keeps serving."""


class ReentrantCallError(MiniSGLError, RuntimeError):
    """A blocking Engine / RequestHandle method was called from one of the engine's own threads
    (e.g. from a logits processor), where waiting would deadlock the engine."""


class ModelLoadError(ModelNotFoundError):
    """The model reference resolves to files that cannot be loaded (corrupt or truncated safetensors
    or GGUF, weights that do not match config.json). A ModelNotFoundError, so one except catches both."""


class InvariantError(AssertionError):
    """The engine's accounting (KV blocks, token-table rows, token writes) is inconsistent: an
    engine bug, never a user error. Raised by the checks of the block pool, the token table and
    `Scheduler.check_invariants`."""
