"""``paraml bench``: the backends side by side on this machine, with the evidence to choose between them.

For a model (a preset or ``MODULE:FUNCTION``) and each backend at 1, 2 and 4 devices it measures throughput
(samples/s, the median of several timed windows after warm-up), step time, time to the first step (tracing), the
bytes of variables on each device and the process's peak memory. Every variant is timed two ways: the steady-state
step (from the end of a ``fit`` call's first step to its last) and the whole ``fit`` call divided by its steps, whose
difference is the fixed cost a ``fit`` call pays (``fixed_ms``: building the input pipeline, its iterator, ...).

Baselines, run next to paraml: plain Keras ``model.compile(); model.fit()`` on one device with no strategy (what users
compare with), Keras ``fit`` under the same ``MirroredStrategy`` and a hand-written ``strategy.run`` loop; and, where
TensorFlow allows it (``single``, ``mirrored``), paraml with ``jit_compile=True`` (XLA in the replica step). The
ratios (paraml / Keras, XLA / no XLA) are medians of per-window ratios. Timings here are noisy (field notes, 9), so
all variants run in one process and their windows are interleaved (A B C A B C ...): a disturbance hits every
variant alike.

``multi_worker`` runs through ``paraml launch`` with 2 local workers running ``_bench_worker.py``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "BenchResult",
    "PRESETS",
    "RATIOS",
    "TARGETS",
    "compute_ratios",
    "handwritten_step",
    "run_bench",
    "variable_bytes_per_device",
]

GLOBAL_BATCH = 256


def _mlp() -> Any:
    import keras

    layers = [keras.layers.Dense(512, activation="relu") for _ in range(4)]
    return keras.Sequential([keras.Input((256,)), *layers, keras.layers.Dense(10)], name="mlp")


def _mlp2() -> Any:
    """The 256-512-512-10 MLP of issue 13 and field notes 16 (the single-device comparison with plain Keras)."""
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


#: preset name -> (model_fn, input shape, input kind)
PRESETS: dict[str, tuple[Callable[[], Any], tuple[int, ...], str]] = {
    "mlp": (_mlp, (256,), "float"),
    "mlp2": (_mlp2, (256,), "float"),
    "cnn": (_cnn, (32, 32, 3), "float"),
    "transformer": (_transformer, (32,), "tokens"),
}


def _data(shape: tuple[int, ...], kind: str, samples: int) -> tuple[Any, Any]:
    import numpy as np

    rng = np.random.default_rng(0)
    x = rng.integers(0, 1000, (samples, *shape)).astype("int32") if kind == "tokens" else rng.random((samples, *shape))
    return x.astype("int32" if kind == "tokens" else "float32"), rng.integers(0, 10, samples).astype("int32")


def variable_bytes_per_device(variables: Sequence[Any]) -> dict[str, int]:
    """Bytes of ``variables`` on each device (a mirrored variable counts once on every device holding a copy)."""
    totals: dict[str, int] = {}
    for variable in variables:
        value = getattr(variable, "value", variable)
        copies = getattr(value, "values", None) or (value,)
        for copy in copies:
            device = "/device:" + copy.device.split("device:")[-1]
            totals[device] = totals.get(device, 0) + int(copy.shape.num_elements()) * copy.dtype.size
    return dict(sorted(totals.items()))


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


@dataclass
class BenchResult:
    """One row of ``paraml bench``: a backend on a number of devices (or a baseline)."""

    backend: str
    devices: int
    micro_batches: int | None = None
    xla: bool = False
    samples_per_s: float = 0.0
    step_ms: float = 0.0
    """Steady-state milliseconds per step (median of the windows)."""
    fit_call_ms: float = 0.0
    """A whole ``fit`` call's milliseconds divided by its steps (median of the windows): what a user's epoch costs."""
    fixed_ms: float = 0.0
    """The fixed cost of one ``fit`` call: the whole call minus its steps at the steady-state step time."""
    first_step_s: float = 0.0
    variable_bytes_per_device: dict[str, int] = field(default_factory=dict)
    peak_rss_mib: float = 0.0
    windows_ms: list[float] = field(default_factory=list)
    call_windows_ms: list[float] = field(default_factory=list)
    steps_per_call: int = 0

    @property
    def label(self) -> str:
        """``backend@devices`` plus micro-batches and ``xla`` where they apply."""
        label = f"{self.backend}@{self.devices}" + (f" mb={self.micro_batches}" if self.micro_batches else "")
        return label + (" xla" if self.xla else "")


class _Runner:
    """A variant whose ``window()`` runs one ``fit`` call (or as many steps) and returns the steady-state
    milliseconds per step and the whole call's milliseconds per step."""

    def __init__(self, result: BenchResult, window: Callable[[], tuple[float, float]]) -> None:
        self.result, self.window = result, window


def _timed_fit(fit: Callable[[Any], Any], steps: int) -> tuple[float, float]:
    """Run ``fit(callbacks)`` of ``steps + 1`` batches: (steady ms per step, whole call ms per step)."""
    clock = _step_clock()
    start = time.perf_counter()
    fit([clock])
    whole = time.perf_counter() - start
    return clock.ms_per_step(), whole * 1000 / (steps + 1)


def _step_clock(clock: Callable[[], float] = time.perf_counter) -> Any:
    """A Keras callback timing steady-state steps of one ``fit``: from the end of its first batch to its last.

    The first batch of a fit call carries the call's fixed costs (a new iterator over the data, callbacks); they are
    reported apart (``first_step_s``), and the windows compare the per-step cost, as the hand-written loop's do.
    ``clock`` is wall time by default; ``time.process_time`` gives CPU time, steadier on a busy machine.
    """
    import keras

    class StepClock(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch == 0:
                self.start, self.batches = clock(), 0
            else:
                self.end, self.batches = clock(), batch

        def ms_per_step(self) -> float:
            return (self.end - self.start) * 1000 / self.batches

    return StepClock()


def _paraml_runner(par: Any, model_fn: Callable[[], Any], data: Any, steps: int) -> _Runner:
    """Build ``model_fn`` on ``par``, time its first step (tracing), warm up, and return its timed window (one fit
    call of ``steps + 1`` batches of numpy input, as a user's epoch)."""
    import keras

    par.build(
        model_fn,
        optimizer=keras.optimizers.SGD(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = data
    window_x, window_y = x[: (steps + 1) * GLOBAL_BATCH], y[: (steps + 1) * GLOBAL_BATCH]
    start = time.perf_counter()
    par.fit(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH], batch_size=GLOBAL_BATCH, verbose=0)  # traces the step
    micro_batches = getattr(par.backend, "micro_batches", None)
    xla = par.jit_compile is True
    result = BenchResult(par.strategy, len(par.devices), micro_batches, xla, first_step_s=time.perf_counter() - start)
    result.variable_bytes_per_device = variable_bytes_per_device(par.model.weights + par.model.optimizer.variables)

    def window() -> tuple[float, float]:
        return _timed_fit(
            lambda callbacks: par.fit(
                window_x, window_y, batch_size=GLOBAL_BATCH, verbose=0, shuffle=False, callbacks=callbacks
            ),
            steps,
        )

    window()  # warm-up
    return _Runner(result, window)


def handwritten_step(strategy: Any, model: Any, optimizer: Any, loss: Any) -> Callable[[Any], Any]:
    """The canonical TensorFlow custom training loop step (``strategy.run`` + ``GradientTape`` +
    ``tf.nn.compute_average_loss``), the baseline paraml's loop is measured against."""
    import tensorflow as tf

    @tf.function
    def step(iterator: Any) -> Any:
        def replica(x: Any, y: Any) -> Any:
            with tf.GradientTape() as tape:
                per_sample = loss(y, model(x, training=True))
                value = tf.nn.compute_average_loss(per_sample, global_batch_size=GLOBAL_BATCH)
            grads = tape.gradient(value, model.trainable_variables)
            optimizer.apply_gradients(zip(grads, model.trainable_variables))
            return value

        return strategy.reduce("SUM", strategy.run(replica, args=next(iterator)), axis=None)

    return step


def _handwritten_runner(model_fn: Callable[[], Any], data: Any, steps: int) -> _Runner:
    """The hand-written ``strategy.run`` loop under ``MirroredStrategy`` on 2 devices, over one iterator (it has no
    per-call cost: its whole-call time is its ``steps + 1`` steps)."""
    import keras
    import tensorflow as tf

    from .backends.distribute import MirroredBackend

    x, y = data
    window = tf.data.Dataset.from_tensor_slices((x[: (steps + 1) * GLOBAL_BATCH], y[: (steps + 1) * GLOBAL_BATCH]))
    window = window.batch(GLOBAL_BATCH, drop_remainder=True)
    hand = MirroredBackend(2)  # the same strategy paraml builds (collective keys kept apart)
    with hand.strategy.scope():
        model, optimizer = model_fn(), keras.optimizers.SGD(0.01)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    step = handwritten_step(hand.strategy, model, optimizer, loss)
    iterator = iter(hand.strategy.experimental_distribute_dataset(window.repeat()))
    start = time.perf_counter()
    step(iterator).numpy()
    first = time.perf_counter() - start

    def hand_window() -> tuple[float, float]:
        begin = time.perf_counter()
        step(iterator).numpy()  # as the clocked fits: time from the end of a first step
        start = time.perf_counter()
        for _ in range(steps):
            value = step(iterator)
        value.numpy()
        end = time.perf_counter()
        return (end - start) * 1000 / steps, (end - begin) * 1000 / (steps + 1)

    hand_window()
    return _Runner(BenchResult("handwritten-mirrored", 2, first_step_s=first), hand_window)


def _keras_runner(
    model_fn: Callable[[], Any], data: Any, steps: int, devices: int | None, jit_compile: bool = False
) -> _Runner:
    """Keras' own ``model.compile(); model.fit()`` on numpy input: with no strategy at all (``devices=None``: plain
    Keras on one device, the baseline users know) or under ``MirroredStrategy`` on ``devices`` devices."""
    import contextlib

    import keras

    from .backends.distribute import MirroredBackend

    scope = MirroredBackend(devices).strategy.scope() if devices else contextlib.nullcontext()
    with scope:
        model = model_fn()
        model.compile(
            keras.optimizers.SGD(0.01),
            keras.losses.SparseCategoricalCrossentropy(from_logits=True),
            jit_compile=jit_compile,
        )
    x, y = data
    window_x, window_y = x[: (steps + 1) * GLOBAL_BATCH], y[: (steps + 1) * GLOBAL_BATCH]
    start = time.perf_counter()
    model.fit(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH], batch_size=GLOBAL_BATCH, verbose=0)
    first = time.perf_counter() - start
    name = "keras-fit-mirrored" if devices else "keras-fit-single"

    def window() -> tuple[float, float]:
        return _timed_fit(
            lambda callbacks: model.fit(
                window_x, window_y, batch_size=GLOBAL_BATCH, verbose=0, shuffle=False, callbacks=callbacks
            ),
            steps,
        )

    window()
    return _Runner(BenchResult(name, devices or 1, xla=jit_compile, first_step_s=first), window)


#: Backends whose replica step TensorFlow can compile with XLA (``jit_compile=True``); the others refuse it.
XLA_BACKENDS = ("single", "mirrored")


def _configs(
    device_counts: Sequence[int], micro_batches: Sequence[int], quick: bool = False
) -> list[tuple[str, int, dict[str, Any]]]:
    """(strategy, devices, options) of the paraml rows. ``quick`` leaves out the rows no ratio needs on 1 device and
    keeps XLA only where a ratio uses it (single@1, mirrored@2)."""
    configs: list[tuple[str, int, dict[str, Any]]] = [("single", 1, {}), ("single", 1, {"jit_compile": True})]
    for n in device_counts:
        if quick and n == 1:
            continue
        configs += [("mirrored", n, {})]
        if not quick or n == 2:
            configs += [("mirrored", n, {"jit_compile": True})]
        configs += [("central_storage", n, {})]
        if n > 1:
            configs += [("model_parallel", n, {"micro_batches": m}) for m in micro_batches]
    return configs


def _multi_worker(preset: str, steps: int, windows: int, threads: int, progress: Callable[[str], None]) -> BenchResult:
    """``multi_worker`` with 2 local workers through the launcher; the chief prints its result as JSON."""
    import io

    from .launch import launch

    progress("multi_worker@2x1: starting 2 workers with paraml launch")
    captured = io.StringIO()
    worker = str(Path(__file__).with_name("_bench_worker.py"))
    code = launch(worker, [preset, str(steps), str(windows), str(threads)], num_workers=2, out=captured)
    for line in captured.getvalue().splitlines():
        if "PARAML_BENCH_RESULT " in line:
            return BenchResult(**json.loads(line.split("PARAML_BENCH_RESULT ", 1)[1]))
    raise RuntimeError(f"multi_worker benchmark failed (exit code {code}):\n{captured.getvalue()[-2000:]}")


def worker_main(argv: Sequence[str]) -> None:
    """One worker of the ``multi_worker`` benchmark (run by ``paraml launch``): time it, the chief prints JSON."""
    import os

    preset, steps, windows, threads = argv[0], int(argv[1]), int(argv[2]), int(argv[3])
    if threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads)
    from .parallel import Parallel

    par = Parallel("multi_worker", seed=0)  # before anything touches TensorFlow's devices
    model_fn, shape, kind = PRESETS[preset]
    runner = _paraml_runner(par, model_fn, _data(shape, kind, (steps + 1) * GLOBAL_BATCH), steps)
    for _ in range(windows):
        _record(runner)
    _finish(runner.result, steps)
    runner.result.devices = par.num_workers * len(par.devices)
    if os.environ.get("PARAML_WORKER_INDEX") == "0":
        print("PARAML_BENCH_RESULT " + json.dumps(asdict(runner.result)), flush=True)


def _record(runner: _Runner) -> None:
    steady, call = runner.window()
    runner.result.windows_ms.append(steady)
    runner.result.call_windows_ms.append(call)


def _finish(result: BenchResult, steps: int) -> None:
    result.step_ms = statistics.median(result.windows_ms)
    result.samples_per_s = GLOBAL_BATCH / (result.step_ms / 1000)
    result.steps_per_call = steps + 1
    if result.call_windows_ms:
        result.fit_call_ms = statistics.median(result.call_windows_ms)
        fixed = [(c - w) * (steps + 1) for c, w in zip(result.call_windows_ms, result.windows_ms)]
        result.fixed_ms = statistics.median(fixed)
    result.peak_rss_mib = _peak_rss_mib()


#: name -> (numerator, denominator): the ratios ``paraml bench`` reports when both rows ran (< 1: the first is faster).
#: ``{n}`` is the number of devices of the data-parallel rows (2 in ``paraml bench``, every GPU in gpu_check.py).
RATIOS: dict[str, tuple[str, str]] = {
    "single_vs_keras_fit_single": ("single@1", "keras-fit-single@1"),
    "single_xla_vs_keras_fit_single": ("single@1 xla", "keras-fit-single@1"),
    "single_xla_vs_keras_fit_single_xla": ("single@1 xla", "keras-fit-single@1 xla"),
    "paraml_vs_keras_fit": ("mirrored@{n}", "keras-fit-mirrored@{n}"),  # mirrored / Keras fit, same strategy
    "mirrored_xla_vs_keras_fit_mirrored": ("mirrored@{n} xla", "keras-fit-mirrored@{n}"),
    "paraml_vs_handwritten": ("mirrored@{n}", "handwritten-mirrored@{n}"),
    "keras_fit_xla_vs_no_xla": ("keras-fit-single@1 xla", "keras-fit-single@1"),
    "keras_fit_mirrored_vs_single": ("keras-fit-mirrored@{n}", "keras-fit-single@1"),
}

#: The issue-13 targets: (ratio, at most). The best ``single`` variant is the faster of ``single`` and ``single xla``.
TARGETS: dict[str, float] = {"best_single_vs_keras_fit_single": 0.9, "best_mirrored_vs_keras_fit_mirrored": 0.9}


def _paired(a: Sequence[float], b: Sequence[float]) -> float:
    """The median of per-window ratios ``a / b`` (the two ran side by side in each window)."""
    return statistics.median(x / y for x, y in zip(a, b))


def compute_ratios(results: Sequence[BenchResult], devices: int = 2) -> tuple[dict[str, float], dict[str, float]]:
    """(steady-state ratios, whole-fit-call ratios) of :data:`RATIOS` (data-parallel rows on ``devices`` devices),
    ``xla_vs_no_xla_<row>`` for every paraml row with an XLA twin, and ``best_single_vs_keras_fit_single`` /
    ``best_mirrored_vs_keras_fit_mirrored`` (the faster of the XLA and plain variant)."""
    by_label = {r.label: r for r in results if r.call_windows_ms}
    pairs = {name: (a.format(n=devices), b.format(n=devices)) for name, (a, b) in RATIOS.items()}
    for label in by_label:
        if label.endswith(" xla") and not label.startswith("keras") and label[: -len(" xla")] in by_label:
            pairs[f"xla_vs_no_xla_{label[: -len(' xla')]}"] = (label, label[: -len(" xla")])
    steady: dict[str, float] = {}
    call: dict[str, float] = {}
    for name, (a, b) in pairs.items():
        if a in by_label and b in by_label:
            steady[name] = _paired(by_label[a].windows_ms, by_label[b].windows_ms)
            call[name] = _paired(by_label[a].call_windows_ms, by_label[b].call_windows_ms)
    for best, (plain, xla) in {
        "best_single_vs_keras_fit_single": ("single_vs_keras_fit_single", "single_xla_vs_keras_fit_single"),
        "best_mirrored_vs_keras_fit_mirrored": ("paraml_vs_keras_fit", "mirrored_xla_vs_keras_fit_mirrored"),
    }.items():
        for ratios in (steady, call):
            values = [ratios[n] for n in (plain, xla) if n in ratios]
            if values:
                ratios[best] = min(values)
    return steady, call


def run_bench(
    model: str = "mlp",
    *,
    devices: Sequence[int] = (1, 2, 4),
    micro_batches: Sequence[int] = (1, 2, 4),
    steps: int = 31,
    windows: int = 5,
    threads_per_device: int = 0,
    multi_worker: bool = True,
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the comparison; return ``{"results": [BenchResult...], "ratios": {...}, "fit_call_ratios": {...},
    "targets": {...}, "machine": {...}}``.

    A timed window is one ``fit`` call of ``steps + 1`` batches per variant. ``quick`` leaves out the rows no ratio
    needs (1-device data-parallel rows, XLA on more than 2 devices, Keras with XLA). Call it at program start: it sets
    up ``max(devices)`` simulated devices when the machine has fewer.
    """
    import os
    import platform

    from .devices import ensure_devices
    from .parallel import Parallel

    began = time.perf_counter()
    progress = progress or (
        lambda message: print(f"[bench] {message} ({time.perf_counter() - began:.1f} s)", file=sys.stderr, flush=True)
    )
    if threads_per_device:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads_per_device)
    ensure_devices(max(devices))
    if model in PRESETS:
        model_fn, shape, kind = PRESETS[model]
    else:
        from .cli import load_object

        model_fn = load_object(model)
        probe = model_fn()
        shape, kind = tuple(probe.inputs[0].shape[1:]), "tokens" if "int" in str(probe.inputs[0].dtype) else "float"
    data = _data(shape, kind, (steps + 1) * GLOBAL_BATCH)
    runners = []
    configs = _configs(devices, micro_batches, quick)
    baselines: list[tuple[str, Callable[[], _Runner]]] = [
        ("Keras fit, no strategy", lambda: _keras_runner(model_fn, data, steps, None))
    ]
    if not quick:
        baselines.append(("Keras fit, no strategy, XLA", lambda: _keras_runner(model_fn, data, steps, None, True)))
    if 2 in devices:
        baselines.append(("the hand-written loop", lambda: _handwritten_runner(model_fn, data, steps)))
        baselines.append(("Keras fit under MirroredStrategy(2)", lambda: _keras_runner(model_fn, data, steps, 2)))
    total = len(configs) + len(baselines)
    for i, (strategy, n, options) in enumerate(configs, start=1):
        progress(f"{i}/{total} build and warm up {strategy}@{n} {options or ''}")
        runners.append(_paraml_runner(Parallel(strategy, devices=n, seed=0, **options), model_fn, data, steps))
    for i, (what, make) in enumerate(baselines, start=len(configs) + 1):
        progress(f"{i}/{total} build and warm up {what}")
        runners.append(make())
    for w in range(windows):
        progress(f"timed window {w + 1}/{windows} of {len(runners)} variants, interleaved")
        shift = w % len(runners)  # A B C, B C A, ...: no variant always runs first or after the same neighbour
        for runner in runners[shift:] + runners[:shift]:
            _record(runner)
    results = [runner.result for runner in runners]
    for result in results:
        _finish(result, steps)
    if multi_worker:
        results.append(_multi_worker(model, steps, windows, threads_per_device, progress))
    ratios, call_ratios = compute_ratios(results)
    by_label = {r.label: r for r in results}
    if "multi_worker@2" in by_label and "mirrored@2" in by_label:
        ratios["multi_worker_vs_mirrored_steps_per_s"] = (
            by_label["mirrored@2"].step_ms / by_label["multi_worker@2"].step_ms
        )
    targets = {
        name: {
            "at_most": limit,
            "steady": ratios.get(name),
            "fit_call": call_ratios.get(name),
            "met": name in call_ratios and call_ratios[name] <= limit,
        }
        for name, limit in TARGETS.items()
    }
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    import tensorflow as tf

    machine.update(
        tensorflow=tf.__version__,
        gpus=len(tf.config.list_physical_devices("GPU")),
        threads_per_device=threads_per_device or "default",
    )
    return {
        "model": model,
        "global_batch": GLOBAL_BATCH,
        "steps_per_fit_call": steps + 1,
        "windows": windows,
        "results": results,
        "ratios": ratios,
        "fit_call_ratios": call_ratios,
        "targets": targets,
        "machine": machine,
    }


def _ratio_lines(report: dict[str, Any], markdown: bool) -> list[str]:
    steady, call = report["ratios"], report.get("fit_call_ratios", {})
    lines = []
    if markdown:
        lines += ["| ratio (< 1: the first is faster) | steady-state step | whole fit call |", "|---|---|---|"]
    else:
        lines.append(f"{'ratio (< 1: the first is faster)':<42}{'steady':>8}{'fit call':>10}")
    for name, value in steady.items():
        whole = f"{call[name]:.3f}" if name in call else "-"
        lines.append(f"| `{name}` | {value:.3f} | {whole} |" if markdown else f"{name:<42}{value:>8.3f}{whole:>10}")
    for name, target in report.get("targets", {}).items():
        verdict = "met" if target["met"] else "MISSED"
        measured = "-" if target["fit_call"] is None else f"{target['fit_call']:.3f}"
        text = f"target {name} <= {target['at_most']} (whole fit call): {measured}, {verdict}"
        lines.append(f"- {text}" if markdown else text)
    return lines


def format_report(report: dict[str, Any]) -> str:
    """The benchmark as a terminal table followed by the ratios."""
    from .sizes import format_bytes

    lines = [f"model {report['model']}, global batch {report['global_batch']}, machine {report['machine']}", ""]
    lines.append(
        f"{'variant':<26}{'samples/s':>10}{'step ms':>9}{'fit-call ms':>12}{'fixed ms':>10}{'first step s':>13}"
        f"{'max var bytes/device':>22}{'peak RSS MiB':>13}"
    )
    for r in report["results"]:
        largest = max(r.variable_bytes_per_device.values(), default=0)
        lines.append(
            f"{r.label:<26}{r.samples_per_s:>10.0f}{r.step_ms:>9.2f}{r.fit_call_ms:>12.2f}{r.fixed_ms:>10.1f}"
            f"{r.first_step_s:>13.2f}{format_bytes(largest) if largest else '-':>22}{r.peak_rss_mib:>13.0f}"
        )
    lines.append("")
    lines += _ratio_lines(report, markdown=False)
    lines.append("")
    lines.append(
        f"step ms: steady state; fit-call ms: a whole fit call of {report.get('steps_per_fit_call', '?')} steps per "
        "step; fixed ms: what one fit call costs beyond its steps. Ratios: medians of per-window ratios."
    )
    lines.append("Simulated CPU devices share one thread pool: pipeline and data-parallel gains here are not a GPU's.")
    return "\n".join(lines)


def format_markdown(report: dict[str, Any], command: str) -> str:
    """The benchmark as a Markdown results page (``docs/results.md`` is one)."""
    from .sizes import format_bytes

    machine = report["machine"]
    lines = [
        "# Results of a `paraml bench` run",
        "",
        f"Generated by `{command}`. Machine: {machine['cpus']} CPU cores, {machine['gpus']} GPUs, "
        f"{machine['platform']}, Python {machine['python']}, TensorFlow {machine['tensorflow']}, intra-op threads "
        f"per device: {machine['threads_per_device']}. Model `{report['model']}`, global batch "
        f"{report['global_batch']}, numpy input, {report.get('windows', '?')} interleaved windows of one fit call of "
        f"{report.get('steps_per_fit_call', '?')} steps per variant. Devices are logical CPUs sharing the same 2 "
        "cores, so more devices cannot be faster here: these numbers show paraml's overheads and memory layout, not a "
        "GPU cluster's speed-ups.",
        "",
        "| variant | samples/s | step ms | fit-call ms/step | fixed ms/call | first step s | largest variable bytes on "
        "one device | peak RSS MiB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        largest = max(r.variable_bytes_per_device.values(), default=0)
        lines.append(
            f"| {r.label} | {r.samples_per_s:.0f} | {r.step_ms:.2f} | {r.fit_call_ms:.2f} | {r.fixed_ms:.0f} | "
            f"{r.first_step_s:.2f} | {format_bytes(largest) if largest else '-'} | {r.peak_rss_mib:.0f} |"
        )
    lines += ["", "Ratios measured in the same run (windows interleaved, medians of per-window ratios):", ""]
    lines += _ratio_lines(report, markdown=True)
    lines += [
        "",
        "Step times are steady-state: from the end of a fit call's first step to its last. The fit-call time is a "
        "whole `fit` call divided by its steps; the difference, times the steps, is the fixed cost of one call "
        "(building the input pipeline and its iterator, callbacks). `xla` rows run with `jit_compile=True`; "
        "`keras-fit-single` is plain `model.compile(); model.fit()` with no strategy.",
        "",
    ]
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> bool:
    """A PNG of throughput and largest per-device variable bytes per variant; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = report["results"]
    labels = [r.label for r in results]
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(12, 0.4 * len(labels) + 2))
    speed.barh(labels, [r.samples_per_s for r in results])
    speed.set_xlabel("samples/s")
    memory.barh(labels, [max(r.variable_bytes_per_device.values(), default=0) / 2**20 for r in results])
    memory.set_xlabel("largest variable MiB on one device")
    speed.invert_yaxis()
    memory.invert_yaxis()
    figure.suptitle(f"paraml bench: {report['model']}, global batch {report['global_batch']}")
    figure.tight_layout()
    figure.savefig(path)
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``paraml bench``."""
    parser.add_argument("--model", default="mlp", help=f"a preset ({', '.join(PRESETS)}) or MODULE:FUNCTION")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1 and 2 devices, micro-batches 4, fewer windows, only the rows a ratio needs",
    )
    parser.add_argument("--devices", default="1,2,4", help="device counts, e.g. 1,2,4")
    parser.add_argument("--steps", type=int, default=31, help="steps per timed window (a fit call: steps + 1)")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per variant (the median is reported)")
    parser.add_argument("--threads-per-device", type=int, default=0, help="intra-op threads (1: one core per device)")
    parser.add_argument("--no-multi-worker", action="store_true", help="skip the 2-worker launcher run")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--markdown", default=None, help="write a Markdown results page here")
    parser.add_argument(
        "--plot", default=None, help="write a PNG plot here (needs matplotlib: pip install paraml[plot])"
    )


def run_from_args(ns: argparse.Namespace) -> int:
    """``paraml bench`` with parsed arguments."""
    devices = (1, 2) if ns.quick else tuple(int(d) for d in ns.devices.split(","))
    report = run_bench(
        ns.model,
        devices=devices,
        micro_batches=(4,) if ns.quick else (1, 2, 4),
        steps=ns.steps,
        windows=2 if ns.quick else ns.windows,
        threads_per_device=ns.threads_per_device,
        multi_worker=not ns.no_multi_worker,
        quick=ns.quick,
    )
    print(format_report(report))
    if ns.json:
        with open(ns.json, "w") as file:
            json.dump(
                {**report, "results": [asdict(r) | {"label": r.label} for r in report["results"]]}, file, indent=1
            )
    if ns.markdown:
        with open(ns.markdown, "w") as file:
            file.write(format_markdown(report, "paraml bench " + " ".join(sys.argv[2:])))
    if ns.plot and not write_plot(report, ns.plot):
        print("no plot: matplotlib is not installed (pip install 'paraml[plot]')", file=sys.stderr)
    return 0
