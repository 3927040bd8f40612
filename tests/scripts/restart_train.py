"""A worker of `paraml launch --max-restarts`: trains with checkpoint_dir and kills itself where it is told to.

Usage: restart_train.py OUT_DIR [--epochs E] [--checkpoint-every N] [--kill RESTART:WORKER:STEP ...] [--pipeline]
                        [--async] [--shard-optimizer] [--hold-after-epoch E]

- Trains digits_model on the digits data with Parallel("multi_worker") and ``fit(checkpoint_dir=OUT_DIR/ckpt)``;
  ``--pipeline``: with Parallel("model_parallel", micro_batches=2) instead, each worker a 2-stage pipeline over its
  2 simulated devices, the workers its data-parallel copies.
- ``--async``: ``fit(..., async_checkpoint=True)``, the checkpoints written in the background.
- ``--shard-optimizer``: ``Parallel("multi_worker", shard_optimizer=True)`` (ZeRO-1 across the workers); the run
  then also saves its final state with ``par.save(OUT_DIR/final)`` (every worker its shard).
- ``--hold-after-epoch E``: on the first run, after epoch E (1-based) every worker waits there until it is sent
  SIGTERM (a launcher resizing the job), then goes on: the loop stops at the next step and saves.
- ``--kill R:W:S``: on run R (``PARAML_RESTART`` == R), worker W SIGKILLs itself right after global step S
  (counted from the start of training over all epochs, 1-based). Several may be given.
- Writes ``OUT_DIR/pid-r{R}-w{W}`` (its PID), appends events to ``OUT_DIR/events.jsonl`` (start, first step, kill,
  done, with global steps; ``benchmarks/bench_faults.py`` times them as they arrive); the chief saves the final
  weights to ``OUT_DIR/weights.npz``, every worker to ``OUT_DIR/weights-w{W}.npz``.
"""

import argparse
import json
import os
import signal
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--checkpoint-every", type=int, default=None)
parser.add_argument("--kill", action="append", default=[], help="RESTART:WORKER:STEP")
parser.add_argument("--pipeline", action="store_true", help="model_parallel: a 2-stage pipeline per worker")
parser.add_argument("--async", dest="background", action="store_true", help="fit(..., async_checkpoint=True)")
parser.add_argument("--shard-optimizer", action="store_true", help="ZeRO-1 across the workers")
parser.add_argument("--hold-after-epoch", type=int, default=None, help="wait for SIGTERM after this epoch (run 0)")
args = parser.parse_args()

RESTART = int(os.environ.get("PARAML_RESTART", "0"))
INDEX = int(os.environ["PARAML_WORKER_INDEX"])


def event(name: str, **fields: object) -> None:
    line = json.dumps({"event": name, "restart": RESTART, "worker": INDEX, **fields})
    with open(os.path.join(args.out, "events.jsonl"), "a") as file:  # one short O_APPEND write: no interleaving
        file.write(line + "\n")


with open(os.path.join(args.out, f"pid-r{RESTART}-w{INDEX}"), "w") as file:
    file.write(str(os.getpid()))
event("start")

kills = set()
for spec in args.kill:
    restart, worker, step = (int(part) for part in spec.split(":"))
    if restart == RESTART and worker == INDEX:
        kills.add(step)

import paraml  # noqa: E402
from paraml import Parallel  # noqa: E402

# First: the strategy must exist before TF initialises its devices (simulating them initialises nothing).
if args.pipeline:
    paraml.simulate_devices(2)
    par = Parallel("model_parallel", seed=0, micro_batches=2)
else:
    par = Parallel("multi_worker", seed=0, shard_optimizer=args.shard_optimizer)

import keras  # noqa: E402
import numpy as np  # noqa: E402

from paraml import load_digits  # noqa: E402
from paraml.demo import digits_model  # noqa: E402


class Faults(keras.callbacks.Callback):
    """Logs the first step of this run and SIGKILLs this process after the chosen global steps."""

    def __init__(self) -> None:
        super().__init__()
        self.epoch, self.first, self.last = 0, True, 0

    def on_train_begin(self, logs=None):
        event("train_begin")  # built, and restored from the checkpoint (fit resumes before its callbacks begin)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_epoch_end(self, epoch, logs=None):
        event("epoch_end", epoch=epoch + 1, step=self.last)
        if RESTART == 0 and args.hold_after_epoch == epoch + 1:
            held = []  # the guard's handler stays in charge: ours only notes that the signal came
            previous = signal.getsignal(signal.SIGTERM)

            def note(signum, frame):
                held.append(signum)
                if callable(previous):
                    previous(signum, frame)

            signal.signal(signal.SIGTERM, note)
            for _ in range(1200):  # at most 2 minutes
                if held:
                    break
                time.sleep(0.1)
            signal.signal(signal.SIGTERM, previous)
            event("released", step=self.last)

    def on_train_batch_end(self, batch, logs=None):
        step = self.last = self.epoch * self.params["steps"] + batch + 1
        if self.first:
            self.first = False
            event("first_step", step=step)
        if step in kills:
            event("kill", step=step)
            print(f"killing myself after step {step}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)


faults = Faults()
(x, y), _ = load_digits()
par.build(digits_model, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
if RESTART == 0 and par.is_chief:
    np.savez(os.path.join(args.out, "initial.npz"), *par.model.get_weights())
par.fit(
    x,
    y,
    batch_size=64,
    epochs=args.epochs,
    verbose=0,
    callbacks=[faults],
    checkpoint_dir=os.path.join(args.out, "ckpt"),
    checkpoint_every=args.checkpoint_every,
    async_checkpoint=args.background,
)
if par.is_chief:
    np.savez(os.path.join(args.out, "weights.npz"), *par.model.get_weights())
if args.shard_optimizer:
    par.save(os.path.join(args.out, "final"))
np.savez(os.path.join(args.out, f"weights-w{INDEX}.npz"), *par.model.get_weights())
event("done", step=faults.last)
print(f"done on run {RESTART}", flush=True)
