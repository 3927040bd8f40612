"""Pipeline schedules of ``model_parallel``: the order in which the devices run micro-batches forward and backward.

A schedule is data: :meth:`Schedule.orders` lists, per device, the passes it runs in order (as torch's
``pipelining`` schedules and Megatron-LM's ``schedules.py`` do); :meth:`Schedule.timeline` plays those orders out
(each pass one step, a pass runs once what it reads has run) and ``str()`` draws it; :meth:`Schedule.waits_for` is
the rule ``model_parallel`` enforces with it, and :attr:`Schedule.bubble` the idle fraction read from the timeline.
In a drawing, ``F3`` is micro-batch 3's forward pass, ``B3`` its backward pass, ``W3`` its weight-gradient pass
(zero-bubble only), and ``F3.1`` micro-batch 3 on the device's second chunk (interleaved only).

* ``"gpipe"`` (GPipe): every micro-batch goes forward through every stage, then every micro-batch goes backward. A
  stage may hold the activations of all M micro-batches at once.
* ``"1f1b"`` (PipeDream-Flush, as in Megatron-LM, DeepSpeed and torch.distributed.pipelining): after ``K - s - 1``
  forward passes, stage ``s`` of ``K`` alternates one forward and one backward pass, so it holds at most ``K - s``
  micro-batches: the first stage K, the last one. The bubble is GPipe's, ``(K - 1) / (M + K - 1)``.
* ``"interleaved"`` (Megatron-LM's interleaved 1F1B): the model is cut into ``K x v`` chunks (``virtual_stages=v``),
  chunk ``c`` on device ``c mod K``, so each device holds ``v`` non-adjacent chunks and a micro-batch passes every
  device ``v`` times. Each pass is a chunk's (1/v of a stage's layers), so the idle time shrinks ``v`` times:
  ``(K - 1) / (v M + K - 1)``. Micro-batches go in groups of ``K``, so ``M`` must be a multiple of ``K``.
* ``"zero_bubble"`` (ZB-H1, Qi et al. 2023): each backward pass is split into the input-gradient pass ``B``, which
  the previous stage waits for, and the weight-gradient pass ``W``, which nothing downstream waits for and so fills
  the idle slots. A stage keeps a micro-batch until its ``W`` and holds at most ``2K - 1 - s`` of them (ZB-H2's
  bound; 1F1B holds ``K - s``): the deferred ``W`` passes are what fills the bubble. With F, B and W one step each
  the bubble is ``(K - 1) / (3M + K - 1)`` when M is large enough, about a third of 1F1B's. paraml takes a stage's
  ``W`` in the same gradient computation as its ``B`` and TensorFlow runs each op once its inputs exist, so the
  activations are freed at ``B`` (:meth:`Schedule.held`); ``W`` is when the gradients are added to their sums.

All of them compute the same gradients; they differ in the order, the idle time and the activations alive.
This module imports neither TensorFlow nor Keras.

Example:
    >>> print(Schedule("1f1b", stages=2, micro_batches=3))
    1f1b, 2 stages x 3 micro-batches (F: forward, B: backward)
    step  stage 0  stage 1
    ----  -------  -------
    0     F0
    1     F1       F0
    2              B0
    3     B0       F1
    4     F2       B1
    5     B1       F2
    6              B2
    7     B2
    most micro-batches in flight per stage: 2, 1
    bubble (idle fraction): 0.250
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

from paraml.checks import check_choice, check_int

__all__ = ["SCHEDULES", "Pass", "Schedule"]

#: The schedules ``Parallel("model_parallel", schedule=...)`` accepts.
SCHEDULES = ("gpipe", "1f1b", "interleaved", "zero_bubble")

#: The virtual stages (chunks per device) ``schedule="interleaved"`` takes when none are named.
DEFAULT_VIRTUAL_STAGES = 2

#: ``(kind, chunk, micro_batch)``: kind ``"F"`` (forward), ``"B"`` (backward; under zero-bubble, the input-gradient
#: part) or ``"W"`` (zero-bubble's weight-gradient part) of ``micro_batch`` on model chunk ``chunk`` (a stage: chunk
#: ``c`` runs on device ``c % stages``).
Pass = tuple[str, int, int]


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``kind`` (one of :data:`SCHEDULES`) over ``stages`` devices, ``micro_batches`` and, for
    ``"interleaved"``, ``virtual_stages`` model chunks per device (default 2).

    The model is cut into :attr:`chunks` = ``stages * virtual_stages`` parts, chunk ``c`` on device ``c % stages``;
    without interleaving a chunk is a stage.

    Raises:
        ValueError: for an unknown kind (naming the valid ones), counts below 1, ``virtual_stages`` with another kind,
            or an interleaved schedule whose micro-batches are not a multiple of its stages.
    """

    kind: str
    stages: int
    micro_batches: int
    virtual_stages: int | None = field(default=None)

    def __post_init__(self) -> None:
        check_choice("schedule", self.kind, SCHEDULES)
        check_int("stages", self.stages)
        check_int("micro_batches", self.micro_batches)
        interleaved = self.kind == "interleaved"
        v = self.virtual_stages
        if v is None:
            v = DEFAULT_VIRTUAL_STAGES if interleaved else 1
        v = check_int("virtual_stages", v)
        if v > 1 and not interleaved:
            raise ValueError(
                f"virtual_stages={v} cuts each device's layers into chunks, which only schedule='interleaved' runs; "
                f"use schedule='interleaved' or leave virtual_stages out (schedule={self.kind!r})"
            )
        if interleaved and v < 2:
            raise ValueError(
                "schedule='interleaved' runs virtual_stages >= 2 model chunks per device, got 1; with one chunk per "
                "device use schedule='1f1b'"
            )
        if interleaved and self.micro_batches % self.stages:
            fitting = -(-self.micro_batches // self.stages) * self.stages
            raise ValueError(
                f"schedule='interleaved' sends micro-batches through the devices in groups of stages={self.stages}: "
                f"micro_batches={self.micro_batches} must be a multiple of {self.stages}; use micro_batches={fitting}"
            )
        object.__setattr__(self, "virtual_stages", v)

    @property
    def chunks(self) -> int:
        """The model chunks the schedule runs: ``stages * virtual_stages`` (the pipeline's stages)."""
        return self.stages * int(self.virtual_stages or 1)

    def device_of(self, chunk: int) -> int:
        """The device (pipeline position) chunk ``chunk`` runs on: ``chunk % stages``."""
        return chunk % self.stages

    # -- the orders --------------------------------------------------------------------------------------------------
    @cached_property
    def _orders(self) -> tuple[tuple[Pass, ...], ...]:
        if self.kind == "zero_bubble":
            return _zero_bubble_orders(self.stages, self.micro_batches)
        return tuple(self._order(device) for device in range(self.stages))

    def orders(self) -> list[list[Pass]]:
        """Per device, the passes it runs, in order.

        Example:
            >>> Schedule("1f1b", stages=2, micro_batches=3).orders()[0]
            [('F', 0, 0), ('F', 0, 1), ('B', 0, 0), ('F', 0, 2), ('B', 0, 1), ('B', 0, 2)]
        """
        return [list(order) for order in self._orders]

    def _order(self, device: int) -> tuple[Pass, ...]:
        """Device ``device``'s passes under GPipe, 1F1B or interleaved 1F1B (Megatron-LM's order): its forward
        passes in groups of ``stages`` micro-batches, chunk after chunk; backward passes likewise with the chunks
        reversed; after a warm-up of forward passes, one forward and one backward pass in turn."""
        p, m, v = self.stages, self.micro_batches, int(self.virtual_stages or 1)

        def nth(k: int, forward: bool) -> tuple[int, int]:  # the k-th pass's (chunk, micro-batch) on this device
            group, within = divmod(k, p * v)
            local = within // p if forward else v - 1 - within // p
            return local * p + device, group * p + within % p

        total = m * v
        forwards = [("F", *nth(k, True)) for k in range(total)]
        backwards = [("B", *nth(k, False)) for k in range(total)]
        if self.kind == "gpipe":
            return tuple(forwards + backwards)
        warmup = min(total, (p - device - 1) * (2 if v > 1 else 1) + (v - 1) * p)
        order = forwards[:warmup]
        for forward, backward in zip(forwards[warmup:], backwards):
            order += [forward, backward]
        return tuple(order + backwards[total - warmup :])

    # -- the rule the backend follows --------------------------------------------------------------------------------
    @cached_property
    def _waits(self) -> dict[tuple[int, int], tuple[Pass, ...]]:
        waits: dict[tuple[int, int], tuple[Pass, ...]] = {}
        for order in self._orders:
            last: dict[str, Pass] = {}
            for kind, chunk, micro_batch in order:
                if kind == "F":
                    waits[(chunk, micro_batch)] = tuple(last[k] for k in ("B", "W") if k in last)
                else:
                    last[kind] = (kind, chunk, micro_batch)
        return waits

    def waits_for(self, stage: int, micro_batch: int) -> tuple[Pass, ...]:
        """The backward passes that must end before ``micro_batch``'s forward pass on chunk ``stage`` may start:
        the last ``B`` (and, under zero-bubble, the last ``W``) its device runs before it; none under GPipe.

        Example:
            >>> Schedule("1f1b", 4, 8).waits_for(stage=3, micro_batch=5), Schedule("1f1b", 4, 8).waits_for(0, 2)
            ((('B', 3, 4),), ())
        """
        if self.kind == "gpipe":
            return ()
        return self._waits.get((stage, micro_batch), ())

    # -- sizes ---------------------------------------------------------------------------------------------------------
    def micro_batch_rows(self, batch_size: int) -> int:
        """The rows of the largest micro-batch of a batch of ``batch_size`` rows (the pipeline gives the first
        ``batch_size % micro_batches`` micro-batches one row more than the others).

        Example:
            >>> Schedule("1f1b", 2, 8).micro_batch_rows(100), Schedule("gpipe", 2, 8).micro_batch_rows(3)
            (13, 1)
        """
        batch_size = check_int("batch_size", batch_size)
        return -(-batch_size // self.micro_batches)

    def held(self, batch_size: int) -> list[int]:
        """Per chunk, the most micro-batches of a batch of ``batch_size`` rows whose activations paraml's pipeline
        holds at once (what the stage figures count): those whose forward pass has run there and whose ``B`` has
        not, at most the micro-batches that are not empty.

        This is :meth:`most_in_flight` except under zero-bubble, where it is fewer: paraml takes a stage's weight
        gradients in the same gradient computation as its input gradients, and TensorFlow runs each op once its
        inputs exist, so the activations go at ``B``; ``W`` is when the gradients are added into their sums, which
        later forward passes wait for. Measured (``benchmarks/bench_stage_memory.py``, 2 stages, 8 micro-batches):
        the stages' figures against the allocator's peak are 0.99 counted to ``B``, 1.27 counted to ``W``.

        Example:
            >>> Schedule("gpipe", 2, 8).held(32), Schedule("gpipe", 2, 8).held(3), Schedule("1f1b", 4, 8).held(32)
            ([8, 8], [3, 3], [4, 3, 2, 1])
            >>> Schedule("zero_bubble", 4, 8).most_in_flight(), Schedule("zero_bubble", 4, 8).held(32)
            ([7, 6, 5, 4], [7, 5, 3, 1])
        """
        batch_size = check_int("batch_size", batch_size)
        return [min(n, batch_size) for n in self._alive_at_most(released_by="B")]

    # -- the timeline --------------------------------------------------------------------------------------------------
    @cached_property
    def _timeline(self) -> tuple[tuple[str, ...], ...]:
        return tuple(tuple(row) for row in _play(self._orders, self.chunks))

    def timeline(self) -> list[list[str]]:
        """One row per time step, one cell per device (``"F2"``, ``"B0"``, ``"W1"``, ``"F2.1"`` or ``""``): each
        device runs the passes of :meth:`orders` in order, one per step, each once what it reads has run."""
        p = self.stages
        rows = []
        for row in self._timeline:
            cells = []
            for cell in row:
                if cell and self.virtual_stages != 1:
                    kind, chunk, micro_batch = cell.split(":")
                    cell = f"{kind}{micro_batch}.{int(chunk) // p}"
                elif cell:
                    kind, _, micro_batch = cell.split(":")
                    cell = f"{kind}{micro_batch}"
                cells.append(cell)
            rows.append(cells)
        return rows

    @property
    def bubble(self) -> float:
        """The idle fraction of the devices over the :meth:`timeline`: empty cells over all cells (each pass one
        step). GPipe and 1F1B give ``(K - 1) / (M + K - 1)``; interleaved ``(K - 1) / (v M + K - 1)`` (a pass is a
        chunk's, 1/v of a stage's); zero-bubble, with F, B and W a step each, about a third of 1F1B's.

        Example:
            >>> round(Schedule("1f1b", stages=4, micro_batches=8).bubble, 4), round(3 / 11, 4)
            (0.2727, 0.2727)
        """
        rows = self._timeline
        cells = len(rows) * self.stages
        return sum(cell == "" for row in rows for cell in row) / cells

    @property
    def held_is_a_bound(self) -> bool:
        """Whether :meth:`most_in_flight` is only an upper bound of what runs: under GPipe nothing orders the passes
        but TensorFlow's dataflow executor, which starts backward passes before the last forward pass and frees
        earlier micro-batches' activations (measured: a stage held 0.3-0.6 of the figure,
        ``benchmarks/bench_stage_memory.py``); the other schedules fix the order with control dependencies.

        Example:
            >>> Schedule("gpipe", 2, 8).held_is_a_bound, Schedule("1f1b", 2, 8).held_is_a_bound
            (True, False)
        """
        return self.kind == "gpipe" and self.micro_batches > 1

    def most_in_flight(self) -> list[int]:
        """Per chunk, the most micro-batches whose forward pass has run there and whose backward pass (zero-bubble:
        weight-gradient pass) has not: the activations it holds at once, in :meth:`timeline`.

        Example:
            >>> Schedule("gpipe", 2, 8).most_in_flight(), Schedule("1f1b", 2, 8).most_in_flight()
            ([8, 8], [2, 1])
        """
        return self._alive_at_most(released_by="W" if self.kind == "zero_bubble" else "B")

    def _alive_at_most(self, released_by: str) -> list[int]:
        """Per chunk, the most micro-batches whose forward pass has run and whose ``released_by`` pass has not."""
        most = [0] * self.chunks
        alive = [0] * self.chunks
        for row in self._timeline:
            for cell in row:
                if not cell:
                    continue
                kind, chunk, _ = cell.split(":")
                c = int(chunk)
                alive[c] += 1 if kind == "F" else -1 if kind == released_by else 0
                most[c] = max(most[c], alive[c])
        return most

    def __str__(self) -> str:
        header = ["step", *(f"stage {s}" for s in range(self.stages))]
        rows = [[str(t), *row] for t, row in enumerate(self.timeline())]
        widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

        def line(cells: list[str]) -> str:
            return "  ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip()

        title = f"{self.kind}, {self.stages} stages x {self.micro_batches} micro-batches"
        legend = "F: forward, B: backward"
        if self.kind == "interleaved":
            title += f", {self.virtual_stages} chunks per stage"
            legend += ", F3.1: micro-batch 3 on the stage's chunk 1"
        if self.kind == "zero_bubble":
            legend = "F: forward, B: input gradient, W: weight gradient"
        flight = ", ".join(map(str, self.most_in_flight()))
        per = "chunk" if self.kind == "interleaved" else "stage"
        body = [line(header), line(["-" * w for w in widths]), *map(line, rows)]
        ending = [f"most micro-batches in flight per {per}: {flight}", f"bubble (idle fraction): {self.bubble:.3f}"]
        if self.kind == "zero_bubble":
            held = ", ".join(map(str, self._alive_at_most(released_by="B")))
            ending[0] += f" (their activations until B: {held}; each W is taken with its B)"
        return "\n".join([f"{title} ({legend})", *body, *ending])


def _ready(done: dict[Pass, int], step: int, action: Pass, chunks: int) -> bool:
    """Whether ``action`` may run at ``step``: what it reads ran at an earlier step."""

    def before(key: Pass) -> bool:
        return key in done and done[key] < step

    kind, c, i = action
    if kind == "F":
        return c == 0 or before(("F", c - 1, i))
    if kind == "W":
        return before(("B", c, i))
    # B reads the next chunk's input gradient (zero-bubble's B) or its whole backward pass (the others': B is both)
    return before(("F", c, i)) and (c == chunks - 1 or before(("B", c + 1, i)))


def _play(orders: tuple[tuple[Pass, ...], ...], chunks: int) -> list[list[str]]:
    """Each device runs its order's passes in order, one per step, each once it is ready; cells ``"F:chunk:mb"``."""
    done: dict[Pass, int] = {}
    position = [0] * len(orders)
    total = sum(map(len, orders))
    rows: list[list[str]] = []
    while len(done) < total:
        step = len(rows)
        row = []
        for device, order in enumerate(orders):
            action = order[position[device]] if position[device] < len(order) else None
            if action is None or not _ready(done, step, action, chunks):
                row.append("")
                continue
            done[action] = step
            position[device] += 1
            row.append(":".join(map(str, action)))
        if not any(row):
            raise RuntimeError(f"the schedule's orders deadlock at step {step}: {orders}")  # a bug, not bad input
        rows.append(row)
    return rows


def _zero_bubble_orders(stages: int, micro_batches: int) -> tuple[tuple[Pass, ...], ...]:
    """Zero-bubble orders, found by playing the passes greedily: at each step a device runs a ready input-gradient
    pass (B, on the critical path) first, else a forward pass while it holds fewer than ``2K - 1 - s`` micro-batches
    (a micro-batch is held until its W; ZB-H2's bound), else its oldest waiting weight-gradient pass (W)."""
    k, m = stages, micro_batches
    done: dict[Pass, int] = {}
    orders: list[list[Pass]] = [[] for _ in range(k)]
    step = 0
    while len(done) < 3 * k * m:
        for s in range(k):
            held = sum(1 for i in range(m) if ("F", s, i) in done and ("W", s, i) not in done)
            candidates = [("B", s, i) for i in range(m)]
            if held < 2 * k - 1 - s:
                candidates += [("F", s, i) for i in range(m)]
            candidates += [("W", s, i) for i in range(m)]
            chosen = next(
                (a for a in candidates if a not in done and _in_order(done, a) and _ready(done, step, a, k)),
                None,
            )
            if chosen is not None:
                done[chosen] = step
                orders[s].append(chosen)
        step += 1
        if step > 4 * k * m + 4 * k:
            raise RuntimeError("the zero-bubble orders did not finish")  # a bug, not bad input
    return tuple(tuple(order) for order in orders)


def _in_order(done: dict[Pass, int], action: Pass) -> bool:
    """A pass of micro-batch ``i`` runs after the same kind of pass of micro-batch ``i - 1`` on its chunk."""
    kind, c, i = action
    return i == 0 or (kind, c, i - 1) in done
