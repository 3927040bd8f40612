"""One process of bench_multi_worker.py: time paraml's fit under ``multi_worker`` (started by ``paraml launch``) or
under ``mirrored`` on 2 simulated devices (started directly), and print the result as one JSON line.

    python -m paraml launch -n 2 benchmarks/multi_worker_bench_worker.py --strategy multi_worker
    python benchmarks/multi_worker_bench_worker.py --strategy mirrored

Only the chief prints ``BENCH_RESULT {json}``: every worker runs the same synchronous steps, so its times are the
cluster's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", choices=("multi_worker", "mirrored"), required=True)
parser.add_argument("--model", choices=("mlp", "digits"), default="mlp")
parser.add_argument("--batch-size", type=int, default=128, help="global batch")
parser.add_argument("--steps", type=int, default=50, help="steps per timed window")
parser.add_argument("--windows", type=int, default=5)
args = parser.parse_args()

import paraml  # noqa: E402
from paraml import Parallel  # noqa: E402

if args.strategy == "multi_worker":
    par = Parallel("multi_worker", seed=0)  # first: the strategy must exist before TF initialises its devices
else:
    paraml.simulate_devices(2)
    par = Parallel("mirrored", devices=2, seed=0)

from common import loss_fn, make_model, optimizer, random_data  # noqa: E402

par.build(lambda: make_model(args.model), optimizer=optimizer(), loss=loss_fn(), metrics=["accuracy"])
x, y = random_data(args.model, args.steps * args.batch_size)  # the same data on every worker (seed 0)


def window() -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    par.fit(x, y, batch_size=args.batch_size, epochs=1, verbose=0, shuffle=False)
    return (time.perf_counter() - wall) / args.steps, (time.process_time() - cpu) / args.steps


window()  # trace and warm up
window()
times = [window() for _ in range(args.windows)]
if par.is_chief:
    walls = [w * 1e3 for w, _ in times]
    result = {
        "strategy": args.strategy,
        "workers": par.num_workers,
        "replicas": par.num_replicas,
        "ms_per_step": walls,
        "median_ms": statistics.median(walls),
        "cpu_ms_per_step_this_process": statistics.median(c * 1e3 for _, c in times),
    }
    print("BENCH_RESULT " + json.dumps(result), flush=True)
sys.exit(0)
