"""Strategy name -> backend class. A new backend is one module that registers itself here."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from paraml.backends.base import Backend
from paraml.checks import did_you_mean

__all__ = ["available", "get_backend", "register", "unregister"]

_BACKENDS: dict[str, type[Backend]] = {}
B = TypeVar("B", bound=type[Backend])

#: Names of the contract that exist but are chosen elsewhere (``"auto"`` is resolved by the facade at build time).
_RESOLVED_ELSEWHERE = ("auto",)


def register(name: str) -> Callable[[B], B]:
    """Class decorator: make ``Parallel(name)`` pick this backend class."""

    def decorate(cls: B) -> B:
        if name in _BACKENDS and _BACKENDS[name] is not cls:
            raise ValueError(f"a backend named {name!r} is already registered ({_BACKENDS[name].__name__})")
        cls.name = name
        _BACKENDS[name] = cls
        return cls

    return decorate


def unregister(name: str) -> None:
    """Forget the backend registered as ``name`` (a test's or a notebook's own backend); unknown names are ignored."""
    _BACKENDS.pop(name, None)


def available() -> tuple[str, ...]:
    """Every strategy name ``Parallel`` accepts, in a stable order."""
    return tuple(_BACKENDS) + _RESOLVED_ELSEWHERE


def get_backend(name: str) -> type[Backend]:
    """The backend class registered as ``name``; a ``ValueError`` that lists the valid names otherwise."""
    if name in _RESOLVED_ELSEWHERE:
        raise ValueError(f"strategy {name!r} is resolved by paraml.Parallel, not a backend of its own")
    if not isinstance(name, str) or name not in _BACKENDS:
        hint = did_you_mean(name, available())
        raise ValueError(f"unknown strategy {name!r}{hint}; valid strategies: {', '.join(map(repr, available()))}")
    return _BACKENDS[name]
