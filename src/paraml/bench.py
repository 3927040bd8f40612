"""``paraml bench``: the backends side by side on this machine, with the evidence to choose between them.

For a model (a preset or ``MODULE:FUNCTION``) and each backend at 1, 2 and 4 devices it measures throughput
(samples/s, the median of several timed windows after warm-up), step time, time to the first step (tracing), the
bytes of variables on each device and the process's peak memory. It also measures paraml against a hand-written
``strategy.run`` loop and against Keras ``model.fit`` under the same ``MirroredStrategy``, as ratios from the same
run. Timings here are noisy (field notes, 9), so all variants run in one process and their windows are interleaved
(A B C A B C ...): a disturbance hits every variant alike.

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

__all__ = ["BenchResult", "PRESETS", "handwritten_step", "run_bench", "variable_bytes_per_device"]

GLOBAL_BATCH = 256


def _mlp() -> Any:
    import keras

    layers = [keras.layers.Dense(512, activation="relu") for _ in range(4)]
    return keras.Sequential([keras.Input((256,)), *layers, keras.layers.Dense(10)], name="mlp")


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
    samples_per_s: float = 0.0
    step_ms: float = 0.0
    first_step_s: float = 0.0
    variable_bytes_per_device: dict[str, int] = field(default_factory=dict)
    peak_rss_mib: float = 0.0
    windows_ms: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        """``backend@devices`` plus micro-batches where they apply."""
        return f"{self.backend}@{self.devices}" + (f" mb={self.micro_batches}" if self.micro_batches else "")


class _Runner:
    """A variant whose ``window()`` runs training steps and returns the steady-state milliseconds per step."""

    def __init__(self, result: BenchResult, window: Callable[[], float]) -> None:
        self.result, self.window = result, window


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
    """Build ``model_fn`` on ``par``, time its first step (tracing), warm up, and return its timed window."""
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
    result = BenchResult(par.strategy, len(par.devices), micro_batches, first_step_s=time.perf_counter() - start)
    result.variable_bytes_per_device = variable_bytes_per_device(par.model.weights + par.model.optimizer.variables)

    def window() -> float:
        clock = _step_clock()
        par.fit(window_x, window_y, batch_size=GLOBAL_BATCH, verbose=0, shuffle=False, callbacks=[clock])
        return clock.ms_per_step()

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


def _baseline_runners(model_fn: Callable[[], Any], data: Any, steps: int) -> list[_Runner]:
    """A hand-written loop and Keras ``model.fit``, both under ``MirroredStrategy`` on 2 devices."""
    import keras
    import tensorflow as tf

    from .backends.distribute import MirroredBackend

    x, y = data
    window = tf.data.Dataset.from_tensor_slices((x[: (steps + 1) * GLOBAL_BATCH], y[: (steps + 1) * GLOBAL_BATCH]))
    window = window.batch(GLOBAL_BATCH, drop_remainder=True)
    runners = []

    hand = MirroredBackend(2)  # the same strategy paraml builds (collective keys kept apart)
    with hand.strategy.scope():
        model, optimizer = model_fn(), keras.optimizers.SGD(0.01)
        loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")
    step = handwritten_step(hand.strategy, model, optimizer, loss)
    distributed = hand.strategy.experimental_distribute_dataset(window.repeat())
    iterator = iter(distributed)
    start = time.perf_counter()
    step(iterator).numpy()
    first = time.perf_counter() - start

    def hand_window() -> float:
        step(iterator).numpy()  # as the clocked fits: time from the end of a first step
        start = time.perf_counter()
        for _ in range(steps):
            value = step(iterator)
        value.numpy()
        return (time.perf_counter() - start) * 1000 / steps

    hand_window()
    runners.append(_Runner(BenchResult("handwritten-mirrored", 2, first_step_s=first), hand_window))

    fit = MirroredBackend(2)
    with fit.strategy.scope():
        keras_model = model_fn()
        keras_model.compile(keras.optimizers.SGD(0.01), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    start = time.perf_counter()
    keras_model.fit(window.take(1), verbose=0)
    first = time.perf_counter() - start

    def keras_window() -> float:
        clock = _step_clock()
        keras_model.fit(window, verbose=0, callbacks=[clock])
        return clock.ms_per_step()

    keras_window()
    runners.append(_Runner(BenchResult("keras-fit-mirrored", 2, first_step_s=first), keras_window))
    return runners


def _configs(device_counts: Sequence[int], micro_batches: Sequence[int]) -> list[tuple[str, int, dict[str, Any]]]:
    configs: list[tuple[str, int, dict[str, Any]]] = [("single", 1, {})]
    for n in device_counts:
        configs += [("mirrored", n, {}), ("central_storage", n, {})]
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
        runner.result.windows_ms.append(runner.window())
    _finish(runner.result)
    runner.result.devices = par.num_workers * len(par.devices)
    if os.environ.get("PARAML_WORKER_INDEX") == "0":
        print("PARAML_BENCH_RESULT " + json.dumps(asdict(runner.result)), flush=True)


def _finish(result: BenchResult) -> None:
    result.step_ms = statistics.median(result.windows_ms)
    result.samples_per_s = GLOBAL_BATCH / (result.step_ms / 1000)
    result.peak_rss_mib = _peak_rss_mib()


def run_bench(
    model: str = "mlp",
    *,
    devices: Sequence[int] = (1, 2, 4),
    micro_batches: Sequence[int] = (1, 2, 4),
    steps: int = 20,
    windows: int = 5,
    threads_per_device: int = 0,
    multi_worker: bool = True,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the comparison; return ``{"results": [BenchResult...], "ratios": {...}, "machine": {...}}``.

    Call it at program start: it sets up ``max(devices)`` simulated devices when the machine has fewer.
    """
    import os
    import platform

    from .devices import ensure_devices
    from .parallel import Parallel

    progress = progress or (lambda message: print(f"[bench] {message}", file=sys.stderr, flush=True))
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
    configs = _configs(devices, micro_batches)
    for i, (strategy, n, options) in enumerate(configs, start=1):
        progress(f"{i}/{len(configs) + 2} build and warm up {strategy}@{n} {options or ''}")
        runners.append(_paraml_runner(Parallel(strategy, devices=n, seed=0, **options), model_fn, data, steps))
    if 2 in devices:
        progress(f"{len(configs) + 1}/{len(configs) + 2} build and warm up the hand-written loop and Keras fit")
        runners += _baseline_runners(model_fn, data, steps)
    for w in range(windows):
        progress(f"timed window {w + 1}/{windows} of {len(runners)} variants, interleaved")
        for runner in runners:
            runner.result.windows_ms.append(runner.window())
    results = [runner.result for runner in runners]
    for result in results:
        _finish(result)
    if multi_worker:
        results.append(_multi_worker(model, steps, windows, threads_per_device, progress))
    by_label = {r.label: r for r in results}
    ratios = {}
    if "mirrored@2" in by_label and "handwritten-mirrored@2" in by_label:
        paraml_windows = by_label["mirrored@2"].windows_ms
        hand, keras_fit = by_label["handwritten-mirrored@2"].windows_ms, by_label["keras-fit-mirrored@2"].windows_ms
        # per-window ratios (the variants ran side by side in each window), then the median
        ratios["paraml_vs_handwritten"] = statistics.median(a / b for a, b in zip(paraml_windows, hand))
        ratios["paraml_vs_keras_fit"] = statistics.median(a / b for a, b in zip(paraml_windows, keras_fit))
    if "multi_worker@2" in by_label and "mirrored@2" in by_label:
        ratios["multi_worker_vs_mirrored_steps_per_s"] = (
            by_label["mirrored@2"].step_ms / by_label["multi_worker@2"].step_ms
        )
    machine = {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()}
    import tensorflow as tf

    machine.update(
        tensorflow=tf.__version__,
        gpus=len(tf.config.list_physical_devices("GPU")),
        threads_per_device=threads_per_device or "default",
    )
    return {"model": model, "global_batch": GLOBAL_BATCH, "results": results, "ratios": ratios, "machine": machine}


def format_report(report: dict[str, Any]) -> str:
    """The benchmark as a terminal table followed by the ratios."""
    from .memory import format_bytes

    lines = [f"model {report['model']}, global batch {report['global_batch']}, machine {report['machine']}", ""]
    lines.append(
        f"{'variant':<28}{'samples/s':>11}{'step ms':>9}{'first step s':>14}{'max var bytes/device':>22}"
        f"{'peak RSS MiB':>14}"
    )
    for r in report["results"]:
        largest = max(r.variable_bytes_per_device.values(), default=0)
        lines.append(
            f"{r.label:<28}{r.samples_per_s:>11.0f}{r.step_ms:>9.2f}{r.first_step_s:>14.2f}"
            f"{format_bytes(largest) if largest else '-':>22}{r.peak_rss_mib:>14.0f}"
        )
    lines.append("")
    for name, value in report["ratios"].items():
        lines.append(f"{name}: {value:.3f}")
    lines.append("")
    lines.append("Simulated CPU devices share one thread pool: pipeline and data-parallel gains here are not a GPU's.")
    return "\n".join(lines)


def format_markdown(report: dict[str, Any], command: str) -> str:
    """The benchmark as a Markdown results page (``docs/results.md`` is one)."""
    from .memory import format_bytes

    machine = report["machine"]
    lines = [
        "# Results of a `paraml bench` run",
        "",
        f"Generated by `{command}`. Machine: {machine['cpus']} CPU cores, {machine['gpus']} GPUs, "
        f"{machine['platform']}, Python {machine['python']}, TensorFlow {machine['tensorflow']}, intra-op threads "
        f"per device: {machine['threads_per_device']}. Model `{report['model']}`, global batch "
        f"{report['global_batch']}. Devices are logical CPUs sharing the same 2 cores, so more devices cannot be "
        "faster here: these numbers show paraml's overheads and memory layout, not a GPU cluster's speed-ups.",
        "",
        "| variant | samples/s | step ms | first step s | largest variable bytes on one device | peak RSS MiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        largest = max(r.variable_bytes_per_device.values(), default=0)
        lines.append(
            f"| {r.label} | {r.samples_per_s:.0f} | {r.step_ms:.2f} | {r.first_step_s:.2f} | "
            f"{format_bytes(largest) if largest else '-'} | {r.peak_rss_mib:.0f} |"
        )
    lines += ["", "Ratios measured in the same run (windows interleaved):", ""]
    lines += [f"- `{name}`: {value:.3f}" for name, value in report["ratios"].items()]
    lines += [
        "",
        "Step times are steady-state: from the end of a fit call's first step to its last. The fixed cost of a fit "
        "call (a new distributed iterator, about 0.1 s here) is paid once per call, not per epoch.",
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
    parser.add_argument("--quick", action="store_true", help="1 and 2 devices, micro-batches 1 and 4, fewer windows")
    parser.add_argument("--devices", default="1,2,4", help="device counts, e.g. 1,2,4")
    parser.add_argument("--steps", type=int, default=20, help="steps per timed window")
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
        micro_batches=(1, 4) if ns.quick else (1, 2, 4),
        steps=ns.steps,
        windows=3 if ns.quick else ns.windows,
        threads_per_device=ns.threads_per_device,
        multi_worker=not ns.no_multi_worker,
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
