"""Checkpoints: exact resume, crash and resume, kill during save, portability across backends, bad input."""

import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import keras
import numpy as np
import pytest
from conftest import logits_loss

from paraml import Parallel
from paraml.loop.checkpoint import latest_checkpoint

SCRIPTS = Path(__file__).parent / "scripts"


def model_fn():
    inputs = keras.Input((8,))
    h = keras.layers.Dense(16, activation="relu")(inputs)
    h2 = keras.layers.Dense(16, activation="relu")(h)
    return keras.Model(inputs, keras.layers.Dense(3)(keras.layers.Add()([h, h2])))


def make(strategy, devices=None, **options):
    par = Parallel(strategy, devices=devices, seed=7, **options)
    par.build(model_fn, optimizer=keras.optimizers.Adam(0.01), loss=logits_loss(), metrics=["accuracy"])
    return par


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(1)
    x = rng.normal(size=(500, 8)).astype("float32")
    return x, (x[:, 0] > 0).astype("int32") + (x[:, 1] > 0.5).astype("int32")


@pytest.mark.parametrize(
    "strategy, devices, options",
    [("single", None, {}), ("mirrored", 2, {}), ("model_parallel", 2, {"micro_batches": 2})],
    ids=["single", "mirrored", "model_parallel"],
)
def test_exact_resume(tmp_path, data, strategy, devices, options):
    x, y = data
    first = make(strategy, devices, **options)
    first.fit(x, y, batch_size=50, epochs=2, verbose=0)
    first.save(tmp_path)
    first.fit(x, y, batch_size=50, epochs=4, initial_epoch=2, verbose=0)
    # a fresh Parallel (new model, new optimizer) restores and continues: Adam's state must come back too
    second = make(strategy, devices, **options)
    state = second.restore(tmp_path)
    assert (state.epoch, state.step, state.seed) == (2, 0, 7)
    assert int(second.model.optimizer.iterations.numpy()) == 20
    second.fit(x, y, batch_size=50, epochs=4, initial_epoch=2, verbose=0)
    for a, b in zip(first.model.get_weights(), second.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def test_portable_across_backends(tmp_path, data):
    x, y = data
    mirrored = make("mirrored", 2)
    mirrored.fit(x, y, batch_size=50, epochs=2, verbose=0)
    mirrored.save(tmp_path)
    expected = mirrored.predict(x)
    for strategy, devices in (("model_parallel", 2), ("single", None), ("central_storage", 2)):
        other = make(strategy, devices)
        other.restore(tmp_path)
        np.testing.assert_allclose(other.predict(x), expected, rtol=1e-6, atol=1e-6)


def test_fit_with_checkpoint_dir_resumes_in_process(tmp_path, data):
    x, y = data
    straight = make("single")
    straight.fit(x, y, batch_size=50, epochs=4, verbose=0)
    interrupted = make("single")
    interrupted.fit(x, y, batch_size=50, epochs=2, verbose=0, checkpoint_dir=tmp_path, checkpoint_every=3, keep=2)
    assert len([p for p in tmp_path.iterdir() if p.name.startswith("ckpt-")]) == 2
    resumed = make("single")
    history = resumed.fit(x, y, batch_size=50, epochs=4, verbose=0, checkpoint_dir=tmp_path)
    assert history.epoch == [2, 3]
    for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "strategy, devices, options", [("single", None, {}), ("mirrored", 2, {"shard_optimizer": True})]
)
def test_async_checkpoints_hold_what_synchronous_ones_hold(tmp_path, data, strategy, devices, options):
    """async_checkpoint=True: every epoch's checkpoint written in the background while training goes on; fit returns
    with the last one complete, and it restores to the weights and Adam state a synchronous run's restores to."""
    x, y = data
    runs = {}
    for background in (False, True):
        par = make(strategy, devices, **options)
        folder = tmp_path / f"async={background}"
        par.fit(x, y, batch_size=50, epochs=3, verbose=0, checkpoint_dir=folder, async_checkpoint=background)
        assert sorted(p.name for p in folder.iterdir()) == ["ckpt-000001", "ckpt-000002", "ckpt-000003", "latest"]
        restored = make("single")
        assert restored.restore(folder).epoch == 3
        runs[background] = restored, par.model.get_weights()
    np.testing.assert_allclose(runs[True][0].predict(x), runs[False][0].predict(x), rtol=1e-6, atol=1e-6)
    for got, want in zip(runs[True][0].model.optimizer.variables, runs[False][0].model.optimizer.variables):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-6, atol=1e-7, err_msg=got.path)
    for got, want in zip(runs[True][0].model.get_weights(), runs[True][1]):  # the last save is the trained model
        np.testing.assert_array_equal(got, want)


def test_a_checkpoint_of_one_layout_resumes_on_another_as_if_uninterrupted(tmp_path, data):
    """One epoch under mirrored on 4 devices with shard_optimizer, saved; the second under model_parallel with
    tensor_parallel=2: the weights of an uninterrupted 2-epoch single run (Adam)."""
    x, y = data
    straight = make("single")
    straight.fit(x, y, batch_size=50, epochs=2, verbose=0)
    first = make("mirrored", 4, shard_optimizer=True)
    first.fit(x, y, batch_size=50, epochs=1, verbose=0, checkpoint_dir=tmp_path)
    second = make("model_parallel", 2, tensor_parallel=2)
    history = second.fit(x, y, batch_size=50, epochs=2, verbose=0, checkpoint_dir=tmp_path)
    assert history.epoch == [1]
    for got, want in zip(second.model.get_weights(), straight.model.get_weights(), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_resume_mid_epoch_from_a_step_checkpoint(tmp_path, data):
    x, y = data
    straight = make("single")
    straight.fit(x, y, batch_size=50, epochs=2, verbose=0)
    partial = make("single")
    partial.fit(x, y, batch_size=50, epochs=1, verbose=0, checkpoint_dir=tmp_path, checkpoint_every=4)
    # drop the end-of-epoch checkpoint: the newest left is mid-epoch 0, after 8 steps
    newest = latest_checkpoint(tmp_path)
    older = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("ckpt-") and p != newest)[-1]
    (tmp_path / "latest").write_text(older + "\n")
    resumed = make("single")
    resumed.fit(x, y, batch_size=50, epochs=2, verbose=0, checkpoint_dir=tmp_path)
    assert int(resumed.model.optimizer.iterations.numpy()) == 20
    for a, b in zip(straight.model.get_weights(), resumed.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)


def run_script(*args, **kwargs):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.Popen(
        [sys.executable, str(SCRIPTS / "resumable_train.py"), *map(str, args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        **kwargs,
    )


def wait_for(process, marker):
    lines = []
    for line in process.stdout:
        lines.append(line)
        if marker in line:
            return lines
    raise AssertionError(f"{marker!r} never printed:\n{''.join(lines)}")


@pytest.mark.slow
def test_crash_and_resume(tmp_path):
    reference = run_script(tmp_path / "ref-ckpt", tmp_path / "ref.npz")
    assert reference.wait(timeout=240) == 0
    crashing = run_script(tmp_path / "ckpt", tmp_path / "out.npz", "--slow-epoch", 2)
    wait_for(crashing, "epoch 2 begins")  # inside epoch 3: epochs 0 and 1 are checkpointed
    crashing.send_signal(signal.SIGKILL)
    crashing.wait(timeout=30)
    restarted = run_script(tmp_path / "ckpt", tmp_path / "out.npz")
    output, _ = restarted.communicate(timeout=240)
    assert restarted.returncode == 0, output
    assert "epoch 0 begins" not in output and "epoch 2 begins" in output  # resumed from epoch 3, not 1
    want, got = np.load(tmp_path / "ref.npz"), np.load(tmp_path / "out.npz")
    for key in want.files:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_kill_during_save_leaves_a_checkpoint_that_restores(tmp_path):
    saver = run_script(tmp_path / "ckpt", tmp_path / "unused.npz", "--save-loop")
    wait_for(saver, "saved 3")
    saver.send_signal(signal.SIGKILL)  # lands in the middle of one of the next saves (they run back to back)
    saver.wait(timeout=30)
    par = Parallel("single")
    from paraml.demo import digits_model

    par.build(digits_model, optimizer="adam", loss=logits_loss())
    state = par.restore(tmp_path / "ckpt")
    assert state.seed == 3


def test_a_resume_says_where_once_and_tensorflow_stays_quiet(tmp_path, data, capfd):
    x, y = data
    make("single").fit(x, y, batch_size=50, epochs=2, verbose=0, checkpoint_dir=tmp_path)
    capfd.readouterr()
    make("single").fit(x, y, batch_size=50, epochs=3, verbose=0, checkpoint_dir=tmp_path)
    gc.collect()  # TensorFlow warns about unrestored values when the restore's status is deleted
    out, err = capfd.readouterr()
    resumed = [line for line in out.splitlines() if line.startswith("paraml: ")]
    assert resumed == [f"paraml: resumed from {tmp_path / 'ckpt-000002'} at epoch 2, step 0"]
    assert "unrestored" not in err and "could not be found" not in err
    make("single").fit(x, y, batch_size=50, epochs=3, verbose=0, checkpoint_dir=tmp_path)
    gc.collect()
    out, err = capfd.readouterr()
    assert f"paraml: already finished: 3 epochs done (checkpoint {tmp_path / 'ckpt-000003'})" in out.splitlines()
    assert "unrestored" not in err and "could not be found" not in err


# -- bad input --------------------------------------------------------------------------------------------------------
def test_restore_from_a_missing_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere"):
        make("single").restore(tmp_path / "nowhere")


def test_restore_from_another_model(tmp_path):
    make("single").save(tmp_path)
    other = Parallel("single")
    other.build(lambda: keras.Sequential([keras.Input((8,)), keras.layers.Dense(5)]), optimizer="adam", loss="mse")
    with pytest.raises(ValueError, match=r"different model: variable '.*kernel' has shape \(8, 5\) here but \(8, 16\)"):
        other.restore(tmp_path)


def test_restore_from_a_corrupt_checkpoint_leaves_it_alone(tmp_path):
    make("single").save(tmp_path)
    data_file = next(latest_checkpoint(tmp_path).glob("ckpt.data-*"))
    data_file.write_bytes(data_file.read_bytes()[:100])  # truncated
    before = data_file.read_bytes()
    with pytest.raises(ValueError, match="corrupt or truncated"):
        make("single").restore(tmp_path)
    assert data_file.read_bytes() == before


def test_bad_checkpoint_arguments(tmp_path, data):
    x, y = data
    par = make("single")
    with pytest.raises(ValueError, match="async_checkpoint needs checkpoint_dir"):
        make("single").fit(x, y, epochs=1, verbose=0, async_checkpoint=True)
    with pytest.raises(ValueError, match="async_checkpoint must be True or False, got 'yes'"):
        make("single").fit(x, y, epochs=1, verbose=0, checkpoint_dir=tmp_path, async_checkpoint="yes")
    with pytest.raises(ValueError, match="checkpoint_every needs checkpoint_dir"):
        par.fit(x, y, checkpoint_every=5, verbose=0)
    with pytest.raises(ValueError, match="keep must be an int >= 1"):
        par.save(tmp_path, keep=0)


def test_restore_with_another_optimizer_names_both(tmp_path):
    make("single").save(tmp_path)  # Adam
    other = Parallel("single", seed=7)
    other.build(model_fn, optimizer="sgd", loss=logits_loss())
    with pytest.raises(ValueError, match="written with the optimizer Adam, this model uses SGD"):
        other.restore(tmp_path)


def test_fit_refuses_an_unwritable_checkpoint_dir_and_another_models_checkpoint(tmp_path, data):
    """Both fail before training; the existing checkpoint is left exactly as it was."""
    x, y = data
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    par = make("single")
    before = [w.copy() for w in par.model.get_weights()]
    try:
        if not os.access(locked, os.W_OK):  # root ignores the mode bits
            with pytest.raises(PermissionError, match="not writable"):
                par.fit(x, y, verbose=0, checkpoint_dir=locked / "ckpt")
    finally:
        locked.chmod(0o700)
    (tmp_path / "file").write_text("")
    with pytest.raises(NotADirectoryError, match="checkpoint_dir '.*file' is a file: give a directory"):
        par.fit(x, y, verbose=0, checkpoint_dir=tmp_path / "file")
    with pytest.raises(NotADirectoryError, match="is inside '.*file', which is a file"):
        par.fit(x, y, verbose=0, checkpoint_dir=tmp_path / "file" / "ckpt")
    assert all(np.array_equal(a, b) for a, b in zip(before, par.model.get_weights()))

    make("single").fit(x, y, verbose=0, checkpoint_dir=tmp_path / "ckpt")
    files = {p: p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()}
    other = Parallel("single", seed=7)
    other.build(
        lambda: keras.Sequential([keras.Input((8,)), keras.layers.Dense(5), keras.layers.Dense(3)]),
        optimizer=keras.optimizers.Adam(0.01),
        loss=logits_loss(),
    )
    with pytest.raises(ValueError, match="is of a different model"):
        other.fit(x, y, verbose=0, checkpoint_dir=tmp_path / "ckpt")
    assert {p: p.read_bytes() for p in (tmp_path / "ckpt").rglob("*") if p.is_file()} == files


def test_inspect_says_what_a_checkpoint_holds_before_a_resume(tmp_path, data):
    x, y = data
    par = make("mirrored", 2, shard_optimizer=True)
    par.fit(x, y, batch_size=50, epochs=2, verbose=0, checkpoint_dir=tmp_path)
    command = [sys.executable, "-m", "paraml", "checkpoint", "inspect"]
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    done = subprocess.run([*command, str(tmp_path)], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    text = done.stdout
    assert "ckpt-000002" in text and "epochs done 2, steps into the next 0, shuffling seed 7" in text, text
    assert "optimizer Adam" in text and "plan: " in text and "ZeRO-1" in text, text
    assert f"model {len(par.model.weights)} (" in text, text
    missing = subprocess.run(
        [*command, str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120, env=env
    )
    assert missing.returncode == 2 and "no checkpoint at" in missing.stderr


def test_par_save_in_the_background_restores_like_a_synchronous_save(tmp_path, data):
    """par.save(asynchronous=True) returns while the write goes on; training on, restoring, or saving again waits for
    it; the checkpoint equals a synchronous save of the same state (weights and Adam's slots)."""
    x, y = data
    par = make("mirrored", 2, shard_optimizer=True)
    par.fit(x, y, batch_size=50, epochs=1, verbose=0)
    want = [v.numpy() for v in par.model.weights + par.model.optimizer.variables]
    background = par.save(tmp_path / "background", asynchronous=True)
    par.fit(x, y, batch_size=50, epochs=2, initial_epoch=1, verbose=0)  # waits for the write before changing state
    assert latest_checkpoint(tmp_path / "background") == background
    par.save(tmp_path / "synchronous")
    restored = make("single")
    restored.restore(tmp_path / "background")
    got = [v.numpy() for v in restored.model.weights + restored.model.optimizer.variables]
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(ValueError, match="asynchronous must be True or False, got 'yes'"):
        par.save(tmp_path / "bad", asynchronous="yes")
