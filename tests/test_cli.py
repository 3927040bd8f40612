"""The `paraml` command's small subcommands: devices, estimate, and its errors."""

import os
import subprocess
import sys

import pytest

from paraml.cli import load_object


def paraml(*args, timeout=120):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    return subprocess.run(
        [sys.executable, "-m", "paraml", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


def test_devices_lists_simulated_devices():
    done = paraml("devices", "--simulate", "3")
    assert done.returncode == 0, done.stderr
    assert [line.split()[0] for line in done.stdout.splitlines()[1:]] == [f"/device:CPU:{i}" for i in range(3)]
    assert "unknown" in done.stdout  # CPUs have no allocator statistics


def test_estimate_prints_the_breakdown(tmp_path):
    module = tmp_path / "models.py"
    module.write_text(
        "import keras\ndef make():\n    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])\n"
    )
    done = paraml("estimate", f"{module}:make", "--batch-size", "2", "--optimizer", "adam")
    assert done.returncode == 0, done.stderr
    # Dense(4->3): 15 parameters x 4 bytes; Adam keeps 2 slots; output 2 x 3 x 4 bytes
    for category, value in [
        ("parameters", "60"),
        ("gradients", "60"),
        ("optimizer slots", "120"),
        ("activations", "24"),
    ]:
        assert any(line.startswith(category) and f" {value} " in f"{line} " for line in done.stdout.splitlines())


@pytest.mark.parametrize(
    "spec, message",
    [
        ("nocolon", "expected MODULE:FUNCTION"),
        ("no_such_module_xyz:f", "cannot import"),
        ("paraml.demo:nothing", "has no"),
    ],
)
def test_load_object_errors(spec, message):
    with pytest.raises(ValueError, match=message):
        load_object(spec)


def test_cli_errors_are_one_line_and_exit_2():
    done = paraml("estimate", "nocolon")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("paraml estimate: error: expected MODULE:FUNCTION")
