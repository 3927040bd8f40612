"""The `paraml` command's small subcommands: devices, estimate, and its errors; load_object, which estimate uses."""

import os
import re
import subprocess
import sys

import pytest

from paraml.bench.loading import load_object


def paraml(*args, timeout=120, cwd=None, **env):
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3", **env}
    for name in [k for k, v in env.items() if v is None]:
        del env[name]
    return subprocess.run(
        [sys.executable, "-m", "paraml", *args], capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd
    )


#: What TensorFlow's own logging looks like (absl/glog lines, and the line absl writes before it is initialised).
TENSORFLOW_LOG = re.compile(r"^(?:[IWE]\d{4} |WARNING: All log messages before absl)", re.MULTILINE)


def test_devices_lists_simulated_devices_and_why_there_is_no_gpu():
    done = paraml("devices", "--simulate", "3")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert [line.split()[0] for line in lines[1:4]] == [f"/device:CPU:{i}" for i in range(3)]
    assert "unknown" in done.stdout  # a CPU's capacity is not known to TensorFlow
    assert lines[4].startswith("TensorFlow sees no GPU, so training runs on the CPU: ")
    assert "nvidia-smi" in lines[4] or "CUDA" in lines[4]


@pytest.mark.slow
def test_commands_leave_tensorflow_logging_out_unless_asked():
    quiet = paraml("devices", TF_CPP_MIN_LOG_LEVEL=None)  # the user's environment, not the tests'
    assert quiet.returncode == 0 and not TENSORFLOW_LOG.search(quiet.stderr), quiet.stderr
    loud = paraml("devices", TF_CPP_MIN_LOG_LEVEL=None, PARAML_LOG="1")
    assert loud.returncode == 0 and TENSORFLOW_LOG.search(loud.stderr), loud.stderr


def test_version_env_and_did_you_mean():
    import paraml as package

    version = paraml("--version")
    assert version.returncode == 0 and version.stdout.strip() == f"paraml {package.__version__}" != "paraml unknown"
    env = paraml("env", TF_CONFIG='{"cluster": {}}')
    assert env.returncode == 0, env.stderr
    for expected in (f"paraml {package.__version__}", "tensorflow 2.", "keras 3.", "TF_CONFIG=", "/device:CPU:0"):
        assert expected in env.stdout
    typo = paraml("devics")
    assert typo.returncode == 2
    assert "unknown command 'devics' (did you mean 'devices'?)" in typo.stderr


@pytest.mark.slow
def test_estimate_prints_the_breakdown(tmp_path):
    module = tmp_path / "models.py"
    module.write_text(
        "import keras\ndef make():\n    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])\n"
    )
    done = paraml("estimate", f"{module}:make", "--batch-size", "2", "--optimizer", "adam")
    assert done.returncode == 0, done.stderr
    # Dense(4->3): 15 parameters x 4 bytes; Adam keeps 2 slots; the batch 2 x 4 and the output 2 x 3, x 4 bytes
    for category, value in [
        ("parameters", "60"),
        ("gradients", "60"),
        ("optimizer slots", "120"),
        ("activations", "56"),
    ]:
        assert any(line.startswith(category) and f" {value} " in f"{line} " for line in done.stdout.splitlines())
    recomputed = paraml("estimate", f"{module}:make", "--batch-size", "2", "--remat", "--optimizer-shards", "2")
    assert recomputed.returncode == 0, recomputed.stderr
    assert "note: optimizer slots of the device holding most of 2 shards" in recomputed.stdout
    # shard_optimizer's return of the updated values: its own bucket and 2 gathered, each at most what an owner holds
    # (the kernel's 48 bytes on one, the bias's 12 on the other)
    assert any(line.split()[:2] == ["collectives", "144"] for line in recomputed.stdout.splitlines())
    small = paraml("estimate", f"{module}:make", "--optimizer-shards", "2", "--bucket-bytes", "8")
    assert small.returncode != 0
    assert "bucket_bytes=8 is smaller than the largest variable (48 bytes)" in small.stderr


@pytest.mark.slow
def test_estimate_takes_the_sequence_length_or_a_sample(tmp_path):
    module = tmp_path / "tokens.py"
    module.write_text(
        "import keras\nimport numpy as np\n"
        "def make():\n"
        "    return keras.Sequential([keras.Input((None,), dtype='int32'), keras.layers.Embedding(50, 16),\n"
        "                             keras.layers.Dense(50)])\n"
        "def batch():\n"
        "    return np.ones((2, 64), 'int32')\n"
    )

    def activations(*options):
        done = paraml("estimate", f"{module}:make", "--batch-size", "4", *options)
        assert done.returncode == 0, done.stderr
        (line,) = [line for line in done.stdout.splitlines() if line.startswith("activations")]
        return int(line.split()[1].replace(",", ""))

    unknown, long, sampled = activations(), activations("--seq-len", "64"), activations("--sample", f"{module}:batch")
    assert long == sampled and long > 7 * unknown  # the default length is 8: activations grow with the length
    bad = paraml("estimate", f"{module}:make", "--seq-len", "0")
    assert bad.returncode == 2 and "--seq-len: expected a whole number >= 1, got '0'" in bad.stderr


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


def test_load_object_finds_module_and_file_attributes(tmp_path):
    from paraml.demo import digits_model

    assert load_object("paraml.demo:digits_model") is digits_model
    module = tmp_path / "models.py"
    module.write_text("def make():\n    return 42\n")
    assert load_object(f"{module}:make")() == 42
    with pytest.raises(FileNotFoundError, match="no file"):
        load_object(f"{tmp_path / 'missing.py'}:make")


def test_cli_errors_are_one_line_and_exit_2():
    done = paraml("estimate", "nocolon")
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1].startswith("paraml estimate: error: expected MODULE:FUNCTION")


@pytest.mark.slow
def test_estimate_finds_a_module_in_the_current_folder(tmp_path):
    (tmp_path / "mymodels.py").write_text(
        "import keras\ndef make():\n    return keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])\n"
    )
    done = paraml("estimate", "mymodels:make", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "parameters" in done.stdout
