"""Parse and validate ``TF_CONFIG``, the environment variable that describes a
TensorFlow multi-worker cluster.

TensorFlow reads ``TF_CONFIG`` itself, but a malformed value only surfaces much
later as an obscure gRPC or collective error (or a hang). This module checks the
value up front and reports exactly what is wrong and how to fix it.

It is pure Python and deliberately does not import TensorFlow, so that the
launcher and the CLI can use it without paying TensorFlow's import time, and so
that parsing can happen before TensorFlow initialises its devices.

Example:
    >>> info = parse_tf_config(make_tf_config(["127.0.0.1:2222", "127.0.0.1:2223"], 1))
    >>> info.num_workers, info.worker_index, info.is_chief
    (2, 1, False)
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "CONNECT_TIMEOUT",
    "CONNECT_TIMEOUT_ENV",
    "ClusterConfigError",
    "ClusterSpecInfo",
    "global_worker_index",
    "CLUSTER_SPEC_ENV",
    "make_tf_config",
    "parse_cluster_spec",
    "parse_tf_config",
    "connect_timeout",
    "wait_for_workers",
]

_ENV_VAR = "TF_CONFIG"

_EXAMPLE = '{"cluster": {"worker": ["host1:12345", "host2:12345"]}, "task": {"type": "worker", "index": 0}}'
_HINT = f"Fix: set TF_CONFIG to a JSON like {_EXAMPLE}, or unset it for a single-process run."


class ClusterConfigError(ValueError):
    """Raised when ``TF_CONFIG`` (or a value given in its place) is invalid.

    The message names ``TF_CONFIG``, states the exact fault and ends with how to
    fix it. It subclasses :class:`ValueError` so that callers that already catch
    ``ValueError`` for bad configuration keep working.

    Example:
        >>> try:
        ...     parse_tf_config("{")
        ... except ClusterConfigError as exc:
        ...     print(str(exc).split(":")[0])
        TF_CONFIG is not valid JSON
    """


def _error(fault: str) -> ClusterConfigError:
    return ClusterConfigError(f"{fault}. {_HINT}")


@dataclass(frozen=True)
class ClusterSpecInfo:
    """The part of ``TF_CONFIG`` that matters for synchronous multi-worker training.

    Attributes:
        workers: Addresses of every task that takes part in training, in global
            order: the ``chief`` task first when a ``chief`` job exists (TF then
            treats the chief as a separate job), followed by the ``worker`` tasks.
        task_type: ``"chief"`` or ``"worker"``: the job of this process.
        task_index: Index of this process inside its own job (as in ``TF_CONFIG``).
        has_chief: Whether the cluster has a separate ``chief`` job. Needed to map
            ``task_index`` to a global index; :func:`parse_tf_config` sets it.

    Example:
        >>> info = ClusterSpecInfo(("a:1", "b:1", "c:1"), "worker", 0, has_chief=True)
        >>> info.num_workers, info.worker_index, info.is_chief
        (3, 1, False)
    """

    workers: tuple[str, ...]
    task_type: str
    task_index: int
    has_chief: bool = False

    @property
    def num_workers(self) -> int:
        """Total number of tasks taking part in training (chief + workers).

        Example:
            >>> ClusterSpecInfo(("a:1", "b:1"), "worker", 0).num_workers
            2
        """
        return len(self.workers)

    @property
    def worker_index(self) -> int:
        """Global index of this task: the chief is 0; worker ``i`` is ``i``, or
        ``i + 1`` when a separate chief job exists.

        Example:
            >>> ClusterSpecInfo(("a:1", "b:1"), "worker", 0, has_chief=True).worker_index
            1
        """
        return global_worker_index(self.task_type, self.task_index, self.has_chief)

    @property
    def is_chief(self) -> bool:
        """Whether this task should do the once-per-cluster work (checkpoints, logs).

        That is the ``chief`` task, or worker 0 when there is no chief job
        (the same rule TensorFlow uses).

        Example:
            >>> ClusterSpecInfo(("a:1", "b:1"), "worker", 0).is_chief
            True
        """
        if self.task_type == "chief":
            return True
        return self.task_type == "worker" and self.task_index == 0 and not self.has_chief


def global_worker_index(task_type: str, task_index: int, has_chief: bool) -> int:
    """The one rule from a task (its job and index in it) to its index among all workers: the chief is 0, worker
    ``i`` is ``i``, or ``i + 1`` when a separate ``chief`` job exists (TensorFlow's order).

    Example:
        >>> [global_worker_index(*task) for task in (("chief", 0, True), ("worker", 0, True), ("worker", 2, False))]
        [0, 1, 2]
    """
    if task_type == "chief":
        return 0
    return task_index + (1 if has_chief else 0)


@dataclass(frozen=True)
class _Jobs:
    """Which variable a cluster JSON came from and what it calls the chief's and the workers' jobs.

    ``TF_CONFIG`` says ``chief``/``worker``; Vertex AI's ``CLUSTER_SPEC`` says ``workerpool0``/``workerpool1``.
    """

    variable: str = _ENV_VAR
    chief: str = "chief"
    worker: str = "worker"


def _check_address(jobs: _Jobs, job: str, position: int, address: Any) -> str:
    where = f'{jobs.variable} cluster job "{job}" entry {position}'
    if not isinstance(address, str):
        raise _error(f'{where} is {address!r}, not a "host:port" string')
    host, sep, port_text = address.rpartition(":")
    if not sep or not host:
        raise _error(f'{where} is "{address}", which has no port; expected "host:port"')
    try:
        port = int(port_text, 10)
    except ValueError:
        raise _error(f'{where} is "{address}", whose port "{port_text}" is not an integer') from None
    if not 1 <= port <= 65535:
        raise _error(f'{where} is "{address}", whose port {port} is not in 1..65535')
    return address


def _check_job(jobs: _Jobs, job: str, tasks: Any) -> tuple[str, ...]:
    if not isinstance(tasks, list):
        raise _error(
            f'{jobs.variable} cluster job "{job}" is {type(tasks).__name__} {tasks!r}, '
            'not a list of "host:port" strings'
        )
    if not tasks:
        raise _error(f'{jobs.variable} cluster job "{job}" is an empty list; list its "host:port" addresses')
    return tuple(_check_address(jobs, job, i, address) for i, address in enumerate(tasks))


def _check_task(jobs: _Jobs, task: Any, cluster: Mapping[str, tuple[str, ...]]) -> tuple[str, int]:
    name = jobs.variable
    if not isinstance(task, dict):
        raise _error(
            f'{name} "task" is {type(task).__name__} {task!r}, not an object like '
            f'{{"type": "{jobs.worker}", "index": 0}}'
        )
    if "type" not in task:
        raise _error(f'{name} "task" has no "type" key (e.g. "{jobs.worker}")')
    task_type = task["type"]
    if not isinstance(task_type, str) or task_type not in cluster:
        raise _error(
            f"{name} task type {task_type!r} is not a job in the cluster "
            f"(the cluster has: {', '.join(sorted(cluster))})"
        )
    if task_type not in (jobs.chief, jobs.worker):
        raise _error(
            f'{name} task type "{task_type}" is not supported: paraml runs synchronous '
            f'training, where every process is a "{jobs.chief}" or a "{jobs.worker}"'
        )
    if "index" not in task:
        raise _error(f'{name} "task" has no "index" key (an integer position in its job)')
    index = task["index"]
    size = len(cluster[task_type])
    # bool is a subclass of int in Python, but `"index": true` is certainly a mistake.
    if not isinstance(index, int) or isinstance(index, bool):
        raise _error(
            f'{name} task index {index!r} is not an integer; it must be in 0..{size - 1} for job "{task_type}"'
        )
    if not 0 <= index < size:
        raise _error(
            f'{name} task index {index} is out of range for job "{task_type}", '
            f"which has {size} task(s): valid range is 0..{size - 1}"
        )
    return task_type, index


def _parse_cluster_json(value: str, jobs: _Jobs = _Jobs()) -> ClusterSpecInfo:
    """Parse a cluster JSON shaped like ``TF_CONFIG`` (``jobs`` names its variable and its chief's and workers'
    jobs); the chief's job comes first and :class:`ClusterSpecInfo` calls it ``chief``."""
    name = jobs.variable
    try:
        config = json.loads(value)
    except json.JSONDecodeError as exc:
        raise _error(f"{name} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise _error(f"{name} is a JSON {type(config).__name__}, not a JSON object")
    if "cluster" not in config:
        raise _error(f'{name} has no "cluster" key')
    cluster = config["cluster"]
    if not isinstance(cluster, dict):
        raise _error(
            f'{name} "cluster" is {type(cluster).__name__} {cluster!r}, '
            "not an object mapping job names to address lists"
        )
    if jobs.chief not in cluster and jobs.worker not in cluster:
        jobs_found = ", ".join(sorted(map(str, cluster))) or "none"
        raise _error(f'{name} "cluster" has no "{jobs.worker}" (nor "{jobs.chief}") job; jobs found: {jobs_found}')
    addresses = {str(job): _check_job(jobs, str(job), tasks) for job, tasks in cluster.items()}
    if len(addresses.get(jobs.chief, ())) > 1:
        raise _error(
            f'{name} cluster job "{jobs.chief}" has {len(addresses[jobs.chief])} addresses; a cluster has at most '
            "one chief"
        )
    if "task" not in config:
        raise _error(f'{name} has no "task" key saying which task this process is')
    task_type, index = _check_task(jobs, config["task"], addresses)
    return ClusterSpecInfo(
        workers=addresses.get(jobs.chief, ()) + addresses.get(jobs.worker, ()),
        task_type="chief" if task_type == jobs.chief else "worker",
        task_index=index,
        has_chief=jobs.chief in addresses,
    )


def parse_tf_config(value: str | None = None) -> ClusterSpecInfo | None:
    """Parse and validate a ``TF_CONFIG`` JSON string.

    Args:
        value: The JSON text. When ``None``, ``os.environ["TF_CONFIG"]`` is read.

    Returns:
        ``None`` when the value is unset, empty or only whitespace (a
        single-process run), otherwise a :class:`ClusterSpecInfo`.

    Raises:
        ClusterConfigError: The value is not valid JSON, not an object, lacks a
            ``cluster`` with a ``worker`` (or ``chief``) job, holds a malformed
            ``host:port`` address, lacks ``task``, or has a task type/index that
            does not exist in the cluster. The message names the exact fault.

    Only ``chief`` and ``worker`` tasks are accepted: other jobs (``ps``,
    ``evaluator``) may appear in the cluster and are validated, but a process of
    those types cannot take part in synchronous training.

    Example:
        >>> cfg = ('{"cluster": {"chief": ["h0:2222"], "worker": ["h1:2222"]},'
        ...        ' "task": {"type": "worker", "index": 0}}')
        >>> info = parse_tf_config(cfg)
        >>> info.workers, info.worker_index, info.is_chief
        (('h0:2222', 'h1:2222'), 1, False)
        >>> parse_tf_config("") is None
        True
    """
    if value is None:
        value = os.environ.get(_ENV_VAR)
    if value is None or not value.strip():
        return None
    return _parse_cluster_json(value)


#: Vertex AI's variable: a JSON like TF_CONFIG whose jobs are worker pools (``workerpool0`` is the chief).
CLUSTER_SPEC_ENV = "CLUSTER_SPEC"
_VERTEX = _Jobs(CLUSTER_SPEC_ENV, chief="workerpool0", worker="workerpool1")


def parse_cluster_spec(value: str) -> ClusterSpecInfo:
    """Parse Vertex AI's ``CLUSTER_SPEC``: worker pool 0 (the chief) and worker pool 1 train; pools 2 and 3
    (reduction servers, evaluators) are validated but cannot take part in synchronous training.

    Raises:
        ClusterConfigError: The same faults as :func:`parse_tf_config`, named with ``CLUSTER_SPEC``'s keys.

    Example:
        >>> spec = ('{"cluster": {"workerpool0": ["cmle-0:2222"], "workerpool1": ["cmle-1:2222", "cmle-2:2222"]},'
        ...         ' "task": {"type": "workerpool1", "index": 1}, "environment": "cloud"}')
        >>> info = parse_cluster_spec(spec)
        >>> info.workers, info.worker_index
        (('cmle-0:2222', 'cmle-1:2222', 'cmle-2:2222'), 2)
    """
    return _parse_cluster_json(value, _VERTEX)


def make_tf_config(addresses: Sequence[str], index: int) -> str:
    """Build the ``TF_CONFIG`` JSON for worker ``index`` of a worker-only cluster.

    Worker 0 acts as the chief (no separate ``chief`` job), which is what
    :func:`paraml.cluster.launch.launch` uses for local runs.

    Args:
        addresses: ``"host:port"`` of every worker, in index order.
        index: This worker's index into ``addresses``.

    Raises:
        ClusterConfigError: ``addresses`` is empty or malformed, or ``index`` is
            out of range (the same checks :func:`parse_tf_config` makes).

    Example:
        >>> make_tf_config(["127.0.0.1:2222", "127.0.0.1:2223"], 0)
        '{"cluster": {"worker": ["127.0.0.1:2222", "127.0.0.1:2223"]}, "task": {"type": "worker", "index": 0}}'
    """
    if isinstance(addresses, str):
        # A bare string is a Sequence[str] too; it would silently become one address per character.
        raise ClusterConfigError(
            f"make_tf_config: addresses must be a list of 'host:port' strings, got the string {addresses!r}"
        )
    config = {
        "cluster": {"worker": list(addresses)},
        "task": {"type": "worker", "index": index},
    }
    text = json.dumps(config)
    parse_tf_config(text)  # validate: what we hand to workers must parse cleanly
    return text


#: Seconds a worker waits for the others to start (``PARAML_CONNECT_TIMEOUT`` overrides; 0 or "none": forever).
CONNECT_TIMEOUT = 300.0
CONNECT_TIMEOUT_ENV = "PARAML_CONNECT_TIMEOUT"


def connect_timeout() -> float | None:
    """``PARAML_CONNECT_TIMEOUT`` in seconds (default :data:`CONNECT_TIMEOUT`; ``0`` or ``none``: no limit)."""
    text = os.environ.get(CONNECT_TIMEOUT_ENV, "").strip().lower()
    if not text:
        return CONNECT_TIMEOUT
    if text in ("0", "none"):
        return None
    try:
        seconds = float(text)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise _error(f"{CONNECT_TIMEOUT_ENV} must be a number of seconds > 0, or 0/none for no limit, got {text!r}")
    return seconds


def wait_for_workers(info: ClusterSpecInfo, timeout: float | None, poll: float = 0.2) -> None:
    """Return once every other worker of ``info`` accepts connections; raise after ``timeout`` seconds naming those
    that never did.

    TensorFlow's own start waits for every task inside C++, holding the GIL, where neither a timeout nor SIGTERM can
    end it: a missing worker (a late machine, a wrong address) hangs the others for good. This wait runs first, in
    Python, so SIGTERM ends it and the timeout holds. Meanwhile this worker listens on its own port (and stops before
    TensorFlow takes it), so that the others, waiting the same way, see it too.
    """
    import socket
    import time

    def split(address: str) -> tuple[str, int]:
        host, _, port = address.rpartition(":")
        return host.strip("[]"), int(port)

    own = info.worker_index
    listener = None
    try:
        listener = socket.create_server(("", split(info.workers[own])[1]))
    except OSError:
        listener = None  # the port is taken (e.g. TensorFlow's server already runs here): the others will see it
    missing = [i for i in range(len(info.workers)) if i != own]
    deadline = None if timeout is None else time.monotonic() + timeout
    try:
        while missing:
            for i in list(missing):
                try:
                    with socket.create_connection(split(info.workers[i]), timeout=1.0):
                        missing.remove(i)
                except OSError:
                    pass
            if not missing:
                break
            if deadline is not None and time.monotonic() > deadline:
                names = ", ".join(f"worker {i} ({info.workers[i]})" for i in missing)
                raise ClusterConfigError(
                    f"worker {own} waited {timeout:g} s for the cluster in TF_CONFIG, and {names} never started: start "
                    f"every worker (paraml launch starts them together), check the addresses, or raise "
                    f"{CONNECT_TIMEOUT_ENV} (seconds)"
                )
            time.sleep(poll)
    finally:
        if listener is not None:
            listener.close()
