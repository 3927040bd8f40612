"""Per-stage figures of ``model_parallel`` (``plan.stages[i].peak_bytes``) against the allocator's peak, per schedule.

One configuration per fresh process (``--one``): the process simulates 2 logical CPUs, builds the MLP of
``benchmarks/bench_memory.py`` (16 Dense layers of 512 with GELU, a Dense of 10) under
``Parallel("model_parallel", devices=2, micro_batches=M, schedule=S, batch_size=B)`` with Adam, runs one training
step (traced and built), collects the garbage that step left (Keras' copies of its data, in reference cycles),
resets the allocator's peak (``tf.config.experimental.reset_memory_stats("CPU:0")``) and reads
``get_memory_info("CPU:0")["peak"]`` after one more step.

Logical CPUs share one allocator, so what is compared is the total: the sum of the stages' figures (each stage's
parameters, gradients, optimizer slots, the activations of the micro-batches it holds at its peak under the
schedule, and on the last stage the outputs and the loss' buffers) plus what the process holds besides them: the
input pipeline, measured the same way with the stages' model replaced by one Dense layer of 10 (``--one input``;
Keras copies the arrays into a tensor and slices the batch from it, so it is about two batches here, where the data
is one batch). The stages' peaks need not fall at the same moment, so the sum is a bound; under GPipe TensorFlow's
dataflow executor also starts a micro-batch's backward pass before the last forward pass, so fewer than all
micro-batches may be held at once.

    .venv/bin/python benchmarks/bench_stage_memory.py [--batch 16384] [--micro-batches 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SCHEDULES = ("gpipe", "1f1b", "zero_bubble", "interleaved")


def mlp():  # noqa: ANN201  (keras: imported late)
    """bench_memory's ``mlp``: 16 Dense layers of 512 with GELU, then a Dense of 10 (logits)."""
    import keras

    layers = [keras.layers.Dense(512, activation="gelu") for _ in range(16)]
    return keras.Sequential([keras.Input((512,)), *layers, keras.layers.Dense(10)])


def tiny():  # noqa: ANN201  (keras: imported late)
    """One Dense layer of 10 on the MLP's inputs: what a step holds besides a model's (``--one input``)."""
    import keras

    return keras.Sequential([keras.Input((512,)), keras.layers.Dense(10)])


def one(schedule: str, micro_batches: int, batch: int) -> dict[str, object]:
    """This process: the plan's stage figures and the allocator's peak of one training step (schedule ``"input"``:
    :func:`tiny` on one device, the input pipeline's peak)."""
    import gc

    from paraml import simulate_devices

    simulate_devices(2)
    import keras
    import numpy as np
    import tensorflow as tf

    from paraml import Parallel

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 512)).astype("float32")
    y = rng.integers(0, 10, batch)
    if schedule == "input":
        par = Parallel("single", seed=0)
    else:
        par = Parallel(
            "model_parallel", devices=2, seed=0, schedule=schedule, micro_batches=micro_batches, batch_size=batch
        )
    model_fn = tiny if schedule == "input" else mlp
    par.build(model_fn, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    par.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=1, verbose=0)  # traced, optimizer built
    gc.collect()  # the first fit's copies of the data, left in reference cycles
    tf.config.experimental.reset_memory_stats("CPU:0")
    par.fit(x, y, batch_size=batch, epochs=1, steps_per_epoch=1, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    stages = par.plan.stages if schedule != "input" else ()
    return {
        "schedule": schedule,
        "micro_batches": micro_batches,
        "batch": batch,
        "stages": [
            {"peak": s.peak_bytes, "activations": s.activation_bytes, "held": s.in_flight, "outputs": s.output_bytes}
            for s in stages
        ],
        "batch_bytes": int(x.nbytes + y.nbytes),  # the step's inputs and labels, as tensors
        "peak": int(peak),
    }


def measured(schedule: str, micro_batches: int, batch: int) -> dict[str, object]:
    """``one`` in a fresh process."""
    command = [sys.executable, __file__, "--one", schedule, str(micro_batches), "--batch", str(batch)]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16384, help="global batch (default 16384)")
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[8], help="micro-batches (default 8)")
    parser.add_argument("--one", nargs=2, metavar=("SCHEDULE", "MICRO_BATCHES"), help=argparse.SUPPRESS)
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.batch)))
        return 0

    from paraml.bench.harness import environment, format_table, write_json

    records, rows = [], []
    held_besides = measured("input", 1, args.batch)["peak"]  # the input pipeline's peak, the model's aside
    for micro_batches in args.micro_batches:
        for schedule in SCHEDULES:
            r = measured(schedule, micro_batches, args.batch)
            stages = r["stages"]
            r["input_bytes"] = held_besides
            total = sum(s["peak"] for s in stages) + held_besides  # type: ignore[index, union-attr, operator]
            r["estimate"] = total
            r["ratio"] = total / r["peak"]  # type: ignore[operator]
            records.append(r)
            rows.append(
                [
                    schedule,
                    str(micro_batches),
                    " / ".join(f"{s['peak'] / 1e6:.0f}" for s in stages),  # type: ignore[index, union-attr]
                    " / ".join(str(s["held"]) for s in stages),  # type: ignore[index, union-attr]
                    f"{held_besides / 1e6:.0f}",  # type: ignore[operator]
                    f"{total / 1e6:.0f}",
                    f"{r['peak'] / 1e6:.0f}",  # type: ignore[operator]
                    f"{r['ratio']:.2f}",
                ]
            )
            print(f"{schedule} x {micro_batches}: done", file=sys.stderr, flush=True)
    header = ["schedule", "micro-batches", "stage MB", "held", "input MB", "sum MB", "peak MB", "sum/peak"]
    print(format_table(rows, header, markdown=True))
    for micro_batches in args.micro_batches:
        largest = {
            r["schedule"]: max(s["peak"] for s in r["stages"])  # type: ignore[union-attr, index]
            for r in records
            if r["micro_batches"] == micro_batches
        }
        peaks = {r["schedule"]: r["peak"] for r in records if r["micro_batches"] == micro_batches}
        print(
            f"{micro_batches} micro-batches: largest stage 1f1b / gpipe {largest['1f1b'] / largest['gpipe']:.2f}; "
            f"measured peak 1f1b / gpipe {peaks['1f1b'] / peaks['gpipe']:.2f}"  # type: ignore[operator]
        )
    write_json({"environment": environment(batch=args.batch), "runs": records}, args.json, echo=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
