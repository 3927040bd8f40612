"""Steps per second of ``multi_worker`` on 2 local workers against ``mirrored`` on 2 simulated devices.

Both train the same model on the same global batch with paraml's fit, in paraml's benchmark worker
(``paraml/_bench_worker.py``): ``multi_worker`` runs as ``python -m paraml launch -n 2 <worker> --strategy
multi_worker`` (two processes, TF_CONFIG on loopback, gradients all-reduced by TensorFlow's collective ops over gRPC);
``mirrored`` runs the same worker as one process with 2 logical CPUs (all-reduce inside the process). Each run is a
fresh process (a process can hold only one device layout) that times several fit-call windows after a warm-up; the
runs are interleaved (A B, B A, ...) by :func:`paraml.bench.harness.interleave` and the ratio is taken of the medians
and
as the median of per-round ratios.

On one machine the two workers share the same 2 cores, so this measures the cost of the gRPC collective path
(serialisation, loopback round trips, two processes' thread pools competing), not a cluster's speed: on a real
cluster each worker has its own cores and the network decides.

    .venv/bin/python benchmarks/bench_multi_worker.py [--rounds 3] [--steps 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

from paraml.bench.command import MARKER, WORKER
from paraml.bench.harness import PRESETS, int_at_least, interleave, marked_results, paired, run_process, write_json


def run(command: list[str], timeout: float, verbose: bool) -> dict[str, Any]:
    """Run ``command``; return the chief's result (a :class:`paraml.bench.harness.BenchResult` as a dict)."""
    done = run_process(command, timeout)
    if verbose:
        print(done.stdout, done.stderr, sep="\n")
    results = marked_results(done.stdout, MARKER)
    if done.code != 0 or len(results) != 1:
        output = (done.stdout + done.stderr)[-3000:]
        raise RuntimeError(f"exit code {done.code}, {len(results)} results: {' '.join(command)}\n{output}")
    return results[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=sorted(PRESETS), default="mlp2", help="default mlp2: 256-512-512-10")
    parser.add_argument("--batch-size", type=int_at_least(1), default=128, help="global batch (default 128)")
    parser.add_argument("--steps", type=int_at_least(2), default=50, help="steps per timed fit call (default 50)")
    parser.add_argument("--windows", type=int_at_least(1), default=5, help="timed windows per run (default 5)")
    parser.add_argument("--rounds", type=int_at_least(1), default=3, help="runs of each variant (default 3)")
    parser.add_argument("--optimizer", default="adam", help="a Keras optimizer name (default adam)")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per run before it is stopped")
    parser.add_argument("-v", "--verbose", action="store_true", help="show the processes' output")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    args = parser.parse_args(argv)

    common = ["--model", args.model, "--batch-size", str(args.batch_size), "--steps", str(args.steps)]
    common += ["--windows", str(args.windows), "--optimizer", args.optimizer]
    commands = {
        "mirrored": [sys.executable, str(WORKER), "--strategy", "mirrored", *common],
        "multi_worker": [
            *(sys.executable, "-m", "paraml", "launch", "-n", "2"),
            *(str(WORKER), "--strategy", "multi_worker", *common),
        ],
    }
    print(
        f"model {args.model}, global batch {args.batch_size}; {args.rounds} run(s) of each variant, interleaved, "
        f"each {args.windows} windows of one fit call of {args.steps} steps after a warm-up",
        flush=True,
    )

    def variant(name: str) -> dict[str, float]:
        result = run(commands[name], args.timeout, args.verbose)
        print(f"  {name:<13} {result['fit_call_ms']:8.2f} ms/step ({result['devices']} replicas)", flush=True)
        return {"fit_call_ms": result["fit_call_ms"], "step_ms": result["step_ms"]}

    series = interleave({name: lambda name=name: variant(name) for name in commands}, args.rounds)
    runs = {name: series[name]["fit_call_ms"] for name in commands}
    mirrored, multi = statistics.median(runs["mirrored"]), statistics.median(runs["multi_worker"])
    ratio_paired = paired(runs["multi_worker"], runs["mirrored"])
    print(f"\n{'variant':<14}{'ms/step':>10}{'steps/s':>10}")
    for name, value in (("mirrored", mirrored), ("multi_worker", multi)):
        print(f"{name:<14}{value:10.2f}{1e3 / value:10.1f}")
    print(f"\nmulti_worker / mirrored step time: {multi / mirrored:.2f}x (paired per round: {ratio_paired:.2f}x)")
    print(
        "Both use 2 replicas on the same 2 cores. multi_worker's two processes share those cores and exchange "
        "gradients\nthrough TensorFlow's gRPC collectives on loopback, so the ratio is the cost of that path on one "
        "machine,\nnot the speed of a cluster, where each worker has its own cores and the network sets the cost."
    )
    record = {
        "benchmark": "multi_worker",
        "model": args.model,
        "global_batch": args.batch_size,
        "steps_per_fit_call": args.steps,
        "windows": args.windows,
        "rounds": args.rounds,
        "ms_per_step": {"mirrored": round(mirrored, 3), "multi_worker": round(multi, 3)},
        "runs_ms_per_step": runs,
        "steady_ms_per_step": {name: statistics.median(series[name]["step_ms"]) for name in commands},
        "ratio_multi_worker_over_mirrored": round(multi / mirrored, 4),
        "ratio_paired": round(ratio_paired, 4),
    }
    write_json(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
