"""A worker of `paraml launch` for resharding: an MLP under Parallel("multi_worker", shard_parameters=True) (ZeRO-3
across the workers) on the digits data.

Usage: reshard_worker.py OUT_DIR write    one epoch from the saved start, a checkpoint at its end (OUT_DIR/ckpt)
       reshard_worker.py OUT_DIR resume   restore OUT_DIR/ckpt (written by any number of workers), measuring this
                                          worker's allocator peak during the restore, then the second epoch
"""

import json
import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def mlp():  # noqa: ANN201  (keras is imported after the strategy)
    """Five kernels of 256 KiB to 1 MiB: the state dwarfs what a step allocates, no tensor dwarfs a worker's share."""
    import keras

    dense = [keras.layers.Dense(512, activation="relu") for _ in range(3)]
    return keras.Sequential([keras.Input((8, 8, 1)), keras.layers.Flatten(), *dense, keras.layers.Dense(10)])


def loss():  # noqa: ANN201
    import keras

    return keras.losses.SparseCategoricalCrossentropy(from_logits=True)


if __name__ == "__main__":
    from paraml import Parallel

    out, phase = sys.argv[1], sys.argv[2]
    par = Parallel("multi_worker", seed=0, shard_parameters=True)  # first: before TF initialises its devices
    import keras
    import tensorflow as tf

    from paraml import load_digits

    (x, y), _ = load_digits()
    par.build(mlp, optimizer=keras.optimizers.Adam(1e-3), loss=loss())
    checkpoint = os.path.join(out, "ckpt")
    if phase == "write":
        par.restore(os.path.join(out, "initial"))  # the test's start, written by one process
        par.fit(x, y, batch_size=64, epochs=1, verbose=0, checkpoint_dir=checkpoint)
        raise SystemExit(0)
    held = sum(sum(b.values()) for b in par.memory_by_device().values())  # this worker's share, where it lives
    tf.config.experimental.reset_memory_stats("CPU:0")
    before = tf.config.experimental.get_memory_info("CPU:0")["current"]
    state = par.restore(checkpoint)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    par.fit(x, y, batch_size=64, epochs=2, initial_epoch=state.epoch, verbose=0)
    par.save(os.path.join(out, "final"))
    record = {"worker": par.worker_index, "held": held, "restore_peak": peak - before, "epoch": state.epoch}
    with open(os.path.join(out, f"resumed-w{par.worker_index}.json"), "w") as file:
        json.dump(record, file)
