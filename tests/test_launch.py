"""Tests for paraml.cluster.launch, the local multi-worker launcher.

The workers are tiny Python scripts written to tmp_path (no TensorFlow), except
one restart test that trains with TensorFlow (tests/scripts/restart_train.py).
Each test is bounded to 60 s by a SIGALRM guard (more with @_time_limit);
subprocess-based tests also pass a timeout.
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from conftest import fails_after

from paraml.cluster.launch import (
    PortUnavailableError,
    add_arguments,
    find_free_ports,
    isolation_prefix,
    launch,
    main,
    run_from_args,
)

SRC = Path(__file__).resolve().parents[1] / "src"
SCRIPTS = Path(__file__).resolve().parent / "scripts"
LAUNCH_PY = SRC / "paraml" / "cluster" / "launch.py"

# Shared start of every worker script: record the PID atomically, so the test can
# check afterwards that the process is gone, and offer a bounded wait for a file.
PREAMBLE = """\
import json, os, signal, subprocess, sys, time
from pathlib import Path

INDEX = int(os.environ["PARAML_WORKER_INDEX"])
HERE = Path(__file__).resolve().parent


def publish(name, text):
    tmp = HERE / (name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, HERE / name)


def wait_for(name):
    for _ in range(1200):  # at most ~60 s
        if (HERE / name).exists():
            return
        time.sleep(0.05)
    sys.exit(99)


publish(f"pid{INDEX}", str(os.getpid()))
"""


_F = TypeVar("_F", bound=Callable[..., object])


def _time_limit(seconds: int) -> Callable[[_F], _F]:
    """Give one test a longer limit than 60 s (the TensorFlow launches)."""

    def mark(test: _F) -> _F:
        test.time_limit = seconds  # type: ignore[attr-defined]
        return test

    return mark


@pytest.fixture(autouse=True)
def _sixty_second_limit(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fail (instead of hanging) if a test runs longer than 60 s (or its @_time_limit)."""
    with fails_after(getattr(request.function, "time_limit", 60), "the test"):
        yield


def _script(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "worker.py"
    path.write_text(PREAMBLE + textwrap.dedent(body))
    return path


def _pid(tmp_path: Path, index: int) -> int:
    return int((tmp_path / f"pid{index}").read_text())


def _assert_gone(pid: int) -> None:
    """The worker was our child and launch() reaped it, so the PID must be free."""
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def _is_alive(pid: int) -> bool:
    """Whether a (non-child) process runs; a zombie awaiting its reaper counts as dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True  # no /proc: cannot tell a zombie apart, assume alive
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _free_port_range(n: int) -> int:
    """A first port p such that p..p+n-1 are all currently free on 127.0.0.1."""
    for _ in range(50):
        first = find_free_ports(1)[0]
        if first + n - 1 > 65535:
            continue
        socks = []
        try:
            for port in range(first, first + n):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    pytest.fail(f"could not find {n} consecutive free ports")


# --------------------------------------------------------------------------- running


def test_two_workers_get_their_index_and_prefixed_output(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        config = json.loads(os.environ["TF_CONFIG"])
        print(f"index={INDEX} task={config['task']['index']}"
              f" num={os.environ['PARAML_NUM_WORKERS']}"
              f" unbuffered={os.environ['PYTHONUNBUFFERED']}")
        print("cluster=" + json.dumps(config["cluster"]["worker"]))
        print(f"to-stderr {INDEX}", file=sys.stderr)
        """,
    )
    out = io.StringIO()
    sigterm_before = signal.getsignal(signal.SIGTERM)

    assert launch(str(script), num_workers=2, out=out) == 0

    lines = out.getvalue().splitlines()
    assert "[worker 0] index=0 task=0 num=2 unbuffered=1" in lines
    assert "[worker 1] index=1 task=1 num=2 unbuffered=1" in lines
    assert "[worker 0] to-stderr 0" in lines
    assert "[worker 1] to-stderr 1" in lines
    clusters = [json.loads(line.split("cluster=", 1)[1]) for line in lines if "cluster=" in line]
    assert len(clusters) == 2
    assert clusters[0] == clusters[1]  # every worker sees the same cluster
    hosts_ports = [address.rsplit(":", 1) for address in clusters[0]]
    assert [host for host, _ in hosts_ports] == ["127.0.0.1", "127.0.0.1"]
    assert len({port for _, port in hosts_ports}) == 2
    # launch() restores the SIGTERM disposition it borrowed
    assert signal.getsignal(signal.SIGTERM) == sigterm_before


def test_args_and_env_are_passed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script(
        tmp_path,
        """
        print("argv=" + json.dumps(sys.argv[1:]))
        print("mine=" + str(os.environ.get("MY_VAR")))
        print("outer=" + str(os.environ.get("PARAML_TEST_OUTER")))
        """,
    )
    monkeypatch.setenv("PARAML_TEST_OUTER", "leaked")
    env = {"PATH": os.environ.get("PATH", ""), "MY_VAR": "hello"}
    out = io.StringIO()

    code = launch(str(script), ["--lr", "0.1", "x y"], num_workers=1, env=env, out=out)

    assert code == 0
    lines = out.getvalue().splitlines()
    assert '[worker 0] argv=["--lr", "0.1", "x y"]' in lines
    assert "[worker 0] mine=hello" in lines
    assert "[worker 0] outer=None" in lines  # env replaces os.environ, it is not merged


def test_launch_waits_for_every_worker_to_succeed(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        if INDEX == 1:
            wait_for("pid0")  # worker 0 has started (and may already be done)
            time.sleep(0.3)
            publish("slow-done", "1")
        """,
    )
    assert launch(str(script), num_workers=2, out=io.StringIO()) == 0
    assert (tmp_path / "slow-done").exists()


def test_failing_worker_stops_a_sleeping_worker(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        if INDEX == 1:
            wait_for("pid0")
            raise RuntimeError("boom in worker 1")
        time.sleep(1000)
        """,
    )
    out = io.StringIO()

    code = launch(str(script), num_workers=2, stop_timeout=5, out=out)

    assert code == 1  # Python's exit code for an uncaught exception
    text = out.getvalue()
    assert "[worker 1] RuntimeError: boom in worker 1" in text
    assert "[paraml launch] worker 1 exited with code 1; stopping the others" in text
    _assert_gone(_pid(tmp_path, 0))
    _assert_gone(_pid(tmp_path, 1))


def test_a_failure_ends_with_a_summary_and_the_others_secondary_errors_cut_short(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        print("I0000 00:00:1796279575.740511   28097 cudart_stub.cc:31] Could not find cuda drivers", file=sys.stderr)
        print("WARNING: All log messages before absl::InitializeLog() is called are written to STDERR", file=sys.stderr)
        if INDEX == 1:
            wait_for("pid0")
            time.sleep(0.5)
            raise ValueError("the real cause")
        signal.signal(signal.SIGTERM, lambda *_: (print("\\n".join(f"secondary {i}" for i in range(40))), sys.exit(3)))
        time.sleep(1000)
        """,
    )
    out, err = io.StringIO(), io.StringIO()
    assert launch(str(script), num_workers=2, stop_timeout=5, out=out, err=err) == 1
    text = out.getvalue()
    assert "cudart_stub" not in text and "absl::InitializeLog" not in text  # TensorFlow's own logging left out
    assert "[worker 0] secondary 4" in text and "[worker 0] secondary 5" not in text
    summary = err.getvalue().strip().splitlines()[-1]
    assert summary.startswith("paraml launch: worker 1 failed first: it exited with code 1; its last error line: ")
    assert "ValueError: the real cause" in summary and "35 lines the other workers printed after it" in summary


def test_paraml_log_keeps_every_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = _script(tmp_path, 'print("I0000 00:00:17.5   2 port.cc:153] oneDNN custom operations are on.")\n')
    monkeypatch.setenv("PARAML_LOG", "1")
    out = io.StringIO()
    assert launch(str(script), num_workers=1, out=out) == 0
    assert "[worker 0] I0000 00:00:17.5   2 port.cc:153] oneDNN custom operations are on." in out.getvalue()


def test_worker_ignoring_sigterm_in_a_busy_loop_is_killed(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        if INDEX == 1:
            wait_for("ready0")
            sys.exit(3)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        publish("ready0", "1")
        while True:
            pass
        """,
    )
    out = io.StringIO()

    code = launch(str(script), num_workers=2, stop_timeout=0.5, out=out)

    assert code == 3  # the failing worker's exit code is propagated
    text = out.getvalue()
    assert "[paraml launch] worker 1 exited with code 3; stopping the others" in text
    assert "worker(s) 0 still running after 0.5 s; killing them" in text
    _assert_gone(_pid(tmp_path, 0))


def test_worker_killed_by_signal_returns_128_plus_signum(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        if INDEX == 1:
            wait_for("pid0")
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(1000)
        """,
    )
    out = io.StringIO()

    code = launch(str(script), num_workers=2, stop_timeout=5, out=out)

    assert code == 128 + signal.SIGKILL
    assert "worker 1 was killed by SIGKILL" in out.getvalue()
    _assert_gone(_pid(tmp_path, 0))


def test_children_of_workers_are_killed_too(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        if INDEX == 1:
            wait_for("grandchild")
            sys.exit(2)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
        publish("grandchild", str(child.pid))
        time.sleep(1000)
        """,
    )

    assert launch(str(script), num_workers=2, stop_timeout=5, out=io.StringIO()) == 2

    grandchild = int((tmp_path / "grandchild").read_text())
    for _ in range(200):  # SIGKILL was sent; allow up to ~10 s for it to take effect
        if not _is_alive(grandchild):
            break
        time.sleep(0.05)
    assert not _is_alive(grandchild)


def test_single_worker_failure_exit_code(tmp_path: Path) -> None:
    script = _script(tmp_path, "sys.exit(7)\n")
    out = io.StringIO()
    assert launch(str(script), num_workers=1, out=out) == 7
    assert "[paraml launch] worker 0 exited with code 7\n" in out.getvalue()


def test_explicit_port_range_is_used(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        """
        print("cluster=" + json.dumps(json.loads(os.environ["TF_CONFIG"])["cluster"]))
        """,
    )
    first = _free_port_range(2)
    out = io.StringIO()

    assert launch(str(script), num_workers=2, port=first, out=out) == 0

    expected = {"worker": [f"127.0.0.1:{first}", f"127.0.0.1:{first + 1}"]}
    assert f"[worker 1] cluster={json.dumps(expected)}" in out.getvalue().splitlines()


@pytest.mark.parametrize(("sig", "expected"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_launcher_stops_workers(tmp_path: Path, sig: int, expected: int) -> None:
    """Ctrl-C (SIGINT) and SIGTERM to the launcher are forwarded; no worker survives."""
    script = _script(tmp_path, "time.sleep(1000)\n")
    # SIGINT may be ignored when tests run in the background; restore Python's default.
    code = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from paraml.cluster.launch import main; "
        f"sys.exit(main(['-n', '2', '--stop-timeout', '5', {str(script)!r}]))"
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", code],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(1000):  # both workers are up within ~50 s
            if all((tmp_path / f"pid{i}").exists() for i in range(2)) or launcher.poll() is not None:
                break
            time.sleep(0.05)
        assert launcher.poll() is None, "launcher ended before its workers started"
        launcher.send_signal(sig)
        stdout, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()

    assert launcher.returncode == expected, stderr.decode()
    assert f"[paraml launch] received {signal.Signals(sig).name}" in stdout.decode()
    for index in range(2):
        _assert_gone(_pid(tmp_path, index))


# ------------------------------------------------------------------------ validation


@pytest.mark.parametrize("n", [0, -1])
def test_num_workers_must_be_positive(tmp_path: Path, n: int) -> None:
    script = _script(tmp_path, "")
    with pytest.raises(ValueError, match=f"got {n}"):
        launch(str(script), num_workers=n, out=io.StringIO())
    assert not (tmp_path / "pid0").exists()


def test_missing_script(tmp_path: Path) -> None:
    missing = tmp_path / "nope.py"
    with pytest.raises(FileNotFoundError, match="nope.py"):
        launch(str(missing), out=io.StringIO())


def test_args_must_not_be_a_string(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="not the string"):
        launch(str(_script(tmp_path, "")), "--lr", out=io.StringIO())


def test_port_in_use_is_reported_before_starting(tmp_path: Path) -> None:
    script = _script(tmp_path, "")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(PortUnavailableError, match=f"port {port} on 127.0.0.1") as excinfo:
            launch(str(script), num_workers=1, port=port, out=io.StringIO())
    assert isinstance(excinfo.value, OSError)
    assert not (tmp_path / "pid0").exists()  # nothing was started


def test_port_range_must_fit(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="65535..65536"):
        launch(str(_script(tmp_path, "")), num_workers=2, port=65535, out=io.StringIO())


def test_find_free_ports() -> None:
    ports = find_free_ports(3)
    assert len(ports) == 3
    assert len(set(ports)) == 3
    assert all(1 <= port <= 65535 for port in ports)
    assert find_free_ports(0) == []
    with pytest.raises(ValueError, match="got -1"):
        find_free_ports(-1)


# ------------------------------------------------------------------------------ CLI


def test_main_runs_the_script(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(tmp_path, 'print("argv=" + json.dumps(sys.argv[1:]))\n')
    assert main(["-n", "1", str(script), "-n", "5", "--flag"]) == 0
    assert '[worker 0] argv=["-n", "5", "--flag"]' in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["-n", "0", "{script}"], "number of workers (-n) must be an int >= 1, got 0"),
        (["{missing}"], "script not found: {missing}"),
        (["--port", "65535", "-n", "2", "{script}"], "65535..65536"),
        (["--nnodes", "2", "{script}"], "--nnodes 2 needs --master HOST:PORT"),
        (["--nnodes", "0", "{script}"], "number of nodes (--nnodes) must be an int >= 1, got 0"),
        (["--nnodes", "2", "--node-rank", "2", "--master", "h:1", "{script}"], "in 0..1, got 2"),
        (["--nnodes", "2", "--master", "h", "{script}"], '--master is "h", not "HOST:PORT"'),
        (["--nnodes", "2", "--master", "h:1", "--isolate-network", "{script}"], "cannot be used with --nnodes > 1"),
    ],
)
def test_main_reports_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], fragment: str
) -> None:
    names = {
        "script": str(_script(tmp_path, "")),
        "missing": str(tmp_path / "missing.py"),
    }
    argv = [arg.format(**names) for arg in argv]

    assert main(argv) == 2

    err = capsys.readouterr().err
    assert err.startswith("paraml launch: error: ")
    assert fragment.format(**names) in err
    assert err.count("\n") == 1  # one line, no traceback


def test_main_reports_port_in_use(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    script = _script(tmp_path, "")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["-n", "1", "--port", str(port), str(script)]) == 2
    err = capsys.readouterr().err
    assert f"paraml launch: error: port {port} on 127.0.0.1 is not available" in err


def test_main_usage_error_returns_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-n", "abc", "x.py"]) == 2
    assert "must be an integer N or a range MIN:MAX (for example 2:4), got 'abc'" in capsys.readouterr().err


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    )
    result = subprocess.run(
        [sys.executable, "-m", "paraml.cluster.launch", "-n", "0", str(tmp_path / "x.py")],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "paraml launch: error: the number of workers (-n) must be" in result.stderr


def test_run_from_args_with_a_subparser(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """How the paraml CLI uses this module: add_arguments on a subparser, then run_from_args."""
    parser = argparse.ArgumentParser(prog="paraml")
    sub = parser.add_subparsers(dest="command", required=True)
    add_arguments(sub.add_parser("launch"))
    script = _script(tmp_path, 'print("n=" + os.environ["PARAML_NUM_WORKERS"])\n')

    ns = parser.parse_args(["launch", "--num-workers", "3", "--stop-timeout", "2", str(script), "a"])

    assert (ns.num_workers, ns.port, ns.stop_timeout, ns.script_args) == (
        3,
        None,
        2.0,
        ["a"],
    )
    assert run_from_args(ns) == 0
    assert capsys.readouterr().out.count("n=3\n") == 3


def test_module_does_not_import_tensorflow() -> None:
    tree = ast.parse(LAUNCH_PY.read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert "subprocess" in imported  # sanity: the walk found the module's imports
    assert imported.isdisjoint({"tensorflow", "keras"})


LISTENER = """
import os, socket, sys, time
s = socket.socket(); s.bind(("0.0.0.0", 0)); s.listen()
open(os.path.join(sys.argv[1], "port" + os.environ["PARAML_WORKER_INDEX"]), "w").write(str(s.getsockname()[1]))
for _ in range(300):
    if os.path.exists(os.path.join(sys.argv[1], "done")):
        break
    time.sleep(0.1)
"""


def _reachable_from_here(tmp_path, *flags):
    """Start 2 workers that listen on every interface; can this (outer) namespace connect to worker 0?"""
    script = tmp_path / "listen.py"
    script.write_text(LISTENER)
    proc = subprocess.Popen(
        [sys.executable, "-m", "paraml.cluster.launch", "-n", "2", *flags, str(script), str(tmp_path)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    port_file = tmp_path / "port0"
    try:
        for _ in range(300):
            if port_file.exists() and port_file.read_text():
                break
            time.sleep(0.1)
        with socket.socket() as client:
            client.settimeout(5)
            try:
                client.connect(("127.0.0.1", int(port_file.read_text())))
                return True
            except ConnectionRefusedError:
                return False
    finally:
        (tmp_path / "done").write_text("")
        assert proc.wait(timeout=60) == 0


@pytest.mark.skipif(isolation_prefix() is None, reason="no unshare / user namespaces on this machine")
def test_workers_are_reachable_only_from_each_other_by_default(tmp_path):
    assert not _reachable_from_here(tmp_path)


def test_no_isolate_network_leaves_the_ports_on_the_machine(tmp_path):
    assert _reachable_from_here(tmp_path, "--no-isolate-network")


GRACEFUL = """
import signal, sys, time
def stop(signum, frame):
    print("cleaning up", flush=True)
    time.sleep(0.3)
    print("clean exit", flush=True)
    sys.exit(130)
signal.signal(signal.SIGINT, stop)
print("ready", flush=True)
time.sleep(60)
"""


def test_ctrl_c_to_the_terminal_group_stops_workers_gracefully(tmp_path):
    """A terminal sends SIGINT to the whole foreground group; with network isolation each worker still gets it once."""
    script = tmp_path / "graceful.py"
    script.write_text(GRACEFUL)
    proc = subprocess.Popen(
        [sys.executable, "-m", "paraml.cluster.launch", "-n", "2", str(script)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    ready = 0
    for line in proc.stdout:
        ready += "ready" in line
        if ready == 2:
            break
    os.killpg(proc.pid, signal.SIGINT)
    output = proc.stdout.read()
    assert proc.wait(timeout=60) == 130
    assert output.count("clean exit") == 2


# ------------------------------------------------------------------------- restarts

# Each run of a worker records its PID under its restart count, so every process of every run can be checked.
RESTART_PIDS = """
RESTART = int(os.environ["PARAML_RESTART"])
publish(f"pid{INDEX}-r{RESTART}", str(os.getpid()))
"""


def _run_pids(tmp_path: Path) -> dict[str, int]:
    return {p.name: int(p.read_text()) for p in tmp_path.glob("pid*-r*") if p.suffix != ".tmp"}


def test_a_worker_that_dies_once_is_restarted_with_every_other(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        RESTART_PIDS
        + textwrap.dedent(
            """
        print(f"run {RESTART} cluster=" + json.dumps(json.loads(os.environ["TF_CONFIG"])["cluster"]))
        if RESTART == 0:
            if INDEX == 1:
                wait_for("pid0-r0")
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(1000)  # worker 0 of the first run would wait forever: the launcher must stop it
        print(f"finished run {RESTART}")
        """
        ),
    )
    out, err = io.StringIO(), io.StringIO()

    code = launch(str(script), num_workers=2, stop_timeout=5, max_restarts=2, out=out, err=err)

    assert code == 0
    assert err.getvalue() == "paraml launch: worker 1 was killed by SIGKILL (exit code 137); restart 1 of 2\n"
    text = out.getvalue()
    assert "[paraml launch] worker 1 was killed by SIGKILL (exit code 137); stopping the others" in text
    assert "[worker 0] finished run 1" in text and "[worker 1] finished run 1" in text
    assert "run 2" not in text  # one restart was enough
    pids = _run_pids(tmp_path)
    assert sorted(pids) == ["pid0-r0", "pid0-r1", "pid1-r0", "pid1-r1"]
    for pid in pids.values():
        _assert_gone(pid)
    clusters = [line.split("cluster=", 1)[1] for line in text.splitlines() if "cluster=" in line]
    assert len(clusters) == 4 and len(set(clusters)) <= 2  # each run: one cluster shared by its workers


def test_restarts_run_out_and_the_last_failure_code_is_returned(tmp_path: Path) -> None:
    script = _script(
        tmp_path,
        RESTART_PIDS
        + textwrap.dedent(
            """
        if INDEX == 1:
            wait_for(f"pid0-r{RESTART}")  # the sibling of this run has started, so every run leaves its pid
            sys.exit(3 + RESTART)  # fails on every run, with a different code each time
        time.sleep(1000)
        """
        ),
    )
    err = io.StringIO()

    code = launch(str(script), num_workers=2, stop_timeout=5, max_restarts=2, out=io.StringIO(), err=err)

    assert code == 5  # the third (last) run's failure
    assert err.getvalue().splitlines() == [
        "paraml launch: worker 1 exited with code 3; restart 1 of 2",
        "paraml launch: worker 1 exited with code 4; restart 2 of 2",
        "paraml launch: worker 1 exited with code 5; no restarts left (2 used)",
        "paraml launch: worker 1 failed first: it exited with code 5",  # it printed nothing on stderr
    ]
    pids = _run_pids(tmp_path)
    assert len(pids) == 6
    for pid in pids.values():
        _assert_gone(pid)


def test_without_max_restarts_nothing_is_restarted(tmp_path: Path) -> None:
    script = _script(tmp_path, RESTART_PIDS + "sys.exit(4)\n")
    err = io.StringIO()
    assert launch(str(script), num_workers=1, out=io.StringIO(), err=err) == 4
    assert err.getvalue() == "paraml launch: worker 0 failed first: it exited with code 4\n"  # the summary only
    assert sorted(_run_pids(tmp_path)) == ["pid0-r0"]


@pytest.mark.parametrize("bad", [-1, 1.5, True, "2"])
def test_max_restarts_must_be_a_non_negative_int(tmp_path: Path, bad: object) -> None:
    script = _script(tmp_path, "")
    with pytest.raises(ValueError, match=f"--max-restarts.*got {bad!r}"):
        launch(str(script), num_workers=1, max_restarts=bad, out=io.StringIO())  # type: ignore[arg-type]
    assert not (tmp_path / "pid0").exists()


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        ("-1", "paraml launch: error: the number of restarts (--max-restarts) must be an int >= 0, got -1"),
        ("two", "argument --max-restarts: invalid int value: 'two'"),
    ],
)
def test_main_reports_a_bad_max_restarts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], value: str, fragment: str
) -> None:
    script = _script(tmp_path, "")
    assert main(["--max-restarts", value, str(script)]) == 2
    assert fragment in capsys.readouterr().err
    assert not (tmp_path / "pid0").exists()  # nothing was started


def test_the_cli_passes_max_restarts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from paraml.cli import main as paraml_main

    script = _script(tmp_path, RESTART_PIDS + "sys.exit(0 if RESTART == 1 else 6)\n")
    argv = ["launch", "-n", "1", "--no-isolate-network", "--max-restarts", "1", str(script)]
    assert paraml_main(argv) == 0
    assert "paraml launch: worker 0 exited with code 6; restart 1 of 1" in capsys.readouterr().err


def test_a_signal_to_the_launcher_is_never_restarted(tmp_path: Path) -> None:
    script = _script(tmp_path, RESTART_PIDS + "time.sleep(1000)\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]))
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "paraml.cluster.launch",
            "-n",
            "2",
            "--max-restarts",
            "3",
            "--stop-timeout",
            "5",
            str(script),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        for _ in range(1000):
            if len(_run_pids(tmp_path)) == 2 or launcher.poll() is not None:
                break
            time.sleep(0.05)
        assert launcher.poll() is None, "launcher ended before its workers started"
        launcher.send_signal(signal.SIGTERM)
        stdout, stderr = launcher.communicate(timeout=60)
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    assert launcher.returncode == 143, stderr.decode()
    assert "restart" not in stderr.decode()
    pids = _run_pids(tmp_path)
    assert sorted(pids) == ["pid0-r0", "pid1-r0"]
    for pid in pids.values():
        assert not _is_alive(pid)  # the workers were the inner launcher's children


@pytest.mark.skipif(isolation_prefix() is None, reason="no unshare / user namespaces on this machine")
def test_the_isolated_launch_restarts_too(tmp_path: Path) -> None:
    # Worker 1 fails once worker 0 has started (on a loaded machine it could fail before worker 0 ran a line).
    fail = "if (RESTART, INDEX) == (0, 1):\n    wait_for('pid0-r0')\n    sys.exit(9)\n"
    script = _script(tmp_path, RESTART_PIDS + fail)
    done = subprocess.run(
        [sys.executable, "-m", "paraml.cluster.launch", "-n", "2", "--max-restarts", "1", str(script)],
        capture_output=True,
        text=True,
        timeout=60,
        env=dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])),
    )
    assert done.returncode == 0, done.stderr
    assert "no private network namespace" not in done.stderr  # it really ran isolated
    assert "paraml launch: worker 1 exited with code 9; restart 1 of 1" in done.stderr
    assert sorted(_run_pids(tmp_path)) == ["pid0-r0", "pid0-r1", "pid1-r0", "pid1-r1"]


def _launch_training(out: Path, launch_args: list[str], script_args: list[str]) -> subprocess.CompletedProcess[str]:
    out.mkdir()
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    command = [sys.executable, "-m", "paraml", "launch", "-n", "2", "--stop-timeout", "2", *launch_args]
    return subprocess.run(
        [*command, str(SCRIPTS / "restart_train.py"), str(out), *script_args],
        capture_output=True,
        text=True,
        timeout=400,
        env=env,
    )


@_time_limit(480)
@pytest.mark.slow
def test_a_killed_worker_resumes_from_the_checkpoint_with_the_uninterrupted_weights(tmp_path: Path) -> None:
    """paraml launch -n 2 --max-restarts 2, worker 1 SIGKILLs itself once in epoch 2 (of 0..2): the launch exits 0
    and the chief's final weights equal an uninterrupted launch's; no process of the job outlives the launch. The
    faulted run writes its checkpoints in the background (async_checkpoint=True), the uninterrupted one does not."""
    import numpy as np

    reference = _launch_training(tmp_path / "reference", [], [])
    assert reference.returncode == 0, reference.stderr[-3000:]
    # 23 steps an epoch (1,438 samples, global batch 64): step 51 is in the middle of epoch 2.
    faulted = _launch_training(tmp_path / "faulted", ["--max-restarts", "2"], ["--kill", "0:1:51", "--async"])
    assert faulted.returncode == 0, f"{faulted.stdout[-3000:]}\n{faulted.stderr[-3000:]}"

    assert "paraml launch: worker 1 was killed by SIGKILL (exit code 137); restart 1 of 2" in faulted.stderr
    assert "restart 2 of 2" not in faulted.stderr
    events = [json.loads(line) for line in (tmp_path / "faulted" / "events.jsonl").read_text().splitlines()]
    kills = [e for e in events if e["event"] == "kill"]
    assert [(e["restart"], e["worker"], e["step"]) for e in kills] == [(0, 1, 51)]
    resumed = {e["worker"]: e["step"] for e in events if e["event"] == "first_step" and e["restart"] == 1}
    assert resumed == {0: 47, 1: 47}  # from the checkpoint at the end of epoch 1, not from step 1

    expected = np.load(tmp_path / "reference" / "weights.npz")
    got = np.load(tmp_path / "faulted" / "weights.npz")
    assert len(got.files) == len(expected.files) > 0
    for name in expected.files:
        np.testing.assert_allclose(got[name], expected[name], rtol=0, atol=1e-5)

    pids = [int(p.read_text()) for p in (tmp_path / "faulted").glob("pid-r*-w*")]
    assert len(pids) == 4  # 2 workers x 2 runs
    for pid in pids:
        _assert_gone(pid)  # the launcher (a child of ours) reaped them all; nothing outlived it


@_time_limit(120)
@pytest.mark.slow
def test_a_missing_worker_ends_the_wait_with_its_name(tmp_path: Path) -> None:
    """A worker whose TF_CONFIG names a task that never starts exits non-zero, naming it, within the timeout; with
    no timeout, SIGTERM still ends the wait."""
    ports = find_free_ports(2)
    tf_config = json.dumps(
        {"cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]}, "task": {"type": "worker", "index": 0}}
    )
    script = tmp_path / "alone.py"
    script.write_text("import paraml\nparaml.Parallel('multi_worker')\nprint('formed')\n")
    env = {**os.environ, "TF_CONFIG": tf_config, "TF_CPP_MIN_LOG_LEVEL": "3", "PARAML_CONNECT_TIMEOUT": "5"}
    # subprocess's timeout bounds the wait: a hang fails the test with TimeoutExpired
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode != 0
    assert f"worker 1 (127.0.0.1:{ports[1]}) never started" in done.stderr and "formed" not in done.stdout
    env["PARAML_CONNECT_TIMEOUT"] = "none"
    waiting = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    time.sleep(8)
    waiting.send_signal(signal.SIGTERM)
    assert waiting.wait(timeout=20) == -signal.SIGTERM


# ------------------------------------------------------------------------- several nodes


def test_nodes_exchange_addresses_and_a_failure_on_one_restarts_every_node(tmp_path: Path) -> None:
    """Two launchers as two "nodes" (2 workers on node 0, 1 on node 1): one cluster of 3; node 1's worker dies in the
    first run, so node 0's sleeping workers are stopped, and both nodes start again, together."""
    script = _script(
        tmp_path,
        RESTART_PIDS
        + textwrap.dedent(
            """
        workers = json.loads(os.environ["TF_CONFIG"])["cluster"]["worker"]
        print(f"run {RESTART}: worker {INDEX} of {os.environ['PARAML_NUM_WORKERS']}, cluster {len(workers)}")
        if RESTART == 0:
            if INDEX == 2:
                wait_for("pid0-r0")
                wait_for("pid1-r0")
                sys.exit(3)
            time.sleep(1000)  # node 0's workers would wait forever: node 1's failure must stop them
        """
        ),
    )
    master = f"127.0.0.1:{find_free_ports(1)[0]}"
    outs = [io.StringIO(), io.StringIO()]
    errs = [io.StringIO(), io.StringIO()]
    codes: list[int | None] = [None, None]

    def node(rank: int, workers: int) -> None:
        codes[rank] = launch(
            str(script),
            [],
            workers,
            nnodes=2,
            node_rank=rank,
            master=master,
            max_restarts=1,
            stop_timeout=5,
            out=outs[rank],
            err=errs[rank],
        )

    threads = [threading.Thread(target=node, args=(rank, n)) for rank, n in ((0, 2), (1, 1))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=50)
    assert codes == [0, 0], [e.getvalue() for e in errs]
    for index in range(3):
        assert f"[worker {index}] run 1: worker {index} of 3, cluster 3" in outs[index // 2].getvalue()
    assert "paraml launch: worker 2 exited with code 3; restart 1 of 1" in errs[1].getvalue()
    assert "paraml launch: node 1 failed first (exit code 3); restart 1 of 1" in errs[0].getvalue()
    assert "another node failed; stopping the workers on this node" in outs[0].getvalue()
    pids = _run_pids(tmp_path)
    assert len(pids) == 6  # 3 workers, 2 runs
    for pid in pids.values():
        _assert_gone(pid)


def test_a_node_whose_master_never_answers_ends_with_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PARAML_CONNECT_TIMEOUT", "0.5")
    master = f"127.0.0.1:{find_free_ports(1)[0]}"
    argv = ["--nnodes", "2", "--node-rank", "1", "--master", master, "-n", "1", str(_script(tmp_path, ""))]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"could not reach the master {master} (--master) within 0.5 s" in err
    assert not list(tmp_path.glob("pid*"))  # no worker started
