"""The backend contract as an extension point: a backend written here, registered by name, trains through the facade."""

import os

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

import keras  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import tensorflow as tf  # noqa: E402

from paraml import Parallel  # noqa: E402
from paraml.backends import Backend, available, get_backend, register, unregister  # noqa: E402
from paraml.backends.base import Capabilities, Layout, Topology  # noqa: E402
from paraml.devices import resolve_devices  # noqa: E402


class OneDeviceByHand(Backend):
    """One device, no tf.distribute: the smallest backend there is."""

    option_names = ("device",)
    capabilities = Capabilities(xla_problem="this example does not try XLA")

    def __init__(self, devices=None, **options):
        super().__init__(devices, **options)
        device = resolve_devices([options.get("device", "CPU:1")])
        self.topology = Topology(device, Layout(data=1))

    def scope(self):
        return tf.device(self.topology.devices[0])

    def distribute(self, dataset):
        return dataset

    def run(self, fn, args):
        with tf.device(self.topology.devices[0]):
            return fn(*args)

    def all_reduce_sum(self, value):
        return value

    def gather(self, value):
        return value


@pytest.fixture
def by_hand():
    register("by_hand")(OneDeviceByHand)
    yield "by_hand"
    unregister("by_hand")


def make_model():
    return keras.Sequential([keras.Input((6,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(3)])


def train(strategy, **options):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(100, 6)).astype("float32"), rng.integers(0, 3, 100)
    par = Parallel(strategy, seed=1, **options)
    par.build(make_model, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    history = par.fit(x, y, batch_size=32, epochs=3, verbose=0)
    return par, history


def test_a_registered_backend_trains_like_single(by_hand):
    assert "by_hand" in available() and get_backend("by_hand") is OneDeviceByHand
    par, history = train("by_hand", device="CPU:2")
    reference, expected = train("single")
    assert par.strategy == "by_hand" and par.devices == ("/device:CPU:2",) and par.num_replicas == 1
    assert all(v.value.device.endswith("CPU:2") for v in par.model.weights)  # placed by the backend's scope
    np.testing.assert_allclose(history.history["loss"], expected.history["loss"], rtol=1e-5)
    for a, b in zip(par.model.get_weights(), reference.model.get_weights()):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
    assert par.describe().splitlines()[0] == "by_hand on 1 device(s): /device:CPU:2"
    assert par.memory_by_device() == {"/device:CPU:2": {"parameters": 652, "optimizer": 2 * 652 + 12}}


def test_its_capabilities_and_options_are_honoured(by_hand):
    message = r"unknown option 'devise' \(did you mean 'device'\?\) for strategy 'by_hand'; valid options: .*device"
    with pytest.raises(ValueError, match=message):
        Parallel("by_hand", devise="CPU:2")
    par = Parallel("by_hand", jit_compile=True)
    with pytest.raises(ValueError, match="jit_compile=True cannot be used: this example does not try XLA"):
        par.build(make_model, optimizer="sgd", loss="mse")


def test_a_name_is_registered_once(by_hand):
    with pytest.raises(ValueError, match="a backend named 'by_hand' is already registered"):
        register("by_hand")(type("Other", (OneDeviceByHand,), {}))
    with pytest.raises(ValueError, match=r"unknown strategy 'by_hnd' \(did you mean 'by_hand'\?\); valid strategies: "):
        get_backend("by_hnd")


def test_layout_and_topology_are_values():
    layout = Layout(data=2, stages=2)
    assert layout.devices_per_replica == 2 and str(layout) == "2 data replicas x 2 stages x 1 tensor shard"
    with pytest.raises(ValueError, match="Layout.stages must be an int >= 1, got 0"):
        Layout(stages=0)
    topology = Topology(("/device:CPU:0",), Layout(data=4), num_workers=4, worker_index=3)
    assert (topology.num_replicas, topology.is_chief) == (4, False)


@pytest.mark.parametrize(
    ("strategy", "devices", "options", "layout"),
    [
        ("single", None, {}, Layout(data=1)),
        ("mirrored", 2, {}, Layout(data=2)),
        ("central_storage", 3, {}, Layout(data=3)),
        ("model_parallel", 2, {"micro_batches": 2}, Layout(stages=2)),
    ],
)
def test_each_backend_says_its_layout(strategy, devices, options, layout):
    backend = Parallel(strategy, devices=devices, **options).backend
    assert backend.topology.layout == layout
    assert backend.topology.num_replicas == layout.data
    assert (backend.topology.num_workers, backend.topology.worker_index) == (1, 0)
    assert backend.across_workers(tf.constant(5.0)).numpy().tolist() == [5.0]
