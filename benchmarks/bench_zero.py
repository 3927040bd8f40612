"""ZeRO stages 1 to 3 (``shard_optimizer``, ``shard_gradients``, ``shard_parameters``) against unsharded data
parallelism: bytes per device, the process's memory peak, step time, and the bytes each replica sends per step.

A model whose state dominates (12 Dense layers of 1024, Adam: 50 MB of parameters). ``mirrored`` on 4 devices (GPUs
when the machine has 4, else logical CPUs). Each variant:

- **state per device**: read from where the variables live (:meth:`paraml.Parallel.memory_by_device`), the device
  holding most;
- **peak**: the allocator's peak (``get_memory_info``) of one fresh process per variant that builds and trains 2
  epochs. On logical CPUs the 4 devices share one allocator, so this is the whole process (all replicas); on GPUs,
  the first GPU's;
- **step time**: measured in one process with the variants interleaved (:func:`paraml.bench.harness.interleave`),
  the median of per-window ratios to unsharded, of the wall time and of the process's CPU time. On logical CPUs the
  devices share two cores, and a call's wall time now and then takes 0.3, 1, 2 or 5 s more while the CPU idles
  (measured on Keras' own ``fit`` under MirroredStrategy(4) too, not in a plain TensorFlow loop): the CPU time is the
  steadier figure there;
- **sent / replica / step**: counted from the collectives each variant issues (not measured): a ring all-reduce of
  the gradients sends 2(N-1)/N of their bytes; ZeRO-1 adds the broadcast of the updated values from each owner
  ((N-1)/N of the parameters); ZeRO-2 sends (N-1)/N of the gradients by all-to-all and the same broadcast; ZeRO-3
  reads each parameter from its owner in the forward pass and again when its unit is recomputed (2(N-1)/N) and sends
  the gradients by all-to-all ((N-1)/N): 1.5 times an all-reduce, as DeepSpeed states for its ZeRO-3.

The two ``one bucket`` variants set ``bucket_bytes`` as large as everything: their collectives move at once, as
before buckets (:mod:`paraml.parallelism.buckets`), for the step time side by side with the default buckets.

``--workers 2``: ``paraml launch -n 2`` of this file once per variant (unsharded, ``shard_optimizer``,
``shard_gradients``, ``shard_parameters``); each worker process (one allocator each) reports what is allocated after
build, the peak of a first epoch (the process's peak: build, tracing, steps) and the median of the next epoch's
per-step peaks. ``--workers-only`` skips the one-machine part.

    .venv/bin/python benchmarks/bench_zero.py [--windows 5] [--workers 2 [--workers-only]] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


MARKER = "bench_zero worker: "
LAYERS, WIDTH, BATCH = 12, 1024, 256

#: Each variant's options, unsharded first.
VARIANTS = {
    "unsharded": {},
    "shard_optimizer": {"shard_optimizer": True},
    "shard_optimizer+remat": {"shard_optimizer": True, "remat": True},
    "shard_gradients": {"shard_gradients": True},
    "shard_parameters": {"shard_parameters": True},
    # one bucket as large as everything: the collectives all at once, as before buckets (step time side by side)
    "shard_optimizer, one bucket": {"shard_optimizer": True, "bucket_bytes": 2**40},
    "shard_gradients, one bucket": {"shard_gradients": True, "bucket_bytes": 2**40},
}


def model_fn():  # noqa: ANN201  (keras is imported late: the strategy comes first under multi_worker)
    import keras

    return keras.Sequential([keras.Input((WIDTH,)), *[keras.layers.Dense(WIDTH) for _ in range(LAYERS)]])


def data(rows: int = BATCH):  # noqa: ANN201
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.normal(size=(rows, WIDTH)).astype("float32"), rng.normal(size=(rows, WIDTH)).astype("float32")


def sent_per_step(variant: str, gradient_bytes: int, devices: int) -> int:
    """The bytes each replica sends per step under ``variant`` (counted from the algorithm, module docstring)."""
    share = (devices - 1) / devices
    sent = {
        "shard_parameters": 3,  # two reads of the parameters, an all-to-all of the gradients
        "shard_gradients": 2,  # an all-to-all of the gradients, a broadcast of the updated values
        "shard_optimizer": 3,  # a ring all-reduce of the gradients, a broadcast of the updated values
        "shard_optimizer+remat": 3,
    }
    return round(sent.get(variant.split(",")[0], 2) * share * gradient_bytes)  # unsharded: a ring all-reduce


def peak_run(variant: str) -> None:
    """One fresh process: build and train ``variant`` on 4 devices, print the allocator's peak and the state."""
    from paraml import Parallel, ensure_devices

    ensure_devices(4)
    import tensorflow as tf

    options = dict(VARIANTS[variant])
    par = Parallel("mirrored", devices=4, seed=0, **options)
    par.build(model_fn, optimizer="adam", loss="mse")
    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    x, y = data(4 * BATCH)
    par.fit(x, y, batch_size=BATCH, epochs=2, verbose=0)
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    by_device = par.memory_by_device()
    print(MARKER + json.dumps({"variant": variant, "peak": peak, "by_device": by_device}), flush=True)


def worker(variant: str) -> None:
    """One worker of ``paraml launch``: train, then print this process's allocator figures and its variables' bytes:
    ``state`` (allocated after build), ``peak`` (over the first epoch) and ``step_peak`` (the median of each step's)."""
    import statistics

    from paraml import Parallel

    par = Parallel("multi_worker", seed=0, **VARIANTS[variant])  # first: before TensorFlow lists its devices
    import keras
    import tensorflow as tf

    step_peaks = []

    class StepPeak(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
            tf.config.experimental.reset_memory_stats(device)

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            step_peaks.append(tf.config.experimental.get_memory_info(device)["peak"])

    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    x, y = data(4 * BATCH)
    par.build(model_fn, optimizer="adam", loss="mse")
    state = tf.config.experimental.get_memory_info(device)["current"]
    par.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    par.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, callbacks=[StepPeak()])
    (by_device,) = par.memory_by_device().values()
    figures = {"state": state, "peak": peak, "step_peak": statistics.median(step_peaks)}
    print(MARKER + json.dumps({"worker": par.worker_index, **figures, **by_device}), flush=True)


def _run_marked(command: list[str]) -> list[dict[str, object]]:
    from paraml.bench.harness import marked_results, run_process

    done = run_process(command, 900)
    if done.code != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return marked_results(done.stdout, MARKER)


def per_worker_peaks(workers: int) -> tuple[list[list[str]], dict[str, object]]:
    """Each worker's figures per variant, from one ``paraml launch`` run each."""
    from paraml.planning.sizes import format_bytes

    found = {}
    for variant in ("unsharded", "shard_optimizer", "shard_gradients", "shard_parameters"):
        command = [sys.executable, "-m", "paraml", "launch", "-n", str(workers), __file__, "--worker-run", variant]
        found[variant] = sorted(_run_marked(command), key=lambda r: r["worker"])
    rows = []
    for variant, results in found.items():
        for result in results:
            against = next(r for r in found["shard_optimizer"] if r["worker"] == result["worker"])
            saved = (int(against["peak"]) - int(result["peak"])) / (LAYERS * (WIDTH * WIDTH + WIDTH) * 4)
            rows.append(
                [variant, str(result["worker"]), format_bytes(int(result["parameters"]))]
                + [format_bytes(int(result[f])) for f in ("optimizer", "state", "peak", "step_peak")]
                + [f"{saved:+.2f}"]
            )
    return rows, found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--workers", type=int, default=0, help="also measure each worker's peak under launch -n N")
    parser.add_argument("--workers-only", action="store_true", help="only the per-worker part (with --workers)")
    parser.add_argument("--worker-run", choices=tuple(VARIANTS), help=argparse.SUPPRESS)  # one launched worker
    parser.add_argument("--peak-run", choices=tuple(VARIANTS), help=argparse.SUPPRESS)  # one fresh process
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    args = parser.parse_args(argv)
    if args.worker_run is not None:
        worker(args.worker_run)
        return 0
    if args.peak_run is not None:
        peak_run(args.peak_run)
        return 0

    from paraml.bench.harness import environment, format_table, write_json
    from paraml.planning.sizes import format_bytes

    record: dict[str, object] = {"environment": environment(), "variants": {}}
    if args.workers_only:
        _print_workers(args.workers, record)
        write_json(record, args.json, echo=False)
        return 0
    peaks = {v: _run_marked([sys.executable, __file__, "--peak-run", v])[0] for v in VARIANTS}
    parameter_bytes = LAYERS * (WIDTH * WIDTH + WIDTH) * 4
    times, cpu_times = _step_times(args.windows)
    rows = []
    for variant, found in peaks.items():
        by_device = found["by_device"]
        most = {k: max(b[k] for b in by_device.values()) for k in ("parameters", "optimizer")}
        saved = (int(peaks["shard_optimizer"]["peak"]) - int(found["peak"])) / parameter_bytes
        sent = sent_per_step(variant, parameter_bytes, 4)
        rows.append(
            [variant, format_bytes(most["parameters"]), format_bytes(most["optimizer"])]
            + [
                format_bytes(int(found["peak"])),
                f"{saved:+.2f}",
                f"{times[variant]:.2f}",
                f"{cpu_times[variant]:.2f}",
                format_bytes(sent),
            ]
        )
        record["variants"][variant] = {  # type: ignore[index]
            **found,
            "peak_below_shard_optimizer_per_parameter_byte": saved,
            "step_time_ratio": times[variant],
            "cpu_time_ratio": cpu_times[variant],
            "sent_per_replica_per_step": sent,
        }
    header = ["variant (4 devices)", "parameters / device", "optimizer / device", "peak"]
    header += ["below shard_optimizer (x params)", "step time / unsharded", "CPU time / unsharded"]
    header += ["sent / replica / step"]
    print(f"parameters: {format_bytes(parameter_bytes)}")
    print(format_table(rows, header))
    if args.workers:
        _print_workers(args.workers, record)
    write_json(record, args.json, echo=False)
    return 0


def _print_workers(workers: int, record: dict[str, object]) -> None:
    """Measure and print each worker's figures per variant (:func:`per_worker_peaks`), kept in ``record``."""
    from paraml.bench.harness import format_table

    rows, record["workers"] = per_worker_peaks(workers)
    header = ["variant", "worker", "parameters", "optimizer", "allocated after build", "peak", "step peak"]
    print(format_table(rows, header + ["peak below shard_optimizer (x params)"]))


def _step_times(windows: int) -> tuple[dict[str, float], dict[str, float]]:
    """Each variant's wall time and process CPU time over unsharded's (medians of per-window ratios), the variants
    interleaved."""
    from paraml import Parallel, ensure_devices
    from paraml.bench.harness import interleave, paired

    ensure_devices(4)
    x, y = data(4 * BATCH)
    fits = {}
    for variant, options in VARIANTS.items():
        par = Parallel("mirrored", devices=4, seed=0, **options)
        par.build(model_fn, optimizer="adam", loss="mse")
        par.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # traced before timing
        fits[variant] = lambda p=par: p.fit(x, y, batch_size=BATCH, epochs=1, verbose=0) and None
    times = interleave(fits, windows)
    wall, cpu = ({v: paired(times[v][c], times["unsharded"][c]) for v in VARIANTS} for c in ("wall_s", "cpu_s"))
    return wall, cpu


if __name__ == "__main__":
    sys.exit(main())
