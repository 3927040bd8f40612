"""Steps per second of ``multi_worker`` on 2 local workers against ``mirrored`` on 2 simulated devices.

Both train the same model on the same global batch with paraml's fit. ``multi_worker`` runs as
``python -m paraml launch -n 2 benchmarks/multi_worker_bench_worker.py`` (two processes, TF_CONFIG on loopback,
gradients all-reduced by TensorFlow's collective ops over gRPC); ``mirrored`` runs the same worker script as one
process with 2 logical CPUs (all-reduce inside the process). Each run is a fresh process (a process can hold only
one device layout), so the variants alternate run by run (A B, B A, ...), each run timing several windows after a
warm-up, and the ratio is taken of the medians.

On one machine the two workers share the same 2 cores, so this measures the cost of the gRPC collective path
(serialisation, loopback round trips, two processes' thread pools competing), not a cluster's speed: on a real
cluster each worker has its own cores and the network decides.

    .venv/bin/python benchmarks/bench_multi_worker.py [--rounds 3] [--steps 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
WORKER = HERE / "multi_worker_bench_worker.py"
MARKER = "BENCH_RESULT "


def run(command: list[str], timeout: float, verbose: bool) -> dict[str, Any]:
    """Run ``command``; return the chief's BENCH_RESULT. On a timeout, SIGTERM first: the launcher then stops its
    workers (a SIGKILL would leave them running, in their own sessions)."""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    env.pop("TF_CONFIG", None)
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        raise RuntimeError(f"timed out after {timeout:g} s: {' '.join(command)}\n{output[-3000:]}") from None
    if verbose:
        print(output)
    results = [line.split(MARKER, 1)[1] for line in output.splitlines() if MARKER in line]
    if proc.returncode != 0 or len(results) != 1:
        raise RuntimeError(
            f"exit code {proc.returncode}, {len(results)} results: {' '.join(command)}\n{output[-3000:]}"
        )
    return json.loads(results[0])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("mlp", "digits"), default="mlp", help="mlp: 784-512-512-10 (default)")
    parser.add_argument("--batch-size", type=int, default=128, help="global batch (default 128)")
    parser.add_argument("--steps", type=int, default=50, help="steps per timed window (default 50)")
    parser.add_argument("--windows", type=int, default=5, help="timed windows per run (default 5)")
    parser.add_argument("--rounds", type=int, default=3, help="runs of each variant, alternating (default 3)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run before it is stopped")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the processes' output")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON result line to PATH")
    args = parser.parse_args()

    common = ["--model", args.model, "--batch-size", str(args.batch_size), "--steps", str(args.steps)]
    common += ["--windows", str(args.windows)]
    commands = {
        "mirrored": [sys.executable, str(WORKER), "--strategy", "mirrored", *common],
        "multi_worker": [
            *(sys.executable, "-m", "paraml", "launch", "-n", "2"),
            *(str(WORKER), "--strategy", "multi_worker", *common),
        ],
    }
    print(
        f"model {args.model}, global batch {args.batch_size}; {args.rounds} run(s) of each variant, alternating, "
        f"each {args.windows} windows of {args.steps} steps after a warm-up",
        flush=True,
    )
    medians: dict[str, list[float]] = {name: [] for name in commands}
    names = list(commands)
    for r in range(args.rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            result = run(commands[name], args.timeout, args.verbose)
            medians[name].append(result["median_ms"])
            print(
                f"  run {r + 1} {name:<13} {result['median_ms']:8.2f} ms/step  ({result['workers']} process(es), "
                f"{result['replicas']} replicas; run took {time.perf_counter() - start:.0f} s)",
                flush=True,
            )

    mirrored, multi = statistics.median(medians["mirrored"]), statistics.median(medians["multi_worker"])
    paired = statistics.median(m / r for m, r in zip(medians["multi_worker"], medians["mirrored"]))
    print()
    print(f"{'variant':<14}{'ms/step':>10}{'steps/s':>10}")
    for name, value in (("mirrored", mirrored), ("multi_worker", multi)):
        print(f"{name:<14}{value:10.2f}{1e3 / value:10.1f}")
    print(f"\nmulti_worker / mirrored step time: {multi / mirrored:.2f}x (paired per round: {paired:.2f}x)")
    print(
        "Both use 2 replicas on the same 2 cores. multi_worker's two processes share those cores and exchange "
        "gradients\nthrough TensorFlow's gRPC collectives on loopback, so the ratio is the cost of that path on one "
        "machine,\nnot the speed of a cluster, where each worker has its own cores and the network sets the cost."
    )
    record = {
        "benchmark": "multi_worker",
        "model": args.model,
        "global_batch": args.batch_size,
        "steps_per_window": args.steps,
        "windows": args.windows,
        "rounds": args.rounds,
        "ms_per_step": {"mirrored": round(mirrored, 3), "multi_worker": round(multi, 3)},
        "runs_ms_per_step": medians,
        "ratio_multi_worker_over_mirrored": round(multi / mirrored, 4),
        "ratio_paired": round(paired, 4),
    }
    line = json.dumps(record, sort_keys=True)
    print("JSON " + line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
