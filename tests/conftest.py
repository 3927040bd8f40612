"""Every test process splits the CPU into 4 logical devices before TensorFlow initialises its devices."""

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import paraml  # noqa: E402

NUM_DEVICES = 4
paraml.simulate_devices(NUM_DEVICES)


def small_mlp(inputs: int = 8, classes: int = 3, regularize: bool = False) -> keras.Model:
    """A two-layer classifier with logits output."""
    reg = keras.regularizers.L2(1e-3) if regularize else None
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(16, activation="relu", kernel_regularizer=reg),
            keras.layers.Dense(classes),
        ]
    )


def logits_loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


@pytest.fixture
def data_1001() -> tuple[np.ndarray, np.ndarray]:
    """1,001 samples: divides neither by the batch nor by the number of replicas."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1001, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")
    return x, y


@contextmanager
def fails_after(seconds: int, what: str = "the block") -> Iterator[None]:
    """Fail instead of hanging: ``TimeoutError`` in the main thread if ``what`` runs longer than ``seconds`` (a wait
    that ignores its own timeout, a launch that never ends)."""

    def on_alarm(signum: int, frame: object) -> None:
        raise TimeoutError(f"{what} did not finish within {seconds} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
