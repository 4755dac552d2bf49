"""One in-process Engine per distinct engine config, shared by every LangChain model that asks for it.

Many chains, threads and models feed the same continuous batch. Engines live until `close_engine` /
`close_all` (or interpreter exit): a model object going out of scope does not stop an engine another
model may be using. An engine that died is replaced by a fresh one on the next use.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any

from minisgl_backend import Engine, EngineConfig

_engines: dict[EngineConfig, Engine] = {}
_lock = threading.Lock()


def build_config(model: str | None, engine_config: dict[str, Any], engine_preset: str | None) -> EngineConfig:
    """EngineConfig from an optional preset (a YAML path or a name under configs/engine/), then
    `engine_config` overrides, then `model` (EngineConfig.resolve, as for the CLI and lm-eval).

    Keys are passed through unchanged, so engine options added later work without an adapter change;
    unknown keys raise minisgl_backend.ConfigError listing the valid ones.
    """
    return EngineConfig.resolve(engine_preset, engine_config, model=model)


def get_engine(config: EngineConfig) -> Engine:
    """The shared engine for `config`, started on first use. The lock is held while loading (seconds)
    so two threads asking at once never load the same model twice. A registered engine that died
    (closed, or its scheduler thread failed) is replaced by a fresh one, never handed out again."""
    with _lock:
        eng = _engines.get(config)
        if eng is not None and not eng.is_alive:
            del _engines[config]
            try:
                eng.close()  # releases its worker threads; callers of the old one already got EngineDeadError
            except Exception:  # noqa: BLE001 - a dead engine failing to close must not block a fresh one
                pass
            eng = None
        if eng is None:
            eng = Engine(config)
            _engines[config] = eng
        return eng


def evict_engine(config: EngineConfig, engine: Engine) -> None:
    """Drop a dead engine so the next `get_engine` starts a fresh one (used by retries)."""
    with _lock:
        if _engines.get(config) is engine:
            del _engines[config]
    engine.close()


def close_engine(config: EngineConfig) -> bool:
    """Close the engine for `config` if one runs; in-flight requests fail with EngineDeadError."""
    with _lock:
        eng = _engines.pop(config, None)
    if eng is None:
        return False
    eng.close()
    return True


def close_all() -> None:
    """Close every shared engine (also registered to run at interpreter exit)."""
    with _lock:
        engines = list(_engines.values())
        _engines.clear()
    for eng in engines:
        eng.close()


def running_configs() -> list[EngineConfig]:
    with _lock:
        return list(_engines)


atexit.register(close_all)
