"""A worker of `paraml launch`: trains an MLP under Parallel("multi_worker", shard_parameters=True) (ZeRO-3 across
workers: each worker holds the weights its replica owns, each unit gathers its weights where it runs), saving a
checkpoint before training and one after, and what it got.

Usage: zero3_worker.py OUT_DIR
"""

import os
import sys

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")


def mlp():  # noqa: ANN201  (keras is imported after the strategy)
    import keras

    # each Dense's kernel and bias have different owners; so have LayerNormalization's gamma and beta
    dense = [keras.layers.Dense(48, activation="gelu") for _ in range(4)]
    return keras.Sequential([keras.Input((12,)), keras.layers.LayerNormalization(), *dense, keras.layers.Dense(3)])


def adam():  # noqa: ANN201
    """Adam with an average of the weights (each average on its variable's owner) and gradient accumulation (each
    running sum there too)."""
    import keras

    return keras.optimizers.Adam(0.01, use_ema=True, gradient_accumulation_steps=2)


def data():  # noqa: ANN201
    import numpy as np

    rng = np.random.default_rng(0)
    return rng.normal(size=(100, 12)).astype("float32"), rng.integers(0, 3, 100)  # a last batch of 4


if __name__ == "__main__":
    import paraml
    from paraml import Parallel

    par = Parallel("multi_worker", seed=2, shard_parameters=True)  # first: before TF initialises its devices
    import keras
    import numpy as np

    x, y = data()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    par.build(mlp, optimizer=adam(), loss=loss)
    par.save(os.path.join(sys.argv[1], "initial"))
    history = par.fit(x, y, batch_size=32, epochs=2, verbose=0)
    par.save(os.path.join(sys.argv[1], "ckpt"))
    np.savez(
        os.path.join(sys.argv[1], f"worker{par.worker_index}.npz"),
        paraml=paraml.__file__,
        loss=history.history["loss"],
        predictions=par.predict(x),
        parameter_bytes=[b["parameters"] for b in par.memory_by_device().values()],
    )
