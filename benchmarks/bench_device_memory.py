"""Each device's measured peak in one training step (:func:`paraml.bench.memory_trace.device_memory_peaks`) against the
planner's per-stage figures (``plan.stages[i].peak_bytes``), per schedule, and against ``estimate_memory`` under
``mirrored``.

One configuration per fresh process (``--one``): the process simulates 2 logical CPUs and builds the MLP of
``benchmarks/bench_stage_memory.py`` (16 Dense layers of 512 with GELU, a Dense of 10) with Adam, under

* ``Parallel("model_parallel", devices=2, micro_batches=M, schedule=S, batch_size=B)`` for S in gpipe, 1f1b,
  interleaved, zero_bubble: a device's figure is the ``peak_bytes`` of the stages it runs (under ``interleaved``
  2 model chunks per device, whose figures are added: a bound, their peaks need not coincide);
* ``Parallel("mirrored", devices=2)``: each device's figure is ``estimate_memory(model, batch_size=B / 2)``, one
  replica's step.

A device's measured peak is the variables and optimizer state living on it plus the most bytes of buffers its ops
held at once in the step, replayed from the allocator's events by the node that allocated each buffer; what no device
accounts for (the input pipeline's buffers, the batches Keras keeps) is shown apart, as is the process's peak (the
replay's and the allocator's own, which agree). On CPU the allocator records buffers of 256 KiB or more only; at the
default batch every activation is far above that.

    .venv/bin/python benchmarks/bench_device_memory.py [--batch 16384] [--micro-batches 8] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")
KINDS = (*SCHEDULES, "mirrored")
MB = 1e6


def one(kind: str, micro_batches: int, batch: int) -> dict[str, object]:
    """This process: each device's measured peak in one training step of ``kind`` and its planned figure."""
    from paraml import simulate_devices

    simulate_devices(2)
    import keras
    import numpy as np
    from bench_stage_memory import mlp  # the same model as the per-stage benchmark

    from paraml import Parallel
    from paraml.bench.memory_trace import device_memory_peaks
    from paraml.memory import estimate_memory

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 512)).astype("float32")
    y = rng.integers(0, 10, batch)
    if kind == "mirrored":
        par = Parallel("mirrored", devices=2, seed=0)
    else:
        options = {"schedule": kind, "micro_batches": micro_batches, "batch_size": batch}
        par = Parallel("model_parallel", devices=2, seed=0, **options)
    par.build(mlp, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    if kind == "mirrored":
        replica = estimate_memory(mlp, batch_size=batch // 2, optimizer="adam").total
        planned = {device: replica for device in par.devices}
    else:
        assert par.plan is not None
        planned = dict.fromkeys(par.devices, 0)
        for stage in par.plan.stages:  # stage s runs on device s % devices (interleaved: more stages than devices)
            planned[par.devices[stage.index % len(par.devices)]] += stage.peak_bytes
    memory = device_memory_peaks(par, x, y)
    print(memory, file=sys.stderr)
    return {
        "kind": kind,
        "micro_batches": micro_batches if kind != "mirrored" else 1,
        "batch": batch,
        "devices": [
            {
                "device": d.device,
                "state": d.state_bytes,
                "buffer_peak": d.buffer_peak_bytes,
                "peak": d.peak_bytes,
                "planned": planned.get(d.device, 0),
            }
            for d in memory.devices
        ],
        "unattributed": memory.unattributed_bytes,
        "held_before": memory.held_before_bytes,
        "process_peak": memory.process_peak_bytes,
        "allocator_peak": max(memory.allocator_peak_bytes.values()),
    }


def measured(kind: str, micro_batches: int, batch: int) -> dict[str, object]:
    """``one`` in a fresh process."""
    command = [sys.executable, __file__, "--one", kind, str(micro_batches), "--batch", str(batch)]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"{kind} x {micro_batches} failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=16384, help="global batch (default 16384)")
    parser.add_argument("--micro-batches", type=int, default=8, help="micro-batches of model_parallel (default 8)")
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS), help="default: all")
    parser.add_argument("--one", nargs=2, metavar=("KIND", "MICRO_BATCHES"), help=argparse.SUPPRESS)
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(one(args.one[0], int(args.one[1]), args.batch)))
        return 0

    from paraml.bench.harness import environment, format_table, write_json

    records, rows = [], []
    for kind in args.kinds:
        r = measured(kind, args.micro_batches, args.batch)
        records.append(r)
        for d in r["devices"]:  # type: ignore[attr-defined]
            rows.append(
                [
                    kind if kind == "mirrored" else f"{kind} x {r['micro_batches']}",
                    d["device"],
                    f"{d['state'] / MB:.0f}",
                    f"{d['buffer_peak'] / MB:.0f}",
                    f"{d['peak'] / MB:.0f}",
                    f"{d['planned'] / MB:.0f}",
                    f"{d['planned'] / d['peak']:.2f}",
                    f"{r['unattributed'] / MB:.0f}",  # type: ignore[operator]
                    f"{r['process_peak'] / MB:.0f} / {r['allocator_peak'] / MB:.0f}",  # type: ignore[operator]
                ]
            )
        print(f"{kind}: done", file=sys.stderr, flush=True)
    header = [
        "run",
        "device",
        "state MB",
        "buffers MB",
        "measured MB",
        "planned MB",
        "planned/measured",
        "unattributed MB",
        "process peak MB (replay / allocator)",
    ]
    print(format_table(rows, header, markdown=True))
    write_json({"environment": environment(batch=args.batch), "runs": records}, args.json, echo=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
