"""Pure planners that split a model's layers into contiguous model-parallel stages.

A model is described as an ordered list of :class:`LayerCost` records (one per
layer, in execution order).  The planners return a :class:`PartitionPlan`: a
tuple of :class:`Stage` objects, each holding a contiguous run of layers.

This module imports neither TensorFlow nor Keras; it is plain Python, so plans
can be made, inspected and tested without touching a device.  Use
:func:`paraml.memory.layer_costs` (or :func:`paraml.planning.observe.unit_costs` of an
observation) to build the cost list from a Keras model.

Memory model of a stage (all numbers in bytes)::

    state_bytes      = param_bytes * (2 + slots_per_param)   # params + grads + slots
    activation_bytes = in_flight * sum of the stage's layers' activations (what each keeps for the backward pass,
                       for one micro-batch) + the largest layer's recompute_bytes (remat: the one being recomputed)
    output_bytes     = in_flight * output_bytes, on the last stage only (the model's outputs and the loss' buffers)
    peak_bytes       = state_bytes + activation_bytes + output_bytes

``in_flight`` is, per stage, the most micro-batches whose forward pass has run there and whose backward pass has
not (:meth:`paraml.planning.schedules.Schedule.most_in_flight`: GPipe all of them, 1F1B at most ``K - s`` on stage
``s`` of ``K``); 1 each by default (one batch, no pipeline). The balanced planner minimises the largest of these
same figures, so what it balances is what it reports.

Example:
    >>> costs = [LayerCost("a", 100, 10), LayerCost("b", 100, 10),
    ...          LayerCost("c", 400, 10), LayerCost("d", 100, 10)]
    >>> plan = plan_balanced(costs, 2)
    >>> [s.layers for s in plan.stages]
    [('a', 'b'), ('c', 'd')]
    >>> plan.stage_of("c")
    1
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from paraml.checks import check_int, check_named
from paraml.planning.sizes import format_bytes

__all__ = [
    "PARTITION_CHOICES",
    "LayerCost",
    "PartitionPlan",
    "Stage",
    "layer_cost",
    "make_plan",
    "plan_balanced",
    "plan_even",
    "plan_explicit",
]

#: The partition strategies accepted by :func:`make_plan` as strings.
PARTITION_CHOICES: tuple[str, ...] = ("balanced", "even")

_MAX_NAMES_IN_ERRORS = 8


@dataclass(frozen=True)
class LayerCost:
    """Memory cost of one layer.

    Attributes:
        name: The layer's (unique) name.
        param_bytes: Bytes of the layer's parameters (variables).
        activation_bytes: Bytes the layer keeps for the backward pass, for one batch (one micro-batch when
            planned for a pipeline).
        recompute_bytes: Bytes the layer holds for a moment while it is recomputed in the backward pass (``remat``:
            its own activations, rebuilt from its inputs), on top of what it keeps; 0 without recompute. One layer
            of a stage is recomputed at a time, so a stage counts its largest, once.

    Example:
        >>> LayerCost("dense", param_bytes=60, activation_bytes=384).param_bytes
        60
    """

    name: str
    param_bytes: int
    activation_bytes: int
    recompute_bytes: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"LayerCost.name must be a non-empty string, got {self.name!r}")
        for name in ("param_bytes", "activation_bytes", "recompute_bytes"):
            # stored as a plain int (a NumPy integer is accepted)
            object.__setattr__(self, name, check_int(f"LayerCost {self.name!r}: {name}", getattr(self, name), low=0))


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: a contiguous run of layers placed on one device.

    Attributes:
        index: Position of the stage in the pipeline (0-based).
        layers: Names of the stage's layers, in model order.
        param_bytes: Sum of the layers' parameter bytes.
        state_bytes: ``param_bytes * (2 + slots_per_param)``: parameters,
            gradients and optimizer slots.
        activation_bytes: What the stage's layers keep for the backward pass at the stage's peak: ``in_flight``
            times one micro-batch's, plus the largest layer's ``recompute_bytes``.
        in_flight: The most micro-batches whose activations the stage holds at once under the schedule.
        output_bytes: The last stage's: the model's outputs and the loss' buffers for its ``in_flight``
            micro-batches (0 on the other stages).

    Example:
        >>> s = Stage(0, ("a", "b"), param_bytes=10, state_bytes=40, activation_bytes=5)
        >>> s.peak_bytes
        45
    """

    index: int
    layers: tuple[str, ...]
    param_bytes: int
    state_bytes: int
    activation_bytes: int
    in_flight: int = 1
    output_bytes: int = 0

    @property
    def peak_bytes(self) -> int:
        """Estimated peak memory of the stage: ``state_bytes + activation_bytes + output_bytes``.

        Example:
            >>> Stage(0, ("a",), 1, 4, 2).peak_bytes
            6
        """
        return self.state_bytes + self.activation_bytes + self.output_bytes


@dataclass(frozen=True)
class PartitionPlan:
    """An ordered split of a model's layers into stages.

    Attributes:
        stages: The stages, in pipeline order.

    Example:
        >>> plan = plan_even([LayerCost(n, 4, 1) for n in "abc"], 2)
        >>> plan.num_stages, plan.stage_of("c"), plan.boundaries
        (2, 1, (0, 2))
    """

    stages: tuple[Stage, ...]

    @property
    def num_stages(self) -> int:
        """Number of stages.

        Example:
            >>> plan_even([LayerCost("a", 1, 1)], 1).num_stages
            1
        """
        return len(self.stages)

    @property
    def boundaries(self) -> tuple[int, ...]:
        """Index (in model order) of the first layer of each stage; starts with 0.

        Example:
            >>> plan_even([LayerCost(n, 1, 1) for n in "abcde"], 2).boundaries
            (0, 3)
        """
        starts = []
        position = 0
        for stage in self.stages:
            starts.append(position)
            position += len(stage.layers)
        return tuple(starts)

    @property
    def largest_stage_bytes(self) -> int:
        """The largest :attr:`Stage.peak_bytes` over all stages.

        Example:
            >>> costs = [LayerCost("a", 10, 0), LayerCost("b", 30, 0)]
            >>> plan_even(costs, 2).largest_stage_bytes  # 30 * (2 + 0)
            60
        """
        return max((s.peak_bytes for s in self.stages), default=0)

    def stage_of(self, layer_name: str) -> int:
        """Return the index of the stage holding ``layer_name``.

        Raises:
            ValueError: if no stage holds a layer of that name.

        Example:
            >>> plan_even([LayerCost(n, 1, 1) for n in "abcd"], 2).stage_of("c")
            1
        """
        for stage in self.stages:
            if layer_name in stage.layers:
                return stage.index
        names = [n for s in self.stages for n in s.layers]
        raise ValueError(f"layer {layer_name!r} is not in this plan; its layers are: {_few(names)}")

    def as_rows(self) -> list[dict[str, Any]]:
        """One dict per stage with keys ``stage``, ``layers``, ``param_bytes``, ``peak_bytes``.

        Example:
            >>> plan_even([LayerCost("a", 1, 2)], 1).as_rows()
            [{'stage': 0, 'layers': ['a'], 'param_bytes': 1, 'peak_bytes': 4}]
        """
        return [
            {
                "stage": s.index,
                "layers": list(s.layers),
                "param_bytes": s.param_bytes,
                "peak_bytes": s.peak_bytes,
            }
            for s in self.stages
        ]

    def describe(self, devices: Sequence[str] | None = None) -> str:
        """Render the plan as a fixed-width table.

        Args:
            devices: Optional device name per stage (same length as the plan).

        Raises:
            ValueError: if ``devices`` does not have one entry per stage.

        Example:
            >>> costs = [LayerCost(n, 1024, 512) for n in ("in", "mid", "out")]
            >>> print(plan_even(costs, 2, slots_per_param=2).describe(["/CPU:0", "/CPU:1"]))
            stage  device  layers       parameters  grads + optimizer  activations  est. peak memory
            -----  ------  -----------  ----------  -----------------  -----------  ----------------
            0      /CPU:0  in..mid (2)    2.00 KiB           6.00 KiB     1.00 KiB          9.00 KiB
            1      /CPU:1  out (1)        1.00 KiB           3.00 KiB        512 B          4.50 KiB
            largest stage: 9.00 KiB
        """
        if devices is not None:
            devices = list(devices)
            if len(devices) != len(self.stages):
                raise ValueError(
                    f"describe() got {len(devices)} devices for {len(self.stages)} stages; "
                    "pass exactly one device per stage"
                )
        # Columns for a pipeline's figures only when they say something (a schedule, the outputs counted).
        pipelined = any(s.in_flight != 1 for s in self.stages)
        outputs = any(s.output_bytes for s in self.stages)
        header = ["stage", "device", "layers", "parameters", "grads + optimizer", "activations"]
        header += ["micro-batches held"] * pipelined + ["outputs + loss"] * outputs + ["est. peak memory"]
        rows = []
        for stage in self.stages:
            layers = stage.layers
            span = layers[0] if len(layers) == 1 else f"{layers[0]}..{layers[-1]}"
            row = [
                str(stage.index),
                "-" if devices is None else str(devices[stage.index]),
                f"{span} ({len(layers)})",
                format_bytes(stage.param_bytes),
                format_bytes(stage.state_bytes - stage.param_bytes),
                format_bytes(stage.activation_bytes),
            ]
            row += [str(stage.in_flight)] * pipelined + [format_bytes(stage.output_bytes)] * outputs
            rows.append([*row, format_bytes(stage.peak_bytes)])
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
        right_aligned = set(range(3, len(header)))

        def fmt(row: Sequence[str]) -> str:
            cells = [
                cell.rjust(widths[i]) if i in right_aligned else cell.ljust(widths[i]) for i, cell in enumerate(row)
            ]
            return "  ".join(cells).rstrip()

        lines = [fmt(header), fmt(["-" * w for w in widths])]
        lines += [fmt(r) for r in rows]
        lines.append(f"largest stage: {format_bytes(self.largest_stage_bytes)}")
        return "\n".join(lines)


def layer_cost(c: LayerCost, slots_per_param: int) -> int:
    """The cost balanced planning minimises for one layer, in bytes.

    ``param_bytes * (2 + slots_per_param) + activation_bytes``: parameters,
    their gradients, the optimizer's slot variables and the layer's output.

    Example:
        >>> layer_cost(LayerCost("d", 100, 7), slots_per_param=2)  # Adam
        407
    """
    slots_per_param = check_int("slots_per_param", slots_per_param, low=0)
    return c.param_bytes * (2 + slots_per_param) + c.activation_bytes


# --------------------------------------------------------------------------- helpers


def _few(names: Sequence[str], limit: int = _MAX_NAMES_IN_ERRORS) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    if len(names) > limit:
        shown += f", ... ({len(names)} layers in total)"
    return shown


def _check_costs(costs: Sequence[LayerCost]) -> list[LayerCost]:
    return check_named(costs, LayerCost, "the list of layer costs")


def _validate(costs: Sequence[LayerCost], num_stages: int, slots_per_param: int) -> tuple[list[LayerCost], int, int]:
    """The planners' arguments checked: ``costs`` as a list, ``num_stages`` and ``slots_per_param`` as ints."""
    costs = _check_costs(costs)
    num_stages = check_int("num_stages", num_stages)
    if num_stages > len(costs):
        raise ValueError(
            f"cannot split {len(costs)} layers into {num_stages} stages: "
            f"num_stages ({num_stages}) must be <= the number of layers ({len(costs)})"
        )
    return costs, num_stages, check_int("slots_per_param", slots_per_param, low=0)


def _check_in_flight(in_flight: Sequence[int] | None, num_stages: int) -> list[int]:
    """``in_flight`` checked: one int >= 1 per stage; ones when None."""
    if in_flight is None:
        return [1] * num_stages
    if isinstance(in_flight, (str, bytes)) or not isinstance(in_flight, Sequence) or len(in_flight) != num_stages:
        raise ValueError(
            f"in_flight must give one count of micro-batches per stage ({num_stages} stages), got {in_flight!r}"
        )
    return [check_int(f"in_flight[{s}]", n) for s, n in enumerate(in_flight)]


class _StageBytes:
    """A stage's peak bytes over a run of layers, as :class:`Stage` counts them: the one formula the planners balance
    and the stages report."""

    def __init__(self, costs: Sequence[LayerCost], slots: int, in_flight: Sequence[int], output_bytes: int) -> None:
        self.costs, self.slots, self.in_flight, self.output_bytes = costs, slots, in_flight, output_bytes

    def stage(self, index: int, lo: int, hi: int) -> Stage:
        """Stage ``index`` holding layers ``lo..hi-1``."""
        members = self.costs[lo:hi]
        params = sum(c.param_bytes for c in members)
        flight = self.in_flight[index]
        return Stage(
            index=index,
            layers=tuple(c.name for c in members),
            param_bytes=params,
            state_bytes=params * (2 + self.slots),
            activation_bytes=flight * sum(c.activation_bytes for c in members)
            + max((c.recompute_bytes for c in members), default=0),
            in_flight=flight,
            output_bytes=flight * self.output_bytes if index == len(self.in_flight) - 1 else 0,
        )

    def growing(self, index: int, lo: int, hi: int, step: int) -> Iterator[tuple[int, int]]:
        """``(end, peak bytes)`` of stage ``index`` as it grows one layer at a time from ``lo`` (``step`` 1: layers
        ``lo..end-1`` for end = lo+1 .. hi; ``step`` -1: layers ``end..lo-1`` for end = lo-1 .. hi)."""
        flight = self.in_flight[index]
        fixed = flight * self.output_bytes if index == len(self.in_flight) - 1 else 0
        state = activations = recompute = 0
        for end in range(lo + step, hi + step, step):
            c = self.costs[end - 1 if step > 0 else end]
            state += c.param_bytes * (2 + self.slots)
            activations += c.activation_bytes
            recompute = max(recompute, c.recompute_bytes)
            yield end, state + flight * activations + recompute + fixed


def _plan_from_starts(
    costs: Sequence[LayerCost],
    starts: Sequence[int],
    slots_per_param: int,
    in_flight: Sequence[int] | None = None,
    output_bytes: int = 0,
) -> PartitionPlan:
    """Build a plan from stage start indices (first is 0, strictly increasing)."""
    flight = _check_in_flight(in_flight, len(starts))
    output_bytes = check_int("output_bytes", output_bytes, low=0)
    counter = _StageBytes(costs, slots_per_param, flight, output_bytes)
    ends = [*starts[1:], len(costs)]
    return PartitionPlan(
        stages=tuple(counter.stage(i, lo, hi) for i, (lo, hi) in enumerate(zip(starts, ends, strict=True)))
    )


# --------------------------------------------------------------------------- planners


def plan_balanced(
    costs: Sequence[LayerCost],
    num_stages: int,
    slots_per_param: int = 0,
    *,
    in_flight: Sequence[int] | None = None,
    output_bytes: int = 0,
) -> PartitionPlan:
    """Split into ``num_stages`` contiguous non-empty stages minimising the largest stage.

    A stage's cost is its :attr:`Stage.peak_bytes` (the module's memory model): with the default ``in_flight``
    (one micro-batch per stage) and no ``output_bytes``, the sum of :func:`layer_cost` over its layers. Under a
    pipeline schedule the same layer costs more on a stage that holds more micro-batches (1F1B: the first), and the
    last stage holds the model's outputs, so where a layer goes changes what it costs. The result is optimal
    (dynamic programming over the cut positions, exact for integer costs). Among all optimal splits, the one whose
    cut positions are lexicographically smallest is returned: every cut is placed as early as possible, so the
    result is deterministic.

    Args:
        costs: Per-layer costs in model order (activations for one micro-batch).
        num_stages: Number of stages.
        slots_per_param: Optimizer slot variables per parameter (Adam: 2).
        in_flight: Per stage, the most micro-batches it holds at once
            (:meth:`paraml.planning.schedules.Schedule.most_in_flight`); ones by default.
        output_bytes: One micro-batch's model outputs and loss buffers, held by the last stage per micro-batch
            in flight there.

    Raises:
        ValueError: if ``num_stages < 1`` or exceeds the number of layers, or ``in_flight`` does not give one count
            per stage.

    Example:
        >>> costs = [LayerCost(f"l{i}", 1, 0) for i in range(6)]
        >>> costs.insert(3, LayerCost("big", 10, 0))
        >>> [s.layers for s in plan_balanced(costs, 3).stages]
        [('l0', 'l1', 'l2'), ('big',), ('l3', 'l4', 'l5')]

        Ties go to the earliest cut:

        >>> [s.layers for s in plan_balanced([LayerCost(n, 5, 0) for n in "abcd"], 3).stages]
        [('a',), ('b',), ('c', 'd')]

        Under 1F1B over 2 stages the first holds 2 micro-batches, the second 1, so it takes fewer layers:

        >>> [len(s.layers) for s in plan_balanced([LayerCost(str(i), 0, 10) for i in range(9)], 2,
        ...                                       in_flight=[2, 1]).stages]
        [3, 6]
    """
    costs, num_stages, slots_per_param = _validate(costs, num_stages, slots_per_param)
    flight = _check_in_flight(in_flight, num_stages)
    output_bytes = check_int("output_bytes", output_bytes, low=0)
    counter = _StageBytes(costs, slots_per_param, flight, output_bytes)
    n, last = len(costs), num_stages - 1

    # best[s][i]: the smallest largest stage over layers 0..i-1 split into stages 0..s (each non-empty). A stage
    # only grows as its start moves left, so the scan over its start stops once the stage alone is no better.
    infinity = float("inf")
    best: list[list[float]] = [[infinity] * (n + 1) for _ in range(num_stages)]
    for end, size in counter.growing(0, 0, n, 1):
        best[0][end] = size
    for s in range(1, num_stages):
        for i in range(s + 1, n + 1):
            for start, size in counter.growing(s, i, s, -1):
                if size >= best[s][i]:
                    break
                best[s][i] = min(best[s][i], max(best[s - 1][start], size))
    bound = best[last][n]

    # fits[s][i]: whether layers i..n-1 split into stages s..last (each non-empty) with every stage <= bound.
    fits = [[False] * (n + 1) for _ in range(num_stages)]
    for i in range(n):
        fits[last][i] = next(size for end, size in counter.growing(last, i, n, 1) if end == n) <= bound
    for s in range(last - 1, -1, -1):
        for i in range(n):
            for end, size in counter.growing(s, i, n - 1, 1):
                if size > bound:
                    break
                if fits[s + 1][end]:
                    fits[s][i] = True
                    break

    # Place each cut as early as possible such that this stage and the rest still fit the bound.
    starts = [0]
    for s in range(last):
        cut = next(end for end, size in counter.growing(s, starts[-1], n - 1, 1) if size <= bound and fits[s + 1][end])
        starts.append(cut)
    return _plan_from_starts(costs, starts, slots_per_param, flight, output_bytes)


def plan_even(
    costs: Sequence[LayerCost],
    num_stages: int,
    slots_per_param: int = 0,
    *,
    in_flight: Sequence[int] | None = None,
    output_bytes: int = 0,
) -> PartitionPlan:
    """Split into stages with the same number of layers, ignoring their costs.

    With ``n`` layers and ``k`` stages, the first ``n % k`` stages get one more layer. ``in_flight`` and
    ``output_bytes`` are counted in the stages' figures as in :func:`plan_balanced`.

    Raises:
        ValueError: if ``num_stages < 1`` or exceeds the number of layers.

    Example:
        >>> costs = [LayerCost(str(i), 1, 0) for i in range(7)]
        >>> [len(s.layers) for s in plan_even(costs, 3).stages]
        [3, 2, 2]
    """
    costs, num_stages, slots_per_param = _validate(costs, num_stages, slots_per_param)
    size, extra = divmod(len(costs), num_stages)
    starts = []
    position = 0
    for i in range(num_stages):
        starts.append(position)
        position += size + (1 if i < extra else 0)
    return _plan_from_starts(costs, starts, slots_per_param, in_flight, output_bytes)


def plan_explicit(
    costs: Sequence[LayerCost],
    spec: Sequence[Sequence[str]] | Sequence[int],
    num_stages: int,
    slots_per_param: int = 0,
    *,
    in_flight: Sequence[int] | None = None,
    output_bytes: int = 0,
) -> PartitionPlan:
    """Build the plan the user spelled out (``in_flight`` and ``output_bytes`` as in :func:`plan_balanced`).

    ``spec`` takes one of two forms:

    * **groups of layer names**: ``[["a", "b"], ["c"]]``: exactly ``num_stages``
      non-empty groups that together list every layer once, contiguously and in
      model order;
    * **cut indices**: ``[2]``: ``num_stages - 1`` strictly increasing layer
      indices in ``1..len(costs)-1``; stage ``i + 1`` starts at ``spec[i]``.
      Do not include ``0`` or ``len(costs)``; ``[]`` means a single stage.

    Raises:
        ValueError: naming the offending layer or value if the spec is invalid.

    Example:
        >>> costs = [LayerCost(n, 1, 0) for n in "abcd"]
        >>> [s.layers for s in plan_explicit(costs, [["a"], ["b", "c", "d"]], 2).stages]
        [('a',), ('b', 'c', 'd')]
        >>> [s.layers for s in plan_explicit(costs, [1, 3], 3).stages]
        [('a',), ('b', 'c'), ('d',)]
    """
    costs, num_stages, slots_per_param = _validate(costs, num_stages, slots_per_param)
    if isinstance(spec, (str, bytes)) or not isinstance(spec, Sequence):
        raise ValueError(
            f"an explicit partition must be a list of layer-name lists or a list of int cut indices, got {spec!r}"
        )
    items = list(spec)
    if all(isinstance(x, int) and not isinstance(x, bool) for x in items):
        starts = _starts_from_cuts(items, len(costs), num_stages)
    elif all(isinstance(g, Sequence) and not isinstance(g, (str, bytes)) for g in items):
        starts = _starts_from_groups(costs, items, num_stages)
    else:
        raise ValueError(
            "an explicit partition must be either a list of lists of layer names "
            "(e.g. [['dense', 'dense_1'], ['dense_2']]) or a list of int cut indices "
            f"(e.g. [2]); got {spec!r}"
        )
    return _plan_from_starts(costs, starts, slots_per_param, in_flight, output_bytes)


def _starts_from_cuts(cuts: list[int], num_layers: int, num_stages: int) -> list[int]:
    form = (
        f"int cut indices: stage i+1 starts at layer index cuts[i]; give "
        f"num_stages - 1 = {num_stages - 1} strictly increasing indices in "
        f"1..{num_layers - 1} (do not include 0 or {num_layers})"
    )
    if len(cuts) != num_stages - 1:
        hint = ""
        if len(cuts) == num_stages + 1 and cuts and cuts[0] == 0 and cuts[-1] == num_layers:
            hint = f"; drop the leading 0 and trailing {num_layers}"
        raise ValueError(f"got {len(cuts)} cut indices {cuts} for {num_stages} stages; expected {form}{hint}")
    previous = 0
    for cut in cuts:
        if not 1 <= cut <= num_layers - 1:
            raise ValueError(f"cut index {cut} is out of range in {cuts}; expected {form}")
        if cut <= previous:
            raise ValueError(f"cut index {cut} is not greater than the previous one in {cuts}; expected {form}")
        previous = cut
    return [0, *cuts]


def _starts_from_groups(costs: list[LayerCost], groups: list[Sequence[str]], num_stages: int) -> list[int]:
    order = [c.name for c in costs]
    index = {name: i for i, name in enumerate(order)}
    if len(groups) != num_stages:
        raise ValueError(
            f"got {len(groups)} layer groups for num_stages={num_stages}; give exactly one group per stage"
        )
    seen: dict[str, int] = {}
    for g, group in enumerate(groups):
        if len(group) == 0:
            raise ValueError(f"layer group {g} is empty; every stage needs at least one layer")
        for name in group:
            if not isinstance(name, str):
                raise ValueError(f"layer group {g} contains {name!r}, which is not a layer name")
            if name not in index:
                raise ValueError(
                    f"layer group {g} names layer {name!r}, which the model does not have; "
                    f"valid layer names include: {_few(order)}"
                )
            if name in seen:
                raise ValueError(
                    f"layer {name!r} is named twice (in group {seen[name]} and group {g}); "
                    "each layer must appear exactly once"
                )
            seen[name] = g
    missing = [name for name in order if name not in seen]
    if missing:
        raise ValueError(
            f"layer {missing[0]!r} is not in any group ({len(missing)} missing: "
            f"{_few(missing)}); the groups must cover every layer"
        )
    flat = [name for group in groups for name in group]
    for position, (got, expected) in enumerate(zip(flat, order, strict=True)):
        if got != expected:
            raise ValueError(
                f"layer {got!r} is out of order: groups must list the layers contiguously "
                f"in model order, so position {position} should be {expected!r} "
                f"(model order: {_few(order)})"
            )
    starts = []
    position = 0
    for group in groups:
        starts.append(position)
        position += len(group)
    return starts


def make_plan(
    costs: Sequence[LayerCost],
    partition: str | Sequence[Sequence[str]] | Sequence[int],
    num_stages: int,
    slots_per_param: int = 0,
    *,
    in_flight: Sequence[int] | None = None,
    output_bytes: int = 0,
) -> PartitionPlan:
    """Dispatch to a planner.

    Args:
        costs: Per-layer costs in model order.
        partition: ``"balanced"`` (:func:`plan_balanced`), ``"even"``
            (:func:`plan_even`), or an explicit spec for :func:`plan_explicit`.
        num_stages: Number of stages.
        slots_per_param: Optimizer slot variables per parameter (Adam: 2).
        in_flight: Per stage, the most micro-batches it holds at once under the pipeline schedule
            (:meth:`paraml.planning.schedules.Schedule.most_in_flight`); ones by default.
        output_bytes: One micro-batch's model outputs and loss buffers (held by the last stage).

    Raises:
        ValueError: for an unknown strategy name or an invalid spec.

    Example:
        >>> costs = [LayerCost(n, 1, 0) for n in "abc"]
        >>> make_plan(costs, "even", 2).boundaries
        (0, 2)
        >>> make_plan(costs, [["a"], ["b", "c"]], 2).boundaries
        (0, 1)
    """
    if isinstance(partition, str):
        key = partition.strip().lower()
        if key == "balanced":
            return plan_balanced(costs, num_stages, slots_per_param, in_flight=in_flight, output_bytes=output_bytes)
        if key == "even":
            return plan_even(costs, num_stages, slots_per_param, in_flight=in_flight, output_bytes=output_bytes)
        raise ValueError(
            f"unknown partition {partition!r}; valid choices are "
            f"{', '.join(repr(c) for c in PARTITION_CHOICES)}, or an explicit list "
            "of layer-name groups or int cut indices"
        )
    if isinstance(partition, Sequence) and not isinstance(partition, bytes):
        return plan_explicit(
            costs, partition, num_stages, slots_per_param, in_flight=in_flight, output_bytes=output_bytes
        )
    raise ValueError(
        f"partition must be one of {', '.join(repr(c) for c in PARTITION_CHOICES)} or an "
        f"explicit list of layer-name groups or int cut indices, got {partition!r}"
    )
