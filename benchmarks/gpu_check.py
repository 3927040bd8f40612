"""paraml against Keras ``model.fit`` on the devices this machine has, in one command.

    python benchmarks/gpu_check.py [--model mlp2] [--windows 5] [--steps 31] [--json gpu_check.json]

On a machine with GPUs it uses them: ``single`` and plain Keras on the first GPU, ``mirrored`` and Keras under
``MirroredStrategy`` over every GPU (with one GPU, the data-parallel rows are left out). Without GPUs it simulates 2
logical CPUs (which share the cores: data-parallel numbers there show overheads, not speed-ups). Rows:

  keras-fit-single@1 [xla]   plain ``model.compile(jit_compile=...); model.fit()``, no strategy
  single@1 [xla]             ``paraml.Parallel("single", jit_compile=...)``
  mirrored@N [xla]           ``paraml.Parallel("mirrored", devices=N, jit_compile=...)``
  keras-fit-mirrored@N       Keras ``fit`` with the model compiled under the same ``MirroredStrategy``

Same model, optimizer (SGD), loss and numpy data (global batch 256) everywhere. Each timed window is one ``fit`` call
of ``steps + 1`` batches per variant, timed by :mod:`paraml.bench.harness` (windows interleaved in one process, ratios
the medians of per-window ratios: the steady-state step and the whole call). A row TensorFlow refuses here (e.g. XLA
on a device without it) is reported and left out. It prints a table, the ratios, and one JSON line (``JSON {...}``),
also written to ``--json``.

Then the memory of one training step per device (leave it out with ``--no-memory``): ``mirrored`` over every device
and its ZeRO stages (``shard_optimizer``, ``shard_gradients``, ``shard_parameters``; ``single`` with one GPU), with
Adam (two slots per parameter for ZeRO to shard), each measured by
:func:`paraml.bench.memory_trace.device_memory_peaks` (each device's variables and the peak of the buffers its ops
allocated, replayed from the allocators' events), next to each GPU's own allocator's peak over the same step
(``tf.config.experimental.get_memory_info("GPU:i")["peak"]``). On CPUs it prints the logical devices' figures only:
they share one allocator, whose peak is the whole process's.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from paraml.bench.harness import GLOBAL_BATCH, PRESETS, int_at_least  # noqa: E402  (imports no TensorFlow)


def main(argv: list[str] | None = None) -> int:
    """Run the check; 0 when it ran (whatever the ratios), 2 on bad arguments."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="mlp2", help="default mlp2: 256-512-512-10")
    parser.add_argument("--windows", type=int_at_least(1), default=5, help="interleaved timed windows (default 5)")
    parser.add_argument("--steps", type=int_at_least(1), default=31, help="steps per window; a fit call: steps + 1")
    parser.add_argument("--no-xla", action="store_true", help="leave out the jit_compile=True rows")
    parser.add_argument("--no-memory", action="store_true", help="leave out the per-device memory of one step")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record here")
    args = parser.parse_args(argv)

    import tensorflow as tf

    gpus = len(tf.config.list_physical_devices("GPU"))  # lists without initialising the devices
    import paraml

    if not gpus:
        paraml.simulate_devices(2)  # before anything initialises TensorFlow's devices
    from paraml.bench.command import compute_ratios, format_ratios, versus_keras_specs
    from paraml.bench.harness import Workload, format_table, measure, progress_printer, random_data, write_json

    devices = gpus or 2
    model_fn, shape, kind = PRESETS[args.model]
    x, y = random_data(shape, kind, (args.steps + 1) * GLOBAL_BATCH)
    work = Workload(model_fn, x, y, args.steps + 1)
    plan = [(spec, work) for spec in versus_keras_specs(devices, xla=not args.no_xla)]
    results, _ = measure(plan, args.windows, progress=progress_printer("gpu_check"), skip_failures=True)
    ratios = compute_ratios(results, devices, "step_ms")
    call_ratios = compute_ratios(results, devices, "fit_call_ms")

    kind_of_device = f"{gpus} GPU(s)" if gpus else "no GPU: 2 simulated CPU devices sharing the cores"
    print(f"model {args.model}, global batch {GLOBAL_BATCH}, {kind_of_device}, TensorFlow {tf.__version__}")
    print(f"{args.windows} interleaved windows of one fit call of {args.steps + 1} steps per variant\n")
    rows = [[r.label, r.step_ms, r.fit_call_ms, f"{r.fixed_ms:.1f}", r.first_step_s] for r in results]
    print(format_table(rows, ["variant", "step ms", "fit-call ms", "fixed ms/call", "first call s"]))
    print()
    report = {"ratios": ratios, "fit_call_ratios": call_ratios}
    print(format_ratios(report))
    memory = None if args.no_memory else device_memory(work, gpus, devices)
    record = {
        "benchmark": "gpu_check",
        "model": args.model,
        "global_batch": GLOBAL_BATCH,
        "gpus": gpus,
        "devices": devices,
        "steps_per_fit_call": args.steps + 1,
        "windows": args.windows,
        "tensorflow": tf.__version__,
        "results": results,
        **report,
        "memory": memory,
    }
    write_json(record, args.json)
    return 0


#: The data-parallel variants whose memory per device is measured: plain, then ZeRO-1, 2 and 3 (issue 33).
MEMORY_VARIANTS: dict[str, dict[str, bool]] = {
    "mirrored": {},
    "shard_optimizer": {"shard_optimizer": True},
    "shard_gradients": {"shard_gradients": True},
    "shard_parameters": {"shard_parameters": True},
}


def device_memory(work: Any, gpus: int, devices: int) -> list[dict[str, Any]]:
    """Print and return each device's measured peak in one step on the workload's first batch, for a fresh
    ``Parallel`` per variant (``mirrored`` and its ZeRO stages; ``single`` on one GPU), next to each GPU's own
    allocator's peak."""
    import gc

    from paraml import Parallel
    from paraml.bench.harness import format_table
    from paraml.bench.memory_trace import device_memory_peaks

    variants = MEMORY_VARIANTS if devices > 1 else {"single": {}}
    mib = 1 << 20
    record = []
    for name, options in variants.items():
        if devices > 1:
            par = Parallel("mirrored", devices=devices, seed=0, **options)
        else:
            par = Parallel("single", seed=0)
        par.build(work.model_fn, **{**work.compile_args(), "optimizer": "adam"})  # slots for ZeRO to shard
        measured = device_memory_peaks(par, work.x[:GLOBAL_BATCH], work.y[:GLOBAL_BATCH])
        rows = []
        for device in measured.devices:
            own = measured.allocator_peak_bytes.get(device.device) if gpus else None  # logical CPUs: the process's
            rows.append(
                [
                    device.device,
                    f"{device.state_bytes / mib:.1f}",
                    f"{device.buffer_peak_bytes / mib:.1f}",
                    f"{device.peak_bytes / mib:.1f}",
                    "-" if own is None else f"{own / mib:.1f}",
                ]
            )
            record.append(
                {"variant": name, "device": device.device, "measured_peak": device.peak_bytes, "allocator_peak": own}
            )
        print(f"\nmemory of one {name} step at global batch {GLOBAL_BATCH}, per device (MiB)")
        header = ["device", "state", "buffer peak", "measured peak", "own allocator's peak"]
        print(format_table(rows, header))
        shared = "" if gpus else " (logical CPUs: one allocator for the process)"
        unattributed, process = measured.unattributed_bytes / mib, measured.process_peak_bytes / mib
        print(f"unattributed {unattributed:.1f} MiB; process peak {process:.1f} MiB replayed{shared}")
        del par, measured
        gc.collect()  # the next variant's peaks start from what is still alive
    return record


if __name__ == "__main__":
    sys.exit(main())
