"""paraml.cluster.detect and paraml.cluster.rendezvous: each scheduler's variables, synthesised, give the cluster
`paraml launch`
would give; bad or conflicting variables are clear errors; every exchange through a master ends within its timeout.

No TensorFlow and no subprocess here: the real 2-process runs are in test_multi_worker.py and
benchmarks/cluster_check.py.
"""

from __future__ import annotations

import ast
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import fails_after

from paraml.cluster.config import ClusterConfigError, make_tf_config
from paraml.cluster.detect import (
    SCHEDULERS,
    Cluster,
    detect_cluster,
    expand_nodelist,
    expand_tasks_per_node,
    setup_tf_config,
)
from paraml.cluster.launch import find_free_ports
from paraml.cluster.rendezvous import Rendezvous, split_address

SRC = Path(__file__).resolve().parents[1] / "src" / "paraml"

SLURM = {
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_PROCID": "2",
    "SLURM_STEP_NODELIST": "node[01-02]",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
    "SLURM_JOB_ID": "4567",
}
SPEC = {
    "cluster": {"workerpool0": ["wp0-0:2222"], "workerpool1": ["wp1-0:2222", "wp1-1:2222"], "workerpool2": ["r:1"]},
    "environment": "cloud",
    "task": {"type": "workerpool1", "index": 1},
}


@pytest.mark.parametrize(
    ("env", "scheduler", "workers", "index"),
    [
        pytest.param({"TF_CONFIG": make_tf_config(["a:1", "b:2"], 1)}, "tf_config", ("a:1", "b:2"), 1, id="tf_config"),
        pytest.param(
            {"CLUSTER_SPEC": json.dumps(SPEC)}, "vertex", ("wp0-0:2222", "wp1-0:2222", "wp1-1:2222"), 2, id="vertex"
        ),
        pytest.param(
            SLURM, "slurm", ("node01:19567", "node01:19568", "node02:19569", "node02:19570"), 2, id="slurm-block"
        ),
        pytest.param(
            {**SLURM, "SLURM_DISTRIBUTION": "cyclic:block", "PARAML_PORT": "3000"},
            "slurm",
            ("node01:3000", "node02:3001", "node01:3002", "node02:3003"),
            2,
            id="slurm-cyclic-paraml-port",
        ),
        pytest.param(
            {**SLURM, "SLURM_STEP_NUM_TASKS": "3", "SLURM_STEP_TASKS_PER_NODE": "1,2", "SLURM_PROCID": "0"},
            "slurm",
            ("node01:19567", "node02:19568", "node02:19569"),
            0,
            id="slurm-uneven",
        ),
        pytest.param(
            {"JOB_COMPLETION_INDEX": "1", "PARAML_NUM_WORKERS": "3", "PARAML_WORKER_HOST": "paraml-{index}.paraml"},
            "kubernetes",
            ("paraml-0.paraml:12345", "paraml-1.paraml:12346", "paraml-2.paraml:12347"),
            1,
            id="kubernetes",
        ),
        pytest.param(
            {"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-1", "PARAML_PORT": "9000"},
            "sagemaker",
            ("algo-1:9000", "algo-2:9001"),
            0,
            id="sagemaker",
        ),
    ],
)
def test_each_scheduler_gives_the_cluster_launch_would_give(env, scheduler, workers, index):
    cluster = detect_cluster(env)
    assert (cluster.scheduler, cluster.workers, cluster.index) == (scheduler, workers, index)
    assert cluster.num_workers == len(workers) and cluster.is_chief is (index == 0)
    assert set(env) >= {name for name, _ in cluster.variables}
    if scheduler not in ("tf_config",):
        assert cluster.to_tf_config() == make_tf_config(workers, index)  # paraml launch's TF_CONFIG
    written = dict(env)
    info = setup_tf_config(written)
    assert (info.workers, info.worker_index) == (workers, index)
    assert written["TF_CONFIG"] == cluster.to_tf_config()


@pytest.mark.parametrize(
    ("env", "scheduler", "size", "index", "master"),
    [
        (
            {"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": "1", "PARAML_MASTER": "h0:7000"},
            "mpi",
            3,
            1,
            "h0:7000",
        ),
        ({"PMI_SIZE": "2", "PMI_RANK": "0", "PARAML_MASTER": "h0:7000"}, "mpi", 2, 0, "h0:7000"),
        (
            {
                "PET_NNODES": "2",
                "PET_NODE_RANK": "1",
                "PET_MASTER_ADDR": "job-node-0-0.job",
                "PET_MASTER_PORT": "29500",
            },
            "kubeflow",
            2,
            1,
            "job-node-0-0.job:29500",
        ),
    ],
    ids=["openmpi", "pmi", "kubeflow"],
)
def test_schedulers_that_name_only_a_master_exchange_the_addresses(env, scheduler, size, index, master):
    cluster = detect_cluster(env)
    assert (cluster.scheduler, cluster.num_workers, cluster.index, cluster.master) == (scheduler, size, index, master)
    assert cluster.workers == () and cluster.chief is None
    assert "exchanged through the master" in cluster.describe()


def test_one_rank_needs_no_master():
    cluster = detect_cluster({"OMPI_COMM_WORLD_SIZE": "1", "OMPI_COMM_WORLD_RANK": "0", "PARAML_PORT": "4000"})
    assert cluster.resolved(timeout=0.5).workers == ("localhost:4000",)


def exchange_addresses(master, rank, size, addresses, **options):
    return Rendezvous.join(master, rank, size, addresses, **options).workers


def _master() -> str:
    return f"127.0.0.1:{find_free_ports(1)[0]}"


def _in_threads(fns):
    """Run each fn in a thread; return their results (or the exceptions they raised), in order."""
    results = [None] * len(fns)

    def run(i, fn):
        try:
            results[i] = fn()
        except Exception as exc:  # noqa: BLE001 - handed back to the test
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    return results


def test_mpi_ranks_exchange_their_addresses_through_paraml_master():
    master = _master()
    envs = [
        {"OMPI_COMM_WORLD_SIZE": "3", "OMPI_COMM_WORLD_RANK": str(r), "PARAML_MASTER": master, "PARAML_PORT": "5000"}
        for r in range(3)
    ]
    results = _in_threads([lambda e=e: setup_tf_config(e) for e in envs])
    want = ("127.0.0.1:5000", "127.0.0.1:5001", "127.0.0.1:5002")
    assert [(info.workers, info.worker_index) for info in results] == [(want, r) for r in range(3)]
    assert all(json.loads(e["TF_CONFIG"])["cluster"]["worker"] == list(want) for e in envs)


def test_exchange_picks_free_ports_and_the_address_toward_the_master():
    master = _master()
    base = {"PET_NNODES": "2", "PET_MASTER_ADDR": "127.0.0.1", "PET_MASTER_PORT": master.split(":")[1]}
    results = _in_threads([lambda r=r: detect_cluster({**base, "PET_NODE_RANK": str(r)}).resolved(5) for r in (0, 1)])
    assert results[0].workers == results[1].workers
    hosts = [split_address(a, "")[0] for a in results[0].workers]
    assert hosts == ["127.0.0.1", "127.0.0.1"] and len(set(results[0].workers)) == 2


@pytest.mark.parametrize(
    ("env", "names"),
    [
        pytest.param(
            {**SLURM, "TF_CONFIG": make_tf_config(["a:1", "b:1"], 1)},
            ["TF_CONFIG", "SLURM_PROCID=2", "worker 1 of 2", "worker 2 of 4"],
            id="tf_config-vs-slurm",
        ),
        pytest.param(
            {**SLURM, "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1", "PARAML_MASTER": "h:1"},
            ["Slurm", "OMPI_COMM_WORLD_RANK=1", "PARAML_SCHEDULER=slurm (or mpi)"],
            id="mpirun-under-slurm",
        ),
    ],
)
def test_sources_that_disagree_are_an_error_naming_both(env, names):
    with pytest.raises(ClusterConfigError, match="the cluster variables disagree") as error:
        detect_cluster(env)
    for name in names:
        assert name in str(error.value)


def test_sources_that_agree_and_a_forced_source():
    agreeing = {**SLURM, "TF_CONFIG": make_tf_config(["a:1", "b:1", "c:1", "d:1"], 2)}
    assert detect_cluster(agreeing).scheduler == "tf_config"  # first in precedence
    disagreeing = {**SLURM, "TF_CONFIG": make_tf_config(["a:1", "b:1"], 1)}
    assert detect_cluster({**disagreeing, "PARAML_SCHEDULER": "slurm"}).scheduler == "slurm"
    assert detect_cluster({**disagreeing, "PARAML_SCHEDULER": "launch"}).label == "paraml launch"
    with pytest.raises(ClusterConfigError, match="did you mean 'slurm'"):
        detect_cluster({**SLURM, "PARAML_SCHEDULER": "slrum"})
    with pytest.raises(ClusterConfigError, match="SageMaker's variables are not set"):
        detect_cluster({**SLURM, "PARAML_SCHEDULER": "sagemaker"})
    assert SCHEDULERS[:3] == ("tf_config", "vertex", "slurm")


@pytest.mark.parametrize(
    ("env", "fault"),
    [
        ({**SLURM, "SLURM_PROCID": "4"}, "SLURM_PROCID=4 is out of range: valid range is 0..3"),
        ({**SLURM, "SLURM_PROCID": "x"}, 'SLURM_PROCID="x" is not an integer'),
        ({**SLURM, "SLURM_STEP_NODELIST": "node[01-03"}, "unbalanced"),
        ({**SLURM, "SLURM_STEP_NODELIST": "node[03-01]"}, "runs backwards"),
        ({**SLURM, "SLURM_STEP_NODELIST": "node[01-03]"}, "counts 2 node(s), but SLURM_STEP_NODELIST"),
        ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "2(x2"}, 'has "2(x2", not a count'),
        ({**SLURM, "SLURM_STEP_TASKS_PER_NODE": "3,2"}, "places 5 task(s), but SLURM_STEP_NUM_TASKS=4"),
        ({**SLURM, "SLURM_STEP_NUM_TASKS": "5"}, "places 4 task(s), but SLURM_STEP_NUM_TASKS=5"),
        ({**SLURM, "SLURM_DISTRIBUTION": "plane=2"}, "SLURM_DISTRIBUTION"),
        ({**SLURM, "SLURMD_NODENAME": "node01"}, "falls on node02"),
        ({**SLURM, "PARAML_PORT": "65534"}, "need ports up to 65537"),
        ({**SLURM, "SLURM_JOB_ID": ""}, "SLURM_JOB_ID is not set"),
        ({"CLUSTER_SPEC": "{oops"}, "CLUSTER_SPEC is not valid JSON"),
        ({"CLUSTER_SPEC": json.dumps({**SPEC, "task": {"type": "workerpool2", "index": 0}})}, '"workerpool0" or a'),
        ({"CLUSTER_SPEC": json.dumps({**SPEC, "task": {"type": "workerpool1", "index": 2}})}, "valid range is 0..1"),
        ({"CLUSTER_SPEC": json.dumps({"cluster": {"workerpool0": ["h"]}})}, '"h", which has no port'),
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1"}, "set PARAML_MASTER=HOST:PORT"),
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "1", "PARAML_MASTER": "h"}, 'not "HOST:PORT"'),
        ({"PET_NNODES": "1:4", "PET_NODE_RANK": "0"}, "elastic ranges are not supported"),
        ({"PET_NNODES": "2", "PET_NODE_RANK": "2"}, "PET_NODE_RANK=2 is out of range"),
        ({"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "m"}, "PET_MASTER_PORT is not set"),
        ({"JOB_COMPLETION_INDEX": "0", "PARAML_WORKER_HOST": "w-{index}"}, "PARAML_NUM_WORKERS is not set"),
        ({"JOB_COMPLETION_INDEX": "2", "PARAML_WORKER_HOST": "w", "PARAML_NUM_WORKERS": "2"}, "out of range"),
        ({"JOB_COMPLETION_INDEX": "0", "PARAML_WORKER_HOST": "w", "PARAML_NUM_WORKERS": "2"}, "has no {index}"),
        ({"SM_HOSTS": "algo-1", "SM_CURRENT_HOST": "algo-1"}, "not a JSON list of host names"),
        ({"SM_HOSTS": '["a", "a"]', "SM_CURRENT_HOST": "a"}, "names a host twice"),
        ({"SM_HOSTS": '["a", "b"]', "SM_CURRENT_HOST": "c"}, 'SM_CURRENT_HOST="c" is not one of SM_HOSTS'),
    ],
)
def test_malformed_variables_are_errors_naming_them_and_the_tf_config_way(env, fault):
    with pytest.raises(ClusterConfigError) as error:
        detect_cluster(env)
    assert fault in str(error.value)
    assert "TF_CONFIG" in str(error.value)


def test_nodelists_and_tasks_per_node_expand_as_slurm_writes_them():
    assert expand_nodelist("node[01-03,07],gpu5") == ["node01", "node02", "node03", "node07", "gpu5"]
    assert expand_nodelist("r[1-2]n[8-9]") == ["r1n8", "r1n9", "r2n8", "r2n9"]
    assert expand_nodelist("a-1,b[098-100]") == ["a-1", "b098", "b099", "b100"]
    assert expand_nodelist("10.0.0.1") == ["10.0.0.1"]
    assert expand_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    for bad in ("a,,b", "a[1-x]", "a[[1]]", "a]"):
        with pytest.raises(ValueError, match="SLURM_STEP_NODELIST"):
            expand_nodelist(bad)
    with pytest.raises(ValueError, match="SLURM_STEP_TASKS_PER_NODE"):
        expand_tasks_per_node("0")


def test_no_cluster_and_the_hints_for_half_set_variables(monkeypatch):
    assert detect_cluster({"SLURM_PROCID": "0", "JOB_COMPLETION_INDEX": "1"}) is None
    with pytest.raises(ClusterConfigError) as error:
        setup_tf_config({"SLURM_PROCID": "0", "JOB_COMPLETION_INDEX": "1"}, required=True)
    for expected in ("paraml launch", "start the script with srun", "set PARAML_WORKER_HOST"):
        assert expected in str(error.value)
    assert setup_tf_config({}) is None


def _paraml_cluster(**env):
    """``paraml cluster`` in a fresh process with ``env`` as its only cluster variables; also fails if it loaded
    TensorFlow."""
    code = "import sys\nfrom paraml.cli import main\ncode = main(['cluster'])\nassert 'tensorflow' not in sys.modules\n"
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("TF_CONFIG", "PARAML_", "SLURM_"))}
    return subprocess.run(
        [sys.executable, "-c", code + "sys.exit(code)"],
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_paraml_cluster_prints_the_scheduler_variables_workers_and_index():
    done = _paraml_cluster(**SLURM)
    assert done.returncode == 0, done.stderr
    for expected in ("scheduler: Slurm", "SLURM_PROCID=2", "2  node02:19569  (this process)", "worker 2 of 4"):
        assert expected in done.stdout
    assert "chief: worker 0 (node01:19567)" in done.stdout
    bad = _paraml_cluster(**{**SLURM, "SLURM_PROCID": "9"})
    assert bad.returncode == 2 and "paraml cluster: error: Slurm: SLURM_PROCID=9 is out of range" in bad.stderr


# ----------------------------------------------------------------------------- rendezvous


def test_a_master_that_never_answers_is_an_error_within_the_timeout():
    with fails_after(3):
        with pytest.raises(ClusterConfigError, match=r"could not reach the master .* \(PET_MASTER_ADDR\) within 0.5 s"):
            exchange_addresses(_master(), 1, 2, [1], timeout=0.5, variables="PET_MASTER_ADDR")


def test_a_master_that_accepts_but_never_replies_is_an_error_within_the_timeout():
    with socket.create_server(("127.0.0.1", 0)) as silent:
        master = f"127.0.0.1:{silent.getsockname()[1]}"
        with fails_after(3), pytest.raises(ClusterConfigError, match="but it never answered within 0.5 s"):
            exchange_addresses(master, 1, 2, [1], timeout=0.5)


def test_ranks_that_never_join_are_named_by_the_master_within_the_timeout():
    with fails_after(3), pytest.raises(ClusterConfigError, match=r"rank\(s\) 1, 2 of 3 never joined"):
        exchange_addresses(_master(), 0, 3, [1], timeout=0.5)


def test_a_stray_connection_is_ignored_and_ranks_that_disagree_are_refused():
    master = _master()
    port = int(master.split(":")[1])

    def stray_then_rank1():
        time.sleep(0.2)
        with socket.create_connection(("127.0.0.1", port)) as stray:
            stray.sendall(b"GET / HTTP/1.0\r\n\r\n")
        return exchange_addresses(master, 1, 2, ["w1:2"], timeout=5)

    results = _in_threads([lambda: exchange_addresses(master, 0, 2, ["w0:1"], timeout=5), stray_then_rank1])
    assert results == [["w0:1", "w1:2"]] * 2
    master = _master()
    results = _in_threads(
        [
            lambda: exchange_addresses(master, 0, 2, [1], timeout=5),
            lambda: exchange_addresses(master, 1, 3, [1], timeout=5),
        ]
    )
    assert all(isinstance(r, ClusterConfigError) and "give every rank the same count" in str(r) for r in results)


def test_an_open_rendezvous_stops_every_rank_after_one_fails():
    master = _master()
    ranks = _in_threads([lambda r=r: Rendezvous.join(master, r, 3, [r], timeout=5, keep_open=True) for r in range(3)])
    try:
        ranks[2].report(7)
        with fails_after(5):  # the others hear of it
            while not (ranks[0].stop_requested and ranks[1].stop_requested):
                time.sleep(0.02)
        ranks[1].report(143)
        ranks[0].report(143)
        assert [r.outcome() for r in ranks] == [(7, False, 2)] * 3
    finally:
        for rank in ranks:
            rank.close()


def test_the_cluster_value_is_frozen_and_needs_its_addresses_for_tf_config():
    cluster = Cluster("kubeflow", 2, 1, master="m:1")
    with pytest.raises(ClusterConfigError, match="not exchanged yet"):
        cluster.to_tf_config()
    with pytest.raises(AttributeError):
        cluster.index = 0  # type: ignore[misc]


@pytest.mark.parametrize("module", ["cluster/detect.py", "cluster/rendezvous.py"])
def test_detection_does_not_import_tensorflow(module):
    imported = set()
    for node in ast.walk(ast.parse((SRC / module).read_text())):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert imported and imported.isdisjoint({"tensorflow", "keras"})
