"""Fault injection for ``paraml launch --max-restarts``: K random kills, and still the reference weights.

One reference job trains without faults (``paraml launch -n 2``, ``fit(checkpoint_dir=...)``). Then each faulted
job runs the same training with ``--max-restarts K`` and a random plan of K kills: on run k (``PARAML_RESTART`` == k)
a random worker SIGKILLs itself after a random global step, later than the previous kill's (so run k, which resumed
from a checkpoint at or before the previous kill, always reaches it). Checkpoints are written at every epoch's end
and every ``--checkpoint-every`` steps, so resumes happen mid-epoch too. For every job it checks that the launch
exited 0 and that the chief's final weights equal the reference's (max |difference| <= 1e-5), and it reports the
time lost per restart:

- ``downtime``: from the kill to the first step of the next run (the launcher notices, stops the survivors -- they
  wait in a collective, and TensorFlow's native SIGTERM handler keeps them alive until ``--stop-timeout`` ends in
  SIGKILL --, starts every worker again, TensorFlow starts up, the checkpoint is restored);
- ``redone``: the steps between the checkpoint it resumed from and the kill, which run twice, and their time at the
  reference job's step time;
- ``overhead``: (faulted job's wall time - reference job's) / K, the whole cost.

The worker is ``tests/scripts/restart_train.py`` (digits data, digits_model, Adam, global batch 64). This is a
fault-injection run, not a timed test: it is run by hand, never by the test suite.

    .venv/bin/python benchmarks/bench_faults.py [--kills 2] [--jobs 2] [--epochs 4] [--seed 0] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

from paraml.bench.harness import format_table, int_at_least, run_process, write_json

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "scripts" / "restart_train.py"
TOLERANCE = 1e-5


class EventClock:
    """Stamps each line the workers append to ``events.jsonl`` with the time it appeared (polled every
    ``POLL_S``): the benchmark keeps the clock, so the worker script (a test script too) reads none."""

    POLL_S = 0.005

    def __init__(self, path: Path) -> None:
        self.path, self.stamps = path, []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.poll, daemon=True)
        self.thread.start()

    def poll(self) -> None:
        while not self.done.is_set():
            self.stamp_new_lines()
            time.sleep(self.POLL_S)

    def stamp_new_lines(self) -> None:
        if self.path.exists():
            lines = self.path.read_text().count("\n")
            self.stamps += [time.perf_counter()] * (lines - len(self.stamps))

    def stop(self) -> list[float]:
        """Stop polling; one stamp per line (lines that came after the last poll get the time the job ended)."""
        self.done.set()
        self.thread.join()
        self.stamp_new_lines()
        return self.stamps


def run_job(out: Path, launch_args: list[str], script_args: list[str], timeout: float) -> dict[str, Any]:
    """One ``paraml launch -n 2`` job; returns its exit code, wall time, events (each with ``t``, when it appeared)
    and output."""
    out.mkdir(parents=True)
    command = [sys.executable, "-m", "paraml", "launch", "-n", "2", *launch_args, str(WORKER), str(out), *script_args]
    events_file = out / "events.jsonl"
    clock = EventClock(events_file)
    done = run_process(command, timeout)
    stamps = clock.stop()
    events = [json.loads(line) for line in events_file.read_text().splitlines()] if events_file.exists() else []
    for event, stamp in zip(events, stamps):
        event["t"] = stamp
    return {"code": done.code, "wall": done.seconds, "events": events, "stdout": done.stdout, "stderr": done.stderr}


def max_difference(a: Path, b: Path) -> float:
    """The largest absolute difference between the arrays of two ``.npz`` files (inf if they hold other names)."""
    left, right = np.load(a), np.load(b)
    if left.files != right.files:
        return float("inf")
    return max(float(np.max(np.abs(left[name] - right[name]))) for name in left.files)


def plan_kills(rng: random.Random, kills: int, total_steps: int, workers: int = 2) -> list[tuple[int, int, int]]:
    """K (run, worker, step) with strictly increasing steps in 2..total_steps-1."""
    steps = sorted(rng.sample(range(2, total_steps), kills))
    return [(run, rng.randrange(workers), step) for run, step in enumerate(steps)]


def analyse(job: dict[str, Any], plan: list[tuple[int, int, int]], step_time: float) -> list[dict[str, Any]]:
    """Per restart: downtime, resume step, redone steps and their time."""
    rows = []
    for run, worker, step in plan:
        kill = [e for e in job["events"] if e["event"] == "kill" and e["restart"] == run]
        first = [e for e in job["events"] if e["event"] == "first_step" and e["restart"] == run + 1]
        if not kill or not first:
            rows.append({"restart": run + 1, "worker": worker, "kill_step": step, "missing": True})
            continue
        resumed_at = min(e["step"] for e in first) - 1  # the checkpoint's step
        redone = step - resumed_at
        downtime = min(e["t"] for e in first) - kill[0]["t"]
        rows.append(
            {
                "restart": run + 1,
                "worker": worker,
                "kill_step": step,
                "resumed_from_step": resumed_at,
                "redone_steps": redone,
                "downtime_s": round(downtime, 3),
                "redone_s": round(redone * step_time, 3),
                "lost_s": round(downtime + redone * step_time, 3),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    positive = int_at_least(1)
    parser.add_argument("--kills", type=positive, default=2, help="K: kills per faulted job (and --max-restarts K)")
    parser.add_argument("--jobs", type=positive, default=2, help="faulted jobs, each with its own random plan")
    parser.add_argument("--epochs", type=positive, default=4)
    parser.add_argument("--checkpoint-every", type=positive, default=5, help="steps between mid-epoch checkpoints")
    parser.add_argument("--stop-timeout", type=float, default=10.0, help="the launcher's grace period (its default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900.0, help="per job")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    parser.add_argument("--keep", action="store_true", help="keep the jobs' folders (printed)")
    args = parser.parse_args(argv)

    rng = random.Random(args.seed)
    root = Path(tempfile.mkdtemp(prefix="paraml-bench-faults-"))
    launch_common = ["--stop-timeout", str(args.stop_timeout)]
    script_common = ["--epochs", str(args.epochs), "--checkpoint-every", str(args.checkpoint_every)]
    try:
        reference = run_job(root / "reference", launch_common, script_common, args.timeout)
        if reference["code"] != 0:
            print(reference["stderr"][-3000:], file=sys.stderr)
            raise SystemExit(f"the reference job failed with code {reference['code']}")
        chief_done = next(e for e in reference["events"] if e["event"] == "done" and e["worker"] == 0)
        chief_first = next(e for e in reference["events"] if e["event"] == "first_step" and e["worker"] == 0)
        total_steps = chief_done["step"]
        step_time = (chief_done["t"] - chief_first["t"]) / max(total_steps - 1, 1)

        jobs = []
        for number in range(args.jobs):
            plan = plan_kills(rng, args.kills, total_steps)
            kill_args = [arg for run, worker, step in plan for arg in ("--kill", f"{run}:{worker}:{step}")]
            job = run_job(
                root / f"faulted{number}",
                [*launch_common, "--max-restarts", str(args.kills)],
                [*script_common, *kill_args],
                args.timeout,
            )
            weights = root / f"faulted{number}" / "weights.npz"
            difference = max_difference(root / "reference" / "weights.npz", weights) if weights.exists() else None
            restarts_logged = job["stderr"].count("; restart ")
            jobs.append(
                {
                    "job": number,
                    "plan": [{"run": r, "worker": w, "step": s} for r, w, s in plan],
                    "exit_code": job["code"],
                    "restarts_logged": restarts_logged,
                    "max_abs_weight_difference": difference,
                    "matches_reference": job["code"] == 0 and difference is not None and difference <= TOLERANCE,
                    "wall_s": round(job["wall"], 3),
                    "overhead_per_restart_s": round((job["wall"] - reference["wall"]) / args.kills, 3),
                    "restarts": analyse(job, plan, step_time),
                }
            )
            if not jobs[-1]["matches_reference"]:
                print(job["stdout"][-2000:], job["stderr"][-3000:], sep="\n", file=sys.stderr)
    finally:
        if args.keep:
            print(f"jobs kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)

    lost = [r["lost_s"] for job in jobs for r in job["restarts"] if "lost_s" in r]
    downtime = [r["downtime_s"] for job in jobs for r in job["restarts"] if "downtime_s" in r]
    overhead = [job["overhead_per_restart_s"] for job in jobs]
    result = {
        "kills_per_job": args.kills,
        "jobs": jobs,
        "reference": {
            "wall_s": round(reference["wall"], 3),
            "steps": total_steps,
            "step_ms": round(step_time * 1e3, 2),
        },
        "stop_timeout_s": args.stop_timeout,
        "checkpoint_every": args.checkpoint_every,
        "all_match_reference": all(job["matches_reference"] for job in jobs),
        "median_lost_per_restart_s": statistics.median(lost) if lost else None,
        "median_downtime_per_restart_s": statistics.median(downtime) if downtime else None,
        "median_overhead_per_restart_s": statistics.median(overhead),
    }

    print(
        f"reference: {total_steps} steps, {step_time * 1e3:.1f} ms/step, {reference['wall']:.1f} s wall "
        f"(2 workers, --stop-timeout {args.stop_timeout:g}, checkpoint every {args.checkpoint_every} steps)"
    )
    header = ["job", "restart", "worker", "kill@", "resume@", "redone", "down s", "lost s"]
    for job in jobs:
        keys = ("resumed_from_step", "redone_steps", "downtime_s", "lost_s")  # None (-) when an event is missing
        rows = [[job["job"], r["restart"], r["worker"], r["kill_step"], *map(r.get, keys)] for r in job["restarts"]]
        print(format_table(rows, header))
        verdict = "matches the reference" if job["matches_reference"] else "DOES NOT match the reference"
        print(
            f"    job {job['job']}: exit {job['exit_code']}, {job['restarts_logged']} restarts logged, max |dw| "
            f"{job['max_abs_weight_difference']}, {verdict}; wall {job['wall_s']:.1f} s, "
            f"overhead {job['overhead_per_restart_s']:.1f} s/restart"
        )
    print(
        f"all jobs end with the reference weights: {result['all_match_reference']}; median per restart: lost "
        f"{result['median_lost_per_restart_s']} s, downtime {result['median_downtime_per_restart_s']} s, "
        f"whole-job overhead {result['median_overhead_per_restart_s']} s"
    )
    write_json(result, args.json)
    return 0 if result["all_match_reference"] else 1


if __name__ == "__main__":
    sys.exit(main())
