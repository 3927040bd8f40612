"""The parallel plan: one value per build that every technique reads (stages, splits, remat, sharding, schedule)."""

import keras
import numpy as np
import pytest

from paraml import Parallel
from paraml.planning.plan import DeviceMesh, Layout, ParallelPlan


def block_mlp() -> keras.Model:
    """A transformer-like feed-forward stack: Dense pairs that split by columns then rows."""
    layers = [keras.layers.Dense(16, activation="gelu"), keras.layers.Dense(8), keras.layers.LayerNormalization()]
    return keras.Sequential([keras.Input((8,)), *layers, keras.layers.Dense(16), keras.layers.Dense(3)])


@pytest.fixture
def plans_made(monkeypatch: pytest.MonkeyPatch) -> list[ParallelPlan]:
    """Every ParallelPlan constructed while the test runs."""
    made: list[ParallelPlan] = []
    original = ParallelPlan.__init__

    def counting(self: ParallelPlan, *args: object, **kwargs: object) -> None:
        original(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(ParallelPlan, "__init__", counting)
    return made


def test_model_parallel_plans_once_and_every_technique_reads_that_plan(plans_made: list[ParallelPlan]) -> None:
    par = Parallel("model_parallel", devices=4, tensor_parallel=2, micro_batches=2, schedule="1f1b", remat=True)
    par.build(block_mlp, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert len(plans_made) == 1, f"the plan was made {len(plans_made)} times in one build"
    plan = plans_made[0]
    assert par.plan is plan and par.backend.techniques.plan is plan
    assert plan.layout == Layout(data=1, stages=2, tensor=2)
    assert plan.mesh.shape == (1, 2, 2)
    assert plan.remat and plan.micro_batches == 2 and plan.schedule.kind == "1f1b"
    assert {s.kind for s in plan.splits.splits} == {"columns", "rows"}
    # what the step trains is the split weights' parts, read from the applied plan
    trained = par.trained_variables
    assert len(trained) > len(par.model.trainable_variables)
    assert par.backend.techniques.recomputed  # remat applied from the plan
    text = plan.describe()
    assert "2 stages x 2 tensor shards" in text and "remat" in text and "1f1b" in text
    x, y = np.random.default_rng(0).random((16, 8), "float32"), np.arange(16) % 3
    par.fit(x, y, batch_size=8, epochs=1, verbose=0)
    assert len(plans_made) == 1, "training made the plan again"


def test_data_parallel_plans_once_with_sharded_optimizer_state(plans_made: list[ParallelPlan]) -> None:
    par = Parallel("mirrored", devices=2, shard_optimizer=True)
    par.build(block_mlp, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    assert len(plans_made) == 1
    plan = par.plan
    assert plan.layout == Layout(data=2) and plan.zero_stage == 1 and not plan.remat and plan.partition is None
    assert plan.stages == () and plan.splits is None
    assert "ZeRO-1" in plan.describe()


def test_mesh_arranges_devices_on_named_axes() -> None:
    mesh = DeviceMesh.arrange([f"CPU:{i}" for i in range(8)], data=2, tensor=2)
    assert mesh.shape == (2, 2, 2)
    assert mesh.stage_group(1, 0) == ("CPU:4", "CPU:5")
    assert mesh.first_devices() == (("CPU:0", "CPU:2"), ("CPU:4", "CPU:6"))
    with pytest.raises(ValueError, match="devices=6 is not a multiple of data_parallel=4"):
        DeviceMesh.arrange([f"CPU:{i}" for i in range(6)], data=4)


def test_a_backend_whose_build_model_applies_no_plan_is_told_what_to_add() -> None:
    from paraml.backends import register, unregister
    from paraml.backends.distribute import SingleBackend

    @register("no_plan")
    class NoPlan(SingleBackend):
        def build_model(self, model_fn, optimizer=None, host_model=None, remat=False):  # noqa: ANN001, ANN201
            with self.scope():
                return model_fn()

    try:
        with pytest.raises(TypeError, match=r"did not apply a plan: .*self\.apply_plan\(model, plan\)"):
            Parallel("no_plan").build(block_mlp, optimizer="sgd", loss="mse")
    finally:
        unregister("no_plan")
