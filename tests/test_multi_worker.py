"""multi_worker: real 2-worker runs through `paraml launch`.

Each worker is its own process: MultiWorkerMirroredStrategy must be created before TensorFlow initialises its devices,
which a test process has long done (docs/tensorflow-notes.md).
"""

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import keras
import numpy as np
import pytest
import tensorflow as tf

from paraml import Parallel, load_digits
from paraml.bench.harness import run_process
from paraml.cluster.config import ClusterConfigError, make_tf_config
from paraml.cluster.launch import find_free_ports
from paraml.demo import digits_model
from paraml.loop.checkpoint import inspect_checkpoint, latest_checkpoint

pytestmark = pytest.mark.slow  # every test starts worker processes
SCRIPT = Path(__file__).parent / "scripts" / "multi_worker_train.py"


def run_launch(*args, timeout=240):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    return subprocess.run(
        [sys.executable, "-m", "paraml", "launch", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.fixture(scope="module")
def two_workers(tmp_path_factory):
    out = tmp_path_factory.mktemp("mw")
    done = run_launch("-n", "2", str(SCRIPT), str(out))
    assert done.returncode == 0, done.stdout + done.stderr
    return done, [np.load(out / f"worker{i}.npz") for i in range(2)], out


def weights(saved, prefix):
    return [saved[f"{prefix}{i}"] for i in range(sum(k.startswith(prefix) for k in saved.files))]


def test_launch_streams_prefixed_output(two_workers):
    done, _, _ = two_workers
    assert "[worker 0] worker 0 of 2, chief=True, replicas=2" in done.stdout
    assert "[worker 1] worker 1 of 2, chief=False, replicas=2" in done.stdout


def test_both_workers_end_with_identical_weights(two_workers):
    _, (w0, w1), _ = two_workers
    for a, b in zip(weights(w0, "final"), weights(w1, "final")):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(w0["predictions"], w1["predictions"])


def test_multi_worker_equals_single_on_the_same_global_batches(two_workers):
    _, (w0, _), _ = two_workers
    (x, y), (x_test, y_test) = load_digits()
    par = Parallel("single", seed=0)
    par.build(
        digits_model,
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        metrics=["accuracy"],
    )
    par.model.set_weights(weights(w0, "initial"))
    history = par.fit(x, y, batch_size=64, epochs=2, verbose=0)
    for got, want in zip(weights(w0, "final"), par.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(w0["loss"], history.history["loss"], rtol=1e-4)
    # predict gathers both workers' shards back into input order (359 test samples: an uneven last batch)
    np.testing.assert_allclose(w0["predictions"], par.predict(x_test, batch_size=100), rtol=1e-4, atol=1e-5)
    assert float(w0["test_accuracy"]) == pytest.approx(par.evaluate(x_test, y_test, batch_size=100)["accuracy"])


def test_sharded_optimizer_state_across_workers_trains_and_resumes_as_unsharded_mirrored(two_workers):
    """The workers shard Adam's slots (shard_optimizer=True): each holds about half, the weights and losses equal
    unsharded mirrored training on 2 devices, the chief's checkpoint holds every slot whole (it restores under
    single), and a restore into the sharded workers trains on exactly."""
    _, (w0, w1), out = two_workers
    (x, y), _ = load_digits()
    par = Parallel("mirrored", devices=2, seed=0)
    par.build(
        digits_model,
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    par.model.set_weights(weights(w0, "initial"))
    history = par.fit(x, y, batch_size=64, epochs=2, verbose=0)
    np.testing.assert_allclose(w0["loss"], history.history["loss"], rtol=1e-5)
    for got, want in zip(weights(w0, "final"), par.model.get_weights()):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    state = [v.numpy() for v in par.model.optimizer.variables]
    one_copy = next(iter(par.memory_by_device().values()))["optimizer"]
    shards = [int(w["optimizer_bytes"][0]) for w in (w0, w1)]  # each worker's one device
    scalars = sum(v.nbytes for v in state if v.ndim == 0)  # the step count and learning rate, on every worker
    assert sum(shards) - scalars == one_copy and max(shards) < 0.6 * one_copy

    single = Parallel("single", seed=0)
    single.build(
        digits_model,
        optimizer=keras.optimizers.Adam(0.01),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    single.restore(out / "ckpt")
    for got, want in zip(single.model.optimizer.variables, state):
        np.testing.assert_allclose(got.numpy(), want, rtol=1e-5, atol=1e-7)
    par.fit(x, y, batch_size=64, epochs=3, initial_epoch=2, verbose=0)
    for mine, other, want in zip(weights(w0, "resumed"), weights(w1, "resumed"), par.model.get_weights()):
        np.testing.assert_array_equal(mine, other)
        np.testing.assert_allclose(mine, want, rtol=1e-5, atol=1e-7)


def test_each_worker_writes_its_own_shard_of_the_checkpoint(two_workers):
    """par.save across 2 workers with shard_optimizer: one folder, a shard per worker and a small index; each Adam
    slot is written by the worker that holds it (no gather), the replicated weights split about evenly, and no tensor
    is written twice."""
    _, _, out = two_workers
    folder = latest_checkpoint(out / "ckpt")
    assert sorted(p.name for p in folder.iterdir()) == ["index.json", "shard-00000", "shard-00001"]
    index = json.loads((folder / "index.json").read_text())
    assert index["shards"] == 2 and index["optimizer_class"] == "Adam"
    written = {w: set(tf.train.load_checkpoint(str(folder / f"shard-{w:05d}" / "ckpt")).get_variable_to_shape_map())
               for w in range(2)}  # fmt: skip
    keys = {w: {k.split("/")[0] for k in found if "/.ATTRIBUTES/" in k} for w, found in written.items()}
    assert not keys[0] & keys[1] and keys[0] | keys[1] == set(index["tensors"])
    for key, entry in index["tensors"].items():
        assert key in keys[entry["shard"]]
    slots = [k for k in index["tensors"] if k.startswith("optimizer_") and index["tensors"][k]["shape"]]
    assert {index["tensors"][k]["shard"] for k in slots} == {0, 1}  # both workers' slots, each by its holder
    weight_bytes = [0, 0]
    for key, entry in index["tensors"].items():
        if key.startswith("model_"):
            weight_bytes[entry["shard"]] += 4 * int(np.prod(entry["shape"]))
    assert max(weight_bytes) < 0.75 * sum(weight_bytes), weight_bytes
    assert "in 2 shards, one per worker" in inspect_checkpoint(folder).describe()


def test_a_models_own_train_step_runs_on_every_worker_as_in_keras(two_workers):
    _, (w0, w1), _ = two_workers
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from own_step import own_step_model  # the workers' model
    finally:
        sys.path.pop(0)
    (x, _), _ = load_digits()
    model = own_step_model()
    model.set_weights(weights(w0, "own_initial"))
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    history = model.fit(x, x[:, 0, :2], batch_size=64, epochs=2, shuffle=False, verbose=0)
    for mine, other, want in zip(weights(w0, "own_final"), weights(w1, "own_final"), model.get_weights()):
        np.testing.assert_array_equal(mine, other)
        np.testing.assert_allclose(mine, want, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(w0["own_mse"], history.history["mse"], rtol=1e-4)


def _run_together(commands_and_envs, timeout=240):
    """Start every (command, extra env) at once, as one cluster's processes (no TF_CONFIG); wait for all."""
    with ThreadPoolExecutor(len(commands_and_envs)) as pool:
        return list(pool.map(lambda c: run_process(c[0], timeout, env={**os.environ, **c[1]}), commands_and_envs))


def _assert_same_final_weights(out, two_workers):
    want = two_workers[1][0]  # worker 0's saved weights (the fixture's second item)
    for i in range(2):
        got = np.load(out / f"worker{i}.npz")
        for a, b in zip(weights(got, "final"), weights(want, "final")):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


def test_the_same_script_under_slurm_variables_ends_with_launchs_weights(tmp_path, two_workers):
    """srun's variables, synthesised for 2 tasks on this machine: no TF_CONFIG, the same weights as paraml launch."""
    port = find_free_ports(1)[0]
    slurm = {
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_JOB_ID": "1",
        "PARAML_PORT": str(port),
    }
    runs = _run_together(
        [([sys.executable, str(SCRIPT), str(tmp_path)], {**slurm, "SLURM_PROCID": str(i)}) for i in range(2)]
    )
    assert [run.code for run in runs] == [0, 0], runs
    assert "worker 1 of 2, chief=False, replicas=2" in runs[1].stdout
    _assert_same_final_weights(tmp_path, two_workers)


def test_launch_on_two_nodes_equals_launch_on_one(tmp_path, two_workers):
    """`paraml launch --nnodes 2 --node-rank R --master 127.0.0.1:PORT -n 1`, two "nodes" on this machine."""
    master = f"127.0.0.1:{find_free_ports(1)[0]}"
    launch = [sys.executable, "-m", "paraml", "launch", "--nnodes", "2", "--master", master, "-n", "1"]
    runs = _run_together([([*launch, "--node-rank", str(r), str(SCRIPT), str(tmp_path)], {}) for r in range(2)])
    assert [run.code for run in runs] == [0, 0], runs
    assert "[worker 1] worker 1 of 2, chief=False, replicas=2" in runs[1].stdout
    _assert_same_final_weights(tmp_path, two_workers)


def test_a_failing_worker_stops_the_run(tmp_path):
    # worker 1 raises after start-up; worker 0 waits in a collective: the launcher must stop it, not hang
    done = run_launch("-n", "2", "--stop-timeout", "5", str(SCRIPT), str(tmp_path), "--fail-worker", "1", timeout=60)
    assert done.returncode != 0
    assert "this worker fails on purpose" in done.stdout + done.stderr
    assert "worker 1 exited with code 1" in done.stdout + done.stderr
    leftovers = subprocess.run(["pgrep", "-f", f"{SCRIPT} {tmp_path}"], capture_output=True, text=True)
    assert leftovers.stdout.strip() == ""


@pytest.mark.parametrize(
    "value, fault",
    [
        ("{not json", "not valid JSON"),
        ('{"cluster": {"ps": ["127.0.0.1:1"]}, "task": {"type": "ps", "index": 0}}', "worker"),
        (make_tf_config(["127.0.0.1:2222", "127.0.0.1:2223"], 0).replace('"index": 0', '"index": 5'), "index"),
    ],
)
def test_malformed_tf_config_is_a_clear_error(monkeypatch, value, fault):
    monkeypatch.setenv("TF_CONFIG", value)
    with pytest.raises(ClusterConfigError, match=rf"TF_CONFIG.*{fault}|{fault}.*TF_CONFIG"):
        Parallel("multi_worker")


def test_missing_tf_config_says_how_to_launch(monkeypatch):
    monkeypatch.delenv("TF_CONFIG", raising=False)
    with pytest.raises(ClusterConfigError, match="paraml launch"):
        Parallel("multi_worker")


def test_multi_worker_rejects_devices_and_bad_options(monkeypatch):
    monkeypatch.setenv("TF_CONFIG", make_tf_config(["127.0.0.1:2222"], 0))
    with pytest.raises(ValueError, match="uses each worker's local devices"):
        Parallel("multi_worker", devices=2)
    with pytest.raises(ValueError, match="communication must be one of 'auto', 'ring', 'nccl', got 'mpi'"):
        Parallel("multi_worker", communication="mpi")


def test_resuming_from_storage_the_workers_do_not_share_fails_clearly(tmp_path):
    done = run_launch("-n", "2", str(SCRIPT), str(tmp_path), "--checkpoint-per-worker", timeout=120)
    assert done.returncode != 0
    # each worker writes its shard of a checkpoint: a worker that does not see the chief's folder is named at once
    assert "must be on storage every worker sees: worker(s) [1] do not see the folder the chief made" in done.stdout
    assert "resumed although" not in done.stdout + done.stderr


TUTORIAL = Path(__file__).parent / "scripts" / "multi_worker_tutorial.py"


def test_tutorial_flow_survives_a_sigterm(tmp_path):
    """TF's multi-worker tutorial (infinite shuffled dataset, steps_per_epoch, checkpoint_dir) on 2 workers: a SIGTERM
    to one worker stops both at the same step with exit 143; the rerun resumes where the checkpoint says and both
    workers end with the uninterrupted weights. (A killed worker's launch: tests/test_launch.py.)"""
    reference = tmp_path / "reference"
    reference.mkdir()
    done = run_launch("-n", "2", str(TUTORIAL), str(reference))
    assert done.returncode == 0, done.stdout + done.stderr
    want = [np.load(reference / f"w{i}.npz") for i in range(2)]

    out = tmp_path / "faulty"
    out.mkdir()
    stopped = run_launch("-n", "2", str(TUTORIAL), str(out), "--sigterm-at", "14")
    assert stopped.returncode == 143, stopped.stdout + stopped.stderr
    for worker in (0, 1):  # both stopped at the step after the signal, together
        steps = [int(line.split()[-1]) for line in stopped.stdout.splitlines() if f"[worker {worker}] step" in line]
        assert steps[-1] == 15, stopped.stdout
    saved = [line.split("] ", 1)[1] for line in stopped.stdout.splitlines() if "checkpoint saved to" in line]
    assert len(saved) == 2 and len(set(saved)) == 1, saved  # every worker names the chief's checkpoint
    resumed = run_launch("-n", "2", str(TUTORIAL), str(out))
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    said = [line.split("] ", 1)[1] for line in resumed.stdout.splitlines() if "paraml: resumed from" in line]
    assert len(said) == 2 and len(set(said)) == 1, said  # once per worker, the same checkpoint
    epochs = [line for line in resumed.stdout.splitlines() if line.startswith("[worker 0] epoch")]
    assert epochs == ["[worker 0] epoch 1 begins", "[worker 0] epoch 2 begins", "[worker 0] epoch 3 begins"]
    first = [line for line in resumed.stdout.splitlines() if line.startswith("[worker 0] step")][0]
    assert first == "[worker 0] step 16", first  # mid epoch 1, after step 15, where the signal stopped both
    for i in range(2):
        got = np.load(out / f"w{i}.npz")
        for key in want[i].files:
            np.testing.assert_allclose(got[key], want[i][key], rtol=1e-5, atol=1e-5)
