"""``model_parallel`` with ``data_parallel=R``: R copies of the pipeline on disjoint devices, each on its slice of the
global batch, gradients averaged; and one pipeline per worker of a cluster, the workers its data-parallel copies."""

import os
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import logits_loss
from test_model_parallel import gpt2, token_data, token_loss

from paraml import Parallel, load_digits
from paraml.demo import digits_model

SCRIPTS = Path(__file__).parent / "scripts"


def mlp():
    return keras.Sequential(
        [keras.Input((8,)), *[keras.layers.Dense(32, activation="relu") for _ in range(3)], keras.layers.Dense(3)]
    )


def mlp_data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(100, 8)).astype("float32")  # 100 rows in batches of 32: a last batch of 4
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")


def trained(strategy, model_fn, data, loss, **options):
    par = Parallel(strategy, seed=0, **options)
    par.build(model_fn, optimizer=keras.optimizers.SGD(0.05), loss=loss)
    history = par.fit(*data, batch_size=options.pop("batch_size", 32), epochs=2, verbose=0)
    return par, history.history["loss"]


@pytest.mark.parametrize(
    "model_fn, data, loss",
    [(mlp, mlp_data, logits_loss()), (gpt2, token_data, token_loss)],
    ids=["mlp", "gpt2"],
)
@pytest.mark.slow
def test_two_pipelines_of_two_stages_train_as_single_on_the_global_batch(model_fn, data, loss):
    reference, want = trained("single", model_fn, data(), loss)
    par, got = trained("model_parallel", model_fn, data(), loss, devices=4, data_parallel=2, micro_batches=2)
    np.testing.assert_allclose(got, want, rtol=1e-4)
    for a, b in zip(par.model.get_weights(), reference.model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    x = data()[0]
    np.testing.assert_allclose(par.predict(x), reference.predict(x), rtol=1e-4, atol=1e-5)

    assert par.num_replicas == 2 and par.backend.topology.layout.stages == 2
    grid = par.backend.grid
    assert grid == (par.devices[:2], par.devices[2:])  # pipeline r on devices 2r, 2r + 1
    stage_of = {id(v): grid[0].index(device) for _, layer, device in par.backend.placement for v in layer.variables}
    for v in par.model.weights:  # each copy of a variable on its stage's device of its pipeline
        copies = [c.device.split("device:")[-1] for c in v.value.values]
        stage = stage_of.get(id(v), 0)
        assert copies == [pipeline[stage].split("device:")[-1] for pipeline in grid], (v.path, copies)
    by_device = par.memory_by_device()
    for s in range(2):  # the copies of a stage hold the same bytes
        assert by_device[grid[0][s]]["parameters"] == by_device[grid[1][s]]["parameters"] > 0
    text = par.describe()
    assert "2 data replicas x 2 stages" in text and f"pipeline 1: {', '.join(grid[1])}" in text


def test_layouts_that_do_not_divide_the_devices_are_refused():
    with pytest.raises(ValueError, match=r"devices=3 is not a multiple of data_parallel=2: .* use 2 devices"):
        Parallel("model_parallel", devices=3, data_parallel=2)
    with pytest.raises(ValueError, match=r"data_parallel must be .*got 0"):
        Parallel("model_parallel", devices=2, data_parallel=0)
    with pytest.raises(ValueError, match=r"unknown option 'data_parallel'"):
        Parallel("mirrored", devices=2, data_parallel=2)
    with pytest.raises(ValueError, match="devices=8 asks for more devices than exist"):
        Parallel("model_parallel", devices=8, data_parallel=2)


@pytest.mark.slow
def test_a_pipeline_per_worker_trains_as_single_and_resumes_after_a_killed_worker(tmp_path):
    """paraml launch -n 2 --max-restarts 1, each worker a 2-stage pipeline over its 2 devices (micro_batches=2);
    worker 1 SIGKILLs itself in epoch 2: the job restarts, resumes from the checkpoint, and both workers end with the
    weights of single on the global batches."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    command = [sys.executable, "-m", "paraml", "launch", "-n", "2", "--stop-timeout", "2", "--max-restarts", "1"]
    script = [str(SCRIPTS / "restart_train.py"), str(tmp_path), "--pipeline", "--epochs", "2", "--kill", "0:1:30"]
    done = subprocess.run([*command, *script], capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert "worker 1 was killed by SIGKILL (exit code 137); restart 1 of 1" in done.stderr
    assert "[worker 0] paraml: resumed from" in done.stdout  # at the end of epoch 1, not from the start

    (x, y), _ = load_digits()
    single = Parallel("single", seed=0)
    single.build(digits_model, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    single.fit(x, y, batch_size=64, epochs=2, verbose=0)
    workers = [np.load(tmp_path / f"weights-w{i}.npz") for i in range(2)]
    for i, want in enumerate(single.model.get_weights()):
        np.testing.assert_array_equal(workers[0][f"arr_{i}"], workers[1][f"arr_{i}"])
        np.testing.assert_allclose(workers[0][f"arr_{i}"], want, rtol=1e-4, atol=1e-5)
