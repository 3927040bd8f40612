"""Shared helpers of paraml's benchmarks: models, random data, interleaved timing and output.

Timings on shared CPU machines are noisy (field notes 9): every benchmark here runs its variants in ONE process,
interleaves their timed windows (A B C, B C A, C A B, ...: the order rotates so no variant always runs first), takes
the median of each variant's windows and reports ratios, which are far steadier than absolute times.

Import this module only after ``paraml.simulate_devices(n)`` has run (it imports TensorFlow and Keras; creating
tensors before the simulated devices exist would fix the device layout too early, field notes 5).
"""

from __future__ import annotations

import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import keras
import numpy as np
import tensorflow as tf

from paraml.backends.distribute import MirroredBackend

__all__ = [
    "HandLoop",
    "MODELS",
    "Series",
    "compare",
    "environment",
    "format_table",
    "interleave",
    "loss_fn",
    "make_model",
    "mirrored_strategy",
    "optimizer",
    "random_data",
    "scale",
    "summarize",
    "write_json",
]

#: name -> (input shape, builder). ``mlp`` is big enough that a step takes a few ms on 2 CPU cores; ``digits`` is
#: the demo's small model (paraml.demo.digits_model), where per-step overhead weighs most.
MODELS: dict[str, tuple[tuple[int, ...], Callable[[], keras.Model]]] = {}


def _mlp() -> keras.Model:
    return keras.Sequential(
        [
            keras.Input((784,)),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(512, activation="relu"),
            keras.layers.Dense(10),
        ],
        name="mlp_784_512_512_10",
    )


def _digits() -> keras.Model:
    from paraml.demo import digits_model

    return digits_model()


MODELS["mlp"] = ((784,), _mlp)
MODELS["digits"] = ((8, 8, 1), _digits)


def make_model(name: str) -> keras.Model:
    """A fresh, built model ``name`` (a key of :data:`MODELS`); call it inside the strategy's scope."""
    return MODELS[name][1]()


def mirrored_strategy(devices: Sequence[str]) -> tf.distribute.MirroredStrategy:
    """A plain ``tf.distribute.MirroredStrategy`` over ``devices`` that can live in one process next to paraml's.

    It is the strategy paraml's ``mirrored`` backend builds (which keeps each strategy's collective keys apart).
    """
    return MirroredBackend(list(devices)).strategy


class HandLoop:
    """The TF custom-training-loop tutorial, written by hand, on a MirroredStrategy over ``devices``.

    Model, optimizer and metric are created in ``strategy.scope()``; a step is ``strategy.run`` of ``GradientTape``
    + ``tf.nn.compute_average_loss(global_batch_size=...)`` + ``apply_gradients``. Two ways to drive it:
    :meth:`tutorial` (``for batch in dist_dataset: step(batch)``, one ``tf.function`` call per step, as in the
    tutorial) and :meth:`iterator` (``steps_per_execution`` steps per call, ``next(iterator)`` inside the function).
    """

    def __init__(self, devices: Sequence[str], model: str, global_batch: int, steps_per_execution: int = 1) -> None:
        self.strategy = strategy = mirrored_strategy(devices)
        self.global_batch = global_batch
        self.k = steps_per_execution
        with strategy.scope():
            self.model = net = make_model(model)
            opt = optimizer()
            # Build the slots here: left to the first apply_gradients inside tf.function, their lifted initialisers
            # fail under MirroredStrategy ("You must feed a value for placeholder tensor 'cond/...'").
            opt.build(net.trainable_variables)
            loss_object = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
            self.accuracy = accuracy = keras.metrics.SparseCategoricalAccuracy(name="accuracy")

        def train_step(inputs: Any) -> tf.Tensor:
            features, labels = inputs
            with tf.GradientTape() as tape:
                logits = net(features, training=True)
                loss = tf.nn.compute_average_loss(loss_object(labels, logits), global_batch_size=global_batch)
            grads = tape.gradient(loss, net.trainable_variables)
            opt.apply_gradients(zip(grads, net.trainable_variables))
            accuracy.update_state(labels, logits)
            return loss

        @tf.function
        def distributed_train_step(dist_inputs: Any) -> tf.Tensor:
            per_replica_losses = strategy.run(train_step, args=(dist_inputs,))
            return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)

        @tf.function
        def distributed_train_steps(iterator: Any, steps: tf.Tensor) -> tf.Tensor:
            total = tf.constant(0.0)
            for _ in tf.range(steps):
                per_replica_losses = strategy.run(train_step, args=(next(iterator),))
                total += strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica_losses, axis=None)
            return total

        self._step, self._steps = distributed_train_step, distributed_train_steps

    def distribute(self, x: Any, y: Any, shuffle: bool = False) -> tuple[Any, int]:
        """The distributed dataset of ``(x, y)`` global batches (built once, iterated every epoch) and its length."""
        dataset = tf.data.Dataset.from_tensor_slices((x, y))
        if shuffle:
            dataset = dataset.shuffle(len(x), seed=0, reshuffle_each_iteration=True)
        dataset = dataset.batch(self.global_batch).prefetch(tf.data.AUTOTUNE)
        return self.strategy.experimental_distribute_dataset(dataset), -(-len(x) // self.global_batch)

    def tutorial(self, x: Any, y: Any, epochs: int = 1, shuffle: bool = False) -> Callable[[], None]:
        """A window of ``epochs`` epochs, the tutorial's way."""
        dist_dataset, _ = self.distribute(x, y, shuffle)

        def window() -> None:
            for _ in range(epochs):
                self.accuracy.reset_state()
                total_loss, num_batches = 0.0, 0
                for batch in dist_dataset:
                    total_loss += self._step(batch)
                    num_batches += 1
                float(total_loss / num_batches), float(self.accuracy.result())  # what an epoch reports

        return window

    def iterator(self, x: Any, y: Any, epochs: int = 1, shuffle: bool = False) -> Callable[[], None]:
        """A window of ``epochs`` epochs, ``steps_per_execution`` steps per call over a new iterator each epoch."""
        dist_dataset, steps = self.distribute(x, y, shuffle)
        sizes = {k: tf.constant(k) for k in {self.k, steps % self.k or self.k}}
        calls = [sizes[min(self.k, steps - start)] for start in range(0, steps, self.k)]

        def window() -> None:
            for _ in range(epochs):
                self.accuracy.reset_state()
                total_loss = 0.0
                it = iter(dist_dataset)
                for k in calls:
                    total_loss += self._steps(it, k)
                float(total_loss / steps), float(self.accuracy.result())

        return window


def optimizer() -> keras.optimizers.Optimizer:
    """The optimizer every variant uses."""
    return keras.optimizers.Adam(1e-3)


def loss_fn() -> keras.losses.Loss:
    """The loss every variant uses: sparse categorical cross-entropy on logits."""
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


def random_data(model: str, samples: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``samples`` random float32 inputs for ``model`` and int32 labels in 0..9."""
    rng = np.random.default_rng(seed)
    shape = MODELS[model][0]
    x = rng.random((samples, *shape), dtype=np.float32)
    y = rng.integers(0, 10, samples).astype(np.int32)
    return x, y


#: One variant's measurements: metric ("wall" or "cpu") -> one value per round.
Series = dict[str, list[float]]


def interleave(
    variants: Mapping[str, Callable[[], Any]],
    windows: int,
    *,
    log: Callable[[str], None] | None = None,
) -> dict[str, Series]:
    """Run each variant ``windows`` times, interleaved; return the seconds of each window, wall and CPU.

    A variant is a function that runs one window. Round ``r`` starts at variant ``r mod len(variants)``
    (A B C, B C A, C A B, ...), so none always runs right after the same neighbour. Garbage is collected before each
    window, untimed. Besides wall time, the process CPU time is recorded: on a shared machine another program taking
    a core stretches wall time (by up to 2x on 2 cores) but hardly changes this process's CPU time.
    """
    names = list(variants)
    results: dict[str, Series] = {name: {"wall": [], "cpu": []} for name in names}
    for r in range(windows):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            gc.collect()
            wall, cpu = time.perf_counter(), time.process_time()
            variants[name]()
            results[name]["cpu"].append(time.process_time() - cpu)
            results[name]["wall"].append(time.perf_counter() - wall)
        if log is not None:
            log(f"  round {r + 1}/{windows} (s): " + "  ".join(f"{n} {results[n]['wall'][-1]:.3f}" for n in names))
    return results


def scale(series: Series, factor: float) -> Series:
    """Every value of ``series`` times ``factor`` (e.g. seconds per window -> ms per step)."""
    return {metric: [v * factor for v in values] for metric, values in series.items()}


def summarize(series: Series) -> dict[str, float]:
    """Median, min and max of the wall values and the median of the CPU values."""
    return {
        "median": statistics.median(series["wall"]),
        "min": min(series["wall"]),
        "max": max(series["wall"]),
        "cpu": statistics.median(series["cpu"]),
    }


def compare(a: Series, b: Series) -> dict[str, float]:
    """Ratios ``a / b`` four ways (they agree when the machine is quiet):

    ``median``: of the median wall times (the headline); ``paired``: the median over rounds of the ratio of the two
    windows of a round (adjacent in time, so slow drifts cancel); ``min``: of the fastest windows (least disturbed);
    ``cpu``: of the median process CPU times (insensitive to other programs taking the cores).
    """
    wa, wb = a["wall"], b["wall"]
    return {
        "median": statistics.median(wa) / statistics.median(wb),
        "paired": statistics.median(x / y for x, y in zip(wa, wb)),
        "min": min(wa) / min(wb),
        "cpu": statistics.median(a["cpu"]) / statistics.median(b["cpu"]),
    }


def format_table(rows: Sequence[Sequence[Any]], header: Sequence[str]) -> str:
    """A plain fixed-width table: the first column left-aligned, the others right-aligned."""
    cells = [[str(c) for c in header]] + [[f"{c:.2f}" if isinstance(c, float) else str(c) for c in r] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for k, row in enumerate(cells):
        parts = [row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]
        lines.append("  ".join(parts))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "machine": platform.machine(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }


def write_json(record: Mapping[str, Any], path: str | None) -> str:
    """Print ``record`` as one JSON line (prefixed ``JSON ``) and, if ``path`` is given, write it there."""
    line = json.dumps(record, sort_keys=True)
    print("JSON " + line, flush=True)
    if path:
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(line + "\n")
    return line
