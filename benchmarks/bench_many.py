"""fit_many throughput: 2 jobs on 2 devices at once against the same 2 jobs one after the other.

    python benchmarks/bench_many.py [--windows 3] [--epochs 3] [--width 512]

Intra-op parallelism is set to 1 thread first, so each logical CPU is closer to "one core per device" (field notes,
7); the physical limit of the ratio is then the number of cores used, 2.0 here. The two variants are interleaved
(A B, A B, ...) in one process and each window gives one ratio (sequential seconds / concurrent seconds); the
median is printed (field notes, 9: timings on these machines are noisy). Both variants include building each model
and tracing its ``tf.function`` s, as a real sweep would.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf  # noqa: E402

tf.config.threading.set_intra_op_parallelism_threads(1)  # before anything initialises TensorFlow's runtime

import paraml  # noqa: E402

DEVICES = paraml.simulate_devices(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from paraml.many import Job, fit_many  # noqa: E402


def make_jobs(samples: int, width: int, epochs: int) -> list[Job]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(samples, 64)).astype("float32")
    y = rng.integers(0, 10, size=samples)

    def model_fn() -> keras.Model:
        return keras.Sequential(
            [
                keras.Input((64,)),
                keras.layers.Dense(width, activation="relu"),
                keras.layers.Dense(width, activation="relu"),
                keras.layers.Dense(10),
            ]
        )

    compile_args = {"optimizer": "adam", "loss": keras.losses.SparseCategoricalCrossentropy(from_logits=True)}
    fit_args = {"batch_size": 128, "epochs": epochs}
    return [Job(name, model_fn, compile_args, (x, y), fit_args) for name in ("job-a", "job-b")]


def timed(jobs: list[Job], devices: int) -> float:
    start = time.perf_counter()
    results = fit_many(jobs, devices=devices, verbose=0)
    seconds = time.perf_counter() - start
    failed = [r.error for r in results.values() if not r.ok]
    if failed:
        raise RuntimeError(f"a benchmark job failed: {failed[0]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int, default=3)
    parser.add_argument("--samples", type=int, default=8192)
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()
    jobs = make_jobs(args.samples, args.width, args.epochs)
    print(f"devices: {', '.join(DEVICES)}; intra-op threads: {tf.config.threading.get_intra_op_parallelism_threads()}")
    timed(jobs, 2)  # warm-up: first-use costs of TensorFlow and Keras
    ratios = []
    for window in range(args.windows):
        concurrent = timed(jobs, 2)  # A: both jobs at once, one per device
        sequential = timed(jobs, 1)  # B: the same jobs one after the other on one device
        ratios.append(sequential / concurrent)
        print(
            f"window {window + 1}: one after the other {sequential:.2f}s, at once {concurrent:.2f}s, "
            f"ratio {ratios[-1]:.2f}"
        )
    print(
        f"throughput ratio (2 jobs at once on 2 devices / one after the other), median of {len(ratios)} windows: "
        f"{statistics.median(ratios):.2f}x (physical limit here 2.0x)"
    )


if __name__ == "__main__":
    main()
