"""fit_many throughput: 2 jobs on 2 devices at once against the same 2 jobs one after the other.

    python benchmarks/bench_many.py [--windows 3] [--epochs 3] [--width 512] [--json PATH]

Intra-op parallelism is set to 1 thread first, so each logical CPU is closer to "one core per device"; the physical
limit of the ratio is then the number of cores used, 2.0 here. The two variants are timed by
:func:`paraml.bench.harness.interleave` (one process, windows interleaved) after an untimed warm-up, and the ratio
(sequential seconds / concurrent seconds) is the median of per-window ratios. Both variants include building each
model and tracing its ``tf.function`` s, as a real sweep would.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from paraml.bench.harness import int_at_least  # noqa: E402  (imports no TensorFlow)


def make_jobs(samples: int, width: int, epochs: int) -> list[Any]:
    """Two identical jobs (a 64-width-width-10 MLP, Adam, batch 128) on the same random data."""
    import keras
    import numpy as np

    import paraml

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
    return [paraml.Job(name, model_fn, compile_args, (x, y), fit_args) for name in ("job-a", "job-b")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--windows", type=int_at_least(1), default=3)
    parser.add_argument("--samples", type=int_at_least(1), default=8192)
    parser.add_argument("--width", type=int_at_least(1), default=512)
    parser.add_argument("--epochs", type=int_at_least(1), default=3)
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    args = parser.parse_args(argv)

    import tensorflow as tf

    tf.config.threading.set_intra_op_parallelism_threads(1)  # before anything initialises TensorFlow's runtime
    import paraml

    devices = paraml.simulate_devices(2)
    from paraml.bench.harness import environment, format_table, interleave, paired, progress_printer, write_json

    jobs = make_jobs(args.samples, args.width, args.epochs)

    def run(n: int) -> None:
        failed = [r.error for r in paraml.fit_many(jobs, devices=n, verbose=0).values() if not r.ok]
        if failed:
            raise RuntimeError(f"a benchmark job failed: {failed[0]}")

    print(f"devices: {', '.join(devices)}; intra-op threads: {tf.config.threading.get_intra_op_parallelism_threads()}")
    run(2)  # warm-up: first-use costs of TensorFlow and Keras
    variants = {"at once": lambda: run(2), "one after the other": lambda: run(1)}
    series = interleave(variants, args.windows, progress=progress_printer("bench_many"), show="wall_s")
    concurrent, sequential = series["at once"]["wall_s"], series["one after the other"]["wall_s"]
    rows = [[w + 1, s, c, f"{s / c:.2f}"] for w, (s, c) in enumerate(zip(sequential, concurrent))]
    print(format_table(rows, ["window", "one after the other s", "at once s", "ratio"]))
    ratio = paired(sequential, concurrent)
    print(
        f"throughput ratio (2 jobs at once on 2 devices / one after the other), median of {args.windows} windows: "
        f"{ratio:.2f}x (physical limit here 2.0x)"
    )
    record = {
        "benchmark": "fit_many",
        "samples": args.samples,
        "width": args.width,
        "epochs": args.epochs,
        "windows_s": {"concurrent": concurrent, "sequential": sequential},
        "ratio_sequential_over_concurrent": round(ratio, 4),
        "env": environment(),
    }
    write_json(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
