"""Where paraml's time goes against plain Keras ``model.fit`` (issue 13): per ``fit`` call and per step.

Every variant trains the same model (default: the 256-512-512-10 MLP of issue 13) with the same optimizer (SGD) and
loss, from numpy arrays, global batch 256, no shuffling, one ``fit`` call of ``--steps`` steps per window, in ONE
process with the windows interleaved (A B C, B C A, ...; field notes 9):

  keras-fit              plain ``model.compile(); model.fit()`` on one device, no strategy (the baseline users know)
  keras-fit xla          the same with ``compile(jit_compile=True)``
  paraml single          ``Parallel("single").fit(x, y, batch_size=256)``
  paraml single xla      ``Parallel("single", jit_compile=True)``
  keras-fit mirrored     ``model.fit`` with the model compiled under ``MirroredStrategy`` over 2 simulated devices
  paraml mirrored        ``Parallel("mirrored", devices=2)`` (and ``... xla``)

Each window gives three numbers: the whole ``fit`` call per step (what an epoch costs), the steady-state step (from
the end of the call's first step to its last, timed by a callback) and the fixed cost of the call (whole call minus
its steps at the steady rate). Ratios are medians of per-window ratios, wall time and process CPU time (on a shared
machine, CPU time moves less).

``--profile`` (item 1 of issue 13) adds copies of ``paraml single`` with one cost removed, each a prototype of a
change, made by patching ONE backend/Trainer instance in this process (never paraml's source):

  -distributed iterator  the backend's ``distribute(dataset)`` returns the dataset itself: a plain ``tf.data``
                         iterator, as Keras uses with no strategy, instead of ``OneDeviceStrategy``'s distributed one
  -cond/all-reduce       no ``tf.cond`` around the replica's gradients (empty replicas) and no all-reduce of the
                         row count: with one replica the global rows are the replica's rows
  -float logs/step       the loop keeps each call's logs as tensors and converts them once, at the end of the epoch
                         (``float(v)`` after every step waits for that step: no dispatch ahead, as Keras does)
  -dataset rebuild       the input pipeline built once and reused by every ``fit`` call on the same arrays
  -all                   all four

and a table of paraml's fixed cost piece by piece (median ms, interleaved): turning the arrays into
``GlobalBatches``, building the ``tf.data`` pipeline, distributing it, creating its iterator and reading the first
batch (distributed and plain), ``build_metrics``, the callback list, and the per-step Python of the loop.

    .venv/bin/python benchmarks/bench_overhead.py [--profile] [--steps 32] [--windows 7] [--model mlp2|mlp|digits]
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import statistics
import sys
import time
import types
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("mlp2", "mlp", "digits"), default="mlp2", help="mlp2: 256-512-512-10")
    parser.add_argument("--batch-size", type=int, default=256, help="global batch (default 256)")
    parser.add_argument("--steps", type=int, default=32, help="steps per fit call / window (default 32)")
    parser.add_argument("--windows", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--devices", type=int, default=2, help="simulated devices of the mirrored rows (default 2)")
    parser.add_argument("--no-mirrored", action="store_true", help="leave out the MirroredStrategy rows")
    parser.add_argument("--no-xla", action="store_true", help="leave out the jit_compile=True rows")
    parser.add_argument("--profile", action="store_true", help="prototypes with one cost removed + fixed-cost pieces")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every round's window times")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON result line to PATH")
    return parser.parse_args(argv)


ARGS = parse_args()

import paraml  # noqa: E402

DEVICES = paraml.simulate_devices(max(2, ARGS.devices))  # first: before anything initialises TensorFlow's devices

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402
from common import environment, format_table, write_json  # noqa: E402

from paraml import Parallel  # noqa: E402
from paraml.backends.distribute import MirroredBackend  # noqa: E402
from paraml.bench import PRESETS  # noqa: E402
from paraml.training import Feed  # noqa: E402


def model_fn() -> keras.Model:
    return PRESETS[ARGS.model][0]() if ARGS.model != "digits" else _digits()


def _digits() -> keras.Model:
    from paraml.demo import digits_model

    return digits_model()


def input_shape() -> tuple[int, ...]:
    return (8, 8, 1) if ARGS.model == "digits" else PRESETS[ARGS.model][1]


def optimizer() -> keras.optimizers.Optimizer:
    return keras.optimizers.SGD(0.01)


def loss() -> keras.losses.Loss:
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


class StepClock(keras.callbacks.Callback):
    """Steady-state time of one fit call: from the end of its first batch to the end of its last."""

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        now = time.perf_counter()
        if batch == 0:
            self.start, self.batches, self.end = now, 0, now
        else:
            self.end, self.batches = now, batch


#: A window: runs one fit call with the given callbacks.
Window = Callable[[list[Any]], None]
#: The paraml models built, by id of their Parallel (to check that a prototype trains as paraml does).
BUILT: dict[int, keras.Model] = {}


# -- variants ----------------------------------------------------------------------------------------------------------
def keras_variant(x: np.ndarray, y: np.ndarray, *, jit: bool = False, devices: int = 0) -> Window:
    """Plain Keras (``devices=0``: no strategy) or Keras under ``MirroredStrategy`` on ``devices`` devices."""
    scope = MirroredBackend(list(DEVICES[:devices])).strategy.scope() if devices else contextlib.nullcontext()
    with scope:
        model = model_fn()
        model.compile(optimizer(), loss(), jit_compile=jit)
    return lambda callbacks: model.fit(
        x, y, batch_size=ARGS.batch_size, epochs=1, verbose=0, shuffle=False, callbacks=callbacks
    )


def paraml_variant(
    x: np.ndarray, y: np.ndarray, strategy: str = "single", *, jit: bool = False, patch: Callable[[Any], None] | None
) -> Window:
    """``Parallel(strategy)`` (2 devices unless ``single``), optionally with a prototype ``patch`` applied to it."""
    devices = 1 if strategy == "single" else ARGS.devices
    par = Parallel(strategy, devices=devices, seed=0, jit_compile=jit)
    par.build(model_fn, optimizer=optimizer(), loss=loss())
    if patch is not None:
        patch(par)
    BUILT[id(par)] = par.model
    return lambda callbacks, par=par: par.fit(
        x, y, batch_size=ARGS.batch_size, epochs=1, verbose=0, shuffle=False, callbacks=callbacks
    )


# -- prototypes: each patches one Parallel's backend or Trainer instance, in this process only ----------------------
def plain_iterator(par: Any) -> None:
    """One device: iterate the ``tf.data`` pipeline itself instead of ``OneDeviceStrategy``'s distributed dataset.

    ``strategy.run`` still runs the step (in the strategy's replica context, on its device); only the multi-device
    iterator (and the auto-shard rewrite of the pipeline) goes."""
    par.backend.distribute = lambda dataset: dataset


def no_cond_allreduce(par: Any) -> None:
    """One replica: no ``tf.cond`` for empty replicas (a 1-replica batch is never empty: an empty input is refused
    before training) and no all-reduce of the row count (the sum over one replica is the value)."""
    par.backend.skips_empty_replicas = False  # the Trainer then calls the gradients directly
    par.backend.all_reduce_sum = lambda value: value


def lazy_logs(par: Any) -> None:
    """``Trainer._run_epoch`` keeping each call's logs as tensors; converted to floats once, when the epoch ends.

    A copy of the loop of training.py with only that changed (callbacks then see tensors, as under Keras' fit; a
    real change would convert only when a callback asks for numbers)."""
    trainer = par._trainer

    def _run_epoch(self: Any, kind: str, feed: Feed, callbacks: Any = None, start_step: int = 0) -> Any:
        self.model.reset_metrics()
        logs: dict[str, Any] = {}
        step, ended = start_step, "done"
        while True:
            left = feed.batches_left(step)
            if left is not None and left <= 0:
                break
            k = 1 if left is None else min(self.steps_per_execution, left)
            requested = kind == "train" and self.stop_requested()
            if callbacks is not None:
                getattr(callbacks, f"on_{kind}_batch_begin")(step)
            stop = tf.constant(float(requested))
            try:
                logs, agreed = self._function(kind, k, feed.source.weighted)(feed.iterator, stop)
            except tf.errors.OutOfRangeError:
                feed.exhausted()
                break
            step += k
            feed.seen += k
            if callbacks is not None:
                getattr(callbacks, f"on_{kind}_batch_end")(step - 1, logs)
            if kind == "train" and self.model.stop_training:
                ended = "stopped" if left is None or left > k else "done"
                break
        return {name: float(v) for name, v in (logs or self.model.get_metrics_result()).items()}, step, ended

    trainer._run_epoch = types.MethodType(_run_epoch, trainer)


def cached_pipeline(par: Any) -> None:
    """Reuse the input pipeline of the previous ``fit`` call when it is on the same arrays with the same arguments
    (keyed by the arrays' identity here; a real change must also notice arrays changed in place)."""
    original = par._batches
    cache: dict[Any, Any] = {}

    def _batches(x: Any, y: Any, batch_size: Any, **kwargs: Any) -> Any:
        key = (id(x), id(y), batch_size, tuple(sorted((k, id(v)) for k, v in kwargs.items())))
        if key not in cache:
            source = original(x, y, batch_size, **kwargs)
            datasets: dict[Any, Any] = {}
            make = source.dataset

            def dataset(epoch: int = 0, stop: int | None = None, skip: int = 0) -> Any:
                if (epoch, stop, skip) not in datasets:
                    datasets[epoch, stop, skip] = make(epoch, stop, skip)
                return datasets[epoch, stop, skip]

            object.__setattr__(source, "dataset", dataset)  # GlobalBatches is a frozen dataclass
            cache[key] = (source, x, y)  # x, y kept alive: their ids stay theirs
        return cache[key][0]

    par._batches = _batches


def all_prototypes(par: Any) -> None:
    for patch in (plain_iterator, no_cond_allreduce, lazy_logs, cached_pipeline):
        patch(par)


PROTOTYPES: dict[str, Callable[[Any], None]] = {
    "paraml single -distributed iterator": plain_iterator,
    "paraml single -cond/all-reduce": no_cond_allreduce,
    "paraml single -float logs/step": lazy_logs,
    "paraml single -dataset rebuild": cached_pipeline,
    "paraml single -all": all_prototypes,
}


# -- timing ------------------------------------------------------------------------------------------------------------
def interleave(variants: dict[str, Window], windows: int) -> dict[str, dict[str, list[float]]]:
    """Per variant and round: whole-call ms/step (wall and CPU) and steady ms/step, the order rotating each round."""
    names = list(variants)
    out = {n: {"call": [], "cpu": [], "steady": []} for n in names}
    for r in range(windows):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            gc.collect()
            clock = StepClock()
            wall, cpu = time.perf_counter(), time.process_time()
            variants[name]([clock])
            end_wall, end_cpu = time.perf_counter(), time.process_time()
            out[name]["call"].append((end_wall - wall) * 1e3 / ARGS.steps)
            out[name]["cpu"].append((end_cpu - cpu) * 1e3 / ARGS.steps)
            out[name]["steady"].append((clock.end - clock.start) * 1e3 / max(clock.batches, 1))
        if ARGS.verbose:
            print(f"  round {r + 1}: " + "  ".join(f"{n} {out[n]['call'][-1]:.2f}" for n in names), flush=True)
    return out


def paired(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def fixed_ms(series: dict[str, list[float]]) -> float:
    """Median fixed cost of one call: (whole call - steps x steady), per round."""
    return statistics.median((c - s) * ARGS.steps for c, s in zip(series["call"], series["steady"]))


def fixed_cost_pieces(par: Any, x: np.ndarray, y: np.ndarray, windows: int) -> dict[str, float]:
    """Median ms of each piece of a ``single`` fit call's fixed cost, and of the loop's Python per step."""
    trainer, backend = par._trainer, par.backend
    source = par._batches(x, y, ARGS.batch_size, shuffle=False)
    dataset = source.dataset(0, 1)
    distributed = backend.distribute(dataset)
    step_fn = trainer._function("train", 1, False)
    feed_iterator = iter(backend.distribute(source.dataset(0, 10_000)))  # enough epochs for every timed step
    stop = tf.constant(0.0)

    def first_batch(iterable: Any) -> None:
        iterator = iter(iterable)
        next(iterator)
        del iterator

    def one_step_sync() -> None:  # what the loop does per step: run, then float() every log (waits for the step)
        values, agreed = step_fn(feed_iterator, stop)
        {name: float(v) for name, v in values.items()}, float(agreed)

    def python_per_step() -> None:  # the loop's own Python per step, without the step
        feed = Feed(backend, source)
        feed.batches_left(0)
        trainer.stop_requested()
        tf.constant(0.0)

    pieces: dict[str, Callable[[], Any]] = {
        "per call: global_batches(x, y)": lambda: par._batches(x, y, ARGS.batch_size, shuffle=False),
        "per call: source.dataset() (tf.data pipeline)": lambda: source.dataset(0, 1),
        "per call: backend.distribute(dataset)": lambda: backend.distribute(dataset),
        "per call: iter(distributed) + first batch": lambda: first_batch(distributed),
        "per call: iter(plain dataset) + first batch": lambda: first_batch(dataset),
        "per call: build_metrics": lambda: trainer.build_metrics(source),
        "per call: CallbackList + History": lambda: keras.callbacks.CallbackList(
            [], add_history=True, add_progbar=False, model=par.model, verbose=0, epochs=1, steps=ARGS.steps
        ),
        "per step: one step + float(logs)": one_step_sync,
        "per step: loop Python (Feed, stop tensor)": python_per_step,
    }
    for piece in pieces.values():
        piece()
    times: dict[str, list[float]] = {name: [] for name in pieces}
    for r in range(windows):
        names = list(pieces)
        for name in names[r % len(names) :] + names[: r % len(names)]:
            gc.collect()
            start = time.perf_counter()
            pieces[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(values) for name, values in times.items()}


def main() -> int:
    steps, batch = ARGS.steps, ARGS.batch_size
    rng = np.random.default_rng(0)
    x = rng.random((steps * batch, *input_shape()), dtype=np.float32)
    y = rng.integers(0, 10, steps * batch).astype(np.int32)
    print(
        f"model {ARGS.model}, global batch {batch}, numpy input, fit calls of {steps} steps, {ARGS.windows} "
        "interleaved rounds",
        flush=True,
    )
    variants: dict[str, Window] = {"keras-fit": keras_variant(x, y), "paraml single": paraml_variant(x, y, patch=None)}
    if not ARGS.no_xla:
        variants["keras-fit xla"] = keras_variant(x, y, jit=True)
        variants["paraml single xla"] = paraml_variant(x, y, jit=True, patch=None)
    if not ARGS.no_mirrored:
        variants["keras-fit mirrored"] = keras_variant(x, y, devices=ARGS.devices)
        variants["paraml mirrored"] = paraml_variant(x, y, "mirrored", patch=None)
        if not ARGS.no_xla:
            variants["paraml mirrored xla"] = paraml_variant(x, y, "mirrored", jit=True, patch=None)
    if ARGS.profile:
        for name, patch in PROTOTYPES.items():
            variants[name] = paraml_variant(x, y, patch=patch)
    start = time.perf_counter()
    for window in variants.values():  # trace, compile and warm up: two untimed calls each
        window([])
        window([])
    print(f"warm-up (tracing and XLA compiles included) {time.perf_counter() - start:.1f} s", flush=True)
    if ARGS.profile:  # same seed, same data, same calls: a prototype must end with paraml single's weights
        reference = BUILT[id(variants["paraml single"].__defaults__[0])].get_weights()
        for name in PROTOTYPES:
            weights = BUILT[id(variants[name].__defaults__[0])].get_weights()
            worst = max(float(np.max(np.abs(a - b))) for a, b in zip(weights, reference))
            print(f"  {name}: max |weight - paraml single's| after the warm-up = {worst:.2e}", flush=True)
    print("timing...", flush=True)
    raw = interleave(variants, ARGS.windows)

    rows = []
    for name, series in raw.items():
        rows.append(
            [
                name,
                statistics.median(series["call"]),
                statistics.median(series["cpu"]),
                statistics.median(series["steady"]),
                fixed_ms(series),
            ]
        )
    print(f"\nms per step (median of {ARGS.windows} rounds)")
    print(format_table(rows, ["variant", "whole fit call", "CPU", "steady", "fixed ms/call"]))

    pairs = {
        "paraml single / keras-fit": ("paraml single", "keras-fit"),
        "paraml single xla / keras-fit": ("paraml single xla", "keras-fit"),
        "paraml single xla / keras-fit xla": ("paraml single xla", "keras-fit xla"),
        "keras-fit xla / keras-fit": ("keras-fit xla", "keras-fit"),
        "paraml single xla / paraml single": ("paraml single xla", "paraml single"),
        "paraml mirrored / keras-fit mirrored": ("paraml mirrored", "keras-fit mirrored"),
        "paraml mirrored xla / keras-fit mirrored": ("paraml mirrored xla", "keras-fit mirrored"),
        "paraml mirrored xla / paraml mirrored": ("paraml mirrored xla", "paraml mirrored"),
    }
    pairs.update({f"{name} / paraml single": (name, "paraml single") for name in PROTOTYPES if name in raw})
    pairs.update({f"{name} / keras-fit": (name, "keras-fit") for name in PROTOTYPES if name in raw})
    ratios: dict[str, dict[str, float]] = {}
    rows = []
    for label, (a, b) in pairs.items():
        if a in raw and b in raw:
            r = {key: round(paired(raw[a][key], raw[b][key]), 4) for key in ("call", "cpu", "steady")}
            ratios[label] = r
            rows.append([label, f"{r['call']:.3f}", f"{r['cpu']:.3f}", f"{r['steady']:.3f}"])
    print("\nratios (medians of per-round ratios; < 1: the first is faster)")
    print(format_table(rows, ["ratio", "whole fit call", "CPU", "steady"]))

    pieces: dict[str, float] = {}
    if ARGS.profile:
        probe = Parallel("single", seed=0)
        probe.build(model_fn, optimizer=optimizer(), loss=loss())
        probe.fit(x[:batch], y[:batch], batch_size=batch, verbose=0)
        pieces = fixed_cost_pieces(probe, x, y, ARGS.windows)
        print("\nparaml single's fixed cost, piece by piece (median ms, interleaved)")
        print(format_table([[name, value] for name, value in pieces.items()], ["piece", "ms"]))

    write_json(
        {
            "benchmark": "overhead",
            "model": ARGS.model,
            "global_batch": batch,
            "steps_per_fit_call": steps,
            "windows": ARGS.windows,
            "ms_per_step": {
                n: {
                    "fit_call": round(statistics.median(s["call"]), 3),
                    "cpu": round(statistics.median(s["cpu"]), 3),
                    "steady": round(statistics.median(s["steady"]), 3),
                    "fixed_ms_per_call": round(fixed_ms(s), 1),
                }
                for n, s in raw.items()
            },
            "ratios": ratios,
            "fixed_cost_pieces_ms": {n: round(v, 2) for n, v in pieces.items()},
            "env": environment(),
        },
        ARGS.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
