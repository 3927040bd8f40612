"""3 epochs of 40 steps with checkpoint_dir; a callback can send this process SIGTERM at a given global step.

Usage: preempt_train.py STRATEGY DEVICES CKPT_DIR OUT.npz [--sigterm-at STEP] [--dataset]
Prints "step N" for every step it runs (the test counts them) and writes the final weights to OUT.npz.
"""

import argparse
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import paraml  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("strategy")
parser.add_argument("devices", type=int)
parser.add_argument("ckpt")
parser.add_argument("out")
parser.add_argument("--sigterm-at", type=int, default=-1)
parser.add_argument("--dataset", action="store_true", help="a shuffled, repeated tf.data pipeline with steps_per_epoch")
args = parser.parse_args()
paraml.simulate_devices(2)

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from paraml import Parallel  # noqa: E402


class Steps(keras.callbacks.Callback):
    def __init__(self):
        super().__init__()
        self.epoch = 0

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch

    def on_train_batch_end(self, batch, logs=None):
        step = self.epoch * 40 + batch
        print(f"step {step}", flush=True)
        if step == args.sigterm_at:
            os.kill(os.getpid(), signal.SIGTERM)  # what a scheduler does


rng = np.random.default_rng(0)
x = rng.normal(size=(40 * 16, 8)).astype("float32")
y = (x[:, 0] > 0).astype("int32")
par = Parallel(args.strategy, devices=args.devices, seed=5)
par.build(
    lambda: keras.Sequential([keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(2)]),
    optimizer=keras.optimizers.Adam(0.01),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
)
if args.dataset:
    data = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(256, seed=1).repeat().batch(16)
    par.fit(data, epochs=3, steps_per_epoch=40, verbose=0, callbacks=[Steps()], checkpoint_dir=args.ckpt)
else:
    par.fit(x, y, batch_size=16, epochs=3, verbose=0, callbacks=[Steps()], checkpoint_dir=args.ckpt)
np.savez(args.out, *par.model.get_weights())
print("finished", flush=True)
