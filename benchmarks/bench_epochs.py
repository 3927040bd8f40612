"""The per-epoch cost of small models: paraml's demo workload (digits, global batch 64, shuffled) over many epochs.

A digits epoch is 23 steps of ~2 ms, so what paraml does once per *epoch* (rebuild the epoch's dataset, distribute
it, create a new distributed iterator: ~100 ms together) can cost more than the epoch's steps. Variants, in one
process on 2 simulated devices, interleaved (field notes 9):

  paraml          ``Parallel("mirrored", devices=2).fit(x, y, batch_size=64, epochs=E)``
  paraml 1-iter   the same Parallel with its Trainer patched (in this process only) to keep ONE distributed
                  iterator over a repeated dataset across the epochs of a fit call (a stand-in for the fix: it
                  repeats the first epoch's order instead of reshuffling)
  hand-iterator   the hand-written tutorial loop (benchmarks/common.py HandLoop), distributed dataset built once,
                  a new iterator each epoch (as the tutorial does)
  keras-fit       ``model.fit(..., epochs=E)`` under the same MirroredStrategy

    .venv/bin/python benchmarks/bench_epochs.py [--epochs 10] [--rounds 5] [--json PATH]
"""

from __future__ import annotations

import argparse
import os
import sys
import types
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--epochs", type=int, default=10, help="epochs per timed window (default 10)")
parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (default 5)")
parser.add_argument("--batch-size", type=int, default=64, help="global batch (default 64, as the demo)")
parser.add_argument("--json", metavar="PATH", help="also write the JSON result line to PATH")
ARGS = parser.parse_args()

import paraml  # noqa: E402

DEVICES = paraml.simulate_devices(2)  # first: before anything initialises TensorFlow's devices

from common import (  # noqa: E402
    HandLoop,
    compare,
    environment,
    format_table,
    interleave,
    loss_fn,
    make_model,
    mirrored_strategy,
    optimizer,
    scale,
    summarize,
    write_json,
)

from paraml import Parallel, load_digits  # noqa: E402


def one_iterator(trainer: Any) -> None:
    """Train the epochs of a fit call from ONE distributed iterator instead of a new dataset + iterator per epoch.

    A timing stand-in, not the fix: it repeats the first epoch's batches (``source.dataset(epoch).repeat()``), so
    every epoch sees the same order; each epoch is still exactly ``source.steps`` batches, its last one short. A real
    fix keeps a new order per epoch inside one dataset.
    """
    original = trainer._run_epoch
    state: dict[str, Any] = {}

    def _run_epoch(self: Any, kind: str, source: Any, epoch: int, on_batch: Any, start_step: int = 0) -> Any:
        if kind != "train" or source.steps is None or start_step:
            return original(kind, source, epoch, on_batch, start_step)
        if state.get("source") is not source:
            state.update(source=source, iterator=iter(self.backend.distribute(source.dataset(epoch).repeat())))
        self._reset_metrics()
        logs: dict[str, float] = {}
        step = 0
        while step < source.steps:
            k = min(self.steps_per_execution, source.steps - step)
            logs = {name: float(v) for name, v in self._function(kind, k)(state["iterator"]).items()}
            step += k
            if on_batch is not None and on_batch(step - 1, logs):
                break
        return logs

    trainer._run_epoch = types.MethodType(_run_epoch, trainer)


def main(args: argparse.Namespace) -> int:
    (x, y), _ = load_digits()
    epochs, batch = args.epochs, args.batch_size
    steps = -(-len(x) // batch)
    print(f"digits: {len(x)} samples, global batch {batch} -> {steps} steps/epoch; windows of {epochs} epochs")

    pars = {}
    for name, patch in (("paraml", None), ("paraml 1-iter", one_iterator)):
        par = Parallel("mirrored", devices=2, seed=0)
        par.build(lambda: make_model("digits"), optimizer=optimizer(), loss=loss_fn(), metrics=["accuracy"])
        if patch is not None:
            patch(par._trainer)
        pars[name] = par
    hand = HandLoop(DEVICES, "digits", batch)
    strategy = mirrored_strategy(DEVICES)
    with strategy.scope():
        model = make_model("digits")
        model.compile(optimizer=optimizer(), loss=loss_fn(), metrics=["accuracy"])

    def fit(par: Parallel) -> Any:
        return lambda: par.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=True)

    variants = {name: fit(par) for name, par in pars.items()}
    variants["hand-iterator"] = hand.iterator(x, y, epochs=epochs, shuffle=True)
    variants["keras-fit"] = lambda: model.fit(x, y, batch_size=batch, epochs=epochs, verbose=0, shuffle=True)
    for window in variants.values():  # trace and warm up
        window()
    raw = interleave(variants, args.rounds)
    per_epoch = {name: scale(series, 1e3 / epochs) for name, series in raw.items()}
    stats = {name: summarize(series) for name, series in per_epoch.items()}

    rows = [[n, s["median"], s["min"], s["cpu"], s["median"] / steps] for n, s in stats.items()]
    print(format_table(rows, ["variant", "ms/epoch", "min", "CPU ms/epoch", "ms/step incl. epoch costs"]))
    ratios = {}
    rows = []
    for a, b in (
        ("paraml", "hand-iterator"),
        ("paraml", "keras-fit"),
        ("paraml 1-iter", "paraml"),
        ("paraml 1-iter", "hand-iterator"),
    ):
        r = compare(per_epoch[a], per_epoch[b])
        ratios[f"{a}/{b}"] = {key: round(v, 4) for key, v in r.items()}
        rows.append([f"{a}/{b}", f"{r['median']:.3f}", f"{r['paired']:.3f}", f"{r['min']:.3f}", f"{r['cpu']:.3f}"])
    print()
    print(format_table(rows, ["ratio", "of medians", "paired", "of mins", "CPU"]))
    print(
        "\n'paraml 1-iter' keeps one distributed iterator for all epochs of a fit call (a patched stand-in that\n"
        "repeats the first epoch's order). The gap to 'paraml' is what paraml spends per epoch rebuilding the\n"
        "epoch's dataset, distributing it and creating a new distributed iterator."
    )
    write_json(
        {
            "benchmark": "epochs",
            "model": "digits",
            "global_batch": batch,
            "steps_per_epoch": steps,
            "epochs_per_window": epochs,
            "rounds": args.rounds,
            "ms_per_epoch": {n: {key: round(v, 3) for key, v in s.items()} for n, s in stats.items()},
            "ratios": ratios,
            "env": environment(),
        },
        args.json,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(ARGS))
