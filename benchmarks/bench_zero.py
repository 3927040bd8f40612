"""``shard_optimizer=True`` under ``mirrored``: optimizer bytes per device and step time, against unsharded.

A model whose state dominates (six Dense layers of 1024, Adam) on N = 2 and 4 simulated devices. Bytes per device
are read from where the variables live (:meth:`paraml.Parallel.memory_by_device`). Step times are measured in one
process with the sharded and unsharded variants interleaved (:func:`paraml.benchmark.interleave`), reported as the
median of per-window ratios (sharded / unsharded). On logical CPUs all devices share one allocator and two cores,
so the time ratio is the overhead of the owner's update and its broadcast, not a GPU's.

    .venv/bin/python benchmarks/bench_zero.py [--windows 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    args = parser.parse_args(argv)

    from paraml import Parallel, simulate_devices

    simulate_devices(4)
    import keras
    import numpy as np

    from paraml.benchmark import environment, format_table, interleave, paired, write_json
    from paraml.sizes import format_bytes

    def model_fn() -> keras.Model:
        return keras.Sequential([keras.Input((1024,)), *[keras.layers.Dense(1024) for _ in range(6)]])

    rng = np.random.default_rng(0)
    x = rng.normal(size=(256, 1024)).astype("float32")
    y = rng.normal(size=(256, 1024)).astype("float32")
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
    write_json(record, args.json, echo=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
