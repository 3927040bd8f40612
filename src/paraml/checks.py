"""Argument checks shared by every module: each raises before anything is built, naming the value and what is valid.

Plain Python (NumPy integers accepted): no TensorFlow import, so the launcher and the planners use them too.

>>> check_int("epochs", 3)
3
>>> check_int("epochs", 0)
Traceback (most recent call last):
...
ValueError: epochs must be an int >= 1, got 0
>>> check_int("steps", None, none_ok=True) is None
True
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Collection, Iterable
from typing import Any, TypeVar

__all__ = ["check_choice", "check_int", "check_named", "check_verbose", "did_you_mean"]

T = TypeVar("T")


def check_int(name: str, value: Any, *, low: int | None = 1, high: int | None = None, none_ok: bool = False) -> Any:
    """``value`` as an ``int`` when it is a whole number in ``[low, high]`` (``None`` too with ``none_ok``).

    ``bool`` is refused (``True`` is an ``int`` in Python, and ``epochs=True`` is a mistake). Raises ``ValueError``
    naming ``name``, the bounds and the value.
    """
    if value is None and none_ok:
        return None
    whole = isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if not whole or (low is not None and value < low) or (high is not None and value > high):
        if low is not None and high is not None:
            bounds = f" in {low}..{high}"
        elif low is not None:
            bounds = f" >= {low}"
        elif high is not None:
            bounds = f" <= {high}"
        else:
            bounds = ""
        raise ValueError(f"{name} must be an int{bounds}{' or None' if none_ok else ''}, got {value!r}")
    return int(value)


def check_named(items: Iterable[Any], kind: type[T], what: str) -> list[T]:
    """``items`` as a list when it is not empty, holds only ``kind`` objects and their ``name`` s are unique.

    ``TypeError`` names an item of another type, ``ValueError`` an empty list or a name that appears twice.

    >>> check_named([], str, "jobs")
    Traceback (most recent call last):
    ...
    ValueError: jobs is empty
    """
    found = list(items)
    if not found:
        raise ValueError(f"{what} is empty")
    seen: set[Any] = set()
    for item in found:
        if not isinstance(item, kind):
            raise TypeError(f"{what} must hold {kind.__name__} objects, got {type(item).__name__}: {item!r}")
        name = getattr(item, "name", None)
        if name in seen:
            raise ValueError(f"{what}: the name {name!r} appears twice; every name must be unique")
        seen.add(name)
    return found


def did_you_mean(value: Any, choices: Iterable[str]) -> str:
    """``" (did you mean 'x'?)"`` for the choice closest to a misspelt ``value``, or ``""``.

    >>> did_you_mean("mirored", ["single", "mirrored"]), did_you_mean("xyz", ["single"])
    (" (did you mean 'mirrored'?)", '')
    """
    if not isinstance(value, str):
        return ""
    close = difflib.get_close_matches(value, [str(c) for c in choices], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


def check_choice(name: str, value: T, choices: Collection[Any]) -> T:
    """``value`` when it is one of ``choices``; otherwise a ``ValueError`` listing them.

    >>> check_choice("schedule", "gpipe", ("gpipe",))
    'gpipe'
    """
    try:
        known = value in choices
    except TypeError:  # an unhashable value is not among hashable choices
        known = False
    if not known:
        hint = did_you_mean(value, choices)
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}{hint}")
    return value


def check_verbose(verbose: Any, default: int) -> int:
    """Keras' ``verbose``: ``"auto"`` (``default``), 0, 1, 2 or a bool, as an int.

    >>> check_verbose("auto", 1), check_verbose(True, 0), check_verbose(2, 1)
    (1, 1, 2)
    """
    if verbose == "auto":
        return default
    if isinstance(verbose, bool) or verbose in (0, 1, 2):
        return int(verbose)
    raise ValueError(f"verbose must be 'auto', 0, 1 or 2, got {verbose!r}")
