"""A worker of `paraml launch`: trains a model with an Embedding (a sparse gradient) and Dense layers under
Parallel("multi_worker", shard_gradients=True) (ZeRO-2: each gradient reduced to its owner by all-to-all) with
gradient accumulation, saves a checkpoint and what it got.

Usage: zero_worker.py OUT_DIR
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def tagger():  # noqa: ANN201  (keras is imported after the strategy)
    import keras

    tokens = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(40, 16)(tokens)
    h = keras.layers.GlobalAveragePooling1D()(h)
    h = keras.layers.Dense(64, activation="relu")(h)
    h = keras.layers.Dense(32, activation="relu")(h)
    return keras.Model(tokens, keras.layers.Dense(3)(h))


def data():  # noqa: ANN201
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.integers(0, 40, (100, 6)).astype("int32"), rng.integers(0, 3, 100)  # a last batch of 4


if __name__ == "__main__":
    from paraml import Parallel

    par = Parallel("multi_worker", seed=2, shard_gradients=True)  # first: before TF initialises its devices
    import keras
    import numpy as np

    x, y = data()
    # with gradient accumulation: its running sums on their owners too, reduced to them across the workers
    optimizer = keras.optimizers.Adam(gradient_accumulation_steps=2)
    par.build(tagger, optimizer=optimizer, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    initial = par.model.get_weights()
    history = par.fit(x, y, batch_size=32, epochs=2, verbose=0)
    par.save(os.path.join(sys.argv[1], "ckpt"))
    np.savez(
        os.path.join(sys.argv[1], f"worker{par.worker_index}.npz"),
        loss=history.history["loss"],
        predictions=par.predict(x),
        optimizer_bytes=[b["optimizer"] for b in par.memory_by_device().values()],
        **{f"initial{i}": w for i, w in enumerate(initial)},
        **{f"final{i}": w for i, w in enumerate(par.model.get_weights())},
    )
