"""Pipeline schedules of ``model_parallel``: the order in which stages run micro-batches forward and backward.

A schedule is data: :class:`Schedule` holds the rule ``model_parallel`` enforces (:meth:`Schedule.waits_for`) and
draws the timeline it gives (:meth:`Schedule.timeline`, ``str()``): one row per time step, one column per stage,
``F3`` for micro-batch 3's forward pass and ``B3`` for its backward pass, with each pass taking one step.

* ``"gpipe"`` (GPipe): every micro-batch goes forward through every stage, then every micro-batch goes backward. A
  stage may hold the activations of all M micro-batches at once.
* ``"1f1b"`` (PipeDream-Flush, as in Megatron-LM, DeepSpeed and torch.distributed.pipelining): stage ``s`` of ``K``
  starts micro-batch ``i``'s forward pass only after micro-batch ``i - (K - s)``'s backward pass on it, so it holds at
  most ``K - s`` micro-batches: the first stage K, the last one. Same gradients, fewer activations alive.

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

from dataclasses import dataclass

from paraml.checks import check_choice, check_int

__all__ = ["SCHEDULES", "Schedule"]

#: The schedules ``Parallel("model_parallel", schedule=...)`` accepts.
SCHEDULES = ("gpipe", "1f1b")


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``kind`` (one of :data:`SCHEDULES`) over ``stages`` stages and ``micro_batches``.

    Raises:
        ValueError: for an unknown kind (naming the valid ones) or counts below 1.
    """

    kind: str
    stages: int
    micro_batches: int

    def __post_init__(self) -> None:
        check_choice("schedule", self.kind, SCHEDULES)
        check_int("stages", self.stages)
        check_int("micro_batches", self.micro_batches)

    def waits_for(self, stage: int, micro_batch: int) -> int | None:
        """The micro-batch whose backward pass on ``stage`` must end before ``micro_batch``'s forward pass on it may
        start, or None (GPipe: none; 1F1B: ``micro_batch - (stages - stage)``, when there is one).

        Example:
            >>> Schedule("1f1b", 4, 8).waits_for(stage=3, micro_batch=5), Schedule("1f1b", 4, 8).waits_for(0, 2)
            (4, None)
        """
        if self.kind != "1f1b":
            return None
        earlier = micro_batch - (self.stages - stage)
        return earlier if earlier >= 0 else None

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
        """Per stage, the most micro-batches of a batch of ``batch_size`` rows whose activations it holds at once:
        :meth:`most_in_flight` over the micro-batches that are not empty.

        Example:
            >>> Schedule("gpipe", 2, 8).held(32), Schedule("gpipe", 2, 8).held(3), Schedule("1f1b", 4, 8).held(32)
            ([8, 8], [3, 3], [4, 3, 2, 1])
        """
        batch_size = check_int("batch_size", batch_size)
        if batch_size >= self.micro_batches:
            return self.most_in_flight()
        return Schedule(self.kind, self.stages, batch_size).most_in_flight()

    def timeline(self) -> list[list[str]]:
        """One row per time step, one cell per stage (``"F2"``, ``"B0"`` or ``""``): each stage runs one pass per step,
        as soon as its inputs are ready; under 1F1B a stage prefers a ready backward pass to a forward pass."""
        k, m = self.stages, self.micro_batches
        done: dict[tuple[str, int, int], int] = {}  # (pass, stage, micro-batch) -> the step it ran at
        rows: list[list[str]] = []

        def ready(kind: str, s: int, i: int, step: int) -> bool:
            def before(key: tuple[str, int, int]) -> bool:
                return key in done and done[key] < step

            if (kind, s, i) in done or (i > 0 and not before((kind, s, i - 1))):
                return False
            if kind == "F":
                wait = self.waits_for(s, i)
                return (s == 0 or before(("F", s - 1, i))) and (wait is None or before(("B", s, wait)))
            if not before(("F", s, i)):
                return False
            if s < k - 1:
                return before(("B", s + 1, i))
            return self.kind == "1f1b" or before(("F", s, m - 1))  # GPipe: the last stage flushes first

        while len(done) < 2 * k * m:
            step = len(rows)
            row = []
            for s in range(k):
                order = ("B", "F") if self.kind == "1f1b" else ("F", "B")
                chosen = next(((kind, i) for kind in order for i in range(m) if ready(kind, s, i, step)), None)
                if chosen is None:
                    row.append("")
                    continue
                done[(chosen[0], s, chosen[1])] = step
                row.append(f"{chosen[0]}{chosen[1]}")
            rows.append(row)
        return rows

    @property
    def bubble(self) -> float:
        """The idle fraction of the stages over the :meth:`timeline`: empty cells over all cells (each pass one step,
        forward and backward alike). For GPipe and 1F1B it comes out as ``(K - 1) / (M + K - 1)``.

        Example:
            >>> round(Schedule("1f1b", stages=4, micro_batches=8).bubble, 4), round(3 / 11, 4)
            (0.2727, 0.2727)
        """
        rows = self.timeline()
        cells = len(rows) * self.stages
        return sum(cell == "" for row in rows for cell in row) / cells

    def most_in_flight(self) -> list[int]:
        """Per stage, the most micro-batches whose forward pass has run there and whose backward pass has not (the
        activations it holds at once), in :meth:`timeline`.

        Example:
            >>> Schedule("gpipe", 2, 8).most_in_flight(), Schedule("1f1b", 2, 8).most_in_flight()
            ([8, 8], [2, 1])
        """
        most = [0] * self.stages
        alive = [0] * self.stages
        for row in self.timeline():
            for s, cell in enumerate(row):
                alive[s] += 1 if cell.startswith("F") else -1 if cell.startswith("B") else 0
                most[s] = max(most[s], alive[s])
        return most

    def __str__(self) -> str:
        header = ["step", *(f"stage {s}" for s in range(self.stages))]
        rows = [[str(t), *row] for t, row in enumerate(self.timeline())]
        widths = [max(len(r[c]) for r in [header, *rows]) for c in range(len(header))]

        def line(cells: list[str]) -> str:
            return "  ".join(cell.ljust(w) for cell, w in zip(cells, widths)).rstrip()

        title = f"{self.kind}, {self.stages} stages x {self.micro_batches} micro-batches (F: forward, B: backward)"
        flight = ", ".join(map(str, self.most_in_flight()))
        body = [line(header), line(["-" * w for w in widths]), *map(line, rows)]
        ending = [f"most micro-batches in flight per stage: {flight}", f"bubble (idle fraction): {self.bubble:.3f}"]
        return "\n".join([title, *body, *ending])
