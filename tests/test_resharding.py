"""Resharding on restore: a checkpoint written under one split of the state resumes under another, as if the run had
never stopped. ZeRO-3 written by 2 workers resumes on 3 workers (each reading its own share, measured) and on one
process with ``mirrored`` on 2 devices; a replicated pipeline (``data_parallel=2``) resumes as one pipeline. The
elastic tests (tests/test_elastic.py) cover ZeRO-1 from 3 workers to 2 and from 2 to 3."""

import json
import os
import shutil
import sys
from pathlib import Path

import keras
import numpy as np
import pytest

from paraml import Parallel, load_digits
from paraml.bench.harness import run_process
from paraml.demo import digits_model
from paraml.loop.checkpoint import latest_checkpoint
from paraml.loop.shards import read_index

pytestmark = pytest.mark.slow  # worker processes, two epochs each
SCRIPTS = Path(__file__).parent / "scripts"
sys.path.insert(0, str(SCRIPTS))
import reshard_worker  # noqa: E402  (its model, shared with the workers)

sys.path.pop(0)


def _launch(workers: int, out: Path, phase: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    command = [sys.executable, "-m", "paraml", "launch", "-n", str(workers)]
    done = run_process([*command, str(SCRIPTS / "reshard_worker.py"), str(out), phase], 300, env=env)
    assert done.code == 0, done.stdout[-3000:] + done.stderr[-3000:]


def _zero3_mlp(strategy: str, devices: int | None = None) -> Parallel:
    par = Parallel(strategy, devices=devices, seed=0)
    par.build(reshard_worker.mlp, optimizer=keras.optimizers.Adam(1e-3), loss=reshard_worker.loss())
    return par


def _assert_same_state(got: Parallel, want: Parallel) -> None:
    for a, b in zip(got.model.get_weights(), want.model.get_weights(), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    for a, b in zip(got.model.optimizer.variables, want.model.optimizer.variables, strict=True):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-7, err_msg=a.path)


@pytest.fixture(scope="module")
def zero3(tmp_path_factory):
    """A start written by one process, one epoch of ZeRO-3 on 2 workers from it (checkpointed), and the
    uninterrupted reference: ``mirrored`` on 2 devices for both epochs from the same start."""
    out = tmp_path_factory.mktemp("zero3")
    _zero3_mlp("single").save(out / "initial")
    _launch(2, out, "write")
    reference = _zero3_mlp("mirrored", 2)
    reference.restore(out / "initial")
    (x, y), _ = load_digits()
    reference.fit(x, y, batch_size=64, epochs=2, verbose=0)
    return out, reference


def test_zero3_written_by_two_workers_resumes_in_one_process_on_mirrored(zero3):
    out, reference = zero3
    assert read_index(latest_checkpoint(out / "ckpt")).metadata["shards"] == 2
    par = _zero3_mlp("mirrored", 2)
    state = par.restore(out / "ckpt")
    assert state.epoch == 1
    (x, y), _ = load_digits()
    par.fit(x, y, batch_size=64, epochs=2, initial_epoch=state.epoch, verbose=0)
    _assert_same_state(par, reference)


def test_zero3_written_by_two_workers_resumes_on_three_each_reading_only_its_share(zero3):
    """Each of 3 workers reads from the 2 shards only the variables it now owns: its allocator's peak during the
    restore (over what it held before) stays under its share plus the largest tensor, far below the whole state
    (measured per worker process). The 3 workers then train on to the uninterrupted run's weights and Adam state."""
    out, reference = zero3
    _launch(3, out, "resume")
    records = [json.loads((out / f"resumed-w{w}.json").read_text()) for w in range(3)]
    sizes = [v.numpy().nbytes for v in reference.model.weights + reference.model.optimizer.variables]
    whole, largest = sum(sizes), max(sizes)
    for record in records:
        assert record["epoch"] == 1
        assert record["restore_peak"] <= record["held"] + largest, (record, largest)
        assert record["restore_peak"] < 0.6 * whole, (record, whole)  # no worker reads the whole state
    resumed = _zero3_mlp("single")
    resumed.restore(out / "final")
    _assert_same_state(resumed, reference)


def test_a_replicated_pipeline_resumes_as_one_pipeline_as_if_uninterrupted(tmp_path):
    """``model_parallel`` with ``data_parallel=2`` (2 pipelines of 2 stages on 4 devices) for one epoch, resumed as
    one pipeline of 2 stages (``data_parallel=1``): the weights and Adam state of an uninterrupted 2-epoch run."""
    (x, y), _ = load_digits()
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def pipeline(devices: int, replicas: int) -> Parallel:
        par = Parallel("model_parallel", devices=devices, data_parallel=replicas, micro_batches=2, seed=0)
        par.build(digits_model, optimizer=keras.optimizers.Adam(0.01), loss=loss)
        return par

    reference = pipeline(2, 1)
    reference.fit(x, y, batch_size=64, epochs=2, verbose=0)
    first = pipeline(4, 2)  # the same seed: the same initial weights
    first.fit(x, y, batch_size=64, epochs=1, verbose=0, checkpoint_dir=tmp_path)
    assert first.backend.topology.layout.stages == 2 and first.num_replicas == 2
    second = pipeline(2, 1)
    history = second.fit(x, y, batch_size=64, epochs=2, verbose=0, checkpoint_dir=tmp_path)
    assert history.epoch == [1]
    _assert_same_state(second, reference)


def test_a_checkpoint_missing_a_workers_shard_is_refused_by_name_before_training(zero3, tmp_path):
    out, _ = zero3
    copy = tmp_path / "ckpt"
    shutil.copytree(out / "ckpt", copy)
    shutil.rmtree(latest_checkpoint(copy) / "shard-00001")
    par = _zero3_mlp("mirrored", 2)
    start = par.model.get_weights()
    (x, y), _ = load_digits()
    missing = r"written by 2 workers but shard-00001 \(the tensors of worker 1\) is missing"
    with pytest.raises(ValueError, match=missing):
        par.fit(x, y, batch_size=64, epochs=2, verbose=0, checkpoint_dir=copy)
    for got, want in zip(par.model.get_weights(), start, strict=True):  # nothing trained, nothing half-restored
        np.testing.assert_array_equal(got, want)
