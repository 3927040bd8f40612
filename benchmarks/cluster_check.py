"""One script on every cluster: each scheduler's variables, synthesised for 2 processes on this machine, end with the
weights of ``paraml launch -n 2``.

The same unmodified training script (``Parallel("multi_worker")``, digits, SGD) runs as 2 processes under each
scheduler's variables and no ``TF_CONFIG``: ``TF_CONFIG`` by hand, Vertex AI's ``CLUSTER_SPEC``, Slurm's ``srun``
variables, OpenMPI's and PMI's ranks with ``PARAML_MASTER``, Kubeflow Trainer's ``PET_*``, a Kubernetes Indexed
Job's ``JOB_COMPLETION_INDEX`` (hosts 127.0.0.10 and 127.0.0.11, both loopback), SageMaker's ``SM_HOSTS`` (host
names ``localhost`` and ``127.0.0.1``), and ``paraml launch --nnodes 2`` as two "nodes". Each variant's two workers
must end equal to each other; the table shows the largest weight difference from ``paraml launch -n 2``.

    .venv/bin/python benchmarks/cluster_check.py [--epochs 2] [--only slurm,mpi]
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from paraml.bench.harness import Completed, format_table, int_at_least, run_process
from paraml.cluster.launch import find_free_ports

WORKER = """
import os, sys
import keras
import numpy as np
from paraml import Parallel, load_digits
from paraml.demo import digits_model

from paraml.cluster.detect import detect_cluster

print(f"read {detect_cluster().scheduler}", flush=True)  # which source the worker is about to read
par = Parallel("multi_worker", seed=0)  # reads TF_CONFIG, or the scheduler's variables
(x, y), _ = load_digits()
par.build(digits_model, optimizer=keras.optimizers.SGD(0.1),
          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
par.fit(x, y, batch_size=64, epochs=int(sys.argv[2]), verbose=0)
np.savez(os.path.join(sys.argv[1], f"worker{par.worker_index}.npz"), *par.model.get_weights())
print(f"worker {par.worker_index} of {par.num_workers}", flush=True)
"""

#: variant -> (what it sets, rank's extra environment from (rank, two free ports, a master address))
Env = Callable[[int, list[int], str], dict[str, str]]


def _tf_config(rank: int, ports: list[int], master: str) -> dict[str, str]:
    workers = [f"127.0.0.1:{p}" for p in ports]
    return {"TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": rank}})}


def _vertex(rank: int, ports: list[int], master: str) -> dict[str, str]:
    cluster = {"workerpool0": [f"127.0.0.1:{ports[0]}"], "workerpool1": [f"127.0.0.1:{ports[1]}"]}
    task = {"type": f"workerpool{rank}", "index": 0}
    return {"CLUSTER_SPEC": json.dumps({"cluster": cluster, "task": task, "environment": "cloud"})}


def _slurm(rank: int, ports: list[int], master: str) -> dict[str, str]:
    return {
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_PROCID": str(rank),
        "SLURM_STEP_NODELIST": "localhost",
        "SLURM_STEP_TASKS_PER_NODE": "2",
        "SLURM_JOB_ID": "1",
        "PARAML_PORT": str(ports[0]),
    }


def _openmpi(rank: int, ports: list[int], master: str) -> dict[str, str]:
    return {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": str(rank), "PARAML_MASTER": master}


def _pmi(rank: int, ports: list[int], master: str) -> dict[str, str]:
    return {"PMI_SIZE": "2", "PMI_RANK": str(rank), "PARAML_MASTER": master}


def _kubeflow(rank: int, ports: list[int], master: str) -> dict[str, str]:
    host, port = master.rsplit(":", 1)
    return {"PET_NNODES": "2", "PET_NODE_RANK": str(rank), "PET_MASTER_ADDR": host, "PET_MASTER_PORT": port}


def _kubernetes(rank: int, ports: list[int], master: str) -> dict[str, str]:
    return {
        "JOB_COMPLETION_INDEX": str(rank),
        "PARAML_NUM_WORKERS": "2",
        "PARAML_WORKER_HOST": "127.0.0.1{index}",  # 127.0.0.10, 127.0.0.11: loopback addresses
        "PARAML_PORT": str(ports[0]),
    }


def _sagemaker(rank: int, ports: list[int], master: str) -> dict[str, str]:
    hosts = ["localhost", "127.0.0.1"]
    return {"SM_HOSTS": json.dumps(hosts), "SM_CURRENT_HOST": hosts[rank], "PARAML_PORT": str(ports[0])}


VARIANTS: dict[str, Env] = {
    "tf_config": _tf_config,
    "vertex": _vertex,
    "slurm": _slurm,
    "openmpi": _openmpi,
    "pmi": _pmi,
    "kubeflow": _kubeflow,
    "kubernetes": _kubernetes,
    "sagemaker": _sagemaker,
}


def consecutive_free_ports() -> list[int]:
    """Two free ports p, p+1 (the rule ``PARAML_PORT + index`` needs both)."""
    for _ in range(50):
        first = find_free_ports(1)[0]
        try:
            with socket.create_server(("", first)), socket.create_server(("", first + 1)):
                return [first, first + 1]
        except (OSError, OverflowError):
            continue
    raise RuntimeError("no two consecutive free ports")


def run_together(commands: list[list[str]], timeout: float) -> list[Completed]:
    """Start every command at once (none inherits TF_CONFIG: a variant sets its variables with ``env``); wait."""
    with ThreadPoolExecutor(len(commands)) as pool:
        return list(pool.map(lambda command: run_process(command, timeout), commands))


def with_env(variables: dict[str, str]) -> list[str]:
    """The ``env NAME=VALUE ...`` prefix that starts a command with these variables set."""
    return ["env", *(f"{name}={value}" for name, value in variables.items())]


def load(out: Path) -> list[list[np.ndarray]]:
    saved = [np.load(out / f"worker{i}.npz") for i in range(2)]
    return [[s[f"arr_{k}"] for k in range(len(s.files))] for s in saved]


def max_difference(a: list[np.ndarray], b: list[np.ndarray]) -> float:
    return max(float(np.max(np.abs(x - y))) for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int_at_least(1), default=2, help="epochs of training (default 2)")
    parser.add_argument("--only", default=",".join([*VARIANTS, "launch_nnodes"]), help="comma-separated variants")
    parser.add_argument("--timeout", type=float, default=300, help="seconds per variant before it is stopped")
    args = parser.parse_args(argv)
    chosen = [v.strip() for v in args.only.split(",") if v.strip()]
    unknown = sorted(set(chosen) - {*VARIANTS, "launch_nnodes"})
    if unknown:
        parser.error(f"unknown variant(s) {unknown}; valid: {', '.join([*VARIANTS, 'launch_nnodes'])}")

    root = Path(tempfile.mkdtemp(prefix="paraml-cluster-check-"))
    script = root / "train.py"
    script.write_text(WORKER)
    python = sys.executable

    read: set[str] = set()  # the sources the last variant's workers read

    def run(out: Path, commands: list[list[str]]) -> tuple[float, bool]:
        """Run one variant's processes together (they write to ``out``); say whether every one succeeded."""
        out.mkdir()
        read.clear()
        start = time.perf_counter()
        done = run_together(commands, args.timeout)
        seconds = time.perf_counter() - start
        failed = [run.stdout + run.stderr for run in done if run.code != 0]
        if failed:
            print(f"{out.name}: FAILED\n{failed[0][-3000:]}", flush=True)
        read.update(line.split("read ", 1)[1] for run in done for line in run.stdout.splitlines() if "read " in line)
        return seconds, not failed

    def train(out: Path) -> list[str]:
        return [str(script), str(out), str(args.epochs)]

    reference = root / "launch"
    seconds, ok = run(reference, [[python, "-m", "paraml", "launch", "-n", "2", *train(reference)]])
    if not ok:
        return 1
    want = load(reference)
    print(f"paraml launch -n 2: {seconds:.1f} s; {args.epochs} epoch(s) of SGD on digits, batch 64", flush=True)
    rows, worst = [], 0.0
    for name in chosen:
        out = root / name
        master = f"127.0.0.1:{find_free_ports(1)[0]}"
        if name == "launch_nnodes":
            launch = [python, "-m", "paraml", "launch", "--nnodes", "2", "--master", master, "-n", "1"]
            variables = "--nnodes 2 --node-rank R --master HOST:PORT -n 1"
            commands = [[*launch, "--node-rank", str(r), *train(out)] for r in range(2)]
        else:
            ports = consecutive_free_ports()
            variables = ", ".join(sorted(VARIANTS[name](0, ports, master)))
            commands = [[*with_env(VARIANTS[name](r, ports, master)), python, *train(out)] for r in range(2)]
        seconds, ok = run(out, commands)
        if not ok:
            rows.append([name, ", ".join(sorted(read)), variables, "failed", None, f"{seconds:.1f}"])
            worst = float("inf")
            continue
        got = load(out)
        agree = "yes" if max_difference(got[0], got[1]) == 0.0 else "no"
        delta = max(max_difference(got[i], want[i]) for i in range(2))
        worst = max(worst, delta if agree == "yes" else float("inf"))
        rows.append([name, ", ".join(sorted(read)), variables, agree, f"{delta:.2e}", f"{seconds:.1f}"])
        print(f"  {name:<14} max |dw| {delta:.2e}  ({seconds:.1f} s)", flush=True)
    print()
    header = ["variant", "source read", "variables set", "workers equal", "max abs dw vs launch", "s"]
    print(format_table(rows, header, markdown=True))
    return 0 if worst <= 1e-6 else 1


if __name__ == "__main__":
    sys.exit(main())
