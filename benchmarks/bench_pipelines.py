"""Replicated pipelines: ``model_parallel`` with ``data_parallel=2`` x 2 stages against 1 x 4 stages and ``mirrored``
on 4 devices, as throughput ratios measured in one process.

The model is a stack of identical ``Dense`` layers (balanced stages), trained with SGD at one global batch. Every
variant gets the same devices and the same global batch; the pipelines use ``micro_batches`` = their stage count
(each stage has work in flight). Timing is :mod:`paraml.bench.harness`'s: every variant built and warmed up in this
process, windows interleaved, step times from the end of each fit call's first batch to its last; the ratios are
medians of per-round ratios.

The devices are 4 GPUs when the machine has them, else 4 logical CPUs. On logical CPUs all four share two cores, so
the figures say what each layout costs in this machine's terms (copies of activations between stages, the pipeline
bubble, the all-reduce), not what GPUs would gain. The gradient
all-reduce of 2 x 2 is among 2 copies of each stage (half the model each), that of ``mirrored`` among 4 copies of
the whole model.

    .venv/bin/python benchmarks/bench_pipelines.py [--windows 5] [--steps 20] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from paraml.bench.harness import int_at_least  # noqa: E402  (imports no TensorFlow)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    positive = int_at_least(1)
    parser.add_argument("--windows", type=positive, default=5, help="timed rounds (default 5)")
    parser.add_argument("--steps", type=positive, default=20, help="timed steps per window (default 20)")
    parser.add_argument("--layers", type=positive, default=8, help="Dense layers (default 8)")
    parser.add_argument("--width", type=positive, default=512, help="width of every layer (default 512)")
    parser.add_argument("--batch-size", type=positive, default=256, help="global batch (default 256)")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    args = parser.parse_args(argv)

    from paraml import ensure_devices

    ensure_devices(4)  # 4 GPUs when the machine has them, else 4 logical CPUs
    import keras
    import numpy as np

    from paraml.bench.harness import (
        Spec,
        Workload,
        environment,
        format_table,
        measure,
        paired,
        progress_printer,
        write_json,
    )

    def model_fn() -> keras.Model:
        layers = [keras.layers.Dense(args.width, activation="relu") for _ in range(args.layers - 1)]
        return keras.Sequential([keras.Input((args.width,)), *layers, keras.layers.Dense(args.width)])

    rows = (args.steps + 1) * args.batch_size
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, args.width)).astype("float32")
    y = rng.integers(0, args.width, rows)
    work = Workload(model_fn, x, y, steps_per_call=args.steps + 1, batch_size=args.batch_size)
    plan = [
        (Spec("mirrored", 4), work),
        (Spec("model_parallel", 4, options={"micro_batches": 4}, tag="1x4"), work),
        (Spec("model_parallel", 4, options={"micro_batches": 2, "data_parallel": 2}, tag="2x2"), work),
    ]
    results, _ = measure(plan, args.windows, progress=progress_printer("bench"))
    by_label = {r.label: r for r in results}
    mirrored, one, two = (by_label[spec.label] for spec, _ in plan)

    def faster(a: object, b: object) -> float:  # throughput of a over b: per-round step-time ratios, b / a
        return paired(b.windows_ms["step_ms"], a.windows_ms["step_ms"])  # type: ignore[attr-defined]

    table = [
        [r.label, f"{r.samples_per_s:,.0f}", f"{r.step_ms:.1f}", f"{faster(r, mirrored):.2f}"]
        for r in (mirrored, one, two)
    ]
    print(format_table(table, ["variant", "samples/s", "step ms", "throughput vs mirrored"]))
    ratio = faster(two, one)
    print(f"2 pipelines x 2 stages vs 1 pipeline x 4 stages: {ratio:.2f}x the throughput")
    record = {
        "environment": environment(),
        "results": [r.__dict__ for r in results],
        "ratios": {
            "2x2_vs_1x4": ratio,
            "2x2_vs_mirrored": faster(two, mirrored),
            "1x4_vs_mirrored": faster(one, mirrored),
        },
    }
    write_json(record, args.json, echo=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
