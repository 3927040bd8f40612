"""One worker of ``paraml launch -n 2`` for tests/test_buckets.py: trains a 6x1024 MLP with Adam under
``multi_worker`` and the ZeRO option named by argv[2] ("unsharded", "shard_optimizer", ...), and writes this
process's allocator peak over the training (reset after build) to argv[1]/worker{i}.npz and the checkpoint (every
weight whole, under ``shard_parameters`` too) to argv[1]/ckpt."""

from __future__ import annotations

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from paraml import Parallel  # noqa: E402

LAYERS, WIDTH = 6, 1024


def model_fn():  # noqa: ANN201
    import keras

    return keras.Sequential([keras.Input((WIDTH,)), *[keras.layers.Dense(WIDTH) for _ in range(LAYERS)]])


def data():  # noqa: ANN201
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.normal(size=(256, WIDTH)).astype("float32"), rng.normal(size=(256, WIDTH)).astype("float32")


def main() -> None:
    out, variant = sys.argv[1], sys.argv[2]
    par = Parallel("multi_worker", seed=0, **({} if variant == "unsharded" else {variant: True}))
    import numpy as np
    import tensorflow as tf

    x, y = data()
    par.build(model_fn, optimizer="adam", loss="mse")
    tf.config.experimental.reset_memory_stats("CPU:0")
    par.fit(x, y, batch_size=32, epochs=1, verbose=0)
    peak = tf.config.experimental.get_memory_info("CPU:0")["peak"]
    np.savez(os.path.join(out, f"worker{par.worker_index}.npz"), peak=peak)
    par.save(os.path.join(out, "ckpt"))


if __name__ == "__main__":
    main()
