"""``paraml demo``: train a small classifier on the shipped digits data under every backend and compare."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TextIO

__all__ = ["DemoResult", "digits_model", "run_demo"]


def digits_model() -> keras.Model:  # noqa: F821 - keras is imported lazily
    """The demo's classifier: a small MLP over the 8x8 digit images."""
    import keras

    return keras.Sequential(
        [
            keras.Input((8, 8, 1)),
            keras.layers.Flatten(),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="digits_mlp",
    )


@dataclass(frozen=True)
class DemoResult:
    """One row of the demo's table."""

    backend: str
    devices: int
    accuracy: float
    seconds: float
    samples_per_second: float


def default_backends(num_devices: int) -> list[tuple[str, int]]:
    """(strategy, devices) pairs the demo runs: every local backend on ``num_devices`` devices."""
    from paraml import backends

    names = [name for name in backends.available() if name not in ("auto", "multi_worker")]
    return [(name, 1 if name == "single" else num_devices) for name in names]


def run_demo(
    num_devices: int = 2, epochs: int = 20, batch_size: int = 64, out: TextIO | None = None
) -> list[DemoResult]:
    """Train :func:`digits_model` under each backend and print a table of accuracy, time and throughput.

    Uses the machine's GPUs (up to ``num_devices``), or without a GPU splits the CPU into ``num_devices`` logical
    devices first, so call it at program start.
    """
    import os
    import sys

    import tensorflow as tf

    from paraml.data import load_digits
    from paraml.devices import simulate_devices
    from paraml.parallel import Parallel

    out = out or sys.stdout
    gpus = len(tf.config.list_physical_devices("GPU"))
    if gpus:
        num_devices = min(num_devices, gpus)
        print(f"paraml demo on {num_devices} GPU(s): the digits classifier under every backend", file=out)
    else:
        simulate_devices(num_devices)
        print(
            f"paraml demo on {num_devices} simulated devices (this machine's CPU split into logical devices; "
            f"{os.cpu_count()} cores shared by all of them): every backend should reach the same accuracy. "
            "The times show this machine, not GPUs: simulated devices compete for the same cores, so the "
            "backends' speeds here say little about speed-ups on real devices.",
            file=out,
        )
    (x_train, y_train), (x_test, y_test) = load_digits()
    results = []
    for strategy, devices in default_backends(num_devices):
        par = Parallel(strategy, devices=devices, seed=0)
        par.build(
            digits_model,
            optimizer="adam",
            loss=_sparse_ce_from_logits(),
            metrics=["accuracy"],
        )
        start = time.perf_counter()
        par.fit(x_train, y_train, batch_size=batch_size, epochs=epochs, verbose=0)
        seconds = time.perf_counter() - start
        accuracy = par.evaluate(x_test, y_test, batch_size=256)["accuracy"]
        results.append(DemoResult(strategy, devices, accuracy, seconds, len(x_train) * epochs / seconds))
        print(f"trained {strategy} on {devices} device(s): test accuracy {accuracy:.3f}", file=out, flush=True)
    print(format_table(results), file=out)
    return results


def _sparse_ce_from_logits() -> object:
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def format_table(results: list[DemoResult]) -> str:
    """The demo's results as a fixed-width table."""
    lines = [f"{'backend':<18}{'devices':>8}{'accuracy':>10}{'time (s)':>10}{'samples/s':>12}"]
    for r in results:
        lines.append(f"{r.backend:<18}{r.devices:>8}{r.accuracy:>10.3f}{r.seconds:>10.2f}{r.samples_per_second:>12.0f}")
    return "\n".join(lines)
