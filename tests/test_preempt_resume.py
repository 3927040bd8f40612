"""Preemption: SIGTERM during fit(checkpoint_dir=...) stops at the next step, saves, exits 143; the rerun resumes
there and ends with the weights of a run that was never stopped (numpy input and a shuffled, repeated tf.data
pipeline with steps_per_epoch)."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from paraml.loop.preemption import EXIT_SIGTERM

pytestmark = pytest.mark.slow  # every test starts worker processes
SCRIPT = Path(__file__).parent / "scripts" / "preempt_train.py"


def run(tmp_path, name, strategy, devices, ckpt, *extra):
    out = tmp_path / f"{name}.npz"
    done = subprocess.run(
        [sys.executable, str(SCRIPT), strategy, str(devices), str(ckpt), str(out), *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )
    steps = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("step ")]
    return done, steps, out


@pytest.mark.parametrize(
    "strategy, devices, extra",
    [("mirrored", 2, ("--dataset",))],  # arrays, single and mirrored: test_checkpoint's in-process resume tests
    ids=["mirrored-tf.data"],
)
def test_sigterm_saves_and_the_rerun_ends_with_the_uninterrupted_weights(tmp_path, strategy, devices, extra):
    reference, ref_steps, ref_out = run(tmp_path, "reference", strategy, devices, tmp_path / "ref-ckpt", *extra)
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert len(ref_steps) == 120

    ckpt = tmp_path / "ckpt"
    stopped, first_steps, _ = run(tmp_path, "stopped", strategy, devices, ckpt, "--sigterm-at", "25", *extra)
    assert stopped.returncode == EXIT_SIGTERM, stopped.stderr[-2000:]
    assert "stopped by SIGTERM" in stopped.stderr and "finished" not in stopped.stdout
    assert first_steps[-1] < 30  # it stopped at the next step, not at the end of the epoch

    rerun, rest, out = run(tmp_path, "rerun", strategy, devices, ckpt, *extra)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert len(rest) <= 95 and len(first_steps) + len(rest) == 120  # no step run twice, none skipped
    want, got = np.load(ref_out), np.load(out)
    for key in want.files:
        np.testing.assert_allclose(got[key], want[key], rtol=1e-5, atol=1e-5)


def test_resume_of_a_dataset_that_reshuffles_every_epoch_matches_the_uninterrupted_run(tmp_path):
    """A finite ``shuffle(...)`` dataset reshuffles at every new iterator: a resumed run replays those iterators."""
    import keras
    import tensorflow as tf

    from paraml import Parallel

    rng = np.random.default_rng(0)
    x = rng.normal(size=(96, 8)).astype("float32")
    y = (x[:, 0] > 0).astype("int32")

    def make():
        par = Parallel("mirrored", devices=2, seed=4)
        par.build(
            lambda: keras.Sequential([keras.Input((8,)), keras.layers.Dense(2)]),
            optimizer=keras.optimizers.Adam(0.01),
            loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        )
        return par, tf.data.Dataset.from_tensor_slices((x, y)).shuffle(96, seed=2).batch(16)

    whole, data = make()
    whole.fit(data, epochs=4, verbose=0)
    first, data = make()
    first.fit(data, epochs=2, verbose=0, checkpoint_dir=tmp_path)
    second, data = make()
    second.fit(data, epochs=4, verbose=0, checkpoint_dir=tmp_path)
    for a, b in zip(whole.model.get_weights(), second.model.get_weights()):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
