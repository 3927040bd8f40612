"""``fit(..., async_checkpoint=True)`` against synchronous checkpoints: the time of a training step that saves.

A model whose state dominates (12 Dense layers of 1024 and Adam: 48 MiB of parameters, 144 MiB saved per checkpoint)
on one device. Each window is one epoch of 16 steps that checkpoints every 4 steps (``checkpoint_every=4``, plus the
epoch's end): synchronously, in the background, and without checkpoints, the variants interleaved
(:func:`paraml.bench.harness.interleave`). Reported: each variant's epoch time over the one without checkpoints (the
median of per-window ratios), and what one checkpoint costs the training loop, (epoch - no checkpoints) / saves.
A background save still copies the state to host memory before training goes on; the write itself overlaps the next
steps. Every window writes into a fresh directory, so every save is a new checkpoint.

    .venv/bin/python benchmarks/bench_checkpoint.py [--windows 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

LAYERS, WIDTH, BATCH, STEPS, EVERY = 12, 1024, 256, 16, 4


def model_fn():  # noqa: ANN201
    import keras

    return keras.Sequential([keras.Input((WIDTH,)), *[keras.layers.Dense(WIDTH) for _ in range(LAYERS)]])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--windows", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    args = parser.parse_args(argv)

    import numpy as np

    from paraml import Parallel
    from paraml.bench.harness import environment, format_table, interleave, paired, write_json

    rng = np.random.default_rng(0)
    x = rng.normal(size=(BATCH * STEPS, WIDTH)).astype("float32")
    y = rng.normal(size=(BATCH * STEPS, WIDTH)).astype("float32")
    par = Parallel("single", seed=0)
    par.build(model_fn, optimizer="adam", loss="mse")
    par.fit(x, y, batch_size=BATCH, epochs=1, verbose=0)  # traced before timing
    scratch = tempfile.mkdtemp(prefix="bench-checkpoint-")
    count = iter(range(10**6))

    def epoch(**checkpoints: object):  # noqa: ANN202
        def window() -> None:
            folder = os.path.join(scratch, str(next(count))) if checkpoints else None
            par.fit(x, y, batch_size=BATCH, epochs=1, verbose=0, checkpoint_dir=folder, **checkpoints)

        return window

    variants = {
        "no checkpoints": epoch(),
        "synchronous": epoch(checkpoint_every=EVERY, keep=1),
        "async_checkpoint": epoch(checkpoint_every=EVERY, keep=1, async_checkpoint=True),
    }
    times = interleave(variants, args.windows)
    base = times["no checkpoints"]["wall_s"]
    saves = STEPS // EVERY  # every 4 steps, the last at the epoch's end
    rows, record = [], {"environment": environment(), "saves_per_epoch": saves, "variants": {}}
    for name, series in times.items():
        ratio = paired(series["wall_s"], base)
        per_save = sorted((a - b) / saves for a, b in zip(series["wall_s"], base))[len(base) // 2]
        rows.append([name, f"{sorted(series['wall_s'])[len(base) // 2]:.2f} s", f"{ratio:.2f}", f"{per_save:.3f} s"])
        record["variants"][name] = {"wall_s": series["wall_s"], "ratio": ratio, "per_save_s": per_save}  # type: ignore[index]
    print(f"{STEPS} steps of batch {BATCH}, a checkpoint every {EVERY} steps ({saves} per epoch), 144 MiB each")
    print(format_table(rows, ["variant", "epoch (median)", "epoch / no checkpoints", "per save (median)"]))
    write_json(record, args.json, echo=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
