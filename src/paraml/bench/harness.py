"""The timing harness of paraml's benchmarks: ``paraml bench`` and every script in ``benchmarks/`` time with it.

Timings on shared CPU machines are noisy (another program taking a core stretches a window by up to 2x on 2
cores), so every benchmark runs its variants in ONE process and interleaves their timed windows: round ``r`` starts
at variant ``r mod n`` (A B C, B C A, C A B, ...), so a disturbance hits every variant alike and none always runs
first or right after the same neighbour. Garbage is collected before each window, untimed; the first call (tracing)
and a warm-up window are never timed. A comparison is the median of per-window ratios (two windows of a round ran
side by side, so slow drifts cancel). Besides wall time, the process CPU time is recorded: it hardly moves when
other programs take the cores.

A fit window is one ``fit`` call of ``steps_per_call`` batches, measured two ways: the steady-state step, from the
end of the call's first batch to the end of its last (a Keras callback), and the whole call divided by its batches
(what a user's epoch costs). The difference, times the batches, is the fixed cost of a call (``fixed_ms``: building
the input pipeline and its iterator, callbacks, ...).

Everything is measured through the public API: ``paraml.Parallel`` (``build``, ``fit``) for paraml's rows, plain
Keras (``model.compile(); model.fit()``, with no strategy or under a ``tf.distribute.MirroredStrategy``) and a
hand-written ``strategy.run`` loop for the baselines.

Importing this module imports neither TensorFlow nor Keras (the ``paraml`` command imports it to list its options);
they are imported when a variant is built.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, is_dataclass
from typing import Any

from paraml.bench.loading import load_object
from paraml.checks import check_int
from paraml.memory import variable_bytes_by_device

__all__ = [
    "GLOBAL_BATCH",
    "HANDWRITTEN",
    "KERAS_MIRRORED",
    "KERAS_SINGLE",
    "METRICS",
    "PRESETS",
    "BenchResult",
    "Completed",
    "Spec",
    "Variant",
    "Workload",
    "build_variant",
    "environment",
    "fit_window",
    "format_table",
    "int_at_least",
    "interleave",
    "json_line",
    "make_parallel",
    "marked_results",
    "measure",
    "paired",
    "peak_rss_mib",
    "progress_printer",
    "random_data",
    "resolve_model",
    "run_process",
    "time_variants",
    "write_json",
]

GLOBAL_BATCH = 256

# -- models and data ---------------------------------------------------------------------------------------------------


def _mlp() -> Any:
    import keras

    layers = [keras.layers.Dense(512, activation="relu") for _ in range(4)]
    return keras.Sequential([keras.Input((256,)), *layers, keras.layers.Dense(10)], name="mlp")


def _mlp2() -> Any:
    """A 256-512-512-10 MLP: the single-device comparison with plain Keras."""
    import keras

    layers = [keras.layers.Dense(512, activation="relu") for _ in range(2)]
    return keras.Sequential([keras.Input((256,)), *layers, keras.layers.Dense(10)], name="mlp2")


def _cnn() -> Any:
    import keras

    return keras.Sequential(
        [
            keras.Input((32, 32, 3)),
            keras.layers.Conv2D(32, 3, activation="relu", name="conv1"),
            keras.layers.Conv2D(64, 3, strides=2, activation="relu", name="conv2"),
            keras.layers.Conv2D(64, 3, strides=2, activation="relu", name="conv3"),
            keras.layers.GlobalAveragePooling2D(name="pool"),
            keras.layers.Dense(128, activation="relu", name="dense"),
            keras.layers.Dense(10, name="logits"),
        ],
        name="cnn",
    )


def _transformer() -> Any:
    import keras

    class Block(keras.layers.Layer):
        """Self-attention and a feed-forward network, each with a residual connection and layer norm."""

        def __init__(self, width: int = 128, heads: int = 4, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.attention = keras.layers.MultiHeadAttention(heads, width // heads)
            self.ffn = keras.Sequential([keras.layers.Dense(4 * width, activation="gelu"), keras.layers.Dense(width)])
            self.norm1, self.norm2 = keras.layers.LayerNormalization(), keras.layers.LayerNormalization()

        def call(self, x: Any) -> Any:
            x = self.norm1(x + self.attention(x, x))
            return self.norm2(x + self.ffn(x))

    inputs = keras.Input((32,), dtype="int32")
    h = keras.layers.Embedding(1000, 128, name="embed")(inputs)
    for i in range(2):
        h = Block(name=f"block{i}")(h)
    h = keras.layers.GlobalAveragePooling1D(name="pool")(h)
    return keras.Model(inputs, keras.layers.Dense(10, name="logits")(h), name="transformer")


def _digits() -> Any:
    """The demo's small model, where the per-step overhead weighs most."""
    from paraml.demo import digits_model

    return digits_model()


#: preset name -> (model_fn, input shape, input kind: "float" or "tokens" in 0..999); 10 classes each.
PRESETS: dict[str, tuple[Callable[[], Any], tuple[int, ...], str]] = {
    "mlp": (_mlp, (256,), "float"),
    "mlp2": (_mlp2, (256,), "float"),
    "cnn": (_cnn, (32, 32, 3), "float"),
    "transformer": (_transformer, (32,), "tokens"),
    "digits": (_digits, (8, 8, 1), "float"),
}


def resolve_model(name: str) -> tuple[Callable[[], Any], tuple[int, ...], str]:
    """``(model_fn, input shape, input kind)`` of a preset or of ``MODULE:FUNCTION`` (``FILE.py:FUNCTION``).

    A loaded function is called once to read its model's input (which initialises TensorFlow: call this after the
    devices are set up, and after creating a ``multi_worker`` ``Parallel``).
    """
    if name in PRESETS:
        return PRESETS[name]
    model_fn = load_object(name)
    if not callable(model_fn):
        raise ValueError(f"{name!r} is not a function that builds a model")
    probe = model_fn()
    kind = "tokens" if "int" in str(probe.inputs[0].dtype) else "float"
    return model_fn, tuple(probe.inputs[0].shape[1:]), kind


def random_data(shape: Sequence[int], kind: str, samples: int, seed: int = 0) -> tuple[Any, Any]:
    """``samples`` random inputs of ``shape`` (float32 in [0, 1), or int32 tokens in 0..999) and int32 labels 0..9."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if kind == "tokens":
        x = rng.integers(0, 1000, (samples, *shape)).astype("int32")
    else:
        x = rng.random((samples, *shape), dtype=np.float32)
    return x, rng.integers(0, 10, samples).astype("int32")


def _take(x: Any, rows: int) -> Any:
    """The first ``rows`` rows of an array or of every array of a dict."""
    return {key: value[:rows] for key, value in x.items()} if isinstance(x, Mapping) else x[:rows]


# -- memory ------------------------------------------------------------------------------------------------------------


def peak_rss_mib() -> float:
    """The peak resident memory of this process so far, in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


# -- interleaved timing ------------------------------------------------------------------------------------------------

#: One variant's measurements: metric -> one value per timed window.
Series = dict[str, list[float]]


def interleave(
    variants: Mapping[str, Callable[[], Mapping[str, float] | None]],
    windows: int,
    *,
    progress: Callable[[str], None] | None = None,
    show: str | None = None,
) -> dict[str, Series]:
    """Run each variant's window ``windows`` times, interleaved; return, per variant, metric -> one value per window.

    A variant is a function running one window. Round ``r`` starts at variant ``r mod len(variants)`` (A B C, B C A,
    C A B, ...). Garbage is collected before each window, untimed. Every window records ``wall_s`` and ``cpu_s``
    (process CPU time) of the whole window, plus the metrics the window returns. ``progress`` is told when a round
    starts and, with ``show`` (a metric), each variant's value of it when the round ends.
    """
    windows = check_int("windows", windows)
    names = list(variants)
    results: dict[str, Series] = {name: {"wall_s": [], "cpu_s": []} for name in names}
    for r in range(windows):
        if progress is not None:
            progress(f"timed window {r + 1}/{windows} of {len(names)} variants, interleaved")
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            gc.collect()
            wall, cpu = time.perf_counter(), time.process_time()
            measured = variants[name]() or {}
            results[name]["cpu_s"].append(time.process_time() - cpu)
            results[name]["wall_s"].append(time.perf_counter() - wall)
            for metric, value in measured.items():
                results[name].setdefault(metric, []).append(value)
        if progress is not None and show is not None:
            progress("  " + "  ".join(f"{name} {results[name][show][-1]:.2f}" for name in names))
    return results


def paired(a: Sequence[float], b: Sequence[float]) -> float:
    """The median of per-window ratios ``a / b`` (the two ran side by side in each window)."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


#: The metrics of a fit window, each in milliseconds per step: steady-state wall and CPU time, whole-call wall and CPU.
METRICS = ("step_ms", "step_cpu_ms", "fit_call_ms", "fit_call_cpu_ms")


def _step_clock() -> Any:
    """A Keras callback stamping wall and process CPU time at the end of a fit call's first execution (its first
    batch, or its first ``steps_per_execution`` batches) and of its last."""
    import keras

    class StepClock(keras.callbacks.Callback):
        first: int | None = None  # the batch the first hook of the call ended (steps_per_execution - 1)

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            now = time.perf_counter(), time.process_time()
            if self.first is None:
                self.first, self.start, self.end, self.batches = batch, now, now, 0
            else:
                self.end, self.batches = now, batch - self.first

    return StepClock()


def fit_window(fit: Callable[[list[Any]], Any], steps_per_call: int) -> Callable[[], dict[str, float]]:
    """A window running ``fit(callbacks)``, one ``fit`` call of ``steps_per_call`` batches, returning :data:`METRICS`.

    The first batch of a call carries the call's fixed costs (a new iterator over the data, callbacks): the
    steady-state step is timed from its end to the end of the last batch; the whole call is divided by its batches.
    """
    steps_per_call = check_int("steps_per_call", steps_per_call, low=2)

    def window() -> dict[str, float]:
        clock = _step_clock()
        wall, cpu = time.perf_counter(), time.process_time()
        fit([clock])
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        if clock.batches < 1:
            raise RuntimeError(f"the fit call ran {clock.batches + 1} batch(es); a window needs at least 2")
        steady = [(end - start) * 1000 / clock.batches for start, end in zip(clock.start, clock.end)]
        return {
            "step_ms": steady[0],
            "step_cpu_ms": steady[1],
            "fit_call_ms": wall * 1000 / steps_per_call,
            "fit_call_cpu_ms": cpu * 1000 / steps_per_call,
        }

    return window


# -- variants ----------------------------------------------------------------------------------------------------------

#: The baselines, by the name a :class:`Spec` gives them in place of a paraml strategy.
KERAS_SINGLE = "keras-fit-single"  # plain ``model.compile(); model.fit()``, no strategy: what users compare with
KERAS_MIRRORED = "keras-fit-mirrored"  # Keras ``fit`` with the model compiled under ``MirroredStrategy``
HANDWRITTEN = "handwritten-mirrored"  # the canonical ``strategy.run`` + ``GradientTape`` loop, ``MirroredStrategy``
BASELINES = (KERAS_SINGLE, KERAS_MIRRORED, HANDWRITTEN)


@dataclass(frozen=True)
class Workload:
    """What a variant trains: a model, its data (at least ``steps_per_call`` global batches), the global batch, the
    optimizer (a Keras name: ``"sgd"`` is SGD(0.01), ``"adam"`` Adam(0.001)) and the loss (default: sparse
    categorical cross-entropy on logits)."""

    model_fn: Callable[[], Any]
    x: Any
    y: Any
    steps_per_call: int
    batch_size: int = GLOBAL_BATCH
    optimizer: str = "sgd"
    loss: Any = None

    def compile_args(self) -> dict[str, Any]:
        """Fresh ``optimizer`` and ``loss`` arguments for ``build`` or ``model.compile``."""
        import keras

        loss = self.loss or keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        return {"optimizer": keras.optimizers.get(self.optimizer), "loss": loss}

    def window_data(self) -> tuple[Any, Any]:
        """The rows of one fit call: ``steps_per_call`` global batches."""
        rows = self.steps_per_call * self.batch_size
        return _take(self.x, rows), _take(self.y, rows)


def _label(backend: str, devices: int | None, options: Mapping[str, Any], xla: bool, tag: str) -> str:
    micro_batches, steps = options.get("micro_batches"), options.get("steps_per_execution")
    label = f"{backend}@{devices or '?'}" + (f" mb={micro_batches}" if micro_batches else "")
    label += (f" spe={steps}" if steps else "") + (" xla" if xla else "")
    return f"{tag} {label}" if tag else label


@dataclass(frozen=True)
class Spec:
    """One variant: ``Parallel(strategy, devices=devices, jit_compile=jit_compile, **options)``, or a baseline of
    :data:`BASELINES` on ``devices`` devices (Keras' ``fit`` takes ``options`` as ``model.compile`` arguments, such as
    ``steps_per_execution``). ``devices=None``: the strategy's default (``multi_worker``). ``tag`` prefixes the
    label (e.g. the model's name when several models are timed together)."""

    strategy: str
    devices: int | None = 1
    jit_compile: bool = False
    options: Mapping[str, Any] = field(default_factory=dict)
    tag: str = ""

    @property
    def label(self) -> str:
        """``[tag ]strategy@devices[ mb=M][ spe=S][ xla]``."""
        return _label(self.strategy, self.devices, self.options, self.jit_compile, self.tag)


@dataclass
class Variant:
    """A built, traced and warmed-up variant: its timed ``window`` and what building it measured."""

    spec: Spec
    work: Workload
    window: Callable[[], dict[str, float]]
    devices: int
    first_step_s: float
    model: Any
    optimizer: Any
    parallel: Any = None
    """The ``paraml.Parallel`` of a paraml variant (``None`` for a baseline)."""


def make_parallel(spec: Spec) -> Any:
    """``paraml.Parallel`` of ``spec`` (seed 0). Under ``multi_worker``, create it before anything touches
    TensorFlow's devices and pass it to :func:`build_variant`."""
    from paraml.parallel import Parallel

    if spec.strategy in BASELINES:
        raise ValueError(f"{spec.strategy!r} is a baseline, not a paraml strategy")
    return Parallel(spec.strategy, devices=spec.devices, seed=0, jit_compile=spec.jit_compile, **spec.options)


def _first_fit(fit: Callable[..., Any], work: Workload) -> float:
    """Seconds of a first ``fit`` call on one batch (it traces the step)."""
    start = time.perf_counter()
    fit(_take(work.x, work.batch_size), _take(work.y, work.batch_size), batch_size=work.batch_size, verbose=0)
    return time.perf_counter() - start


def _time_fit(fit: Callable[..., Any], work: Workload) -> tuple[float, Any]:
    """The first call's seconds, then the timed windows of ``fit`` (paraml's or Keras') on the workload."""
    first = _first_fit(fit, work)
    x, y = work.window_data()
    window = fit_window(
        lambda callbacks: fit(
            x, y, batch_size=work.batch_size, epochs=1, verbose=0, shuffle=False, callbacks=callbacks
        ),
        work.steps_per_call,
    )
    return first, window


def _paraml_variant(spec: Spec, work: Workload, par: Any) -> Variant:
    with warnings.catch_warnings():  # the 1-device rows of a data-parallel strategy are measured on purpose
        warnings.filterwarnings("ignore", message="strategy .* has one device")
        par.build(work.model_fn, **work.compile_args())
    first, window = _time_fit(par.fit, work)
    devices = len(par.devices) * par.num_workers
    return Variant(spec, work, window, devices, first, par.model, par.model.optimizer, par)


def _mirrored_strategy(devices: int) -> Any:
    import tensorflow as tf

    from paraml.devices import list_devices

    available = list_devices()
    if len(available) < devices:
        raise ValueError(f"a MirroredStrategy over {devices} devices needs {devices}, this process has {available}")
    return tf.distribute.MirroredStrategy(list(available[:devices]))


def _keras_variant(spec: Spec, work: Workload) -> Variant:
    import contextlib

    mirrored = spec.strategy == KERAS_MIRRORED
    scope = _mirrored_strategy(spec.devices or 1).scope() if mirrored else contextlib.nullcontext()
    with scope:
        model = work.model_fn()
        model.compile(**work.compile_args(), jit_compile=spec.jit_compile, **spec.options)
    first, window = _time_fit(model.fit, work)
    return Variant(spec, work, window, spec.devices if mirrored else 1, first, model, model.optimizer)


def handwritten_step(strategy: Any, model: Any, optimizer: Any, loss: Any, global_batch: int) -> Callable[[Any], Any]:
    """The canonical TensorFlow custom training loop step (``strategy.run`` + ``GradientTape`` +
    ``tf.nn.compute_average_loss``) over ``next(iterator)``; ``loss`` returns per-sample values."""
    import tensorflow as tf

    @tf.function
    def step(iterator: Any) -> Any:
        def replica(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                per_sample = loss(y, model(x, training=True))
                value = tf.nn.compute_average_loss(per_sample, global_batch_size=global_batch)
            grads = tape.gradient(value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return value

        return strategy.reduce("SUM", strategy.run(replica, args=next(iterator)), axis=None)

    return step


def _handwritten_variant(spec: Spec, work: Workload) -> Variant:
    """The hand-written loop over one iterator: it has no per-call cost, so its "call" is its steps in a row."""
    import keras
    import tensorflow as tf

    if work.loss is not None:
        raise ValueError("the hand-written loop uses the default loss (sparse categorical cross-entropy on logits)")
    strategy = _mirrored_strategy(spec.devices or 1)
    with strategy.scope():
        model, optimizer = work.model_fn(), keras.optimizers.get(work.optimizer)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction=None)
    step = handwritten_step(strategy, model, optimizer, loss, work.batch_size)
    dataset = tf.data.Dataset.from_tensor_slices(work.window_data()).batch(work.batch_size, drop_remainder=True)
    iterator = iter(strategy.experimental_distribute_dataset(dataset.repeat()))
    start = time.perf_counter()
    step(iterator).numpy()
    first = time.perf_counter() - start
    steps = work.steps_per_call

    def window() -> dict[str, float]:
        begin = time.perf_counter(), time.process_time()
        step(iterator).numpy()  # as in a fit window: the steady state starts at the end of a first step
        start = time.perf_counter(), time.process_time()
        for _ in range(steps - 1):
            value = step(iterator)
        value.numpy()
        end = time.perf_counter(), time.process_time()
        return {
            "step_ms": (end[0] - start[0]) * 1000 / (steps - 1),
            "step_cpu_ms": (end[1] - start[1]) * 1000 / (steps - 1),
            "fit_call_ms": (end[0] - begin[0]) * 1000 / steps,
            "fit_call_cpu_ms": (end[1] - begin[1]) * 1000 / steps,
        }

    return Variant(spec, work, window, spec.devices or 1, first, model, optimizer)


def build_variant(spec: Spec, work: Workload, *, parallel: Any = None, warmup: int = 1) -> Variant:
    """Build ``spec`` on ``work``, time its first call (tracing) and run ``warmup`` untimed windows.

    ``parallel``: the ``Parallel`` of ``spec`` already made by :func:`make_parallel` (``multi_worker`` must exist
    before anything touches TensorFlow's devices); by default it is made here.
    """
    check_int("warmup", warmup, low=0)
    if spec.strategy in (KERAS_SINGLE, KERAS_MIRRORED):
        variant = _keras_variant(spec, work)
    elif spec.strategy == HANDWRITTEN:
        variant = _handwritten_variant(spec, work)
    else:
        variant = _paraml_variant(spec, work, parallel if parallel is not None else make_parallel(spec))
    for _ in range(warmup):
        variant.window()
    return variant


# -- results -----------------------------------------------------------------------------------------------------------


@dataclass
class BenchResult:
    """One timed variant: what it is, what building it measured, its windows and their medians."""

    label: str
    backend: str
    devices: int
    micro_batches: int | None = None
    xla: bool = False
    batch_size: int = GLOBAL_BATCH
    steps_per_call: int = 0
    samples_per_s: float = 0.0
    step_ms: float = 0.0
    """Steady-state milliseconds per step (median of the windows)."""
    step_cpu_ms: float = 0.0
    """Process CPU milliseconds per steady-state step (median of the windows)."""
    fit_call_ms: float = 0.0
    """A whole ``fit`` call's milliseconds divided by its steps (median of the windows): what a user's epoch costs."""
    fit_call_cpu_ms: float = 0.0
    """The same in process CPU time."""
    fixed_ms: float = 0.0
    """The fixed cost of one ``fit`` call: the whole call minus its steps at the steady-state step time (median)."""
    first_step_s: float = 0.0
    """Seconds of the first ``fit`` call, on one batch: tracing the step."""
    variable_bytes_per_device: dict[str, int] = field(default_factory=dict)
    peak_rss_mib: float = 0.0
    windows_ms: dict[str, list[float]] = field(default_factory=dict)
    """Metric of :data:`METRICS` -> its value in every timed window, in order."""


def _result(variant: Variant, series: Series) -> BenchResult:
    spec, work = variant.spec, variant.work
    windows = {metric: series[metric] for metric in METRICS}
    medians = {metric: statistics.median(values) for metric, values in windows.items()}
    steps = work.steps_per_call
    variables = list(variant.model.weights) + list(variant.optimizer.variables)
    return BenchResult(
        label=_label(spec.strategy, variant.devices, spec.options, spec.jit_compile, spec.tag),
        backend=spec.strategy,
        devices=variant.devices,
        micro_batches=spec.options.get("micro_batches"),
        xla=spec.jit_compile,
        batch_size=work.batch_size,
        steps_per_call=steps,
        samples_per_s=work.batch_size / (medians["step_ms"] / 1000),
        fixed_ms=statistics.median((c - s) * steps for c, s in zip(windows["fit_call_ms"], windows["step_ms"])),
        first_step_s=variant.first_step_s,
        variable_bytes_per_device=variable_bytes_by_device(variables),
        peak_rss_mib=peak_rss_mib(),
        windows_ms=windows,
        **medians,
    )


def time_variants(
    variants: Sequence[Variant],
    windows: int,
    *,
    progress: Callable[[str], None] | None = None,
    show: str | None = None,
) -> list[BenchResult]:
    """Time ``variants`` in ``windows`` interleaved rounds (:func:`interleave`, which ``progress`` and ``show``
    are passed to); one result each, in order."""
    labels = [variant.spec.label for variant in variants]
    names = [label if labels.count(label) == 1 else f"{label} #{i}" for i, label in enumerate(labels)]
    series = interleave(dict(zip(names, (v.window for v in variants))), windows, progress=progress, show=show)
    return [_result(variant, series[name]) for name, variant in zip(names, variants)]


def measure(
    plan: Sequence[tuple[Spec, Workload]],
    windows: int,
    *,
    progress: Callable[[str], None] | None = None,
    show: str | None = None,
    skip_failures: bool = False,
) -> tuple[list[BenchResult], list[Variant]]:
    """Build every ``(spec, workload)`` of ``plan`` (:func:`build_variant`), then time them (:func:`time_variants`,
    which ``progress`` and ``show`` are passed to).

    ``skip_failures``: a variant that cannot be built (e.g. XLA on a device without it) is reported to ``progress``
    and left out, instead of raising. Returns the results and the variants, in the same order.
    """
    say = progress or (lambda message: None)
    variants = []
    for i, (spec, work) in enumerate(plan, start=1):
        shown = ("micro_batches", "steps_per_execution")
        others = {key: value for key, value in spec.options.items() if key not in shown}  # not in the label
        say(f"{i}/{len(plan)} build, trace and warm up {spec.label} {others or ''}".rstrip())
        try:
            variants.append(build_variant(spec, work))
        except Exception as error:
            if not skip_failures:
                raise
            say(f"{spec.label} left out: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    if not variants:
        raise RuntimeError("no variant could be built")
    return time_variants(variants, windows, progress=progress, show=show), variants


# -- output ------------------------------------------------------------------------------------------------------------


def format_table(rows: Sequence[Sequence[Any]], header: Sequence[str], *, markdown: bool = False) -> str:
    """A table: fixed-width (the first column left-aligned, the others right-aligned) or Markdown.

    A float cell is written with 2 decimals and ``None`` as ``-``; format a cell yourself for other precisions.
    """

    def cell(value: Any) -> str:
        return "-" if value is None else f"{value:.2f}" if isinstance(value, float) else str(value)

    cells = [[str(c) for c in header]] + [[cell(c) for c in row] for row in rows]
    if markdown:
        lines = ["| " + " | ".join(row) + " |" for row in cells]
        return "\n".join([lines[0], "|" + "---|" * len(header), *lines[1:]])
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = []
    for k, row in enumerate(cells):
        lines.append("  ".join([row[0].ljust(widths[0])] + [c.rjust(w) for c, w in zip(row[1:], widths[1:])]))
        if k == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if is_dataclass(value) and not isinstance(value, type):
        return asdict(value)
    if hasattr(value, "tolist"):  # numpy scalars and arrays
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def json_line(value: Any) -> str:
    """``value`` as one line of JSON; dataclasses (a :class:`BenchResult`, ...) become objects."""
    return json.dumps(value, default=_jsonable)


def write_json(record: Mapping[str, Any], path: str | os.PathLike[str] | None = None, *, echo: bool = True) -> str:
    """Write ``record`` (dataclasses included) as JSON to ``path`` if given; with ``echo``, also print it as one
    line prefixed ``JSON ``. Returns the one-line JSON."""
    line = json_line(record)
    if echo:
        print("JSON " + line, flush=True)
    if path:
        with open(path, "w", encoding="utf-8") as file:
            file.write(json.dumps(record, indent=1, default=_jsonable) + "\n")
    return line


def environment(**extra: Any) -> dict[str, Any]:
    """What the numbers were measured on (imports TensorFlow, initialising no device), plus ``extra``."""
    import keras
    import tensorflow as tf

    return {
        "cpus": os.cpu_count(),
        "gpus": len(tf.config.list_physical_devices("GPU")),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "python": platform.python_version(),
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        **extra,
    }


def progress_printer(prefix: str) -> Callable[[str], None]:
    """A ``progress`` function printing ``[prefix] message (seconds since now)`` to stderr."""
    began = time.perf_counter()

    def progress(message: str) -> None:
        print(f"[{prefix}] {message} ({time.perf_counter() - began:.1f} s)", file=sys.stderr, flush=True)

    return progress


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an int >= ``low`` (checked by :func:`paraml.checks.check_int`)."""

    def parse(text: str) -> int:
        try:
            return check_int("value", int(text), low=low)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an int >= {low}, got {text!r}") from None

    parse.__name__ = f"int >= {low}"
    return parse


# -- separate processes ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Completed:
    """A finished process: exit code, output and wall seconds."""

    code: int
    stdout: str
    stderr: str
    seconds: float


def run_process(command: Sequence[str], timeout: float, *, env: Mapping[str, str] | None = None) -> Completed:
    """Run ``command`` (``TF_CPP_MIN_LOG_LEVEL=3``, no inherited ``TF_CONFIG``) and wait for it.

    After ``timeout`` seconds it gets SIGTERM (``paraml launch`` then stops its workers, which a SIGKILL would leave
    running in their own sessions), then SIGKILL 30 s later, and ``RuntimeError`` is raised.
    """
    environ = dict(os.environ if env is None else env, TF_CPP_MIN_LOG_LEVEL="3")
    environ.pop("TF_CONFIG", None)
    start = time.perf_counter()
    proc = subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environ)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            stdout, stderr = proc.communicate()
        raise RuntimeError(f"timed out after {timeout:g} s: {' '.join(command)}\n{stderr[-3000:]}") from None
    return Completed(proc.returncode, stdout, stderr, time.perf_counter() - start)


def marked_results(text: str, marker: str) -> list[Any]:
    """The JSON values printed after ``marker`` on lines of ``text`` (e.g. a chief's result among workers' output)."""
    return [json.loads(line.split(marker, 1)[1]) for line in text.splitlines() if marker in line]
