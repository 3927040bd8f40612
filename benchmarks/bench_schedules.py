"""Pipeline schedules, measured: each device's idle fraction in a traced training step next to the schedule's bubble.

For each schedule (default: every name in ``paraml.planning.schedules.SCHEDULES``) an MLP of identical ``Dense``
layers is pipelined over K stages (``Parallel("model_parallel", devices=K, micro_batches=M, schedule=...)``,
``partition="even"``) and one training step at a time is traced with :func:`paraml.bench.trace.trace_step`: which
device ran which op, and when. Printed per schedule and device: the measured idle fraction (the median over the
traced steps), the idle fraction the schedule's timeline gives that stage and its ``Schedule(...).bubble`` (every
pass one time step), then the step's span (first op start to last op end) and the text timeline of the median step.
The schedules' traced steps are interleaved round by round (A B, B A, ...) in this one process, so the step-time
ratio to the first schedule is a median of per-round ratios.

The devices are K logical CPUs (``paraml.simulate_devices``). They share this machine's cores and one thread pool:
an op "on" CPU:1 and one on CPU:0 compete for the same cores, so a measured idle fraction is evidence of the dataflow
(what each device could run when), not a GPU's figure. The profiler adds a few microseconds per op to the span.

    .venv/bin/python benchmarks/bench_schedules.py [--stages 2] [--micro-batches 4] [--schedules gpipe,1f1b]
        [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from paraml.bench.harness import int_at_least  # noqa: E402  (imports no TensorFlow)
from paraml.planning.schedules import SCHEDULES, Schedule  # noqa: E402  (imports no TensorFlow)

#: The ``virtual_stages`` an ``"interleaved"`` schedule runs with (each device holds that many chunks of layers).
VIRTUAL_STAGES = 2


def schedule_names(text: str) -> list[str]:
    """``--schedules``: names separated by commas, each one of :data:`SCHEDULES`."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in names if name not in SCHEDULES]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown schedule(s) {', '.join(map(repr, unknown)) or '(none given)'}; choose from {', '.join(SCHEDULES)}"
        )
    return names


def schedule_options(kind: str) -> dict[str, Any]:
    """What ``Parallel`` and ``Schedule`` take besides the kind: ``virtual_stages`` for ``"interleaved"`` only."""
    return {"virtual_stages": VIRTUAL_STAGES} if kind == "interleaved" else {}


def make_schedule(kind: str, stages: int, micro_batches: int) -> Schedule | None:
    """``Schedule(kind, ...)`` with :func:`schedule_options`, or None when this paraml's ``Schedule`` takes no such
    option (then the prediction is left out, not guessed)."""
    try:
        return Schedule(kind, stages=stages, micro_batches=micro_batches, **schedule_options(kind))
    except TypeError:
        return None


def stage_idle(schedule: Schedule) -> list[float]:
    """Per stage, the empty cells of its column of the schedule's timeline over the timeline's steps."""
    rows = schedule.timeline()
    return [sum(row[s] == "" for row in rows) / len(rows) for s in range(schedule.stages)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    positive = int_at_least(1)
    parser.add_argument("--stages", type=int_at_least(2), default=2, help="pipeline stages K = devices (default 2)")
    parser.add_argument("--micro-batches", type=positive, default=4, help="micro-batches M (default 4)")
    parser.add_argument(
        "--schedules",
        type=schedule_names,
        default=list(SCHEDULES),
        help=f"schedules to compare, separated by commas (default: {','.join(SCHEDULES)})",
    )
    parser.add_argument("--rounds", type=positive, default=3, help="traced steps per schedule (default 3)")
    parser.add_argument("--layers", type=positive, default=8, help="Dense layers, split evenly (default 8)")
    parser.add_argument("--width", type=positive, default=512, help="width of every layer (default 512)")
    parser.add_argument("--batch-size", type=positive, default=512, help="global batch (default 512)")
    parser.add_argument(
        "--intra-op-threads",
        type=int_at_least(0),
        default=0,
        help="threads one op may use (default 0: TensorFlow's choice; 1 is closer to one core per device)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    args = parser.parse_args(argv)
    if args.layers < args.stages:
        parser.error(f"--layers {args.layers} gives fewer layers than --stages {args.stages}: at least one per stage")

    import paraml

    devices = paraml.simulate_devices(args.stages)
    import keras
    import numpy as np
    import tensorflow as tf

    from paraml.bench.harness import environment, format_table, paired, write_json
    from paraml.bench.trace import StepTrace, trace_step

    if args.intra_op_threads:
        tf.config.threading.set_intra_op_parallelism_threads(args.intra_op_threads)
    k, m = args.stages, args.micro_batches

    def model_fn() -> keras.Model:
        layers = [keras.layers.Dense(args.width, activation="relu") for _ in range(args.layers - 1)]
        return keras.Sequential([keras.Input((args.width,)), *layers, keras.layers.Dense(args.width)])

    rng = np.random.default_rng(0)
    x = rng.normal(size=(args.batch_size, args.width)).astype("float32")
    y = rng.normal(size=(args.batch_size, args.width)).astype("float32")

    pipelines, schedules = {}, {}
    for kind in args.schedules:
        options = schedule_options(kind)
        par = paraml.Parallel(
            "model_parallel", devices=k, micro_batches=m, schedule=kind, partition="even", seed=0, **options
        )
        par.build(model_fn, optimizer="sgd", loss="mse")
        pipelines[kind], schedules[kind] = par, make_schedule(kind, k, m)

    traces: dict[str, list[StepTrace]] = {kind: [] for kind in args.schedules}
    for r in range(args.rounds):  # round r starts at schedule r mod n: none always runs first
        order = args.schedules[r % len(args.schedules) :] + args.schedules[: r % len(args.schedules)]
        for kind in order:
            traces[kind].append(trace_step(pipelines[kind], x, y, warmup=2 if r == 0 else 1))
            print(f"[bench] round {r + 1}/{args.rounds} {kind}: {traces[kind][-1].span * 1e3:.1f} ms", file=sys.stderr)

    print(
        f"{k} stages x {m} micro-batches, {args.layers} x Dense({args.width}), batch {args.batch_size}, SGD; "
        f"median of {args.rounds} traced steps per schedule, on {k} logical CPUs sharing {os.cpu_count()} cores"
    )
    print(
        "(logical CPUs share one thread pool: the measured idle fractions are evidence of the dataflow, "
        "not GPU figures)\n"
    )
    first = args.schedules[0]
    rows, record = [], {}
    for kind in args.schedules:
        schedule, measured = schedules[kind], traces[kind]
        spans = [t.span * 1e3 for t in measured]
        ratio = paired(spans, [t.span * 1e3 for t in traces[first]])
        predicted: list[float | None] = [None] * k if schedule is None else list(stage_idle(schedule))
        bubble = None if schedule is None else schedule.bubble
        idle = {d: statistics.median(t.idle_fraction(d) for t in measured) for d in devices}
        for stage, device in enumerate(devices):
            rows.append(
                [
                    kind,
                    device,
                    f"{idle[device]:.3f}",
                    _fraction(predicted[stage]),
                    _fraction(bubble),
                    f"{statistics.median(spans):.1f}",
                    f"{ratio:.2f}",
                ]
            )
        record[kind] = {
            "idle_fraction": idle,
            "predicted_stage_idle": predicted,
            "bubble": bubble,
            "step_ms": spans,
            f"step_vs_{first}": ratio,
        }
    headers = ["schedule", "device", "idle measured", "idle predicted", "bubble", "step ms", f"step / {first}"]
    print(format_table(rows, headers))
    for kind in args.schedules:
        median_step = sorted(traces[kind], key=lambda t: t.span)[len(traces[kind]) // 2]
        print(f"\n{kind}, the median step:\n{median_step}")
    setting = environment(logical_cpus=k, intra_op_threads=args.intra_op_threads)
    write_json({"environment": setting, "arguments": vars(args), "schedules": record}, args.json, echo=False)
    return 0


def _fraction(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


if __name__ == "__main__":
    sys.exit(main())
