"""TensorFlow's "Multi-worker training with Keras" flow on paraml: an infinite shuffled, repeated dataset,
``epochs=4, steps_per_epoch=10, checkpoint_dir=...``. Run with ``paraml launch -n 2``.

Usage: multi_worker_tutorial.py OUT_DIR [--sigterm-at STEP]
- ``--sigterm-at S``: worker 1 sends itself SIGTERM after global step S (0-based), as a scheduler would.
Prints "epoch E begins" and "step S"; each worker saves its final weights to OUT_DIR/w{index}.npz.
"""

import argparse
import os
import signal

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--sigterm-at", type=int, default=-1)
args = parser.parse_args()

from paraml import Parallel  # noqa: E402

par = Parallel("multi_worker", seed=0)  # first: the strategy must exist before TF initialises its devices

import keras  # noqa: E402
import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

from paraml import load_digits  # noqa: E402
from paraml.demo import digits_model  # noqa: E402


class Faults(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        self.epoch = epoch
        print(f"epoch {epoch} begins", flush=True)

    def on_train_batch_end(self, batch, logs=None):
        step = self.epoch * 10 + batch
        print(f"step {step}", flush=True)
        if step == args.sigterm_at and par.worker_index == 1:
            os.kill(os.getpid(), signal.SIGTERM)


par.build(digits_model, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
(x, y), _ = load_digits()
dataset = tf.data.Dataset.from_tensor_slices((x, y)).shuffle(1000, seed=7).repeat().batch(64)
par.fit(
    dataset,
    epochs=4,
    steps_per_epoch=10,
    verbose=0,
    callbacks=[Faults()],
    checkpoint_dir=os.path.join(args.out, "ckpt"),
)
np.savez(os.path.join(args.out, f"w{par.worker_index}.npz"), *par.model.get_weights())
print("finished", flush=True)
