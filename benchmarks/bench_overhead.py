"""Where paraml's time goes against plain Keras ``model.fit``: per ``fit`` call and per step.

Every variant trains the same model (default ``mlp2``, 256-512-512-10) with the same optimizer (SGD) and loss, from
numpy arrays, global batch 256, no shuffling, one ``fit`` call of ``--steps`` steps per window:

  keras-fit-single@1 [xla]   plain ``model.compile(jit_compile=...); model.fit()`` on one device, no strategy
  single@1 [xla]             ``Parallel("single", jit_compile=...).fit(x, y, batch_size=256)``
  mirrored@N [xla]           ``Parallel("mirrored", devices=N, jit_compile=...)`` on N simulated devices
  keras-fit-mirrored@N       ``model.fit`` with the model compiled under ``MirroredStrategy`` on the same devices

Each window gives the whole ``fit`` call per step (wall and process CPU time: what an epoch costs), the steady-state
step and the fixed cost of a call; ratios are medians of per-window ratios. Timing is :mod:`paraml.bench.harness`'s
(variants interleaved in one process); everything goes through the public API.

What paraml's loop costs piece by piece (prototypes with one cost removed, the fixed cost of a call split into its
pieces) could only be measured by patching paraml's private code, which measures a copy of the loop rather than the
loop itself; this script measures only what a user sees.

    .venv/bin/python benchmarks/bench_overhead.py [--steps 32] [--windows 7] [--model mlp2|mlp|digits] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from paraml.bench.harness import GLOBAL_BATCH, PRESETS, int_at_least  # noqa: E402  (imports no TensorFlow)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="mlp2", help="mlp2: 256-512-512-10 (default)")
    parser.add_argument("--batch-size", type=int_at_least(1), default=GLOBAL_BATCH, help="global batch (default 256)")
    parser.add_argument("--steps", type=int_at_least(2), default=32, help="steps per fit call / window (default 32)")
    parser.add_argument("--windows", type=int_at_least(1), default=7, help="timed rounds (default 7)")
    parser.add_argument("--devices", type=int_at_least(2), default=2, help="devices of the mirrored rows (default 2)")
    parser.add_argument("--no-mirrored", action="store_true", help="leave out the MirroredStrategy rows")
    parser.add_argument("--no-xla", action="store_true", help="leave out the jit_compile=True rows")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every round's whole-call ms/step")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import paraml

    paraml.simulate_devices(args.devices)  # first: before anything initialises TensorFlow's devices

    from paraml.bench.command import compute_ratios, versus_keras_specs
    from paraml.bench.harness import (
        Workload,
        environment,
        format_table,
        measure,
        progress_printer,
        random_data,
        write_json,
    )

    model_fn, shape, kind = PRESETS[args.model]
    x, y = random_data(shape, kind, args.steps * args.batch_size)
    work = Workload(model_fn, x, y, args.steps, args.batch_size)
    specs = versus_keras_specs(1 if args.no_mirrored else args.devices, xla=not args.no_xla)
    print(
        f"model {args.model}, global batch {args.batch_size}, numpy input, fit calls of {args.steps} steps, "
        f"{args.windows} interleaved rounds",
        flush=True,
    )
    show = "fit_call_ms" if args.verbose else None
    results, _ = measure([(s, work) for s in specs], args.windows, progress=progress_printer("overhead"), show=show)

    rows = [[r.label, r.fit_call_ms, r.fit_call_cpu_ms, r.step_ms, f"{r.fixed_ms:.1f}"] for r in results]
    print(f"\nms per step (median of {args.windows} rounds)")
    print(format_table(rows, ["variant", "whole fit call", "CPU", "steady", "fixed ms/call"]))

    metrics = {"fit_call": "fit_call_ms", "cpu": "fit_call_cpu_ms", "steady": "step_ms"}
    ratios = {key: compute_ratios(results, args.devices, metric) for key, metric in metrics.items()}
    names = list(ratios["fit_call"])
    rows = [[name, *(f"{ratios[key][name]:.3f}" for key in metrics)] for name in names]
    print("\nratios (medians of per-round ratios; < 1: the first is faster)")
    print(format_table(rows, ["ratio", "whole fit call", "CPU", "steady"]))

    record = {
        "benchmark": "overhead",
        "model": args.model,
        "global_batch": args.batch_size,
        "steps_per_fit_call": args.steps,
        "windows": args.windows,
        "results": results,
        "ratios": {name: {key: round(ratios[key][name], 4) for key in metrics} for name in names},
        "env": environment(),
    }
    write_json(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
