"""Resize time of an elastic ``paraml launch``: how long a job stands still when a worker leaves or a node joins.

Three cases, each a real job of ``tests/scripts/restart_train.py`` (digits, digits_model, Adam with ZeRO-1 across the
workers, global batch 64, 3 epochs of 23 steps, ``fit(checkpoint_dir=...)``):

- ``worker lost``: ``paraml launch -n 2:3`` on one machine, checkpoints every ``--checkpoint-every`` steps; worker 2
  SIGKILLs itself after global step 30. The launcher stops the other two, goes on with 2 from the last checkpoint.
- ``node joins``: ``--nnodes 2:3``, one worker a node; after epoch 1 the two workers wait, a third node starts. The
  launcher stops the run (every worker saves at the next step) and goes on with 3.
- ``node leaves``: ``--nnodes 2:3`` with 3 nodes; after epoch 1 node 2's launcher gets SIGTERM. Its worker saves with
  the others and the job goes on with 2.

Each resize is split, from the times the benchmark sees (it polls the workers' events and their pid files every
5 ms; the worker script keeps no clock):

- ``stop``: from the fault (the kill, the joining node's start, the SIGTERM) until the last worker of the old run has
  exited (its stop checkpoint written, or ``--stop-timeout`` ended it: a survivor of a kill waits in a collective);
- ``re-form``: until the first worker of the new run has started (the launchers agree on the new world);
- ``restore``: until every new worker has begun training (Python and TensorFlow start, the strategy, the build, the
  checkpoint read and resharded);
- ``first step``: until every new worker has done its first step (the step function traced again);
- ``steps lost``: from the resize line the chief prints (``... N steps lost``).

Run by hand, never by the test suite (tests/test_elastic.py checks the same jobs end with an uninterrupted run's
weights and Adam state):

    .venv/bin/python benchmarks/bench_resize.py [--repeats 1] [--stop-timeout 10] [--json PATH] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench_faults import EventClock  # beside this script (its folder is on sys.path when it runs)

from paraml.bench.harness import format_table, int_at_least, write_json
from paraml.cluster.launch import find_free_ports

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "restart_train.py"
CASES = ("worker lost", "node joins", "node leaves")
PHASES = ("stop", "re-form", "restore", "first step")
Events = list[dict[str, Any]]  # what the workers wrote to events.jsonl, each with "t": when it appeared


class Watch(EventClock):
    """:class:`EventClock` on the job's ``events.jsonl``, also stamping each worker process of the first run
    (``pid-r0-w*``) with the time it was gone."""

    def __init__(self, out: Path) -> None:
        self.out, self.gone = out, {}
        super().__init__(out / "events.jsonl")  # starts polling

    def stamp_new_lines(self) -> None:
        super().stamp_new_lines()
        now = time.perf_counter()
        for pid_file in self.out.glob("pid-r0-w*"):
            text = pid_file.read_text().strip()
            if text and pid_file.name not in self.gone and not Path(f"/proc/{text}").exists():
                self.gone[pid_file.name] = now

    def events(self) -> Events:
        """Every event so far, each with ``t``: when it appeared."""
        lines = self.path.read_text().splitlines() if self.path.exists() else []
        return [{**json.loads(line), "t": t} for line, t in zip(lines, self.stamps)]

    def wait_for(self, what: Callable[[Events], bool], jobs: list[subprocess.Popen], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not what(self.events()):
            if time.monotonic() > deadline or any(job.poll() not in (None, 0) for job in jobs):
                raise SystemExit(f"the job never got there (exit codes {[job.poll() for job in jobs]})")
            time.sleep(0.05)


def start(out: Path, launcher: list[str], script: list[str]) -> subprocess.Popen:
    env = {**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"}
    env.pop("TF_CONFIG", None)
    command = [sys.executable, "-m", "paraml", "launch", *launcher, str(WORKER), str(out), "--shard-optimizer"]
    return subprocess.Popen([*command, *script], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def held_after_epoch(count: int) -> Callable[[Events], bool]:
    return lambda events: sum(e["event"] == "epoch_end" and e["epoch"] == 1 for e in events) >= count


def run_case(case: str, out: Path, stop_timeout: float, checkpoint_every: int, timeout: float) -> dict[str, Any]:
    """One job of ``case``: its phases (seconds), the steps lost, and the workers before and after."""
    out.mkdir(parents=True)
    watch = Watch(out)
    grace = ["--stop-timeout", str(stop_timeout)]
    jobs: list[subprocess.Popen] = []
    try:
        if case == "worker lost":
            kill = ["--kill", "0:2:30", "--checkpoint-every", str(checkpoint_every)]
            jobs.append(start(out, ["-n", "2:3", "--max-restarts", "1", *grace], kill))
            watch.wait_for(lambda events: any(e["event"] == "kill" for e in events), jobs, timeout)
            fault = next(e["t"] for e in watch.events() if e["event"] == "kill")
        else:
            master = f"127.0.0.1:{find_free_ports(1)[0]}"
            nodes = ["-n", "1", "--nnodes", "2:3", "--master", master, *grace]
            first = 2 if case == "node joins" else 3
            jobs += [start(out, [*nodes, "--node-rank", str(r)], ["--hold-after-epoch", "1"]) for r in range(first)]
            watch.wait_for(held_after_epoch(first), jobs, timeout)
            fault = time.perf_counter()
            if case == "node joins":
                jobs.append(start(out, [*nodes, "--node-rank", "2"], []))
            else:
                jobs[2].send_signal(signal.SIGTERM)
        results = [job.communicate(timeout=timeout) for job in jobs]
    finally:
        watch.stop()
        for job in jobs:
            if job.poll() is None:
                job.kill()
    stdout = results[0][0]
    codes = [job.returncode for job in jobs]
    expected = [0, 0, 128 + signal.SIGTERM] if case == "node leaves" else [0] * len(jobs)
    if codes != expected:
        print(stdout[-2000:], results[0][1][-3000:], sep="\n", file=sys.stderr)
        raise SystemExit(f"{case}: the launchers exited with {codes}, expected {expected}")
    events = watch.events()
    new = [e for e in events if e["restart"] == 1]
    stopped = max(watch.gone.values())
    formed = min(e["t"] for e in new if e["event"] == "start")
    restored = max(e["t"] for e in new if e["event"] == "train_begin")
    stepped = max(e["t"] for e in new if e["event"] == "first_step")
    resize = re.search(r"paraml: resized \((.*?)\); layout: (\d+) workers.*?; (\d+) steps? lost", stdout)
    if resize is None:
        raise SystemExit(f"{case}: the chief printed no resize line:\n{stdout[-2000:]}")
    phases = [stopped - fault, formed - stopped, restored - formed, stepped - restored]
    return {
        "case": case,
        "change": resize.group(1),
        "phases_s": dict(zip(PHASES, (round(p, 3) for p in phases))),
        "total_s": round(stepped - fault, 3),
        "steps_lost": int(resize.group(3)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--repeats", type=int_at_least(1), default=1, help="jobs per case (the table: medians)")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), metavar="CASE")
    parser.add_argument("--stop-timeout", type=float, default=10.0, help="the launcher's grace period (its default)")
    parser.add_argument("--checkpoint-every", type=int_at_least(1), default=5, help="worker lost: steps between saves")
    parser.add_argument("--timeout", type=float, default=600.0, help="per job")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    args = parser.parse_args(argv)

    root = Path(tempfile.mkdtemp(prefix="paraml-bench-resize-"))
    runs: list[dict[str, Any]] = []
    try:
        for repeat in range(args.repeats):  # the cases interleaved, so a slow minute of the machine hits them all
            for number, case in enumerate(args.cases):
                out = root / f"{repeat}-{number}"
                runs.append(run_case(case, out, args.stop_timeout, args.checkpoint_every, args.timeout))
                print(json.dumps(runs[-1]), flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    rows = []
    for case in args.cases:
        mine = [r for r in runs if r["case"] == case]
        medians = [statistics.median(r["phases_s"][p] for r in mine) for p in PHASES]
        total = statistics.median(r["total_s"] for r in mine)
        lost = statistics.median(r["steps_lost"] for r in mine)
        rows.append([case, mine[0]["change"], *(f"{m:.1f}" for m in medians), f"{total:.1f}", f"{lost:g}"])
    header = ["case", "change", *(f"{p} s" for p in PHASES), "total s", "steps lost"]
    print(format_table(rows, header, markdown=args.markdown))
    write_json({"stop_timeout_s": args.stop_timeout, "repeats": args.repeats, "runs": runs}, args.json, echo=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
