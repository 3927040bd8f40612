import pytest

import paraml
from paraml.devices import canonical_device, describe_devices, list_devices, resolve_devices


@pytest.mark.parametrize(
    "given, expected",
    [
        ("/gpu:0", "/device:GPU:0"),
        ("GPU:0", "/device:GPU:0"),
        ("gpu:1", "/device:GPU:1"),
        ("/device:CPU:1", "/device:CPU:1"),
        ("/job:localhost/replica:0/task:0/device:CPU:2", "/device:CPU:2"),
        ("cpu:3", "/device:CPU:3"),
    ],
)
def test_canonical_device(given, expected):
    assert canonical_device(given) == expected


@pytest.mark.parametrize("bad", ["", "GPU", "banana:x", 3])
def test_canonical_device_rejects_garbage(bad):
    with pytest.raises(ValueError, match="device"):
        canonical_device(bad)


def test_simulated_devices_exist():
    assert list_devices("CPU") == tuple(f"/device:CPU:{i}" for i in range(4))


def test_simulate_same_layout_again_is_harmless():
    assert len(paraml.simulate_devices(4)) == 4


def test_simulate_other_layout_too_late_says_why():
    with pytest.raises(RuntimeError, match=r"too late.*4 logical CPU"):
        paraml.simulate_devices(2)


def test_resolve_devices_forms():
    assert resolve_devices(None) == list_devices()
    assert resolve_devices(2) == ("/device:CPU:0", "/device:CPU:1")
    assert resolve_devices(["cpu:2", "/CPU:3"]) == ("/device:CPU:2", "/device:CPU:3")


def test_resolve_too_many_devices_gives_count():
    with pytest.raises(ValueError, match=r"devices=9 .* has 4"):
        resolve_devices(9)


def test_resolve_unknown_or_duplicate_device():
    with pytest.raises(ValueError, match="'GPU:0' does not exist"):
        resolve_devices(["GPU:0"])
    with pytest.raises(ValueError, match="more than once"):
        resolve_devices(["CPU:1", "cpu:1"])


def test_describe_devices_lists_cpus_without_memory():
    infos = describe_devices()
    assert [i.name for i in infos] == list(list_devices("CPU"))
    assert all(i.memory_bytes is None and i.device_type == "CPU" for i in infos)
