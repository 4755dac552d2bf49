"""lm-evaluation-harness model `minisgl`: the minisgl engine behind `lm_eval --model minisgl`.

Kept import-light on purpose: the `.pth` start-up hook imports this package in every interpreter,
so nothing here may import torch, lm_eval or the engine at module level.
"""

from __future__ import annotations

MODEL_NAME = "minisgl"
MODEL_TARGET = "lm_eval_minisgl.model:MiniSGLLM"

__all__ = ["MODEL_NAME", "MODEL_TARGET", "register"]


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
