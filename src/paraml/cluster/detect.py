"""Which scheduler started this process, and the cluster it describes: read before TensorFlow starts.

``Parallel("multi_worker")`` needs the cluster as ``TF_CONFIG``. Each scheduler describes it its own way, so this
module reads, in this order, the first source whose variables are set:

- ``tf_config``: ``TF_CONFIG`` (set by ``paraml launch``, Ray Train, Kubeflow's TFJob), addresses as written;
- ``vertex``: ``CLUSTER_SPEC`` (Vertex AI; ``workerpool0`` is the chief), addresses as written;
- ``slurm``: ``SLURM_STEP_NUM_TASKS``, ``SLURM_PROCID``, ``SLURM_STEP_NODELIST``, ``SLURM_STEP_TASKS_PER_NODE``,
  ``SLURM_JOB_ID`` (a task of ``srun``): the step's nodes, by its task layout (``SLURM_DISTRIBUTION`` block or cyclic);
- ``mpi``: ``OMPI_COMM_WORLD_RANK``/``SIZE`` or ``PMI_RANK``/``PMI_SIZE``, with ``PARAML_MASTER`` (``HOST:PORT``)
  through which the ranks exchange their addresses;
- ``kubeflow``: ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT`` (Kubeflow Trainer),
  addresses exchanged through the master;
- ``kubernetes``: ``JOB_COMPLETION_INDEX`` (Indexed Job, JobSet) with ``PARAML_NUM_WORKERS`` and
  ``PARAML_WORKER_HOST``, the pods' host name with ``{index}`` for each worker's index;
- ``sagemaker``: ``SM_HOSTS``, ``SM_CURRENT_HOST``.

**Ports.** Worker ``i`` listens on ``base + i``: ``base`` is ``PARAML_PORT`` when set, else ``15000 +
SLURM_JOB_ID % 10000`` under Slurm (so that two jobs on one node differ, as Lightning does) and
:data:`DEFAULT_PORT` elsewhere. Sources exchanged through a master use ``PARAML_PORT + i`` when set, else a free port.
``PARAML_HOST`` overrides the address a process sends in an exchange (default: the one it reaches the master from).

**Conflicts.** Every other source whose variables are set must agree with the one used on the number of workers and
this process's index, or :func:`detect_cluster` raises, naming both. ``PARAML_SCHEDULER=<name>`` reads that source
alone (``paraml launch`` sets ``PARAML_SCHEDULER=launch`` for its workers: its ``TF_CONFIG``, nested in a scheduler).

Pure Python: no TensorFlow. Errors are :class:`~paraml.cluster.config.ClusterConfigError` naming the variables and how
to
set ``TF_CONFIG`` instead.

Example:
    >>> env = {"SLURM_STEP_NUM_TASKS": "4", "SLURM_PROCID": "3", "SLURM_STEP_NODELIST": "node[01-02]",
    ...        "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_JOB_ID": "81234"}
    >>> cluster = detect_cluster(env)
    >>> cluster.scheduler, cluster.index, cluster.workers
    ('slurm', 3, ('node01:16234', 'node01:16235', 'node02:16236', 'node02:16237'))
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass
from typing import Any

from paraml.cluster.config import (
    CLUSTER_SPEC_ENV,
    ClusterConfigError,
    ClusterSpecInfo,
    connect_timeout,
    make_tf_config,
    parse_cluster_spec,
    parse_tf_config,
)
from paraml.cluster.rendezvous import Rendezvous, join_address, split_address

__all__ = [
    "DEFAULT_PORT",
    "SCHEDULERS",
    "SCHEDULER_ENV",
    "Cluster",
    "detect_cluster",
    "expand_nodelist",
    "expand_tasks_per_node",
    "no_cluster_message",
    "setup_tf_config",
]

#: Base port of schedulers that give no port (worker ``i`` listens on ``base + i``); ``PARAML_PORT`` overrides it.
DEFAULT_PORT = 12345
_SLURM_PORT = 15000  # + SLURM_JOB_ID % 10000
PORT_ENV = "PARAML_PORT"
HOST_ENV = "PARAML_HOST"
MASTER_ENV = "PARAML_MASTER"
#: Read this source alone (a name of :data:`SCHEDULERS`, or ``launch``), with no check against the others.
SCHEDULER_ENV = "PARAML_SCHEDULER"

_TF_CONFIG_HINT = (
    'or describe the cluster with TF_CONFIG instead, e.g. TF_CONFIG=\'{"cluster": {"worker": ["host1:12345", '
    '"host2:12345"]}, "task": {"type": "worker", "index": 0}}\''
)

_LABELS = {
    "tf_config": "TF_CONFIG",
    "launch": "paraml launch",
    "vertex": "Vertex AI",
    "slurm": "Slurm",
    "mpi": "MPI",
    "kubeflow": "Kubeflow Trainer",
    "kubernetes": "Kubernetes Indexed Job/JobSet",
    "sagemaker": "SageMaker",
}


@dataclass(frozen=True)
class Cluster:
    """A cluster as a scheduler described it, and this process's place in it.

    Attributes:
        scheduler: The source's name (``"slurm"``, ...; see :data:`SCHEDULERS`).
        num_workers: How many workers train together.
        index: This process's index among them (0 is the chief).
        workers: Every worker's ``"host:port"``, in index order; empty until exchanged through :attr:`master`.
        variables: ``(name, value)`` of every variable read, in the order read.
        master: ``"host:port"`` through which the workers' addresses are exchanged, for sources that give only that.
        port: This process's own port in that exchange (None: a free one).
        host: This process's own host in that exchange (None: the address it reaches the master from).
        tf_config: The ``TF_CONFIG`` text when the source is one (kept as written, with its ``chief`` job).

    Example:
        >>> c = Cluster("sagemaker", 2, 1, ("algo-1:12345", "algo-2:12346"))
        >>> c.is_chief, c.chief, json.loads(c.to_tf_config())["task"]
        (False, 'algo-1:12345', {'type': 'worker', 'index': 1})
    """

    scheduler: str
    num_workers: int
    index: int
    workers: tuple[str, ...] = ()
    variables: tuple[tuple[str, str], ...] = ()
    master: str | None = None
    port: int | None = None
    host: str | None = None
    tf_config: str | None = None

    @property
    def label(self) -> str:
        """The scheduler's name for people (``"Kubeflow Trainer"``)."""
        return _LABELS.get(self.scheduler, self.scheduler)

    @property
    def is_chief(self) -> bool:
        """Whether this process is worker 0, which does the once-per-cluster work."""
        return self.index == 0

    @property
    def chief(self) -> str | None:
        """Worker 0's address (None until exchanged)."""
        return self.workers[0] if self.workers else None

    def resolved(self, timeout: float | None) -> Cluster:
        """This cluster with every worker's address: exchanged through :attr:`master` when needed (waiting at most
        ``timeout`` seconds, None: no limit), else itself."""
        if self.workers:
            return self
        port = self.port if self.port is not None else _free_port()
        if self.num_workers == 1:
            return dataclasses.replace(self, workers=(join_address(self.host or "localhost", port),))
        assert self.master is not None
        variables = _MASTER_VARIABLES[self.scheduler]
        exchange = Rendezvous.join(
            self.master, self.index, self.num_workers, [port], host=self.host, timeout=timeout, variables=variables
        )
        return dataclasses.replace(self, workers=tuple(exchange.workers))

    def to_tf_config(self) -> str:
        """The ``TF_CONFIG`` for this process: as written for the ``tf_config`` source, else a worker-only cluster
        (worker 0 the chief), as ``paraml launch`` makes. Needs :attr:`workers` (see :meth:`resolved`)."""
        if self.tf_config is not None:
            return self.tf_config
        if not self.workers:
            raise ClusterConfigError(f"the {self.label} cluster's addresses are not exchanged yet (see resolved())")
        return make_tf_config(self.workers, self.index)

    def describe(self) -> str:
        """What ``paraml cluster`` prints: the scheduler, the variables read, the workers, this process, the chief."""
        lines = [f"scheduler: {self.label} ({self.scheduler})"]
        lines.append("variables read: " + ", ".join(f"{name}={value}" for name, value in self.variables))
        if self.workers:
            lines.append(f"workers: {self.num_workers}")
            for i, address in enumerate(self.workers):
                marks = [m for m, on in (("chief", i == 0), ("this process", i == self.index)) if on]
                lines.append(f"  {i}  {address}" + (f"  ({', '.join(marks)})" if marks else ""))
            lines.append(f"chief: worker 0 ({self.workers[0]})")
        else:
            lines.append(
                f"workers: {self.num_workers}, their addresses exchanged through the master {self.master} "
                f"({_MASTER_VARIABLES[self.scheduler]}) when training starts"
            )
            lines.append("chief: worker 0 (rank 0, on the master's machine)")
        lines.append(f"this process: worker {self.index} of {self.num_workers}")
        if self.workers:
            lines.append(f"TF_CONFIG: {self.to_tf_config()}")
        return "\n".join(lines)


_MASTER_VARIABLES = {"mpi": MASTER_ENV, "kubeflow": "PET_MASTER_ADDR, PET_MASTER_PORT"}


def _free_port() -> int:
    from paraml.cluster.launch import find_free_ports

    return find_free_ports(1, "")[0]


class _Reader:
    """The variables of one source, each read recorded; faults raised as ClusterConfigError naming them."""

    def __init__(self, environ: Mapping[str, str], scheduler: str) -> None:
        self.environ = environ
        self.scheduler = scheduler
        self.read: dict[str, str] = {}

    def get(self, name: str) -> str | None:
        value = self.environ.get(name)
        if value is not None and value.strip():
            self.read[name] = value
            return value.strip()
        return None

    def error(self, fault: str, fix: str = "") -> ClusterConfigError:
        fix = f"{fix}, " if fix else ""
        return ClusterConfigError(f"{_LABELS[self.scheduler]}: {fault}. Fix: {fix}{_TF_CONFIG_HINT}")

    def require(self, name: str, fix: str) -> str:
        value = self.get(name)
        if value is None:
            raise self.error(f"{name} is not set", fix)
        return value

    def integer(self, name: str, low: int = 0, high: int | None = None, fix: str = "") -> int:
        text = self.require(name, fix or f"set {name}")
        try:
            value = int(text, 10)
        except ValueError:
            raise self.error(f'{name}="{text}" is not an integer', fix) from None
        if value < low or (high is not None and value > high):
            span = f"{low}..{high}" if high is not None else f">= {low}"
            raise self.error(f"{name}={value} is out of range: valid range is {span}", fix)
        return value

    def port_base(self, default: int, count: int) -> int:
        base = self.integer(PORT_ENV, 1, 65535) if self.get(PORT_ENV) is not None else default
        if base + count - 1 > 65535:
            raise self.error(f"{count} workers from port {base} need ports up to {base + count - 1} (> 65535)", "")
        return base

    def cluster(self, num_workers: int, index: int, workers: Sequence[str] = (), **more: Any) -> Cluster:
        return Cluster(self.scheduler, num_workers, index, tuple(workers), tuple(self.read.items()), **more)


def _spec_cluster(env: _Reader, info: ClusterSpecInfo, **more: Any) -> Cluster:
    return env.cluster(info.num_workers, info.worker_index, info.workers, **more)


def _tf_config(env: _Reader) -> Cluster:
    text = env.require("TF_CONFIG", "set TF_CONFIG")
    info = parse_tf_config(text)
    assert info is not None
    return _spec_cluster(env, info, tf_config=text)


def _vertex(env: _Reader) -> Cluster:
    text = env.require(CLUSTER_SPEC_ENV, "")
    return _spec_cluster(env, parse_cluster_spec(text))


def _slurm(env: _Reader) -> Cluster:
    count = env.integer("SLURM_STEP_NUM_TASKS", 1, fix="start the script with srun")
    rank = env.integer("SLURM_PROCID", 0, count - 1, fix="start the script with srun")
    nodes_text = env.require("SLURM_STEP_NODELIST", "start the script with srun")
    layout_text = env.require("SLURM_STEP_TASKS_PER_NODE", "start the script with srun")
    job_id = env.integer("SLURM_JOB_ID", 0) if env.get(PORT_ENV) is None else 0
    try:
        nodes = expand_nodelist(nodes_text)
        per_node = expand_tasks_per_node(layout_text)
    except ValueError as exc:
        raise env.error(str(exc)) from None
    if len(per_node) != len(nodes):
        raise env.error(
            f'SLURM_STEP_TASKS_PER_NODE="{layout_text}" counts {len(per_node)} node(s), but '
            f'SLURM_STEP_NODELIST="{nodes_text}" lists {len(nodes)}'
        )
    if sum(per_node) != count:
        raise env.error(
            f'SLURM_STEP_TASKS_PER_NODE="{layout_text}" places {sum(per_node)} task(s), but '
            f"SLURM_STEP_NUM_TASKS={count}"
        )
    distribution = (env.get("SLURM_DISTRIBUTION") or "block").split(":")[0].split(",")[0]
    if distribution not in ("block", "cyclic"):
        raise env.error(
            f'SLURM_DISTRIBUTION="{distribution}" places tasks in a way paraml cannot derive',
            "use srun --distribution=block (the default) or cyclic",
        )
    placement = _place(per_node, distribution)
    here = env.get("SLURMD_NODENAME")
    if here is not None and nodes[placement[rank]] != here:
        raise env.error(
            f"SLURM_PROCID={rank} falls on {nodes[placement[rank]]} by the {distribution} layout of "
            f"SLURM_STEP_TASKS_PER_NODE, but SLURMD_NODENAME={here}"
        )
    base = env.port_base(_SLURM_PORT + job_id % 10000, count)
    return env.cluster(count, rank, [join_address(nodes[n], base + i) for i, n in enumerate(placement)])


def _place(per_node: list[int], distribution: str) -> list[int]:
    """The node of each task, in task order: ``block`` fills each node in turn, ``cyclic`` deals one per node."""
    if distribution == "block":
        return [node for node, tasks in enumerate(per_node) for _ in range(tasks)]
    placed, left = [], list(per_node)
    while any(left):
        for node, tasks in enumerate(left):
            if tasks:
                placed.append(node)
                left[node] -= 1
    return placed


def _mpi(env: _Reader) -> Cluster:
    prefix = "OMPI_COMM_WORLD_" if env.get("OMPI_COMM_WORLD_SIZE") is not None else "PMI_"
    size = env.integer(f"{prefix}SIZE", 1)
    rank = env.integer(f"{prefix}RANK", 0, size - 1, fix="start the script with mpirun")
    master = env.get(MASTER_ENV)
    if master is None and size > 1:
        raise env.error(
            f"{prefix}RANK and {prefix}SIZE say which rank this is, not where the others are",
            f"set {MASTER_ENV}=HOST:PORT (rank 0's machine and a free port; mpirun -x {MASTER_ENV}) so that the "
            "ranks exchange their addresses through it",
        )
    if master is not None:
        try:
            split_address(master, MASTER_ENV)
        except ClusterConfigError as exc:
            raise env.error(str(exc)) from None
    return env.cluster(size, rank, master=master, **_exchange(env, rank))


def _kubeflow(env: _Reader) -> Cluster:
    nodes_text = env.require("PET_NNODES", "")
    if not nodes_text.isdigit():
        raise env.error(f'PET_NNODES="{nodes_text}" is not a fixed number of nodes (elastic ranges are not supported)')
    nodes = env.integer("PET_NNODES", 1)
    rank = env.integer("PET_NODE_RANK", 0, nodes - 1)
    host = env.require("PET_MASTER_ADDR", "")
    port = env.integer("PET_MASTER_PORT", 1, 65535)
    return env.cluster(nodes, rank, master=join_address(host, port), **_exchange(env, rank))


def _exchange(env: _Reader, index: int) -> dict[str, Any]:
    """This process's own host and port for an exchange through a master."""
    base = env.port_base(0, index + 1) if env.get(PORT_ENV) is not None else None
    return {"port": None if base is None else base + index, "host": env.get(HOST_ENV)}


def _kubernetes(env: _Reader) -> Cluster:
    fix = "set PARAML_NUM_WORKERS to the Job's completions"
    count = env.integer("PARAML_NUM_WORKERS", 1, fix=fix)
    index = env.integer("JOB_COMPLETION_INDEX", 0, count - 1)
    pattern = env.require("PARAML_WORKER_HOST", "")
    if "{index}" not in pattern:
        raise env.error(
            f'PARAML_WORKER_HOST="{pattern}" has no {{index}}',
            'set it to the pods\' host names with {index} for the index, e.g. "paraml-{index}.paraml"',
        )
    base = env.port_base(DEFAULT_PORT, count)
    return env.cluster(count, index, [join_address(pattern.replace("{index}", str(i)), base + i) for i in range(count)])


def _sagemaker(env: _Reader) -> Cluster:
    text = env.require("SM_HOSTS", "")
    try:
        hosts = json.loads(text)
    except json.JSONDecodeError:
        hosts = None
    if not isinstance(hosts, list) or not hosts or not all(isinstance(h, str) and h for h in hosts):
        raise env.error(f'SM_HOSTS={text} is not a JSON list of host names like ["algo-1", "algo-2"]')
    if len(set(hosts)) != len(hosts):
        raise env.error(f"SM_HOSTS={text} names a host twice")
    current = env.require("SM_CURRENT_HOST", "")
    if current not in hosts:
        raise env.error(f'SM_CURRENT_HOST="{current}" is not one of SM_HOSTS={text}')
    base = env.port_base(DEFAULT_PORT, len(hosts))
    return env.cluster(len(hosts), hosts.index(current), [join_address(h, base + i) for i, h in enumerate(hosts)])


_Source = tuple[Callable[[Mapping[str, str]], bool], Callable[[_Reader], Cluster]]


def _set(*names: str) -> Callable[[Mapping[str, str]], bool]:
    return lambda environ: all((environ.get(name) or "").strip() for name in names)


_SOURCES: dict[str, _Source] = {
    "tf_config": (_set("TF_CONFIG"), _tf_config),
    "vertex": (_set(CLUSTER_SPEC_ENV), _vertex),
    "slurm": (_set("SLURM_STEP_NUM_TASKS"), _slurm),
    "mpi": (lambda e: _set("OMPI_COMM_WORLD_SIZE")(e) or _set("PMI_SIZE")(e), _mpi),
    "kubeflow": (_set("PET_NNODES"), _kubeflow),
    "kubernetes": (_set("JOB_COMPLETION_INDEX", "PARAML_WORKER_HOST"), _kubernetes),
    "sagemaker": (_set("SM_HOSTS"), _sagemaker),
}
_FORCED_ONLY = {"launch": _SOURCES["tf_config"]}  # paraml launch's TF_CONFIG, named as such

#: The sources :func:`detect_cluster` reads, in order of precedence.
SCHEDULERS: tuple[str, ...] = tuple(_SOURCES)


def detect_cluster(environ: Mapping[str, str] | None = None) -> Cluster | None:
    """The cluster this process's environment describes (``os.environ`` by default), or None when none does.

    Reads the first source of :data:`SCHEDULERS` whose variables are set (``PARAML_SCHEDULER`` names one to read
    alone), then checks that every other source that is set agrees on the number of workers and this process's
    index. No network: sources that give only a master return a :class:`Cluster` without :attr:`~Cluster.workers`
    (:meth:`Cluster.resolved` exchanges them).

    Raises:
        ClusterConfigError: A source's variables are malformed or missing, two sources disagree (naming both), or
            ``PARAML_SCHEDULER`` names an unknown source or one whose variables are not set.

    Example:
        >>> detect_cluster({"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2"}).workers
        ('algo-1:12345', 'algo-2:12346')
        >>> detect_cluster({}) is None
        True
    """
    environ = os.environ if environ is None else environ
    forced = (environ.get(SCHEDULER_ENV) or "").strip()
    if forced:
        sources = {**_SOURCES, **_FORCED_ONLY}
        if forced not in sources:
            from paraml.checks import did_you_mean

            raise ClusterConfigError(
                f"{SCHEDULER_ENV}={forced!r}{did_you_mean(forced, sources)} is not a source paraml reads; "
                f"valid: {', '.join(sources)}"
            )
        present, read = sources[forced]
        if not present(environ):
            raise ClusterConfigError(
                f"{SCHEDULER_ENV}={forced} but {_LABELS[forced]}'s variables are not set; unset {SCHEDULER_ENV} "
                "to detect the source"
            )
        return read(_Reader(environ, forced))
    found = [name for name, (present, _) in _SOURCES.items() if present(environ)]
    if not found:
        return None
    clusters = [_SOURCES[name][1](_Reader(environ, name)) for name in found]
    chosen = clusters[0]
    for other in clusters[1:]:
        if (other.num_workers, other.index) != (chosen.num_workers, chosen.index):
            raise ClusterConfigError(
                f"the cluster variables disagree: {_says(chosen)}, but {_says(other)}. Unset the variables that do "
                f"not describe this process, or set {SCHEDULER_ENV}={chosen.scheduler} (or {other.scheduler}) to "
                "read one source alone"
            )
    return chosen


def _says(cluster: Cluster) -> str:
    variables = ", ".join(f"{name}={value}" for name, value in cluster.variables)
    return f"{cluster.label} ({variables}) says worker {cluster.index} of {cluster.num_workers}"


def no_cluster_message(environ: Mapping[str, str] | None = None) -> str:
    """What was looked for and not found, and how to start a multi-worker script instead."""
    environ = os.environ if environ is None else environ
    text = (
        "TF_CONFIG is not set and no scheduler's variables were found "
        "(CLUSTER_SPEC; srun's SLURM_STEP_*; OMPI_COMM_WORLD_*/PMI_*; PET_*; JOB_COMPLETION_INDEX with "
        "PARAML_WORKER_HOST; SM_HOSTS). Start the script with `paraml launch -n 2 script.py` (it sets TF_CONFIG), "
        "under one of those schedulers, set TF_CONFIG yourself, or pass cluster_resolver="
    )
    if environ.get("SLURM_PROCID") is not None:
        text += (
            ". SLURM_PROCID is set but not SLURM_STEP_NUM_TASKS: this is a batch script, not a task of srun; start "
            "the script with srun"
        )
    if environ.get("JOB_COMPLETION_INDEX") is not None:
        text += (
            ". JOB_COMPLETION_INDEX is set but not PARAML_WORKER_HOST: set PARAML_WORKER_HOST (the pods' host "
            'names with {index}, e.g. "paraml-{index}.paraml") and PARAML_NUM_WORKERS (the completions)'
        )
    return text


def setup_tf_config(
    environ: MutableMapping[str, str] | None = None, *, required: bool = False
) -> ClusterSpecInfo | None:
    """Detect the cluster (:func:`detect_cluster`), exchange its addresses if needed (bounded by
    :func:`~paraml.cluster.config.connect_timeout`), and set ``TF_CONFIG`` in ``environ`` (``os.environ``) from it, so
    that TensorFlow (and any child process) reads the same cluster. Returns the parsed ``TF_CONFIG``, or None
    without a cluster (``required``: raise :func:`no_cluster_message` instead).

    Example:
        >>> env = {"SM_HOSTS": '["algo-1", "algo-2"]', "SM_CURRENT_HOST": "algo-2"}
        >>> setup_tf_config(env).worker_index, json.loads(env["TF_CONFIG"])["cluster"]
        (1, {'worker': ['algo-1:12345', 'algo-2:12346']})
    """
    environ = os.environ if environ is None else environ
    cluster = detect_cluster(environ)
    if cluster is None:
        if required:
            raise ClusterConfigError("strategy 'multi_worker' needs a cluster: " + no_cluster_message(environ))
        return None
    text = cluster.resolved(connect_timeout()).to_tf_config()
    if cluster.tf_config is None:
        environ["TF_CONFIG"] = text
    return parse_tf_config(text)


_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")
_TASKS = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_nodelist(text: str) -> list[str]:
    """Slurm's compressed host list in full: ``node[01-03,07],gpu5`` -> node01, node02, node03, node07, gpu5.

    Zero padding is kept; several bracket groups in one name multiply (``r[1-2]n[1-2]``). ValueError names a
    malformed value.

    Example:
        >>> expand_nodelist("node[01-03,07],gpu5")
        ['node01', 'node02', 'node03', 'node07', 'gpu5']
    """
    names, depth, current = [], 0, ""
    for char in text.strip() + ",":
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
        if depth not in (0, 1):
            raise ValueError(f'SLURM_STEP_NODELIST="{text}" has unbalanced or nested brackets')
        if char == "," and depth == 0:
            if not current.strip():
                raise ValueError(f'SLURM_STEP_NODELIST="{text}" has an empty host name')
            names.extend(_expand_name(current.strip(), text))
            current = ""
        else:
            current += char
    if depth:
        raise ValueError(f'SLURM_STEP_NODELIST="{text}" has unbalanced or nested brackets')
    return names


def _expand_name(name: str, text: str) -> list[str]:
    start = name.find("[")
    if start < 0:
        return [name]
    end = name.index("]", start)
    values = []
    for part in name[start + 1 : end].split(","):
        match = _RANGE.match(part.strip())
        if not match:
            raise ValueError(f'SLURM_STEP_NODELIST="{text}" has "{part}" in brackets, not a number or a range a-b')
        low, high = match.group(1), match.group(2) or match.group(1)
        if int(high) < int(low):
            raise ValueError(f'SLURM_STEP_NODELIST="{text}" has the range "{part}", which runs backwards')
        values += [str(v).zfill(len(low)) for v in range(int(low), int(high) + 1)]
    return [name[:start] + value + rest for value in values for rest in _expand_name(name[end + 1 :], text)]


def expand_tasks_per_node(text: str) -> list[int]:
    """Slurm's tasks per node in full: ``2(x3),1`` -> [2, 2, 2, 1]. ValueError names a malformed value.

    Example:
        >>> expand_tasks_per_node("2(x3),1")
        [2, 2, 2, 1]
    """
    counts: list[int] = []
    for part in text.strip().split(","):
        match = _TASKS.match(part.strip())
        if not match or int(match.group(1)) < 1:
            raise ValueError(
                f'SLURM_STEP_TASKS_PER_NODE="{text}" has "{part}", not a count like 2 or 2(x3) (2 tasks on 3 nodes)'
            )
        counts += [int(match.group(1))] * int(match.group(2) or 1)
    return counts
