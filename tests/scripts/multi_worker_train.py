"""A worker of `paraml launch`: trains on the digits data with Parallel("multi_worker", shard_optimizer=True) (Adam's
slots split over the workers), saves a checkpoint, breaks its state, restores it, trains on, and saves what it got.

Usage: multi_worker_train.py OUT_DIR [--fail-worker N]
"""

import argparse
import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from own_step import own_step_model  # noqa: E402  (beside this script)

from paraml import Parallel, load_digits  # noqa: E402
from paraml.demo import digits_model  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("out")
parser.add_argument("--fail-worker", type=int, default=-1)
parser.add_argument("--checkpoint-per-worker", action="store_true", help="each worker its own checkpoint_dir")
args = parser.parse_args()

par = Parallel(
    "multi_worker", seed=0, shard_optimizer=True
)  # first: the strategy must exist before TF initialises its devices
print(f"worker {par.worker_index} of {par.num_workers}, chief={par.is_chief}, replicas={par.num_replicas}", flush=True)
if par.worker_index == args.fail_worker:
    raise RuntimeError("this worker fails on purpose")

(x, y), (x_test, y_test) = load_digits()
par.build(
    digits_model,
    optimizer=keras.optimizers.Adam(0.01),
    loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    metrics=["accuracy"],
)
initial = par.model.get_weights()
if args.checkpoint_per_worker:  # storage that is not shared: the chief's dir has checkpoints, the others' do not
    checkpoint_dir = os.path.join(args.out, f"ckpt-worker{par.worker_index}")
    par.fit(x, y, batch_size=64, epochs=1, verbose=0, checkpoint_dir=checkpoint_dir)
    par.fit(x, y, batch_size=64, epochs=2, verbose=0, checkpoint_dir=checkpoint_dir)
    raise SystemExit("resumed although the workers disagree")
history = par.fit(x, y, batch_size=64, epochs=2, verbose=0)
result = par.evaluate(x_test, y_test, batch_size=100)
predictions = par.predict(x_test, batch_size=100)
final = par.model.get_weights()
memory = par.memory_by_device()
par.save(os.path.join(args.out, "ckpt"))  # every worker's slots, whole, in the chief's checkpoint
for variable in par.model.weights + par.model.optimizer.variables:  # lose everything a restore must bring back
    variable.assign(np.zeros(variable.shape, variable.dtype))
par.restore(os.path.join(args.out, "ckpt"))
par.fit(x, y, batch_size=64, epochs=3, initial_epoch=2, verbose=0)
resumed = par.model.get_weights()
par.build(own_step_model, optimizer=keras.optimizers.SGD(0.05))
own_initial = par.model.get_weights()
own_history = par.fit(x, x[:, 0, :2], batch_size=64, epochs=2, shuffle=False, verbose=0)
np.savez(
    os.path.join(args.out, f"worker{par.worker_index}.npz"),
    predictions=predictions,
    loss=history.history["loss"],
    test_accuracy=result["accuracy"],
    **{f"initial{i}": w for i, w in enumerate(initial)},
    **{f"final{i}": w for i, w in enumerate(final)},
    **{f"resumed{i}": w for i, w in enumerate(resumed)},
    optimizer_bytes=[b["optimizer"] for b in memory.values()],
    own_mse=own_history.history["mse"],
    **{f"own_initial{i}": w for i, w in enumerate(own_initial)},
    **{f"own_final{i}": w for i, w in enumerate(par.model.get_weights())},
)
print(f"done: test accuracy {result['accuracy']:.3f}", flush=True)
