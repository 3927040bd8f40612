"""What a worker holds while it saves a sharded checkpoint, under ``paraml launch -n 2``.

Each worker trains a model whose state dominates (12 Dense layers of 1024, Adam: 48 MiB of parameters, 96 MiB of
slots) under ``Parallel("multi_worker", shard_optimizer=True)`` for one step, then calls ``par.save``: each worker
writes its own shard of the checkpoint (the tensors it owns, its optimizer slots as they are). Around the save, the
worker's allocator peak (``tf.config.experimental.get_memory_info("CPU:0")``, reset just before; each worker is its own
process, so this is one worker's host memory) is compared with its shard's bytes and the largest tensor, read from the
checkpoint's index: the issue asks that no worker hold more than its own shard plus the largest tensor while saving.

    .venv/bin/python benchmarks/bench_sharded_save.py [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

LAYERS, WIDTH, BATCH = 12, 1024, 64


def model_fn():  # noqa: ANN201
    import keras

    return keras.Sequential([keras.Input((WIDTH,)), *[keras.layers.Dense(WIDTH) for _ in range(LAYERS)]])


def worker(out: Path) -> None:
    """One worker of the launch: train a step, save, write what the save added to its peak."""
    import numpy as np
    import tensorflow as tf

    from paraml import Parallel

    par = Parallel("multi_worker", seed=0, shard_optimizer=True)
    par.build(model_fn, optimizer="adam", loss="mse")
    x = np.random.default_rng(par.worker_index).normal(size=(BATCH, WIDTH)).astype("float32")
    par.fit(x, x, batch_size=BATCH, epochs=1, verbose=0)
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    rss_before = _reset_peak_rss()
    folder = par.save(out / "ckpt")
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    rss_added = _peak_rss() - rss_before if rss_before is not None else None
    index = json.loads((folder / "index.json").read_text())
    sizes = {key: 4 * int(np.prod(entry["shape"])) for key, entry in index["tensors"].items()}
    shard = sum(size for key, size in sizes.items() if index["tensors"][key]["shard"] == par.worker_index)
    record = {
        "worker": par.worker_index,
        "held_before": before,
        "added_by_save": peak - before,
        "rss_added_by_save": rss_added,
        "own_shard": shard,
        "largest_tensor": max(sizes.values()),
        "whole_state": sum(sizes.values()),
    }
    (out / f"worker{par.worker_index}.json").write_text(json.dumps(record))


def _status(field: str) -> int:
    """A field of ``/proc/self/status`` in bytes (Linux)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _reset_peak_rss() -> int | None:
    """Reset the process's peak resident set (Linux: ``/proc/self/clear_refs``) and return the current one, or None
    where that cannot be done."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status("VmRSS")
    except (OSError, KeyError):
        return None


def _peak_rss() -> int:
    return _status("VmHWM")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)  # set by the launch below
    args = parser.parse_args(argv)
    if args.worker:
        worker(Path(args.worker))
        return 0

    from paraml.bench.harness import environment, format_table, write_json
    from paraml.planning.sizes import format_bytes

    out = Path(tempfile.mkdtemp(prefix="bench-sharded-save-"))
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    command = [sys.executable, "-m", "paraml", "launch", "-n", "2", __file__, "--worker", str(out)]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)
    if done.returncode != 0:
        print(done.stdout + done.stderr, file=sys.stderr)
        return done.returncode
    records = [json.loads((out / f"worker{w}.json").read_text()) for w in range(2)]
    rows = [
        [
            str(r["worker"]),
            format_bytes(r["added_by_save"]),
            "-" if r["rss_added_by_save"] is None else format_bytes(r["rss_added_by_save"]),
            format_bytes(r["own_shard"]),
            format_bytes(r["largest_tensor"]),
            format_bytes(r["whole_state"]),
            "yes"
            if max(r["added_by_save"], r["rss_added_by_save"] or 0) <= r["own_shard"] + r["largest_tensor"]
            else "no",
        ]
        for r in records
    ]
    header = ["worker", "allocator peak added", "resident peak added", "own shard", "largest tensor", "whole state"]
    header.append("<= shard + largest")
    print(f"{LAYERS} x Dense({WIDTH}), Adam, shard_optimizer=True, paraml launch -n 2 (each worker its own allocator)")
    print(format_table(rows, header))
    write_json({"environment": environment(), "workers": records}, args.json, echo=bool(args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
