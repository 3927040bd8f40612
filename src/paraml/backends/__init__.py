"""Backends: one module per way of spreading training over devices, picked by name through the registry."""

from paraml.backends import distribute, model_parallel  # noqa: F401  (each module registers its backends
from paraml.backends.base import Backend
from paraml.backends.registry import available, get_backend, register, unregister

__all__ = ["Backend", "available", "get_backend", "register", "unregister"]
