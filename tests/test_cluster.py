"""Tests for paraml.cluster.config: TF_CONFIG parsing, validation and generation."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from paraml.cluster.config import (
    ClusterConfigError,
    ClusterSpecInfo,
    make_tf_config,
    parse_tf_config,
)

CLUSTER_PY = Path(__file__).resolve().parents[1] / "src" / "paraml" / "cluster" / "config.py"


def _cfg(cluster: object = None, task: object = None, **extra: object) -> str:
    config: dict[str, object] = {}
    if cluster is not None:
        config["cluster"] = cluster
    if task is not None:
        config["task"] = task
    config.update(extra)
    return json.dumps(config)


TWO_WORKERS = {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}


@pytest.mark.parametrize(
    ("value", "fault"),
    [
        pytest.param("{not json", "not valid JSON", id="invalid-json"),
        pytest.param('{"cluster": ', "line 1 column", id="json-error-detail"),
        pytest.param("[1, 2]", "not a JSON object", id="not-object"),
        pytest.param('"worker"', "not a JSON object", id="string"),
        pytest.param(
            _cfg(task={"type": "worker", "index": 0}),
            'no "cluster" key',
            id="no-cluster",
        ),
        pytest.param(_cfg(cluster=["a:1"], task={}), "not an object", id="cluster-not-object"),
        pytest.param(
            _cfg(cluster={"ps": ["h:1"]}, task={"type": "ps", "index": 0}),
            'no "worker" (nor "chief") job',
            id="no-worker-job",
        ),
        pytest.param(
            _cfg(cluster={"worker": "h:1,h:2"}, task={"type": "worker", "index": 0}),
            'not a list of "host:port" strings',
            id="job-not-list",
        ),
        pytest.param(
            _cfg(cluster={"worker": []}, task={"type": "worker", "index": 0}),
            "empty list",
            id="job-empty",
        ),
        pytest.param(
            _cfg(cluster={"worker": ["h:1", 2]}, task={"type": "worker", "index": 0}),
            'entry 1 is 2, not a "host:port" string',
            id="address-not-string",
        ),
        pytest.param(
            _cfg(cluster={"worker": ["localhost"]}, task={"type": "worker", "index": 0}),
            '"localhost", which has no port',
            id="address-no-port",
        ),
        pytest.param(
            _cfg(cluster={"worker": [":2222"]}, task={"type": "worker", "index": 0}),
            "which has no port",
            id="address-no-host",
        ),
        pytest.param(
            _cfg(cluster={"worker": ["h:http"]}, task={"type": "worker", "index": 0}),
            'port "http" is not an integer',
            id="port-not-int",
        ),
        pytest.param(
            _cfg(cluster={"worker": ["h:70000"]}, task={"type": "worker", "index": 0}),
            "port 70000 is not in 1..65535",
            id="port-too-big",
        ),
        pytest.param(
            _cfg(cluster={"worker": ["h:0"]}, task={"type": "worker", "index": 0}),
            "port 0 is not in 1..65535",
            id="port-zero",
        ),
        pytest.param(
            _cfg(cluster={"chief": ["a:1", "b:1"]}, task={"type": "chief", "index": 0}),
            "at most one chief",
            id="two-chiefs",
        ),
        pytest.param(_cfg(cluster=TWO_WORKERS), 'no "task" key', id="no-task"),
        pytest.param(_cfg(cluster=TWO_WORKERS, task=[0]), '"task" is list', id="task-not-object"),
        pytest.param(_cfg(cluster=TWO_WORKERS, task={"index": 0}), 'no "type" key', id="no-type"),
        pytest.param(
            _cfg(cluster=TWO_WORKERS, task={"type": "chief", "index": 0}),
            "task type 'chief' is not a job in the cluster (the cluster has: worker)",
            id="type-not-in-cluster",
        ),
        pytest.param(
            _cfg(cluster={**TWO_WORKERS, "ps": ["p:1"]}, task={"type": "ps", "index": 0}),
            'task type "ps" is not supported',
            id="type-ps",
        ),
        pytest.param(
            _cfg(cluster=TWO_WORKERS, task={"type": "worker"}),
            'no "index" key',
            id="no-index",
        ),
        pytest.param(
            _cfg(cluster=TWO_WORKERS, task={"type": "worker", "index": "1"}),
            "task index '1' is not an integer; it must be in 0..1",
            id="index-string",
        ),
        pytest.param(
            _cfg(cluster=TWO_WORKERS, task={"type": "worker", "index": True}),
            "task index True is not an integer",
            id="index-bool",
        ),
        pytest.param(
            _cfg(cluster=TWO_WORKERS, task={"type": "worker", "index": 2}),
            "task index 2 is out of range",
            id="index-too-big",
        ),
        pytest.param(
            _cfg(cluster=TWO_WORKERS, task={"type": "worker", "index": -1}),
            "valid range is 0..1",
            id="index-negative",
        ),
    ],
)
def test_invalid_tf_config_names_the_fault_and_the_fix(value: str, fault: str) -> None:
    with pytest.raises(ClusterConfigError) as excinfo:
        parse_tf_config(value)
    message = str(excinfo.value)
    assert "TF_CONFIG" in message
    assert fault in message
    assert "set TF_CONFIG to a JSON like" in message


def test_invalid_json_chains_the_decode_error() -> None:
    with pytest.raises(ClusterConfigError) as excinfo:
        parse_tf_config("{")
    assert isinstance(excinfo.value.__cause__, json.JSONDecodeError)


def test_cluster_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match="TF_CONFIG"):
        parse_tf_config("[]")


@pytest.mark.parametrize("value", ["", "   \n"])
def test_empty_value_means_no_cluster(value: str) -> None:
    assert parse_tf_config(value) is None


def test_reads_environment_when_value_is_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TF_CONFIG", raising=False)
    assert parse_tf_config() is None
    monkeypatch.setenv("TF_CONFIG", "")
    assert parse_tf_config() is None
    monkeypatch.setenv("TF_CONFIG", make_tf_config(["h:1", "h:2", "h:3"], 2))
    info = parse_tf_config()
    assert info is not None
    assert info.worker_index == 2
    monkeypatch.setenv("TF_CONFIG", "{oops")
    with pytest.raises(ClusterConfigError, match="TF_CONFIG is not valid JSON"):
        parse_tf_config()


@pytest.mark.parametrize("index", [0, 1, 2])
def test_make_then_parse_round_trip(index: int) -> None:
    addresses = ["127.0.0.1:5000", "127.0.0.1:5001", "[::1]:5002"]
    info = parse_tf_config(make_tf_config(addresses, index))
    assert info == ClusterSpecInfo(tuple(addresses), "worker", index, has_chief=False)
    assert info.num_workers == 3
    assert info.worker_index == index
    assert info.is_chief is (index == 0)


def test_make_tf_config_is_standard_tf_json() -> None:
    config = json.loads(make_tf_config(["a:1", "b:2"], 1))
    assert config == {
        "cluster": {"worker": ["a:1", "b:2"]},
        "task": {"type": "worker", "index": 1},
    }


@pytest.mark.parametrize(
    ("addresses", "index", "fault"),
    [
        ([], 0, "empty list"),
        (["a:1"], 1, "out of range"),
        (["nohost"], 0, "no port"),
    ],
)
def test_make_tf_config_rejects_bad_input(addresses: list[str], index: int, fault: str) -> None:
    with pytest.raises(ClusterConfigError, match=fault):
        make_tf_config(addresses, index)


def test_make_tf_config_rejects_a_bare_string() -> None:
    with pytest.raises(ClusterConfigError, match="list of 'host:port' strings"):
        make_tf_config("a:1", 0)


def _chief_cfg(task_type: str, index: int) -> str:
    cluster = {"chief": ["c:1"], "worker": ["w:1", "w:2"], "evaluator": ["e:1"]}
    return _cfg(cluster=cluster, task={"type": task_type, "index": index})


def test_chief_layout_chief_task() -> None:
    info = parse_tf_config(_chief_cfg("chief", 0))
    assert info is not None
    assert info.workers == ("c:1", "w:1", "w:2")  # chief first, evaluator excluded
    assert info.num_workers == 3
    assert info.worker_index == 0
    assert info.is_chief


@pytest.mark.parametrize(("index", "global_index"), [(0, 1), (1, 2)])
def test_chief_layout_worker_tasks(index: int, global_index: int) -> None:
    info = parse_tf_config(_chief_cfg("worker", index))
    assert info is not None
    assert info.has_chief
    assert info.worker_index == global_index
    assert not info.is_chief  # worker 0 is not the chief when a chief job exists


def test_chief_only_cluster() -> None:
    info = parse_tf_config(_cfg(cluster={"chief": ["c:1"]}, task={"type": "chief", "index": 0}))
    assert info is not None
    assert (info.num_workers, info.worker_index, info.is_chief) == (1, 0, True)


def test_chief_index_out_of_range() -> None:
    with pytest.raises(ClusterConfigError, match=r'job "chief", which has 1 task\(s\)'):
        parse_tf_config(_chief_cfg("chief", 1))


def test_spec_info_is_frozen() -> None:
    info = ClusterSpecInfo(("a:1",), "worker", 0)
    with pytest.raises(AttributeError):
        info.task_index = 1  # type: ignore[misc]


def test_module_does_not_import_tensorflow() -> None:
    tree = ast.parse(CLUSTER_PY.read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            imported.add(node.module.split(".")[0])
    assert imported.isdisjoint({"tensorflow", "keras"})
    assert imported  # sanity: the walk found the module's imports
