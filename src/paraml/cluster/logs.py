"""TensorFlow's start-up logging, kept out of the user's way unless asked for.

TensorFlow 2.21 writes 7 to 14 lines before a program prints anything (absl's "All log messages before
absl::InitializeLog()", oneDNN, CUDA probes, CPU instruction sets) and its Python side logs ``INFO:tensorflow`` /
``WARNING:tensorflow`` lines about its own internals. ``TF_CPP_MIN_LOG_LEVEL=3`` does not silence the lines written
before absl is initialised, so paraml filters its own processes' output instead: ``paraml`` commands run with a
filtered standard error (:func:`filtered_stderr`), and ``paraml launch`` drops such lines from its workers' output.
``PARAML_LOG=1`` shows everything again.

This module does not import TensorFlow.

>>> is_tensorflow_noise("I0000 00:00:1796276269.221096    9512 port.cc:153] oneDNN custom operations are on.")
True
>>> is_tensorflow_noise("Epoch 1/3")
False
"""

from __future__ import annotations

import os
import re
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["LOG_ENV", "filtered_stderr", "is_tensorflow_noise", "show_all_logs"]

#: Set to 1 to see TensorFlow's own logging (``paraml ... `` commands and ``paraml launch`` workers).
LOG_ENV = "PARAML_LOG"

_NOISE = re.compile(
    r"^(?:"
    r"[IWEF]\d{4} \d\d:\d\d:\d+\.\d+\s+\d+ [\w.\-]+:\d+\]"  # absl/glog: I0000 00:00:17.2 9512 port.cc:153] ...
    r"|WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|To enable the following instructions: .* rebuild TensorFlow with the appropriate compiler flags\."
    r"|(?:INFO|WARNING):tensorflow:"  # TensorFlow's Python logging, about its own internals
    r")"
)


def show_all_logs() -> bool:
    """Whether the user asked for TensorFlow's logging (``PARAML_LOG`` set to anything but ``""`` or ``"0"``)."""
    return os.environ.get(LOG_ENV, "") not in ("", "0")


def is_tensorflow_noise(line: str) -> bool:
    """Whether ``line`` (without its newline) is TensorFlow's own logging rather than the program's output."""
    return _NOISE.match(line) is not None


@contextmanager
def filtered_stderr() -> Iterator[None]:
    """Inside the block, standard error (the file descriptor, so TensorFlow's C++ lines too) loses TensorFlow's
    logging lines; everything else passes through unchanged. A no-op with ``PARAML_LOG=1``."""
    if show_all_logs():
        yield
        return
    sys.stderr.flush()
    original = os.dup(2)
    read_end, write_end = os.pipe()
    os.dup2(write_end, 2)
    os.close(write_end)

    def relay() -> None:
        with os.fdopen(read_end, "rb") as lines, os.fdopen(os.dup(original), "wb", buffering=0) as out:
            for line in lines:
                if not is_tensorflow_noise(line.decode("utf-8", errors="replace").rstrip("\r\n")):
                    out.write(line)

    thread = threading.Thread(target=relay, name="paraml-stderr-filter", daemon=True)
    thread.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(original, 2)  # the pipe's last writer closes: the relay reads to the end and stops
        os.close(original)
        thread.join(timeout=5)
