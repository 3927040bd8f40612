"""Elastic launches: a job goes on when workers leave or nodes join (`paraml launch -n MIN:MAX`, `--nnodes MIN:MAX`).

A resize is a restart at another size. The launcher stops every worker (SIGTERM: where every worker is still there,
each stops at the next step and they write a checkpoint together; a worker that died takes the work since the last
checkpoint with it), forms the new cluster of the workers that are there and starts the same script again. A script
that trains with ``fit(checkpoint_dir=...)`` resumes exactly: checkpoints store each tensor whole, by position, so a
checkpoint of N workers is read by M (each reads only what it holds), and the global batch is the user's
``batch_size`` whatever the number of workers, so every step sees the samples it would have seen.

The rules:

- **One machine**, ``-n MIN:MAX``: MAX workers start. A worker that fails leaves: the job goes on with the others
  (renumbered from 0) while at least MIN remain. Each such resize takes one of ``--max-restarts``.
- **Several machines**, ``--nnodes MIN:MAX``: node 0 (``--node-rank 0``, on the ``--master`` host) holds the
  rendezvous for the whole job (:class:`ElasticHost`); any other node (any ``--node-rank`` >= 1) may connect at any
  time (:class:`ElasticMember`). A run starts once MIN nodes are there (after a short last call for the others), with
  at most MAX, node 0 first and the others in the order they came. A node that comes while the job runs with fewer
  than MAX joins at once: every worker is stopped (they write their checkpoint) and the job goes on with it; that is
  not a restart. A node whose launcher is stopped (SIGTERM, as a preempted machine's is) or lost leaves; a node whose
  worker fails runs one worker fewer from then on (with fewer than ``-n``'s MIN it leaves); each failure takes one of
  ``--max-restarts``. Node 0 leaving ends the job.

At each resize the workers get :data:`RESIZE_ENV` (what changed) and :data:`REACHED_ENV` (where the last run's chief
got to, from :data:`PROGRESS_ENV`, which it writes after each step), and the chief prints one line: who left or
joined, the new layout, the checkpoint it resumed from, the steps lost (:mod:`paraml.loop.checkpoint`).

Messages between nodes are lines of JSON. Pure Python: no TensorFlow.

Example:
    >>> Bounds.parse("2:4", "--nnodes")
    Bounds(low=2, high=4)
    >>> str(Bounds.parse(3, "-n"))
    '3'
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from paraml.cluster.config import ClusterConfigError
from paraml.cluster.rendezvous import (
    _attempt,
    _deadline,
    _expired,
    _Lines,
    _own_addresses,
    _raise_longer,
    _send_quietly,
    split_address,
)

__all__ = [
    "PROGRESS_ENV",
    "REACHED_ENV",
    "RESIZE_ENV",
    "Bounds",
    "ElasticHost",
    "ElasticMember",
    "read_progress",
    "resize_text",
]

RESIZE_ENV = "PARAML_RESIZE"  # what the last resize changed ("worker 2 left: 3 -> 2 workers"); unset on the first run
REACHED_ENV = "PARAML_REACHED"  # "EPOCH STEP" the last run's chief reached before the resize
PROGRESS_ENV = "PARAML_PROGRESS_FILE"  # where the chief writes "EPOCH STEP" after each step

_PROTOCOL = "paraml-elastic-1"
_LAST_CALL = 1.0  # seconds a round waits for more nodes once MIN are there (unless MAX are)
_POLL = 0.05


@dataclass(frozen=True)
class Bounds:
    """How many (workers or nodes) a launch may have: ``MIN:MAX`` (torchrun's form), or ``N`` for exactly N."""

    low: int
    high: int

    @classmethod
    def parse(cls, value: int | str, option: str) -> Bounds:
        """``3`` or ``"3"`` -> 3:3, ``"2:4"`` -> 2:4; anything else is a ValueError naming ``option`` and the value."""
        text = str(value).strip()
        parts = text.split(":")
        if isinstance(value, bool) or len(parts) > 2 or not all(p.strip().isdigit() for p in parts):
            raise ValueError(f"{option} must be an integer N or a range MIN:MAX (for example 2:4), got {value!r}")
        low, high = int(parts[0]), int(parts[-1])
        if low < 1 and len(parts) == 1:
            raise ValueError(f"{option} must be an int >= 1, got {low}")
        if low < 1:
            raise ValueError(f"{option} {text}: the minimum must be >= 1, got {low}")
        if low > high:
            raise ValueError(f"{option} {text}: MIN {low} is larger than MAX {high}; give MIN:MAX with MIN <= MAX")
        return cls(low, high)

    @property
    def elastic(self) -> bool:
        """Whether the count may change while the job runs."""
        return self.low < self.high

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


def resize_text(change: str, before: int, after: int) -> str:
    """The line workers get in :data:`RESIZE_ENV`: ``"worker 2 left: 3 -> 2 workers"``."""
    return f"{change}: {before} -> {after} workers"


def read_progress(path: str | os.PathLike[str]) -> str:
    """``"EPOCH STEP"`` the chief last wrote to ``path`` (empty when it wrote nothing)."""
    try:
        parts = Path(path).read_text().split()
    except OSError:
        return ""
    return " ".join(parts[:2]) if len(parts) >= 2 and all(p.isdigit() for p in parts[:2]) else ""


@dataclass(frozen=True)
class Formed:
    """One run's cluster as a node sees it: every worker's address, where this node's are, what changed."""

    addresses: list[str]
    first: int  # the global index of this node's first worker
    workers: int  # how many workers this node starts
    resize: str  # empty on the first run
    reached: str  # "EPOCH STEP" of the last run's chief, or empty
    run: int  # the job's run number (PARAML_RESTART), node 0's count


@dataclass
class _Node:
    """The host's view of one node (the host itself has no socket)."""

    number: int  # in order of arrival: 0 is the host
    workers: int
    name: str = "node 0"  # as messages name it: by the --node-rank it was given (its arrival, when two gave one)
    sock: socket.socket | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)
    addresses: list[str] | None = None
    result: tuple[int, bool] | None = None  # (exit code, leaves)
    gone: bool = False

    def send(self, message: dict[str, Any]) -> None:
        if self.sock is not None:
            _send_quietly(self.sock, message, self.lock)


class ElasticHost:
    """Node 0 of an elastic multi-node launch: listens on the master's port for the whole job, forms each run of the
    nodes that are there, stops a run when a node comes, fails or goes, and decides what follows.

    Used by :func:`paraml.cluster.launch.launch` as the run's peers: :meth:`form`, :attr:`stop_requested`,
    :meth:`report`, :meth:`outcome`, :meth:`close`.
    """

    def __init__(self, master: str, workers: Bounds, nodes: Bounds, timeout: float | None, max_restarts: int) -> None:
        self.workers, self.nodes, self.timeout, self.max_restarts = workers, nodes, timeout, max_restarts
        self.restarts = 0
        self._host, port = split_address(master, "--master")
        try:
            self._server = socket.create_server(("", port))
        except OSError as exc:
            raise ClusterConfigError(
                f"node 0 cannot listen on port {port} of --master {master}: {exc.strerror or exc}. Node 0 must run on "
                "the master's machine, and that port must be free"
            ) from None
        self._server.settimeout(_POLL)
        self._cond = threading.Condition()
        self._nodes: list[_Node] = [_Node(0, workers.high)]  # every node there, the host first
        self._members: list[_Node] = []  # the current run's
        self._stop_reason = ""
        self._first_failure: _Node | None = None
        self._previous: list[_Node] = []  # the last run's members
        self._changes: list[str] = []  # who left after the last run
        self._before = 0  # workers in the last run
        self._resize, self._reached = "", ""
        self._running = False  # between form() and outcome()
        self._closed = False
        self._threads = [threading.Thread(target=self._accept, name="paraml-elastic", daemon=True)]
        self._threads[0].start()

    # ------------------------------------------------------------------ arrivals

    def _accept(self) -> None:
        number = 0
        while not self._closed:
            try:
                conn, _ = self._server.accept()
            except (TimeoutError, OSError):
                continue
            lines = _Lines(conn)
            try:
                hello = lines.read(time.monotonic() + 5.0)
            except (OSError, ValueError):
                hello = None
            if not hello or hello.get("protocol") != _PROTOCOL:
                conn.close()  # not one of ours
                continue
            if hello.get("nodes") != [self.nodes.low, self.nodes.high]:
                _send_quietly(conn, {"error": f"this node has --nnodes {hello.get('nodes')}, node 0 {self.nodes}"})
                conn.close()
                continue
            number += 1
            with self._cond:
                rank = hello.get("rank", number)
                taken = any(n.name == f"node {rank}" for n in self._nodes)
                name = f"node {rank}" + (f" (arrival {number})" if taken else "")
                node = _Node(number, int(hello.get("workers", 1)), sock=conn, name=name)
                self._nodes.append(node)
                if self._running and len(self._members) < self.nodes.high:
                    self._request_stop(f"{node.name} came to join")
                self._cond.notify_all()
            thread = threading.Thread(target=self._read, args=(node, lines), name="paraml-elastic", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _read(self, node: _Node, lines: _Lines) -> None:
        while True:
            try:
                message = lines.read(None)
            except (OSError, ValueError):
                message = None
            with self._cond:
                if message is None:
                    node.gone = True
                    self._nodes = [n for n in self._nodes if n is not node]
                    if self._running and node in self._members:
                        self._failed(node, f"{node.name} was lost")
                elif "addresses" in message:
                    node.addresses = [str(a) for a in message["addresses"]]
                elif "result" in message:
                    node.result = (int(message["result"]), bool(message.get("leaves")))
                    if node.result[0]:
                        self._failed(node, f"{node.name} {'is leaving' if node.result[1] else 'failed'}")
                self._cond.notify_all()
            if message is None:
                return

    def _failed(self, node: _Node, reason: str) -> None:
        """(Under the lock.) ``node``'s run ended badly: the first such node is the run's failure, unless the run was
        already being stopped (then its code is the stop's)."""
        if not self._stop_reason:
            self._first_failure = node
        self._request_stop(reason)

    def _request_stop(self, reason: str) -> None:
        """(Under the lock.) Stop the run: every other node stops its workers (each writes its checkpoint)."""
        if self._stop_reason or not self._running:
            return
        self._stop_reason = reason
        for node in self._members[1:]:
            node.send({"stop": reason})

    # ------------------------------------------------------------------ a run

    def form(self, round: int, ports: Sequence[int], host: str | None) -> Formed:
        """Wait for MIN nodes (and a last call), tell each its rank, collect their addresses, send everyone's."""
        deadline = _deadline(self.timeout)
        with self._cond:
            while len(self._nodes) < self.nodes.low:
                if _expired(deadline):
                    raise ClusterConfigError(
                        f"node 0 waited {self.timeout:g} s and {len(self._nodes)} of at least {self.nodes.low} nodes "
                        f"(--nnodes) are there: start the others with the same --master and --nnodes, {_raise_longer()}"
                    )
                self._cond.wait(_POLL)
            last_call = time.monotonic() + _LAST_CALL
            while len(self._nodes) < self.nodes.high and time.monotonic() < last_call:
                self._cond.wait(_POLL)
            members = self._nodes[: self.nodes.high]
            for node in members:
                node.addresses, node.result = None, None
            if self._previous:
                changes = self._changes + [f"{n.name} joined" for n in members if n not in self._previous]
                self._resize = resize_text(", ".join(changes), self._before, sum(n.workers for n in members))
            self._previous = self._members = members
            self._stop_reason, self._first_failure = "", None
        own = _own_addresses(list(ports), host or self._host)
        members[0].addresses = own
        for rank, node in enumerate(members[1:], start=1):
            node.send({"form": round, "rank": rank, "size": len(members)})
        with self._cond:
            while not all(n.addresses is not None or n.gone for n in members):
                self._cond.wait(_POLL)
            if any(n.gone for n in members):
                raise ClusterConfigError("a node left while the cluster was being formed")
        everyone = [list(n.addresses or []) for n in members]
        for node in members[1:]:
            node.send({"cluster": everyone, "resize": self._resize, "reached": self._reached})
        with self._cond:
            self._running = True
            if any(n.gone or n.result is not None for n in members[1:]):  # lost meanwhile
                self._request_stop("a node was lost while the run started")
        workers = [address for group in everyone for address in group]
        return Formed(workers, 0, len(own), self._resize, self._reached, round)

    @property
    def stop_requested(self) -> bool:
        """Whether this run must stop: a node failed, was lost or is leaving, or a node came while there is room."""
        return bool(self._stop_reason)

    @property
    def stop_reason(self) -> str:
        """Why this run is stopped (empty while it runs)."""
        return self._stop_reason

    def report(self, code: int, final: bool = False) -> None:
        """How node 0's own run ended; ``final``: the job ends (node 0 was stopped by a signal)."""
        with self._cond:
            self._members[0].result = (code, final)
            if code:
                self._failed(self._members[0], "node 0 is stopping" if final else "a worker on node 0 failed")
            self._cond.notify_all()
        if final:
            self._finish(code, final=True)

    def outcome(self, reached: str) -> tuple[int, bool, str]:
        """Wait for every node's result; return ``(code, final, why)``: 0 and final when every worker succeeded;
        otherwise whether the job ends, and the line to print. Tells every node what follows."""
        with self._cond:
            while not all(n.result is not None or n.gone for n in self._members):
                self._cond.wait(_POLL)
            members = list(self._members)
        before = sum(n.workers for n in members)
        codes = [n.result[0] if n.result is not None else 1 for n in members]
        if not any(codes):
            self._finish(0, final=True)
            return 0, True, ""
        leaving = [n for n in members if n.result is not None and n.result[1]]  # its launcher was stopped
        lost = [n for n in members if n.gone and n not in leaving]
        failed = self._first_failure if self._first_failure not in (*leaving, *lost) else None
        code = next((c for c in codes if c), 1)
        if failed is not None:
            failed.workers -= 1  # the worker that failed first leaves; so does a node with fewer than MIN workers
            code = failed.result[0] if failed.result is not None else code
            if failed.workers < self.workers.low:
                lost.append(failed)
        left = leaving + lost
        if members[0] in left:
            self._finish(code, final=True)
            return code, True, "node 0 was stopped or has too few workers left: the job ends"
        if lost or failed is not None:  # a failure (not a join, not a node stopped on purpose) takes a restart
            self.restarts += 1
            if self.restarts > self.max_restarts:
                self._finish(code, final=True)
                return code, True, f"no restarts left ({self.max_restarts} used)"
        with self._cond:
            self._nodes = [n for n in self._nodes if n not in left]
            coming = self._nodes[: self.nodes.high]
        if len(coming) < self.nodes.low:
            self._finish(code, final=True)
            return code, True, f"{len(coming)} node(s) left, fewer than --nnodes {self.nodes}: the job ends"
        changes = [f"{n.name} left" for n in left]
        changes += [f"a worker of {failed.name} left"] if failed is not None and failed not in left else []
        self._changes, self._before, self._reached = changes, before, reached  # form() adds who joined
        for node in members[1:]:
            if node not in left:
                node.send({"outcome": code, "final": False, "workers": node.workers})
            elif not node.gone:
                node.send({"outcome": code, "final": True, "workers": 0})
        counted = f"restart {self.restarts} of {self.max_restarts}" if lost or failed is not None else "not a restart"
        return code, False, f"{', '.join(changes) or 'a node is waiting to join'}; {counted}"

    @property
    def own_workers(self) -> int:
        """How many workers node 0 starts in the next run."""
        return self._nodes[0].workers

    def _finish(self, code: int, final: bool) -> None:
        for node in self._members[1:]:
            node.send({"outcome": code, "final": final, "workers": 0})

    def close(self) -> None:
        """Stop listening and close every connection."""
        self._closed = True
        self._server.close()
        for node in {id(n): n for n in [*self._nodes, *self._members]}.values():  # a member may have left _nodes
            if node.sock is not None:
                try:
                    node.sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                node.sock.close()


class ElasticMember:
    """Any node but node 0 of an elastic launch: connects to the master (retrying until it answers), waits for a
    place in a run, runs, reports, and learns what follows."""

    def __init__(self, master: str, workers: Bounds, nodes: Bounds, timeout: float | None, rank: int = 1) -> None:
        host, port = split_address(master, "--master")
        deadline = _deadline(timeout)
        attempt: socket.socket | str = "no attempt"
        while not isinstance(attempt, socket.socket):
            if _expired(deadline):
                raise ClusterConfigError(
                    f"this node could not reach the master {master} (--master) within {timeout:g} s (last attempt: "
                    f"{attempt}): start node 0 there first, {_raise_longer()}"
                )
            attempt = _attempt(host, port, deadline)
        self.sock = attempt
        self.sock.settimeout(None)
        self.workers = workers.high
        self.ended = 0  # the job's code when it ended while this node waited for a place
        self._lines = _Lines(self.sock)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._stop_reason = ""
        self._messages: list[dict[str, Any]] = []
        self._cond = threading.Condition()
        _send_quietly(
            self.sock,
            {"protocol": _PROTOCOL, "nodes": [nodes.low, nodes.high], "workers": workers.high, "rank": rank},
            self._lock,
        )
        self._reader = threading.Thread(target=self._read, name="paraml-elastic", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        while True:
            try:
                message = self._lines.read(None)
            except (OSError, ValueError):
                message = None
            with self._cond:
                if message is None:
                    message = {"outcome": 1, "final": True, "gone": True}
                if "stop" in message:
                    self._stop_reason = str(message["stop"])
                    self._stop.set()
                else:
                    self._messages.append(message)
                self._cond.notify_all()
            if message.get("gone"):
                self._stop_reason = self._stop_reason or "the master is gone"
                self._stop.set()
                return

    def _next(self, *keys: str) -> dict[str, Any]:
        with self._cond:
            while True:
                for message in self._messages:
                    if any(k in message for k in (*keys, "error", "gone")):
                        self._messages.remove(message)
                        return message
                self._cond.wait(_POLL)

    def form(self, round: int, ports: Sequence[int], host: str | None) -> Formed | None:
        """Wait for a place in a run (None: the job ended meanwhile, with :attr:`ended`); send this node's addresses;
        get everyone's."""
        message = self._next("form", "outcome")
        if "error" in message:
            raise ClusterConfigError(f"the master refused this node: {message['error']}")
        if "form" not in message:
            self.ended = int(message.get("outcome", 1))
            return None
        self._stop.clear()
        self._stop_reason = ""
        own = _own_addresses(list(ports), host or self.sock.getsockname()[0])
        _send_quietly(self.sock, {"addresses": own}, self._lock)
        reply = self._next("cluster")
        if "cluster" not in reply:
            return None
        everyone = reply["cluster"]
        first = sum(len(group) for group in everyone[: int(message["rank"])])
        workers = [address for group in everyone for address in group]
        resize, reached = str(reply.get("resize", "")), str(reply.get("reached", ""))
        return Formed(workers, first, len(own), resize, reached, int(message["form"]))

    @property
    def stop_requested(self) -> bool:
        """Whether the master asked this node to stop its workers."""
        return self._stop.is_set()

    @property
    def stop_reason(self) -> str:
        """Why (empty while the run goes on)."""
        return self._stop_reason

    def report(self, code: int, final: bool = False) -> None:
        """Tell the master how this node's run ended; ``final``: this node leaves (its launcher was stopped)."""
        _send_quietly(self.sock, {"result": code, "leaves": final}, self._lock)

    def outcome(self, reached: str = "") -> tuple[int, bool, str]:
        """What follows this run: ``(code, final, why)``; this node runs ``self.workers`` workers next."""
        message = self._next("outcome")
        final = bool(message.get("final"))
        self.workers = int(message.get("workers", self.workers)) or self.workers
        why = "the master is gone: the job cannot go on" if message.get("gone") else ""
        why = why or ("" if final else f"the run stopped (exit code {message.get('outcome')}); the job goes on")
        return int(message.get("outcome", 1)), final, why

    @property
    def own_workers(self) -> int:
        """How many workers this node starts in the next run."""
        return self.workers

    def close(self) -> None:
        """Close the connection to the master."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
