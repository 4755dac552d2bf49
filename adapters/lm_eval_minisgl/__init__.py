"""lm-evaluation-harness model `minisgl`: the minisgl engine behind `lm_eval --model minisgl`.

Kept import-light on purpose: the `.pth` start-up hook imports this package in every interpreter,
so nothing here may import torch, lm_eval or the engine at module level.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from pathlib import Path
from typing import Any

MODEL_NAME = "minisgl"
MODEL_TARGET = "lm_eval_minisgl.model:MiniSGLLM"

EXTRA = "pip install 'minisgl[lm-eval]'"

__all__ = ["EXTRA", "MODEL_NAME", "MODEL_TARGET", "missing_extra", "register", "register_tasks", "tasks_dir"]


def missing_extra(error: ModuleNotFoundError) -> ModuleNotFoundError:
    """The error to raise when lm-eval (or a library it brings) is not installed: lm-eval is the
    `lm-eval` extra, not a requirement of the engine, so the message says how to add it."""
    message = f"{error}: the lm-eval adapter needs the lm-eval extra: {EXTRA}"
    return ModuleNotFoundError(message, name=error.name)


def register() -> None:
    """Register `minisgl` in lm-eval's model registry (idempotent), keeping the built-in models.

    lm-eval 0.4.13's `get_model` imports `lm_eval.models` (which registers hf, dummy, ...) only while
    the registry is empty, so the built-ins are imported first; the class itself stays a lazy
    "module:attr" placeholder so nothing heavy loads until `--model minisgl` is actually used.
    """
    import lm_eval.models  # noqa: F401  (built-ins first, see above)
    from lm_eval.api.registry import model_registry

    if MODEL_NAME not in model_registry:
        model_registry.register(MODEL_NAME, target=MODEL_TARGET)


def tasks_dir() -> Path | None:
    """The local lm-eval tasks (minisgl_mc, minisgl_gen, minisgl_ppl): the checkout's configs/tasks
    in a source or editable install, else the wheel's copy, minisgl_backend/configs/tasks. The same
    rule as `minisgl_backend.config.config_dir`, found without importing the engine (and torch)."""
    spec = importlib.util.find_spec("minisgl_backend")
    if spec is None or not spec.submodule_search_locations:
        return None
    package = Path(next(iter(spec.submodule_search_locations)))
    checkout = package.parent
    if (checkout / "pyproject.toml").is_file() and (checkout / "configs" / "tasks").is_dir():
        return checkout / "configs" / "tasks"
    shipped = package / "configs" / "tasks"
    return shipped if shipped.is_dir() else None


def _with_our_tasks(include_path: Any, include_defaults: bool) -> Any:
    """`include_path` with the package's tasks first, unless the caller excluded the defaults or
    already names a copy of them (e.g. `--include_path <checkout>/configs/tasks`: that copy alone)."""
    ours = tasks_dir()
    if ours is None or not include_defaults:
        return include_path
    given = (
        []
        if include_path is None
        else list(include_path)
        if isinstance(include_path, (list, tuple))
        else [include_path]
    )
    names = [p.name for p in ours.glob("*.yaml")]
    if any((Path(p) / name).is_file() for p in given for name in names):
        return include_path
    return [str(ours), *given]


def register_tasks() -> None:
    """Make every lm-eval TaskManager (the CLI's included) index the package's local tasks beside
    lm-eval's own, so `--tasks minisgl_mc` works from any directory (idempotent)."""
    from lm_eval.tasks.manager import TaskManager

    original = TaskManager.__init__
    if getattr(original, "_minisgl_tasks", False):
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        try:
            bound = signature.bind(self, *args, **kwargs)
            bound.apply_defaults()
            bound.arguments["include_path"] = _with_our_tasks(
                bound.arguments.get("include_path"), bool(bound.arguments.get("include_defaults", True))
            )
        except Exception:  # noqa: BLE001 - never break lm-eval: without our tasks it still runs
            return original(self, *args, **kwargs)
        original(*bound.args, **bound.kwargs)

    __init__._minisgl_tasks = True  # type: ignore[attr-defined]
    TaskManager.__init__ = __init__
