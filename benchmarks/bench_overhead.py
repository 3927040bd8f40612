"""Where paraml's time goes against plain Keras ``model.fit``: per ``fit`` call and per step.

Every variant trains the same model (default ``mlp2``, 256-512-512-10) with the same optimizer (SGD) and loss, from
numpy arrays, global batch 256, no shuffling, one ``fit`` call of ``--steps`` steps per window:

  keras-fit-single@1 [xla]   plain ``model.compile(jit_compile=...); model.fit()`` on one device, no strategy
  single@1 [xla]             ``Parallel("single", jit_compile=...).fit(x, y, batch_size=256)``
  mirrored@N [xla]           ``Parallel("mirrored", devices=N, jit_compile=...)`` on N simulated devices
  keras-fit-mirrored@N       ``model.fit`` with the model compiled under ``MirroredStrategy`` on the same devices
  [keras-fit-]single@1 spe=S with ``--steps-per-execution S``: both running S steps per call of their step function

Each window gives the whole ``fit`` call per step (wall and process CPU time: what an epoch costs), the steady-state
step and the fixed cost of a call; ratios are medians of per-window ratios. Timing is :mod:`paraml.bench.harness`'s
(variants interleaved in one process); everything goes through the public API.

What paraml's loop costs piece by piece (prototypes with one cost removed, the fixed cost of a call split into its
pieces) could only be measured by patching paraml's private code, which measures a copy of the loop rather than the
loop itself; this script measures only what a user sees.

``--model gpt2`` is a keras_hub ``GPT2CausalLM`` (random init, no download; 2 blocks of hidden 128, 4 heads, sequence
32, vocabulary 1000) trained on next-token labels (keras-hub comes with the dev extra).

    .venv/bin/python benchmarks/bench_overhead.py [--steps 32] [--windows 7] [--model mlp2|cnn|gpt2|...] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from paraml.bench.harness import GLOBAL_BATCH, PRESETS, int_at_least  # noqa: E402  (imports no TensorFlow)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    models = sorted([*PRESETS, "gpt2"])
    parser.add_argument("--model", choices=models, default="mlp2", help="mlp2: 256-512-512-10 (default)")
    parser.add_argument("--batch-size", type=int_at_least(1), default=GLOBAL_BATCH, help="global batch (default 256)")
    parser.add_argument("--steps", type=int_at_least(2), default=32, help="steps per fit call / window (default 32)")
    parser.add_argument("--windows", type=int_at_least(1), default=7, help="timed rounds (default 7)")
    parser.add_argument("--devices", type=int_at_least(2), default=2, help="devices of the mirrored rows (default 2)")
    parser.add_argument("--no-mirrored", action="store_true", help="leave out the MirroredStrategy rows")
    parser.add_argument(
        "--steps-per-execution",
        type=int_at_least(2),
        metavar="S",
        help="also time single and Keras' fit running S steps per call of their step function",
    )
    parser.add_argument("--no-xla", action="store_true", help="leave out the jit_compile=True rows")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every round's whole-call ms/step")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    args = parser.parse_args(argv)
    if args.steps_per_execution and args.steps_per_execution >= args.steps:
        parser.error(
            f"--steps-per-execution {args.steps_per_execution} must be below --steps {args.steps}: a window times "
            "the executions after its first"
        )
    return args


GPT2 = {"vocabulary_size": 1000, "num_layers": 2, "num_heads": 4, "hidden_dim": 128, "intermediate_dim": 512}
GPT2_SEQUENCE = 32


def gpt2_workload(steps: int, batch_size: int) -> Any:
    """A tiny keras_hub ``GPT2CausalLM`` on random token ids, each labelled with the next one."""
    import numpy as np

    from paraml.bench.harness import Workload

    def gpt2_fn() -> Any:
        import keras_hub  # a benchmark-only dependency (the dev extra), never imported by paraml

        backbone = keras_hub.models.GPT2Backbone(**GPT2, max_sequence_length=GPT2_SEQUENCE)
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)

    ids = np.random.default_rng(0).integers(0, GPT2["vocabulary_size"], (steps * batch_size, GPT2_SEQUENCE))
    ids = ids.astype(np.int32)
    x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    return Workload(gpt2_fn, x, np.roll(ids, -1, axis=1), steps, batch_size)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import paraml

    paraml.simulate_devices(args.devices)  # first: before anything initialises TensorFlow's devices

    from paraml.bench.command import compute_ratios, versus_keras_specs
    from paraml.bench.harness import (
        KERAS_SINGLE,
        Spec,
        Workload,
        environment,
        format_table,
        measure,
        paired,
        progress_printer,
        random_data,
        write_json,
    )

    if args.model == "gpt2":
        work = gpt2_workload(args.steps, args.batch_size)
    else:
        model_fn, shape, kind = PRESETS[args.model]
        x, y = random_data(shape, kind, args.steps * args.batch_size)
        work = Workload(model_fn, x, y, args.steps, args.batch_size)
    specs = versus_keras_specs(1 if args.no_mirrored else args.devices, xla=not args.no_xla)
    if args.steps_per_execution:
        several = {"steps_per_execution": args.steps_per_execution}
        specs += [Spec(KERAS_SINGLE, 1, options=several), Spec("single", 1, options=several)]
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
    if args.steps_per_execution:  # against Keras' defaults and against Keras running as many steps per call
        spe = f" spe={args.steps_per_execution}"
        pairs = {
            "single_spe_vs_keras_fit_single": (f"single@1{spe}", "keras-fit-single@1"),
            "single_spe_vs_keras_fit_single_spe": (f"single@1{spe}", f"keras-fit-single@1{spe}"),
        }
        by_label = {r.label: r for r in results}
        for key, metric in metrics.items():
            for name, (a, b) in pairs.items():
                ratios[key][name] = paired(by_label[a].windows_ms[metric], by_label[b].windows_ms[metric])
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
