"""Elastic launches (paraml.cluster.elastic): `paraml launch -n MIN:MAX` goes on without a worker that fails, and
`--nnodes MIN:MAX` lets nodes join and leave while the job runs.

The launcher's rules are shown with tiny Python workers (no TensorFlow); the last two tests train for real
(tests/scripts/restart_train.py, ZeRO-1 across the workers) and end with the weights and Adam state of a run that
never changed size.
"""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import fails_after

from paraml.cluster.elastic import Bounds
from paraml.cluster.launch import find_free_ports, launch, main

SCRIPTS = Path(__file__).resolve().parent / "scripts"

# A worker records what its run looked like, then does what the body says.
PREAMBLE = """\
import json, os, sys, time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUN = int(os.environ["PARAML_RESTART"])
INDEX = int(os.environ["PARAML_WORKER_INDEX"])
seen = {k: os.environ.get(k, "") for k in ("PARAML_NUM_WORKERS", "PARAML_RESIZE", "PARAML_REACHED")}
seen["cluster"] = len(json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"])
(HERE / f"run{RUN}-w{INDEX}.json").write_text(json.dumps(seen))


def hold():
    for _ in range(1200):  # until the launcher stops this run (SIGTERM ends the process), at most 60 s
        time.sleep(0.05)
    sys.exit(99)
"""


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(PREAMBLE + textwrap.dedent(body))
    return path


def _seen(tmp_path: Path, run: int) -> dict[int, dict[str, object]]:
    return {int(p.stem.split("-w")[1]): json.loads(p.read_text()) for p in tmp_path.glob(f"run{run}-w*.json")}


def _wait_for(path: Path, count: int = 1, seconds: int = 60) -> None:
    with fails_after(seconds, f"waiting for {count} of {path}"):
        while len(list(path.parent.glob(path.name))) < count:
            time.sleep(0.05)


# ------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "value, message",
    [
        ("3:2", r"MIN 3 is larger than MAX 2"),
        ("0:2", r"the minimum must be >= 1, got 0"),
        ("0", r"must be an int >= 1, got 0"),
        ("two", r"must be an integer N or a range MIN:MAX .*got 'two'"),
        ("1:2:3", r"got '1:2:3'"),
    ],
)
def test_bad_ranges_name_the_value(value: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Bounds.parse(value, "-n")


def test_ranges_parse_as_torchrun_writes_them() -> None:
    assert Bounds.parse("2:4", "--nnodes") == Bounds(2, 4) and Bounds.parse("2:4", "x").elastic
    assert Bounds.parse(3, "-n") == Bounds(3, 3) and not Bounds.parse("3", "-n").elastic


@pytest.mark.parametrize(
    "argv, message",
    [
        (["-n", "3:2"], "the number of workers (-n) 3:2: MIN 3 is larger than MAX 2"),
        (["--nnodes", "0:2", "--master", "127.0.0.1:1"], "the number of nodes (--nnodes) 0:2: the minimum must be"),
        (["-n", "1:2", "--nnodes", "2:3", "--master", "127.0.0.1:1"], "give the range of nodes (--nnodes MIN:MAX)"),
        (["--nnodes", "2:3"], "--nnodes 2:3 needs --master HOST:PORT"),
    ],
)
def test_the_cli_refuses_a_bad_range_before_anything_starts(tmp_path, capsys, argv, message) -> None:
    script = _script(tmp_path, "open(HERE / 'started', 'w').close()\n")
    assert main([*argv, "--no-isolate-network", str(script)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "started").exists()


# ------------------------------------------------------------------------- one machine


def test_one_machine_goes_on_without_the_worker_that_failed(tmp_path) -> None:
    """-n 2:3: worker 2 fails in the first run (the chief had reached epoch 1, step 7); the job goes on with workers
    0 and 1, told what changed and where the chief was; a second failure would leave 1 < MIN: the job then ends."""
    script = _script(
        tmp_path,
        """
        if RUN == 0:
            if INDEX == 0:
                Path(os.environ["PARAML_PROGRESS_FILE"]).write_text("1 7\\n")
            if INDEX == 2:
                sys.exit(3)
            hold()
        if RUN == 1 and INDEX == 1:
            sys.exit(4)
        hold()
        """,
    )
    err = io.StringIO()
    with fails_after(60, "the launch"):
        code = launch(str(script), [], "2:3", max_restarts=3, stop_timeout=2, out=io.StringIO(), err=err)
    assert code == 4, err.getvalue()
    lines = err.getvalue()
    assert "worker 2 exited with code 3; worker 2 left: 3 -> 2 workers, restart 1 of 3" in lines
    assert "worker 1 exited with code 4; 1 worker(s) left, fewer than -n 2:3: the job ends" in lines
    assert sorted(_seen(tmp_path, 0)) == [0, 1, 2]
    second = _seen(tmp_path, 1)
    assert sorted(second) == [0, 1]
    assert all(s["cluster"] == 2 and s["PARAML_NUM_WORKERS"] == "2" for s in second.values())
    assert second[0]["PARAML_RESIZE"] == "worker 2 left: 3 -> 2 workers" and second[0]["PARAML_REACHED"] == "1 7"
    assert not _seen(tmp_path, 2)


def test_a_fixed_size_launch_still_restarts_every_worker(tmp_path) -> None:
    """Without a range nothing changes: a failure restarts all 2 workers, and they get no resize."""
    script = _script(tmp_path, "sys.exit(5 if RUN == 0 and INDEX == 1 else 0)\n")
    with fails_after(60, "the launch"):
        assert launch(str(script), [], 2, max_restarts=1, stop_timeout=2, out=io.StringIO(), err=io.StringIO()) == 0
    second = _seen(tmp_path, 1)
    assert sorted(second) == [0, 1] and second[0]["PARAML_RESIZE"] == ""


# ------------------------------------------------------------------------- several nodes


def _node(script: Path, master: str, rank: int, results: dict[int, int], errs: dict[int, io.StringIO]) -> None:
    errs[rank] = io.StringIO()
    results[rank] = launch(
        str(script),
        [],
        1,
        nnodes="2:3",
        node_rank=min(rank, 1),
        master=master,
        stop_timeout=5,
        out=io.StringIO(),
        err=errs[rank],
    )


def test_a_node_that_comes_joins_at_once_and_a_stopped_node_leaves(tmp_path) -> None:
    """--nnodes 2:3, one worker a node, three launchers as three nodes: nodes 0 and 1 form the first run; node 2's
    arrival stops it (SIGTERM to every worker) and the second run has 3 workers, told "node 2 joined: 2 -> 3"; a
    SIGTERM to node 2's launcher (a preempted machine) makes it leave, and the third run of 2 workers finishes."""
    script = _script(tmp_path, "hold() if RUN < 2 else sys.exit(0)\n")
    master = f"127.0.0.1:{find_free_ports(1)[0]}"
    results: dict[int, int] = {}
    errs: dict[int, io.StringIO] = {}
    nodes = [threading.Thread(target=_node, args=(script, master, r, results, errs), daemon=True) for r in (0, 1)]
    for node in nodes:
        node.start()
    _wait_for(tmp_path / "run0-w*.json", 2)
    # The third node runs as a process of its own, so that it can be sent SIGTERM.
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    argv = ["-m", "paraml", "launch", "-n", "1", "--nnodes", "2:3", "--node-rank", "2", "--master", master]
    pipes = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE}
    third = subprocess.Popen([sys.executable, *argv, str(script)], env=env, **pipes)
    try:
        _wait_for(tmp_path / "run1-w*.json", 3)
        assert all(s["cluster"] == 3 for s in _seen(tmp_path, 1).values())
        assert _seen(tmp_path, 1)[0]["PARAML_RESIZE"] == "node 2 joined: 2 -> 3 workers"
        third.send_signal(signal.SIGTERM)
        assert third.wait(timeout=30) == 128 + signal.SIGTERM
        for node in nodes:
            node.join(timeout=30)
    finally:
        if third.poll() is None:
            third.kill()
    assert results == {0: 0, 1: 0}, {r: e.getvalue() for r, e in errs.items()}
    last = _seen(tmp_path, 2)
    assert sorted(last) == [0, 1] and last[1]["PARAML_RESIZE"] == "node 2 left: 3 -> 2 workers"
    assert "not a restart" in errs[0].getvalue()  # neither the join nor the node stopped on purpose takes a restart


# ------------------------------------------------------------------------- training through resizes


def _launch_training(out: Path, launcher: list[str], script_args: list[str], timeout: float = 400):
    out.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("TF_CONFIG", None)
    command = [sys.executable, "-m", "paraml", "launch", *launcher, str(SCRIPTS / "restart_train.py"), str(out)]
    return subprocess.Popen(
        [*command, "--shard-optimizer", "--epochs", "2", *script_args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _events(out: Path) -> list[dict[str, object]]:
    path = out / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.fixture(scope="module")
def uninterrupted():
    """What the job must end with: 2 epochs of the script's training from its initial weights on one process
    (mirrored on 2 devices: the same global batches), and Adam's whole state."""
    import keras

    from paraml import Parallel, load_digits
    from paraml.demo import digits_model

    def make(initial):
        par = Parallel("mirrored", devices=2, seed=0)
        par.build(digits_model, optimizer="adam", loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        par.model.set_weights(initial)
        return par

    def run(initial):
        par = make(initial)
        (x, y), _ = load_digits()
        par.fit(x, y, batch_size=64, epochs=2, verbose=0)
        return par.model.get_weights(), [v.numpy() for v in par.model.optimizer.variables]

    return make, run


def _assert_equal_to_uninterrupted(out: Path, uninterrupted) -> None:
    import numpy as np

    make, run = uninterrupted
    initial = np.load(out / "initial.npz")
    weights, state = run([initial[k] for k in initial.files])
    got = np.load(out / "weights.npz")
    for name, want in zip(got.files, weights):
        np.testing.assert_allclose(got[name], want, rtol=1e-5, atol=1e-6)
    restored = make([initial[k] for k in initial.files])
    restored.restore(out / "final")  # every worker's shard of the sharded Adam state, read whole
    assert len(restored.model.optimizer.variables) == len(state)
    for variable, want in zip(restored.model.optimizer.variables, state):
        np.testing.assert_allclose(variable.numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_a_worker_lost_in_the_second_epoch_leaves_a_job_that_ends_as_if_nothing_happened(tmp_path, uninterrupted):
    """-n 2:3 with ZeRO-1 across the workers, checkpoints every 5 steps; worker 2 SIGKILLs itself after global step
    30 (epoch 2 of 2): the job goes on with 2 workers from the last checkpoint (each reads its new share of the Adam
    slots 3 workers wrote), finishes, and equals the uninterrupted run; the steps lost are at most 5."""
    out = tmp_path / "shrink"
    launcher = ["-n", "2:3", "--max-restarts", "1", "--stop-timeout", "3"]
    job = _launch_training(out, launcher, ["--checkpoint-every", "5", "--kill", "0:2:30"])
    stdout, stderr = job.communicate(timeout=400)
    assert job.returncode == 0, stdout[-3000:] + stderr[-3000:]
    assert "worker 2 left: 3 -> 2 workers, restart 1 of 1" in stderr
    line = re.search(r"\[worker 0\] paraml: resized \(worker 2 left: 3 -> 2 workers\); layout: 2 workers, (.*)", stdout)
    assert line is not None, stdout[-3000:]
    lost = int(re.search(r"; (\d+) steps? lost \(the last run reached epoch 1, step 7\)", line.group(1)).group(1))
    first = {e["worker"]: e["step"] for e in _events(out) if e["event"] == "first_step" and e["restart"] == 1}
    assert first == {0: 31 - lost, 1: 31 - lost} and 0 <= lost <= 5  # measured: the resumed run's first step
    assert "ZeRO-1" in line.group(1)
    _assert_equal_to_uninterrupted(out, uninterrupted)


@pytest.mark.slow
def test_a_node_that_joins_after_the_first_epoch_goes_on_from_where_the_job_stood(tmp_path, uninterrupted):
    """--nnodes 2:3 with one worker a node: after epoch 1 both workers wait; a third node comes, the launcher stops
    the run (every worker saves at the next step), and the job goes on with 3 workers from that checkpoint (no step
    lost, none run twice) to the uninterrupted run's weights and Adam state."""
    out = tmp_path / "grow"
    master = f"127.0.0.1:{find_free_ports(1)[0]}"
    nodes = ["-n", "1", "--nnodes", "2:3", "--master", master, "--stop-timeout", "20"]
    jobs = [_launch_training(out, [*nodes, "--node-rank", str(r)], ["--hold-after-epoch", "1"]) for r in (0, 1)]
    joiner = None
    try:
        with fails_after(240, "the first epoch"):
            while len([e for e in _events(out) if e["event"] == "epoch_end" and e["epoch"] == 1]) < 2:
                assert all(j.poll() is None for j in jobs), jobs[0].stderr.read() if jobs[0].stderr else ""
                time.sleep(0.2)
        joiner = _launch_training(out, [*nodes, "--node-rank", "2"], [])
        results = [j.communicate(timeout=400) for j in (*jobs, joiner)]
    finally:
        for job in [*jobs, joiner]:
            if job is not None and job.poll() is None:
                job.kill()
    assert [j.returncode for j in (*jobs, joiner)] == [0, 0, 0], results[0][0][-3000:] + results[0][1][-3000:]
    stdout = results[0][0]
    assert "paraml: resized (node 2 joined: 2 -> 3 workers); layout: 3 workers" in stdout
    assert "; 0 steps lost (the last run reached epoch 1, step " in stdout
    events = _events(out)
    stopped = max(e["step"] for e in events if e["restart"] == 0 and e["event"] in ("first_step", "released"))
    first = {e["worker"]: e["step"] for e in events if e["event"] == "first_step" and e["restart"] == 1}
    assert set(first) == {0, 1, 2} and len(set(first.values())) == 1 and stopped == 23
    assert next(iter(first.values())) in (24, 25)  # the run stopped at the step after the hold, saved, went on
    _assert_equal_to_uninterrupted(out, uninterrupted)
