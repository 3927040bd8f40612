"""Trains on the digits data with checkpoint_dir; prints progress markers the crash test waits for.

Usage: resumable_train.py CKPT_DIR OUT.npz [--slow-epoch N] [--save-loop]
"""

import argparse
import os
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402

from paraml import Parallel, load_digits  # noqa: E402
from paraml.demo import digits_model  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("ckpt")
parser.add_argument("out")
parser.add_argument("--slow-epoch", type=int, default=-1)
parser.add_argument("--save-loop", action="store_true")
args = parser.parse_args()


class Marker(keras.callbacks.Callback):
    def on_epoch_begin(self, epoch, logs=None):
        print(f"epoch {epoch} begins", flush=True)
        if epoch == args.slow_epoch:
            time.sleep(300)  # the test kills the process here


par = Parallel("mirrored", devices=1, seed=3)
par.build(digits_model, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
(x, y), _ = load_digits()
if args.save_loop:  # save again and again; the test kills the process at some point during a save
    for i in range(1000):
        par.save(args.ckpt, keep=2)
        print(f"saved {i}", flush=True)
else:
    par.fit(x, y, batch_size=64, epochs=5, verbose=0, callbacks=[Marker()], checkpoint_dir=args.ckpt)
    np.savez(args.out, *par.model.get_weights())
    print("finished", flush=True)
