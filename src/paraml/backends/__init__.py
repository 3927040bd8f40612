"""Backends: one module per way of spreading training over devices, picked by name through the registry."""

from . import distribute  # noqa: F401  (registers single, mirrored, central_storage)
from .base import Backend
from .registry import available, get_backend, register

__all__ = ["Backend", "available", "get_backend", "register"]
