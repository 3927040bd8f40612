"""``load_object``: a ``"module:attribute"`` or ``"file.py:attribute"`` spec -> that object.

Its own module, importing nothing of paraml, so that the command line (``paraml estimate``) and the benchmark
harness (``paraml bench --model MODULE:FUNCTION``) share it without importing each other.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

__all__ = ["load_object"]


def load_object(spec: str) -> object:
    """``"package.module:function"`` or ``"path/to/file.py:function"`` -> that object.

    Raises ``ValueError`` for a malformed spec, a module that cannot be imported or a missing attribute, and
    ``FileNotFoundError`` for a ``.py`` file that does not exist.
    """
    module_name, sep, attribute = spec.rpartition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(
            f"expected MODULE:FUNCTION (e.g. mypkg.models:make_model or models.py:make_model), got {spec!r}"
        )
    if module_name.endswith(".py"):
        path = Path(module_name)
        if not path.is_file():
            raise FileNotFoundError(f"no file {module_name!r} (from {spec!r})")
        loader = importlib.util.spec_from_file_location(path.stem, path)
        module = importlib.util.module_from_spec(loader)
        loader.loader.exec_module(module)
    else:
        # As `python -m` does, the current folder comes first: `paraml estimate mymodels:make` finds ./mymodels.py
        # (the `paraml` command's own sys.path starts at its script's folder instead).
        added = os.getcwd() not in sys.path
        if added:
            sys.path.insert(0, os.getcwd())
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ValueError(f"cannot import {module_name!r} (from {spec!r}): {error}") from None
        finally:
            if added:
                sys.path.remove(os.getcwd())
    if not hasattr(module, attribute):
        raise ValueError(f"{module_name!r} has no {attribute!r} (from {spec!r})")
    return getattr(module, attribute)
