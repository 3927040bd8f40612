"""paraml's per-step overhead: ``Parallel("mirrored").fit`` against a hand-written loop and Keras ``model.fit``.

All variants train the same model (same optimizer, loss, accuracy metric, global batch, no shuffling) with a
``tf.distribute.MirroredStrategy`` over the same 2 simulated devices, in one process:

  paraml        ``Parallel("mirrored", devices=2).fit(x, y, batch_size=B)``
  hand-tutorial the TF custom-training-loop tutorial: ``for batch in dist_dataset: step(batch)``, where ``step`` is a
                ``tf.function`` of ``strategy.run`` + ``GradientTape`` + ``tf.nn.compute_average_loss`` +
                ``apply_gradients`` (model and optimizer created in ``strategy.scope()``)
  hand-iterator the same step, ``steps_per_execution`` steps per ``tf.function`` call over an iterator
  keras-fit     ``model.fit`` with the model compiled in ``strategy.scope()``

Every variant is traced and warmed up first. Then, interleaved in rounds (field notes 9), each runs a long window
(one ``fit`` call / one pass of ``--steps`` steps) and a short one (one ``tf.function`` call: ``steps_per_execution``
steps). From these come, per round: ms/step over the long window (what an epoch of that many steps costs, the
headline), the steady per-step cost ``(long - short) / (steps - k)``, and the fixed cost per fit call / epoch
(``short - k x steady``: building the dataset, distributing it, creating its iterator, callbacks). Ratios are given
of the median wall times (the headline), paired per round, of the fastest windows, and of process CPU time. When
other programs share the 2 cores, wall times jump between levels (1x, 1.5x, 2x) while CPU time stays put: trust the
CPU column then.

``--profile`` adds copies of paraml with one of its per-step costs removed (by patching the Trainer instance in this
process only, never paraml's source), and paraml fed a ``tf.data.Dataset`` of ``(x, y)`` batches instead of arrays,
to show where paraml's overhead goes, plus paraml's fixed cost piece by piece.

    .venv/bin/python benchmarks/bench_overhead.py [--model mlp|digits] [--steps-per-execution K] [--profile]
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--model", choices=("mlp", "digits"), default="mlp", help="mlp: 784-512-512-10 (default)")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch (default 128)")
    parser.add_argument("--steps", type=int, default=100, help="steps per timed window (default 100)")
    parser.add_argument("--windows", type=int, default=7, help="timed rounds (default 7)")
    parser.add_argument("--steps-per-execution", type=int, default=1, help="steps per tf.function call (default 1)")
    parser.add_argument("--devices", type=int, default=2, help="simulated devices (default 2)")
    parser.add_argument("--intra-op-threads", type=int, default=0, help="TF intra-op threads (0: TF's default)")
    parser.add_argument("--profile", action="store_true", help="also time paraml with single overheads removed")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every round's window times")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON result line to PATH")
    return parser.parse_args(argv)


ARGS = parse_args()

import tensorflow as tf  # noqa: E402

if ARGS.intra_op_threads:  # before the devices exist, like the layout itself
    tf.config.threading.set_intra_op_parallelism_threads(ARGS.intra_op_threads)

import paraml  # noqa: E402

DEVICES = paraml.simulate_devices(ARGS.devices)  # first: before anything initialises TensorFlow's devices

from common import (  # noqa: E402
    HandLoop,
    Series,
    compare,
    environment,
    format_table,
    interleave,
    loss_fn,
    make_model,
    mirrored_strategy,
    optimizer,
    random_data,
    scale,
    summarize,
    write_json,
)

from paraml import Parallel  # noqa: E402

Window = Callable[[], None]
#: Builds a window (one fit call / one pass) over the arrays x, y; each variant builds its model once.
WindowMaker = Callable[[Any, Any], Window]


# -- (a) paraml -------------------------------------------------------------------------------------------------------
def paraml_variant(
    args: argparse.Namespace, patch: Callable[[Any], None] | None = None, dataset_input: bool = False
) -> WindowMaker:
    """paraml's fit on numpy arrays, or (``dataset_input``) on a ``tf.data.Dataset`` of ``(x, y)`` batches."""
    par = Parallel("mirrored", devices=args.devices, seed=0, steps_per_execution=args.steps_per_execution)
    par.build(lambda: make_model(args.model), optimizer=optimizer(), loss=loss_fn(), metrics=["accuracy"])
    if patch is not None:
        patch(par._trainer)

    def maker(x: Any, y: Any) -> Window:
        if dataset_input:
            dataset = tf.data.Dataset.from_tensor_slices((x, y)).batch(args.batch_size)
            return lambda: par.fit(dataset, epochs=1, verbose=0)
        return lambda: par.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False)

    return maker


# -- (b) hand-written loops -------------------------------------------------------------------------------------------
def hand_variants(args: argparse.Namespace) -> dict[str, WindowMaker]:
    """The TF tutorial's custom training loop, as one step per call and as K steps per call over an iterator."""
    loop = HandLoop(DEVICES[: args.devices], args.model, args.batch_size, args.steps_per_execution)
    return {"hand-tutorial": loop.tutorial, "hand-iterator": loop.iterator}


# -- (c) Keras model.fit ----------------------------------------------------------------------------------------------
def keras_variant(args: argparse.Namespace) -> WindowMaker:
    strategy = mirrored_strategy(DEVICES[: args.devices])
    with strategy.scope():
        model = make_model(args.model)
        model.compile(
            optimizer=optimizer(), loss=loss_fn(), metrics=["accuracy"], steps_per_execution=args.steps_per_execution
        )

    def maker(x: Any, y: Any) -> Window:
        return lambda: model.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False)

    return maker


# -- --profile: paraml with one cost removed (patches one Trainer instance, never paraml's source) ---------------------
def no_float_logs(trainer: Any) -> None:
    """_run_epoch without ``float(v)`` of every log value after every call: convert once, at the end."""

    def _run_epoch(self: Any, kind: str, source: Any, epoch: int, on_batch: Any, start_step: int = 0) -> Any:
        self._reset_metrics()
        dataset = source.dataset(epoch)
        iterator = iter(self.backend.distribute(dataset.skip(start_step) if start_step else dataset))
        logs: dict[str, Any] = {}
        step = start_step
        while source.steps is None or step < source.steps:
            k = 1 if source.steps is None else min(self.steps_per_execution, source.steps - step)
            try:
                logs = self._function(kind, k)(iterator)
            except tf.errors.OutOfRangeError:
                break
            step += k
            if on_batch is not None and on_batch(step - 1, logs):
                break
        return {name: float(v) for name, v in (logs or self._logs()).items()}

    trainer._run_epoch = types.MethodType(_run_epoch, trainer)


def no_row_allreduce(global_batch: int) -> Callable[[Any], None]:
    """_train_replica with the global batch as a constant instead of an all_reduce of the replica's row count."""

    def patch(trainer: Any) -> None:
        def _train_replica(self: Any, x: Any, y: Any, w: tf.Tensor) -> None:
            objective = self._objective(tf.constant(float(global_batch)))
            grads, _ = self.backend.gradients(self.model, x, y, w, objective)
            self.optimizer.apply_gradients(zip(grads, self.model.trainable_variables))

        trainer._train_replica = types.MethodType(_train_replica, trainer)

    return patch


def no_sample_weights(trainer: Any) -> None:
    """_objective without the sample weights (and the shape ops that broadcast them)."""

    def _objective(self: Any, global_rows: tf.Tensor) -> Callable[..., tf.Tensor]:
        def objective(y_pred: Any, y: Any, w: tf.Tensor, first: bool) -> tf.Tensor:
            per_sample = tf.cast(self.loss_fn(y, y_pred), tf.float32)
            loss = tf.nn.compute_average_loss(per_sample, global_batch_size=tf.cast(global_rows, tf.int64))
            self.loss_tracker.update_state(per_sample)
            for metric in self.metrics:
                metric.update_state(y, y_pred)
            return loss

        return objective

    trainer._objective = types.MethodType(_objective, trainer)


def train_function(*, loop: bool = True, logs: bool = True) -> Callable[[Any], None]:
    """_function for training without the ``tf.range`` loop when it runs one step (``loop=False``, what Keras does
    for steps_per_execution=1) and/or without reading the metrics after every call (``logs=False``: the train
    function returns ``{}``, and _run_epoch reads the metrics once, at the end of the epoch)."""

    def patch(trainer: Any) -> None:
        original = trainer._function

        def _function(self: Any, kind: str, steps: int) -> Any:
            if kind != "train" or (loop and logs):
                return original(kind, steps)
            key = (f"train-loop{loop}-logs{logs}", steps)
            if key not in self._functions:

                def run(iterator: Any) -> Any:
                    if loop or steps > 1:
                        for _ in tf.range(steps):
                            self.backend.run(self._train_replica, next(iterator))
                    else:
                        self.backend.run(self._train_replica, next(iterator))
                    return self._logs() if logs else {}

                self._functions[key] = tf.function(run)
            return self._functions[key]

        trainer._function = types.MethodType(_function, trainer)

    return patch


def all_patches(global_batch: int) -> Callable[[Any], None]:
    def patch(trainer: Any) -> None:
        for p in (
            no_float_logs,
            no_row_allreduce(global_batch),
            no_sample_weights,
            train_function(loop=False, logs=False),
        ):
            p(trainer)

    return patch


def fixed_cost_breakdown(args: argparse.Namespace, x: Any, y: Any) -> dict[str, float]:
    """Median ms of the pieces of paraml's fixed cost: per fit call, and per epoch (Trainer._run_epoch)."""
    par = Parallel("mirrored", devices=args.devices, seed=0)
    source = par._batches(x, y, args.batch_size, shuffle=False)
    dataset = source.dataset(0)
    distributed = par.backend.distribute(dataset)
    pieces = {
        "global_batches(x, y) [per fit call]": lambda: par._batches(x, y, args.batch_size, shuffle=False),
        "source.dataset(epoch) [per epoch]": lambda: source.dataset(0),
        "backend.distribute(dataset) [per epoch]": lambda: par.backend.distribute(dataset),
        "iter(distributed dataset) [per epoch]": lambda: iter(distributed),
    }
    times = interleave(pieces, 5)
    return {name: statistics.median(t["wall"]) * 1e3 for name, t in times.items()}


# -- main -------------------------------------------------------------------------------------------------------------
MAIN = ("paraml", "hand-tutorial", "hand-iterator", "keras-fit")
SHORT = " (1 call)"


def derive(raw: dict[str, Series], steps: int, k: int) -> dict[str, dict[str, Series]]:
    """Per main variant: ms/step over the long window, steady ms/step, and fixed ms per call, one value per round."""
    out: dict[str, dict[str, Series]] = {"epoch": {}, "steady": {}, "fixed": {}}
    for name in raw:
        if name.endswith(SHORT):
            continue
        out["epoch"][name] = scale(raw[name], 1e3 / steps)
        if name + SHORT in raw:
            long, short = raw[name], raw[name + SHORT]
            steady = {m: [(lv - sv) * 1e3 / (steps - k) for lv, sv in zip(long[m], short[m])] for m in long}
            out["steady"][name] = steady
            out["fixed"][name] = {m: [sv * 1e3 - k * st for sv, st in zip(short[m], steady[m])] for m in short}
    return out


def ratio_rows(series: dict[str, Series], targets: dict[str, float]) -> tuple[list[list[Any]], dict[str, Any]]:
    rows, ratios = [], {}
    for other in MAIN[1:]:
        if other not in series:
            continue
        name = f"paraml/{other}"
        r = compare(series["paraml"], series[other])
        ratios[name] = {key: round(v, 4) for key, v in r.items()}
        target = targets.get(other)
        verdict = ""
        if target is not None:
            verdict = f"<= {target:.2f}: wall {'met' if r['median'] <= target else 'MISSED'}, "
            verdict += f"CPU {'met' if r['cpu'] <= target else 'MISSED'}"
        rows.append([name, f"{r['median']:.3f}", f"{r['paired']:.3f}", f"{r['min']:.3f}", f"{r['cpu']:.3f}", verdict])
    return rows, ratios


RATIO_HEADER = ["ratio", "of medians", "paired", "of mins", "CPU", "target"]


def main(args: argparse.Namespace) -> int:
    k = args.steps_per_execution
    if k < 1 or args.windows < 1 or args.batch_size < args.devices or args.steps < 2 * k:
        print("error: windows, steps-per-execution >= 1, steps >= 2 x steps-per-execution, batch >= devices")
        return 2
    args.steps = args.steps // k * k  # whole tf.function calls only
    x, y = random_data(args.model, args.steps * args.batch_size)
    x1, y1 = random_data(args.model, k * args.batch_size, seed=1)
    print(
        f"model {args.model}, global batch {args.batch_size} over {args.devices} simulated devices, "
        f"steps_per_execution={k}; {args.windows} rounds of windows of {args.steps} steps and of {k} step(s)",
        flush=True,
    )

    makers: dict[str, WindowMaker] = {"paraml": paraml_variant(args)}
    makers.update(hand_variants(args))
    makers["keras-fit"] = keras_variant(args)
    variants = {name: maker(x, y) for name, maker in makers.items()}
    variants.update({name + SHORT: maker(x1, y1) for name, maker in makers.items()})
    if args.profile:
        patches = {
            "paraml -float/step": no_float_logs,
            "paraml -row allreduce": no_row_allreduce(args.batch_size),
            "paraml -sample weights": no_sample_weights,
            "paraml -while loop": train_function(loop=False),
            "paraml -logs/call": train_function(logs=False),
            "paraml -all five": all_patches(args.batch_size),
        }
        if k > 1:
            del patches["paraml -while loop"]
        variants.update({name: paraml_variant(args, patch)(x, y) for name, patch in patches.items()})
        variants["paraml tf.data input"] = paraml_variant(args, dataset_input=True)(x, y)

    start = time.perf_counter()
    failed: dict[str, str] = {}
    for name, window in list(variants.items()):  # trace and warm up: two untimed windows each
        if name.removesuffix(SHORT) in failed:
            continue
        try:
            window()
            window()
        except tf.errors.OpError as error:  # e.g. keras-fit with steps_per_execution > 1 (keras-team/keras#19246)
            base = name.removesuffix(SHORT)
            lines = [line.strip() for line in error.message.splitlines() if line.strip()]
            detail = [line for line in lines if line.startswith("(0)")] or lines
            failed[base] = detail[0][:200]
            print(f"{base} FAILED and is left out: {failed[base]}", flush=True)
            for key in (base, base + SHORT):
                variants.pop(key, None)
    print(f"warm-up (tracing included) {time.perf_counter() - start:.1f} s; timing...", flush=True)
    raw = interleave(variants, args.windows, log=lambda line: print(line, flush=True) if args.verbose else None)
    derived = derive(raw, args.steps, k)
    epoch, steady, fixed = derived["epoch"], derived["steady"], derived["fixed"]

    print(f"\nms per step (median of {args.windows} windows; CPU = process CPU time; steady = without fixed costs)")
    rows = []
    main_variants = [name for name in MAIN if name in epoch]
    for name in main_variants:
        e, st, fx = summarize(epoch[name]), summarize(steady[name]), summarize(fixed[name])
        rows.append([name, e["median"], e["min"], e["max"], e["cpu"], st["median"], st["cpu"], fx["median"], fx["cpu"]])
    header = ["variant", "ms/step", "min", "max", "CPU", "steady", "steady CPU", "fixed ms/call", "fixed CPU"]
    print(format_table(rows, header))

    # The faster hand-written loop by CPU time (wall time jumps when other programs take a core).
    hand_best = min(("hand-tutorial", "hand-iterator"), key=lambda n: summarize(epoch[n])["cpu"])
    targets = {hand_best: 1.05, "keras-fit": 1.0}
    for name, message in failed.items():
        print(f"\n{name}: FAILED, left out ({message})")
    print(f"\nratios over {args.steps}-step epochs (< 1: paraml faster; fastest hand-written loop: {hand_best})")
    rows, epoch_ratios = ratio_rows(epoch, targets)
    print(format_table(rows, RATIO_HEADER))
    print("\nratios of steady per-step cost (fixed per-call costs removed)")
    rows, steady_ratios = ratio_rows(steady, targets)
    print(format_table(rows, RATIO_HEADER))

    profile: dict[str, Any] = {}
    if args.profile:
        print("\nprofile: paraml with one cost removed, against paraml over the same epochs (ratio < 1: that cost)")
        rows = []
        for name in epoch:
            if name.startswith("paraml ") and name != "paraml":
                r = compare(epoch[name], epoch["paraml"])
                profile[name] = {key: round(v, 4) for key, v in r.items()}
                saved = summarize(epoch["paraml"])["cpu"] - summarize(epoch[name])["cpu"]
                rows.append([name, f"{r['median']:.3f}", f"{r['paired']:.3f}", f"{r['cpu']:.3f}", f"{saved:+.3f}"])
        print(format_table(rows, ["variant", "wall ratio", "paired", "CPU ratio", "CPU ms/step saved"]))
        breakdown = fixed_cost_breakdown(args, x, y)
        profile["paraml_fixed_ms"] = {name: round(v, 2) for name, v in breakdown.items()}
        print("\nprofile: paraml's fixed cost, piece by piece (median ms)")
        for name, value in breakdown.items():
            print(f"  {name:<42}{value:8.1f}")

    write_json(
        {
            "benchmark": "overhead",
            "model": args.model,
            "global_batch": args.batch_size,
            "devices": args.devices,
            "steps_per_window": args.steps,
            "windows": args.windows,
            "steps_per_execution": k,
            "ms_per_step": {n: {key: round(v, 4) for key, v in summarize(epoch[n]).items()} for n in epoch},
            "steady_ms_per_step": {
                n: {key: round(v, 4) for key, v in summarize(steady[n]).items()} for n in main_variants
            },
            "fixed_ms_per_call": {
                n: {key: round(v, 2) for key, v in summarize(fixed[n]).items()} for n in main_variants
            },
            "failed": failed,
            "ratios": epoch_ratios,
            "steady_ratios": steady_ratios,
            "profile": profile,
            "env": environment(),
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
