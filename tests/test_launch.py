"""Tests for paraml.launch, the local multi-worker launcher.

The workers are tiny Python scripts written to tmp_path (no TensorFlow). Each
test is bounded to 60 s by a SIGALRM guard; subprocess-based tests also pass
timeout=60.
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
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from paraml.launch import (
    PortUnavailableError,
    add_arguments,
    find_free_ports,
    isolation_prefix,
    launch,
    main,
    run_from_args,
)

SRC = Path(__file__).resolve().parents[1] / "src"
LAUNCH_PY = SRC / "paraml" / "launch.py"

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


class _TestTimeout(Exception):
    pass


@pytest.fixture(autouse=True)
def _sixty_second_limit() -> Iterator[None]:
    """Fail (instead of hanging) if a test runs longer than 60 s."""

    def on_alarm(signum: int, frame: object) -> None:
        raise _TestTimeout("test did not finish within 60 s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(60)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


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
        "from paraml.launch import main; "
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
        (["-n", "0", "{script}"], "number of workers must be an integer >= 1, got 0"),
        (["{missing}"], "script not found: {missing}"),
        (["--port", "65535", "-n", "2", "{script}"], "65535..65536"),
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
    assert "invalid int value" in capsys.readouterr().err


def test_python_dash_m_entry_point(tmp_path: Path) -> None:
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
    )
    result = subprocess.run(
        [sys.executable, "-m", "paraml.launch", "-n", "0", str(tmp_path / "x.py")],
        check=False,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "paraml launch: error: the number of workers must be" in result.stderr


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
        [sys.executable, "-m", "paraml.launch", "-n", "2", *flags, str(script), str(tmp_path)],
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
        [sys.executable, "-m", "paraml.launch", "-n", "2", str(script)],
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
