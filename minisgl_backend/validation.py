"""One validation layer for EngineConfig and SamplingParams: a spec per field, checked at construction.

Every entry point (Python API, CLI `--set`, YAML presets, the LangChain and lm-eval adapters, the HTTP
server) builds one of these dataclasses, so every value passes the same checks. Rules:

- ints are real ints: `True`/`False` (bool is an int subclass), floats (even 16.0) and strings are
  rejected; numpy integers are accepted and stored as int;
- floats accept ints and floats (not bools, not strings); NaN and +-inf are rejected;
- bools are real bools: the string "false" is an error, never truthy;
- each error is the caller's error class (ConfigError / InvalidSamplingParamsError) and names the
  field, the accepted range and the value it got.
"""

from __future__ import annotations

import math
import numbers
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

SEED_LIMIT = 2**64  # seeds (config and per request) are 0 <= seed < 2**64: the sampler's 64-bit key


def _fmt(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True)
class Spec:
    """How one field is checked. `kind`: int | float | bool | str | choice | any."""

    kind: str
    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False  # lo < value instead of lo <= value
    hi_open: bool = False  # value < hi instead of value <= hi
    optional: bool = False  # None is accepted
    choices: tuple[Any, ...] = ()
    note: str = ""  # extra text for the error message (what None or 0 means, ...)

    def describe(self) -> str:
        if self.kind == "choice":
            text = "one of " + ", ".join(repr(c) for c in self.choices)
        elif self.kind == "bool":
            text = "true or false (a bool)"
        elif self.kind == "str":
            text = "a non-empty string"
        else:
            text = "an int" if self.kind == "int" else "a finite number"
            if self.lo is not None and self.hi is not None:
                lo, hi = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
                text += f" in {lo}{_num(self.lo)}, {_num(self.hi)}{hi}"
            elif self.lo is not None:
                text += f" {'>' if self.lo_open else '>='} {_num(self.lo)}"
            elif self.hi is not None:
                text += f" {'<' if self.hi_open else '<='} {_num(self.hi)}"
        if self.optional:
            text += " or None"
        return text + (f" ({self.note})" if self.note else "")

    def check(self, name: str, value: Any, error: type[Exception]) -> Any:
        """The value to store (normalised: numpy ints -> int, ints -> float for float fields)."""
        if value is None and self.optional:
            return None
        bad = _Bad(self, name, value, error)
        if self.kind == "bool":
            if not isinstance(value, bool):
                raise bad()
            return value
        if self.kind == "str":
            if not isinstance(value, str) or not value:
                raise bad()
            return value
        if self.kind == "choice":
            if isinstance(value, bool) or value not in self.choices:
                raise bad()
            return value
        kind = type(value)
        if self.kind == "int":
            if kind is not int:  # fast path first: the ABC checks are slow
                if kind is bool or not isinstance(value, numbers.Integral):
                    raise bad()
                value = int(value)
        elif self.kind == "float":
            if kind is not float:
                if kind is bool or not isinstance(value, numbers.Real):
                    raise bad()
                try:
                    value = float(value)
                except OverflowError:  # an int beyond float range
                    raise bad() from None
            if not math.isfinite(value):
                raise bad()
        else:
            return value
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            raise bad()
        if self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi):
            raise bad()
        return value


class _Bad:
    """Builds the error lazily (describe() only runs when a value is rejected)."""

    __slots__ = ("spec", "name", "value", "error")

    def __init__(self, spec: Spec, name: str, value: Any, error: type[Exception]) -> None:
        self.spec, self.name, self.value, self.error = spec, name, value, error

    def __call__(self) -> Exception:
        return self.error(f"{self.name} must be {self.spec.describe()}, got {_fmt(self.value)}")


def _num(x: float) -> str:
    if x == SEED_LIMIT:
        return "2**64"
    return str(int(x)) if float(x).is_integer() else str(x)


def validate_fields(obj: Any, specs: dict[str, Spec], error: type[Exception]) -> None:
    """Check every field of a frozen dataclass `obj` that has a spec; store normalised values."""
    for name, spec in specs.items():
        value = getattr(obj, name)
        checked = spec.check(name, value, error)
        if checked is not value:
            object.__setattr__(obj, name, checked)


def check_int_sequence(name: str, value: Any, error: type[Exception]) -> tuple[int, ...]:
    """A list/tuple of ints (no bools, floats or strings); None or () is empty."""
    if not value and isinstance(value, (tuple, list, type(None))):
        return ()
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise error(f"{name} must be a list of ints, got {_fmt(value)}")
    bad = [
        t
        for t in value
        if type(t) is not int and (isinstance(t, bool) or not isinstance(t, numbers.Integral))
    ]
    if bad:
        raise error(f"{name} must be a list of ints, got {_fmt(value)} (not ints: {_fmt(bad[:5])})")
    return tuple(int(t) for t in value)


LOGIT_BIAS_LIMIT = 100.0  # OpenAI's range for a logit_bias value: [-100, 100]


def check_logit_bias(name: str, value: Any, error: type[Exception]) -> tuple[tuple[int, float], ...]:
    """A dict token id -> bias (or a sequence of (id, bias) pairs), as sorted (id, bias) pairs. Ids are
    non-negative ints (no bools, no strings: JSON's string keys are converted by the server), each id
    at most once; biases finite numbers in [-100, 100]. None or empty: no bias."""
    if not value and isinstance(value, (tuple, list, dict, type(None))):
        return ()
    shape = f"{name} must be a dict of token id (int) -> bias, got {_fmt(value)}"
    if isinstance(value, Mapping):
        pairs = list(value.items())
    elif isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        pairs = list(value)
        if any(not isinstance(p, Sequence) or isinstance(p, (str, bytes)) or len(p) != 2 for p in pairs):
            raise error(shape)
    else:
        raise error(shape)
    bias_spec = Spec("float", lo=-LOGIT_BIAS_LIMIT, hi=LOGIT_BIAS_LIMIT)
    out: dict[int, float] = {}
    for tid, bias in pairs:
        if type(tid) is not int and (isinstance(tid, bool) or not isinstance(tid, numbers.Integral)):
            raise error(f"{name} keys must be token ids (ints >= 0), got {_fmt(tid)}")
        tid = int(tid)
        if tid < 0:
            raise error(f"{name} keys must be token ids (ints >= 0), got {tid}")
        if tid in out:
            raise error(f"{name} names token id {tid} more than once")
        out[tid] = bias_spec.check(f"{name}[{tid}]", bias, error)
    return tuple(sorted(out.items()))


def check_text(name: str, text: str, error: type[Exception]) -> str:
    """A str that can be encoded as UTF-8 (a lone surrogate such as '\\ud800' cannot)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise error(
            f"{name} is not valid Unicode text (lone surrogate at index {e.start}: "
            f"{_fmt(text[e.start : e.end])}); pass well-formed text or token ids"
        ) from None
    return text


def check_str_sequence(name: str, value: Any, error: type[Exception]) -> tuple[str, ...]:
    """One non-empty string or a list/tuple of them."""
    if not value and isinstance(value, (tuple, list, type(None))):
        return ()
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, Sequence) or isinstance(value, bytes):
        raise error(f"{name} must be a string or a list of non-empty strings, got {_fmt(value)}")
    if any(not isinstance(s, str) or not s for s in value):
        raise error(f"{name} must hold non-empty strings, got {_fmt(value)}")
    for s in value:
        check_text(name, s, error)
    return tuple(value)


def check_callables(name: str, value: Any, error: type[Exception]) -> tuple[Callable, ...]:
    if not value and isinstance(value, (tuple, list, type(None))):
        return ()
    if callable(value) or not isinstance(value, Sequence) or isinstance(value, (str, bytes)):
        raise error(f"{name} must be a list of callables (output_ids, logits) -> logits, got {_fmt(value)}")
    if any(not callable(f) for f in value):
        raise error(f"{name} must be callables (output_ids, logits) -> logits, got {_fmt(value)}")
    return tuple(value)


def machine_memory_gb() -> float | None:
    """Physical memory of this machine in GiB (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return None
