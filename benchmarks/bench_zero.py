"""``shard_optimizer=True``: optimizer bytes per device and step time under ``mirrored``, and each worker's
memory peak under ``multi_worker``, against unsharded.

A model whose state dominates (six Dense layers of 1024, Adam). ``mirrored`` on N = 2 and 4 devices (GPUs when the
machine has 4, else logical CPUs): bytes per device read from where the variables live
(:meth:`paraml.Parallel.memory_by_device`); step times measured in one process with the sharded and unsharded
variants interleaved (:func:`paraml.bench.harness.interleave`), reported as the median of per-window ratios (sharded /
unsharded). On logical CPUs all devices share one allocator and two
cores, so the time ratio is the overhead of the owner's update and its broadcast, not a GPU's.

``--workers 2``: ``paraml launch -n 2`` of this file once unsharded and once sharded; each worker process (one
allocator each) reports from its first device's allocator (``get_memory_info``) what is allocated after build (the
weights and the optimizer state), the peak of a first epoch (the process's peak: build, tracing, 8 steps) and the
median of the next epoch's per-step peaks.

    .venv/bin/python benchmarks/bench_zero.py [--windows 5] [--workers 2] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


MARKER = "bench_zero worker: "


def model_fn():  # noqa: ANN201  (keras is imported late: the strategy comes first under multi_worker)
    import keras

    return keras.Sequential([keras.Input((1024,)), *[keras.layers.Dense(1024) for _ in range(6)]])


def data():  # noqa: ANN201
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.normal(size=(256, 1024)).astype("float32"), rng.normal(size=(256, 1024)).astype("float32")


def worker(shard: bool) -> None:
    """One worker of ``paraml launch``: train, then print this process's allocator figures and its variables' bytes:
    ``state`` (allocated after build), ``peak`` (over the whole run) and ``step_peak`` (the median of each step's)."""
    import json
    import statistics

    from paraml import Parallel

    par = Parallel("multi_worker", seed=0, shard_optimizer=shard)  # first: before TensorFlow lists its devices
    import keras
    import numpy as np
    import tensorflow as tf

    step_peaks = []

    class StepPeak(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch: int, logs: object = None) -> None:
            tf.config.experimental.reset_memory_stats(device)

        def on_train_batch_end(self, batch: int, logs: object = None) -> None:
            step_peaks.append(tf.config.experimental.get_memory_info(device)["peak"])

    device = "GPU:0" if tf.config.list_physical_devices("GPU") else "CPU:0"
    x, y = (np.concatenate([a] * 4) for a in data())
    par.build(model_fn, optimizer="adam", loss="mse")
    state = tf.config.experimental.get_memory_info(device)["current"]
    par.fit(x, y, batch_size=128, epochs=1, verbose=0)
    peak = tf.config.experimental.get_memory_info(device)["peak"]
    par.fit(x, y, batch_size=128, epochs=1, verbose=0, callbacks=[StepPeak()])
    (by_device,) = par.memory_by_device().values()
    figures = {"state": state, "peak": peak, "step_peak": statistics.median(step_peaks)}
    print(MARKER + json.dumps({"worker": par.worker_index, **figures, **by_device}), flush=True)


def per_worker_peaks(workers: int) -> tuple[list[list[str]], dict[str, object]]:
    """Each worker's peak, unsharded and sharded, from two ``paraml launch`` runs (one per variant)."""
    from paraml.bench.harness import marked_results, run_process
    from paraml.planning.sizes import format_bytes

    found = {}
    for shard in (False, True):
        command = [sys.executable, "-m", "paraml", "launch", "-n", str(workers), __file__, "--worker-run", str(shard)]
        done = run_process(command, 600)
        if done.code != 0:
            raise RuntimeError(f"{' '.join(command)} failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
        found[shard] = sorted(marked_results(done.stdout, MARKER), key=lambda r: r["worker"])
    rows = []
    for plain, sharded in zip(found[False], found[True]):
        rows.append([str(plain["worker"]), format_bytes(plain["parameters"])])
        for figure in ("optimizer", "state", "peak", "step_peak"):
            saved = (plain[figure] - sharded[figure]) / plain["parameters"]
            rows[-1].append(f"{format_bytes(plain[figure])} -> {format_bytes(sharded[figure])} ({saved:.2f})")
    return rows, {"unsharded": found[False], "sharded": found[True]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--workers", type=int, default=0, help="also measure each worker's peak under launch -n N")
    parser.add_argument("--worker-run", choices=("False", "True"), help=argparse.SUPPRESS)  # one launched worker
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    args = parser.parse_args(argv)
    if args.worker_run is not None:
        worker(args.worker_run == "True")
        return 0

    from paraml import Parallel, ensure_devices

    ensure_devices(4)  # 4 GPUs when the machine has them, else 4 logical CPUs
    from paraml.bench.harness import environment, format_table, interleave, paired, write_json
    from paraml.planning.sizes import format_bytes

    x, y = data()
    record: dict[str, object] = {"environment": environment(), "devices": {}}
    rows = []
    for n in (2, 4):
        fits, bytes_by = {}, {}
        for shard in (False, True):
            par = Parallel("mirrored", devices=n, seed=0, shard_optimizer=shard)
            par.build(model_fn, optimizer="adam", loss="mse")
            par.fit(x, y, batch_size=128, epochs=1, verbose=0)  # traced before timing
            bytes_by[shard] = par.memory_by_device()
            fits[f"shard={shard}"] = lambda p=par: p.fit(x, y, batch_size=128, epochs=1, verbose=0) and None
        times = interleave(fits, args.windows)
        ratio = paired(times["shard=True"]["wall_s"], times["shard=False"]["wall_s"])
        most = {s: max(b["optimizer"] for b in bytes_by[s].values()) for s in (False, True)}
        params = max(b["parameters"] for b in bytes_by[True].values())
        rows.append([str(n), format_bytes(params), format_bytes(most[False]), format_bytes(most[True]), f"{ratio:.2f}"])
        record["devices"][str(n)] = {  # type: ignore[index]
            "parameters_per_device": params,
            "optimizer_per_device": most[False],
            "sharded_optimizer_per_device": most[True],
            "step_time_ratio": ratio,
            "memory_by_device": {str(s): bytes_by[s] for s in (False, True)},
        }
    header = ["devices", "parameters / device", "optimizer / device", "sharded: most on a device", "step time"]
    print(format_table(rows, header))
    if args.workers:
        rows, record["workers"] = per_worker_peaks(args.workers)
        header = ["worker", "parameters", "optimizer bytes", "allocated after build", "process peak", "step peak"]
        print("each: unsharded -> sharded (saved / parameter bytes)")
        print(format_table(rows, header))
    write_json(record, args.json, echo=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
