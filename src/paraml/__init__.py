"""paraml: multi-device training on TensorFlow/Keras 3 with one word.

>>> from paraml import Parallel
>>> par = Parallel("single")
>>> par.strategy
'single'

Public names are imported on first use, so ``paraml launch`` (which only starts processes) never loads TensorFlow.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import os
from typing import TYPE_CHECKING, Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # TensorFlow's C++ start-up chatter hides paraml's output

try:  # one source of truth: the installed package's metadata (pyproject.toml)
    __version__ = importlib.metadata.version("paraml")
except importlib.metadata.PackageNotFoundError:  # pragma: no cover - run from a source tree without installing
    __version__ = "unknown"

#: public name -> module that defines it
_EXPORTS = {
    "Parallel": "parallel",
    "Job": "many",
    "JobResult": "many",
    "fit_many": "many",
    "estimate_memory": "memory",
    "simulate_devices": "devices",
    "ensure_devices": "devices",
    "list_devices": "devices",
    "load_digits": "data",
    "OwnStepWarning": "loop.steps",
}

__all__ = [
    "Job",
    "JobResult",
    "OwnStepWarning",
    "Parallel",
    "__version__",
    "ensure_devices",
    "estimate_memory",
    "fit_many",
    "list_devices",
    "load_digits",
    "simulate_devices",
]

if TYPE_CHECKING:  # pragma: no cover
    from paraml.data import load_digits
    from paraml.devices import ensure_devices, list_devices, simulate_devices
    from paraml.loop.steps import OwnStepWarning
    from paraml.many import Job, JobResult, fit_many
    from paraml.memory import estimate_memory
    from paraml.parallel import Parallel


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'paraml' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
