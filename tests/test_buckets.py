"""ZeRO's collectives in buckets (``bucket_bytes``, :mod:`paraml.parallelism.buckets`): the grouping, the errors,
``describe()``, training equal to unsharded, and each worker's (and each device's) peak lowered by what the stage
shards: a 6x1024 MLP (24 MiB of parameters), Adam."""

from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from paraml import Parallel, estimate_memory  # noqa: E402
from paraml.bench.harness import run_process  # noqa: E402
from paraml.parallelism.buckets import DEFAULT_BUCKET_BYTES, bucket_size, buckets, in_flight_bytes  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
import bucket_worker  # noqa: E402

PARAMETERS = bucket_worker.LAYERS * (bucket_worker.WIDTH**2 + bucket_worker.WIDTH) * 4
#: How much lower than unsharded each stage's peak must be, in parameter bytes (issue 45).
SAVED = {"shard_optimizer": 0.6, "shard_gradients": 1.0, "shard_parameters": 1.3}
STAGE = {"shard_optimizer": 1, "shard_gradients": 2, "shard_parameters": 3}


def small_mlp() -> keras.Model:
    return keras.Sequential([keras.Input((12,)), *[keras.layers.Dense(48) for _ in range(4)], keras.layers.Dense(3)])


def test_buckets_group_in_order_and_a_large_tensor_goes_alone():
    assert buckets([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert buckets([3, 3, 3], 0) == [[0], [1], [2]]
    assert buckets([], 8) == []
    assert bucket_size(None, 10, option="shard_optimizer") == DEFAULT_BUCKET_BYTES
    assert bucket_size(None, DEFAULT_BUCKET_BYTES + 1, option="shard_optimizer") == DEFAULT_BUCKET_BYTES + 1
    assert bucket_size(100, 100, option="shard_optimizer") == 100


@pytest.mark.parametrize("bad", [0, -5, 1.5, "4MiB", True])
def test_a_bucket_that_is_not_a_positive_number_of_bytes_is_refused_naming_it(bad):
    with pytest.raises(ValueError, match=rf"bucket_bytes must be a positive whole number of bytes, got {bad!r}"):
        Parallel("mirrored", devices=2, shard_optimizer=True, bucket_bytes=bad)


def test_a_bucket_without_a_zero_stage_is_refused():
    with pytest.raises(ValueError, match="bucket_bytes=1024 sizes the collectives of shard_optimizer"):
        Parallel("mirrored", devices=2, bucket_bytes=1024)
    with pytest.raises(ValueError, match="unknown option 'bucket_bytes'"):
        Parallel("model_parallel", devices=2, bucket_bytes=1024)


def test_a_bucket_smaller_than_the_largest_variable_is_refused_at_build():
    par = Parallel("mirrored", devices=2, shard_gradients=True, bucket_bytes=1000)
    largest = 48 * 48 * 4
    with pytest.raises(ValueError, match=rf"bucket_bytes=1000 is smaller than the largest variable \({largest} "):
        par.build(small_mlp, optimizer="adam", loss="mse")


def test_small_buckets_train_as_unsharded_and_describe_says_so():
    """Buckets of two 48x48 kernels (several all-reduces and broadcasts a step, each waiting for the one before):
    the weights equal unsharded ``mirrored`` on 2 devices (Adam, 2 epochs, rtol 1e-5); ``describe()`` names them."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(100, 12)).astype("float32"), rng.normal(size=(100, 3)).astype("float32")
    runs = {}
    for name, options in {
        "plain": {},
        "shard_optimizer": {"shard_optimizer": True, "bucket_bytes": 2 * 48 * 48 * 4 + 2 * 48 * 4},
        "shard_gradients": {"shard_gradients": True, "bucket_bytes": 48 * 48 * 4 + 48 * 4},
    }.items():
        par = Parallel("mirrored", devices=2, seed=3, **options)
        par.build(small_mlp, optimizer="adam", loss="mse")
        if runs:
            par.model.set_weights(runs["plain"][0])  # the same start
        start = par.model.get_weights()
        par.fit(x, y, batch_size=20, epochs=2, shuffle=False, verbose=0)
        runs[name] = (start, par.model.get_weights(), par.describe())
    for name in ("shard_optimizer", "shard_gradients"):
        for got, want in zip(runs[name][1], runs["plain"][1], strict=True):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert "buckets: gradients reduced and updated values returned 18.38 KiB at a time" in runs["shard_optimizer"][2]
    assert "buckets:" not in runs["plain"][2]


def test_the_estimate_counts_the_collectives_in_flight_of_each_stage():
    """``estimate_memory(optimizer_shards=2, zero_stage=s)`` adds :func:`in_flight_bytes` of the bucket the plan would
    use (the default, or ``bucket_bytes``), and refuses a bad bucket by its value; one replica has none."""
    model = bucket_worker.model_fn()
    kernel = bucket_worker.WIDTH**2 * 4  # the largest variable: the default bucket exactly
    for stage in (1, 2, 3):
        estimate = estimate_memory(model, batch_size=16, loss="mse", optimizer_shards=2, zero_stage=stage)
        assert estimate.collectives == in_flight_bytes(stage, 2, DEFAULT_BUCKET_BYTES, PARAMETERS // 2, PARAMETERS) > 0
        assert estimate.total == estimate.parameters + estimate.gradients + estimate.optimizer_slots + (
            estimate.activations + estimate.collectives
        )
        larger = estimate_memory(
            model, batch_size=16, loss="mse", optimizer_shards=2, zero_stage=stage, bucket_bytes=2 * kernel
        )
        wider = in_flight_bytes(stage, 2, 2 * kernel, PARAMETERS // 2, PARAMETERS)
        assert larger.collectives == wider > estimate.collectives
    assert "collectives" in str(estimate) and estimate.as_dict()["collectives"] == estimate.collectives
    assert estimate_memory(model, batch_size=16, loss="mse").collectives == 0
    with pytest.raises(ValueError, match=r"bucket_bytes=1000 is smaller than the largest variable \(4194304 bytes\)"):
        estimate_memory(model, batch_size=16, loss="mse", optimizer_shards=2, bucket_bytes=1000)
    with pytest.raises(ValueError, match="bucket_bytes must be a positive whole number of bytes, got -1"):
        estimate_memory(model, batch_size=16, loss="mse", bucket_bytes=-1)


@pytest.mark.slow
def test_each_workers_peak_is_lowered_by_what_its_stage_shards(tmp_path):
    """``paraml launch -n 2``, one launch per variant: each worker's allocator peak over an epoch (its own process)
    is below unsharded's by at least 0.6x the parameter bytes with ``shard_optimizer``, 1.0x with ``shard_gradients``,
    1.3x with ``shard_parameters``; ``estimate_memory`` of the stage is within 10% of each worker's peak; the weights
    equal unsharded's (rtol 1e-5)."""
    script = Path(__file__).parent / "scripts" / "bucket_worker.py"
    env = {k: v for k, v in os.environ.items() if k != "TF_CONFIG"}
    found = {}
    for variant in ("unsharded", *SAVED):
        out = tmp_path / variant
        out.mkdir()
        command = [sys.executable, "-m", "paraml", "launch", "-n", "2", str(script), str(out), variant]
        done = run_process(command, 300, env=env)
        assert done.code == 0, done.stdout[-3000:] + done.stderr[-3000:]
        found[variant] = [np.load(out / f"worker{i}.npz") for i in range(2)]
    unsharded = max(int(w["peak"]) for w in found["unsharded"])
    for variant, fraction in SAVED.items():
        for worker in found[variant]:
            saved = (unsharded - int(worker["peak"])) / PARAMETERS
            assert saved >= fraction, (variant, saved, int(worker["peak"]), unsharded)
    for variant, stage in STAGE.items():  # the estimate, its collectives counted, within 10% of each worker's peak
        estimate = estimate_memory(
            bucket_worker.model_fn(), batch_size=16, loss="mse", optimizer_shards=2, zero_stage=stage
        )
        for worker in found[variant]:
            assert abs(estimate.total / int(worker["peak"]) - 1) <= 0.10, (variant, estimate.total, int(worker["peak"]))

    def trained(variant: str) -> list[np.ndarray]:  # the workers' checkpoint, every weight whole
        single = Parallel("single", seed=0)
        single.build(bucket_worker.model_fn, optimizer="adam", loss="mse")
        single.restore(tmp_path / variant / "ckpt")
        return single.model.get_weights()

    want = trained("unsharded")
    for variant in SAVED:
        for got, expected in zip(trained(variant), want, strict=True):
            np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6, err_msg=variant)


@pytest.mark.slow
def test_each_devices_peak_under_mirrored_is_lowered_by_what_its_stage_shards():
    """``mirrored`` on 2 logical devices (one allocator): each device's peak of one step, replayed from the allocator's
    own events (:func:`paraml.bench.memory_trace.device_memory_peaks`), below unsharded's as each worker's is."""
    from paraml.bench.memory_trace import device_memory_peaks

    x, y = (a[:32] for a in bucket_worker.data())
    peaks = {}
    for variant in ("unsharded", *SAVED):
        par = Parallel("mirrored", devices=2, seed=0, **({} if variant == "unsharded" else {variant: True}))
        par.build(bucket_worker.model_fn, optimizer="adam", loss="mse")
        memory = device_memory_peaks(par, x, y)
        peaks[variant] = [memory.peak_bytes(d) for d in memory.device_names[:2]]
    unsharded = min(peaks["unsharded"])
    for variant, fraction in SAVED.items():
        for peak in peaks[variant]:
            assert (unsharded - peak) / PARAMETERS >= fraction, (variant, peaks)
