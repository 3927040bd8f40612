"""The GPU check of issue 13, in one command: paraml against Keras ``model.fit`` on the devices this machine has.

    python benchmarks/gpu_check.py [--model mlp2] [--windows 5] [--steps 31] [--json gpu_check.json]

On a machine with GPUs it uses them: ``single`` and plain Keras on the first GPU, ``mirrored`` and Keras under
``MirroredStrategy`` over every GPU (with one GPU, the data-parallel rows are left out). Without GPUs it simulates 2
logical CPUs (which share the cores: data-parallel numbers there show overheads, not speed-ups). Rows:

  keras-fit-single@1 [xla]   plain ``model.compile(jit_compile=...); model.fit()``, no strategy
  single@1 [xla]             ``paraml.Parallel("single", jit_compile=...)``
  mirrored@N [xla]           ``paraml.Parallel("mirrored", devices=N, jit_compile=...)``
  keras-fit-mirrored@N       Keras ``fit`` with the model compiled under the same ``MirroredStrategy``

Same model, optimizer (SGD), loss and numpy data (global batch 256) everywhere. Each timed window is one ``fit`` call
of ``steps + 1`` batches per variant, the windows interleaved in one process (A B C, B C A, ...), and each ratio is
the median of per-window ratios: the steady-state step (from the end of the call's first step) and the whole call.
It prints a table, the ratios, and one JSON line (``JSON {...}``), also written to ``--json``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 when it ran (whatever the ratios), 2 on bad arguments."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="mlp2", help="a paraml bench preset (default mlp2: 256-512-512-10)")
    parser.add_argument("--windows", type=int, default=5, help="interleaved timed windows (default 5)")
    parser.add_argument("--steps", type=int, default=31, help="steps per window; a fit call is steps + 1 (default 31)")
    parser.add_argument("--no-xla", action="store_true", help="leave out the jit_compile=True rows")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record here")
    args = parser.parse_args(argv)
    if args.windows < 1 or args.steps < 2:
        print("error: --windows >= 1 and --steps >= 2", file=sys.stderr)
        return 2

    import tensorflow as tf

    gpus = len(tf.config.list_physical_devices("GPU"))  # lists without initialising the devices
    import paraml

    if not gpus:
        paraml.simulate_devices(2)  # before anything initialises TensorFlow's devices (field notes 5)
    from paraml import Parallel
    from paraml.bench import (
        GLOBAL_BATCH,
        PRESETS,
        _data,
        _finish,
        _keras_runner,
        _paraml_runner,
        _ratio_lines,
        _record,
        compute_ratios,
    )

    if args.model not in PRESETS:
        print(f"error: --model must be one of {', '.join(PRESETS)}", file=sys.stderr)
        return 2
    devices = gpus if gpus else 2
    began = time.perf_counter()

    def say(message: str) -> None:
        print(f"[gpu_check] {message} ({time.perf_counter() - began:.1f} s)", file=sys.stderr, flush=True)

    model_fn, shape, kind = PRESETS[args.model]
    data = _data(shape, kind, (args.steps + 1) * GLOBAL_BATCH)
    xla = (False,) if args.no_xla else (False, True)
    makers = []
    for jit in xla:
        makers.append(
            (f"keras-fit-single xla={jit}", lambda jit=jit: _keras_runner(model_fn, data, args.steps, None, jit))
        )
        makers.append(
            (
                f"single xla={jit}",
                lambda jit=jit: _paraml_runner(Parallel("single", seed=0, jit_compile=jit), model_fn, data, args.steps),
            )
        )
    if devices > 1:
        for jit in xla:
            makers.append(
                (
                    f"mirrored@{devices} xla={jit}",
                    lambda jit=jit: _paraml_runner(
                        Parallel("mirrored", devices=devices, seed=0, jit_compile=jit), model_fn, data, args.steps
                    ),
                )
            )
        makers.append((f"keras-fit-mirrored@{devices}", lambda: _keras_runner(model_fn, data, args.steps, devices)))
    runners = []
    for i, (what, make) in enumerate(makers, start=1):
        say(f"{i}/{len(makers)} build, trace and warm up {what}")
        try:
            runners.append(make())
        except Exception as error:  # a row TF refuses here (e.g. XLA on a device without it): reported, left out
            say(f"{what} left out: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    for w in range(args.windows):
        say(f"timed window {w + 1}/{args.windows} of {len(runners)} variants, interleaved")
        shift = w % len(runners)
        for runner in runners[shift:] + runners[:shift]:
            _record(runner)
    results = [runner.result for runner in runners]
    for result in results:
        _finish(result, args.steps)
    ratios, call_ratios = compute_ratios(results, devices)
    kind_of_device = f"{gpus} GPU(s)" if gpus else "no GPU: 2 simulated CPU devices sharing the cores"
    print(f"model {args.model}, global batch {GLOBAL_BATCH}, {kind_of_device}, TensorFlow {tf.__version__}")
    print(f"{args.windows} interleaved windows of one fit call of {args.steps + 1} steps per variant\n")
    print(f"{'variant':<26}{'step ms':>9}{'fit-call ms':>13}{'fixed ms/call':>15}{'first call s':>14}")
    for r in results:
        print(f"{r.label:<26}{r.step_ms:>9.2f}{r.fit_call_ms:>13.2f}{r.fixed_ms:>15.1f}{r.first_step_s:>14.2f}")
    print()
    report = {"ratios": ratios, "fit_call_ratios": call_ratios}
    print("\n".join(_ratio_lines(report, markdown=False)))
    record = {
        "benchmark": "gpu_check",
        "model": args.model,
        "global_batch": GLOBAL_BATCH,
        "gpus": gpus,
        "devices": devices,
        "steps_per_fit_call": args.steps + 1,
        "windows": args.windows,
        "tensorflow": tf.__version__,
        "results": [asdict(r) | {"label": r.label} for r in results],
        "ratios": ratios,
        "fit_call_ratios": call_ratios,
    }
    from common import write_json  # imported here: it imports TensorFlow, which must not start before the devices

    write_json(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
