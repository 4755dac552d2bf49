"""Start-up hook (imported by the installed `minisgl-lm-eval.pth`): register `minisgl` with lm-eval.

lm-eval 0.4.13 reads no entry points, so the stock `lm_eval --model minisgl` only works if something
registers the model after `lm_eval.models` has registered the built-ins. This module installs a
meta-path finder that wraps the loaders of `lm_eval.models` and `lm_eval.tasks.manager`: right after
the first runs, the model is registered; after the second, every TaskManager also indexes the
package's local tasks (`--tasks minisgl_mc` from any directory, no `--include_path`). It costs one
list insert at start-up, imports nothing heavy, and never raises — a failing hook must not break
unrelated Python programs. Where lm-eval is not installed (it is the `lm-eval` extra) the finder never
acts: `lm_eval.models` cannot be imported, so nothing is registered and nothing is imported.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable
from importlib.abc import Loader, MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType


def _register_model() -> None:
    from lm_eval_minisgl import register

    register()


def _register_tasks() -> None:
    from lm_eval_minisgl import register_tasks

    register_tasks()


_TARGETS = {"lm_eval.models": _register_model, "lm_eval.tasks.manager": _register_tasks}


class _RegisteringLoader(Loader):
    """Delegates to the real loader, then registers the adapter once the module has executed."""

    def __init__(self, inner: Loader, after: Callable[[], None]) -> None:
        self._inner = inner
        self._after = after

    def create_module(self, spec: ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)  # errors of lm_eval itself propagate unchanged
        try:
            self._after()
        except Exception as e:  # noqa: BLE001 - see module docstring
            logging.getLogger("lm_eval_minisgl").warning("could not register minisgl with lm-eval: %r", e)

    def __getattr__(self, name: str):  # get_source, get_resource_reader, ... of the real loader
        return getattr(self._inner, name)


class _Finder(MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        after = _TARGETS.get(fullname)
        if after is None:
            return None
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _RegisteringLoader(spec.loader, after)
                    return spec
        except Exception:  # noqa: BLE001 - fall back to the normal import machinery
            return None
        return None


def install() -> None:
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())
        for target, after in _TARGETS.items():
            if target in sys.modules:  # already imported before this hook ran
                try:
                    after()
                except Exception:  # noqa: BLE001
                    pass


try:
    install()
except Exception:  # noqa: BLE001
    pass
