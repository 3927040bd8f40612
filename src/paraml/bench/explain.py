"""Why a step takes the time it takes: one traced training step of the user's own model and layout, split into its
parts, with what the plan predicts for each and the one change that would remove the most.

"MirroredStrategy is slower than one GPU" is TensorFlow's most repeated multi-GPU complaint; the answer is in the
step. :func:`explain_step` traces one step (:func:`paraml.bench.trace.trace_step`: each device's ops, from
TensorFlow's profiler) and the time the loop spent on it, and splits that time into:

* **compute**: the devices' own ops (forward, backward, the loss), also given per device;
* **reduction**: the collectives that bring the replicas' gradients together (all-reduce, ZeRO's reduce-scatter and
  gathers: TensorFlow's ``Collective*`` ops);
* **transfers**: activations and weights sent from one device to another (``_Send``; a pipeline's, a stage's reads);
* **optimizer**: the optimizer's update (the ops under its name scope);
* **input**: the step waiting for ``tf.data``'s next batch (its get-next on the host);
* **bubble** (a pipeline with micro-batches) or **waiting** (otherwise): a device idle inside the step, waiting for
  another device or a dependency; the plan predicts a pipeline's bubble (:attr:`paraml.planning.schedules.Schedule.
  bubble`);
* **host**: the rest of the loop's time on the step, outside the devices' work (Python, launching the function).

Each device's time over the step's span is given to one part at each instant (a collective before a send, before
the optimizer, before compute, before the input wait; nothing: idle), then the parts are averaged over the devices;
the input wait outside the span and the host overhead add up with them to the loop's time on the step.

Measured, with its limits: on logical CPUs the devices share the machine's cores and one thread pool, so idle time
there is evidence of the dataflow, not a GPU's figure; the profiler adds a few microseconds per op.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from paraml.bench.trace import OpRun, StepTrace, merge_intervals, trace_step
from paraml.planning.observe import variable_bytes
from paraml.planning.sizes import format_bytes

if TYPE_CHECKING:
    from paraml.parallel import Parallel

__all__ = ["PARTS", "StepExplanation", "explain_step", "explain_trace"]

#: The parts of a step, in the order they are shown; "bubble" is called "waiting" outside a pipeline.
PARTS = ("compute", "reduction", "transfers", "optimizer", "input", "bubble", "host")

#: The parts a change of layout or of the input can remove (compute and the optimizer's update are the work itself).
AVOIDABLE = ("host", "reduction", "input", "bubble", "transfers")

#: The letter of each part in the text timeline; ``.`` is idle.
LETTERS = {"compute": "c", "reduction": "r", "transfers": "t", "optimizer": "o", "input": "i"}

#: Which part a device's instant belongs to when several ops overlap: the first of these.
PRIORITY = ("reduction", "transfers", "optimizer", "compute", "input")

#: Below this share of the step, no part is worth naming: compute is the step.
WORTH_NAMING = 0.1

SEND_OPS = frozenset({"_Send", "_HostSend", "Send", "HostSend"})


@dataclass(frozen=True)
class StepExplanation:
    """One step split into its parts (see the module docstring).

    Attributes:
        layout: What ran (the strategy, its devices and the plan's layout), in words.
        step_ms: The loop's milliseconds on the step.
        parts: Milliseconds of each of :data:`PARTS` (averaged over the devices), adding up to ``step_ms``.
        compute_by_device: Milliseconds each device computed.
        predicted: What the plan predicts for a part, in words (the parts it can predict).
        biggest: The biggest avoidable part (:data:`AVOIDABLE`), or None when none reaches 10% of the step.
        advice: One sentence: the biggest avoidable part and what to change.
        pipelined: Whether idle time is a pipeline's bubble (else it is "waiting").
        trace: The traced step.
        optimizer_scopes: The name scopes of the optimizer's update ops.
    """

    layout: str
    step_ms: float
    parts: dict[str, float]
    compute_by_device: dict[str, float]
    predicted: dict[str, str]
    biggest: str | None
    advice: str
    pipelined: bool
    trace: StepTrace = field(repr=False)
    optimizer_scopes: frozenset[str] = frozenset()

    def shares(self) -> dict[str, float]:
        """Each part's share of the step (0 to 1)."""
        return {part: ms / self.step_ms if self.step_ms > 0 else 0.0 for part, ms in self.parts.items()}

    def label(self, part: str) -> str:
        """The part's name as shown: "bubble" outside a pipeline is "waiting", "host" is "host overhead"."""
        if part == "bubble" and not self.pipelined:
            return "waiting"
        return "host overhead" if part == "host" else part

    def timeline(self, width: int = 60) -> list[str]:
        """One row of ``width`` columns per device over the step's span, each column the letter of the part that
        took most of it (:data:`LETTERS`; ``.`` idle)."""
        scopes = set(self.optimizer_scopes)
        return [_letters(self.trace, device, width, scopes) for device in self.compute_by_device]

    def __str__(self) -> str:
        shares = self.shares()
        lines = [
            f"one step of {self.layout}: {self.step_ms:.2f} ms as the loop saw it, "
            f"{self.trace.span * 1e3:.2f} ms from the devices' first op to their last",
            f"{'part':<14} {'ms':>8} {'share':>7}  the plan predicts",
        ]
        for part in PARTS:
            lines.append(
                f"{self.label(part):<14} {self.parts[part]:>8.2f} {shares[part]:>7.1%}  {self.predicted.get(part, '')}"
            )
        lines.append("compute per device: " + ", ".join(f"{d} {ms:.2f} ms" for d, ms in self.compute_by_device.items()))
        width = max(len(d) for d in self.compute_by_device)
        lines.append("timeline (c compute, r reduction, t transfers, o optimizer, i input, . idle):")
        lines += [f"  {d.ljust(width)}  {row}" for d, row in zip(self.compute_by_device, self.timeline())]
        lines.append(self.advice)
        return "\n".join(lines)

    def plot(self, path: str) -> bool:
        """Write the step's timeline per device as a PNG (each op coloured by its part); False, and nothing written,
        without matplotlib (``pip install 'paraml[plot]'``)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            return False
        colours = {"compute": "tab:blue", "reduction": "tab:red", "transfers": "tab:orange", "optimizer": "tab:green"}
        colours["input"] = "tab:purple"
        devices = list(self.compute_by_device)
        figure, axes = plt.subplots(figsize=(12, 0.5 * len(devices) + 1.5))
        optimizer_scopes = set(self.optimizer_scopes)
        for row, device in enumerate(devices):
            for part, colour in colours.items():
                spans = [
                    (op.start * 1e3, (op.end - op.start) * 1e3)
                    for op in self.trace.ops
                    if op.device == device and _part_of(op, optimizer_scopes) == part
                ]
                if part == "input":
                    spans += [(s * 1e3, (e - s) * 1e3) for s, e in self.trace.input_waits]
                axes.broken_barh(spans, (row - 0.4, 0.8), color=colour, label=part if row == 0 else None)
        axes.set_yticks(range(len(devices)), devices)
        axes.invert_yaxis()
        axes.set_xlabel("ms from the step's first op")
        axes.legend(loc="upper right", fontsize="small")
        axes.set_title(f"{self.layout}: {self.step_ms:.2f} ms")
        figure.tight_layout()
        figure.savefig(path)
        plt.close(figure)
        return True


def explain_step(
    par: Parallel, x: Any, y: Any = None, *, sample_weight: Any = None, warmup: int = 4
) -> StepExplanation:
    """One training step of ``par`` (built, not trained yet: the first step must be traced) on the global batch
    ``(x, y)``, or on the next batch of ``x`` when it is a ``tf.data.Dataset`` of global batches (its own pipeline is
    then what the step waits for), split into its parts; ``warmup`` untraced steps first (the first traces the
    function; a dataset's buffers settle).

    Raises:
        ValueError: as :func:`paraml.bench.trace.trace_step` does (a ``Parallel`` that trained before).
    """
    trace = trace_step(par, x, y, sample_weight=sample_weight, warmup=warmup)
    return explain_trace(par, trace)


def explain_trace(par: Parallel, trace: StepTrace) -> StepExplanation:
    """:class:`StepExplanation` of a step ``par`` ran and :func:`paraml.bench.trace.trace_step` traced."""
    plan = par.plan
    devices = trace.devices[: len(par.devices)]
    span = trace.span
    pipelined = plan is not None and len(plan.stages) > 1 and plan.micro_batches > 1
    scopes = _optimizer_scopes(par)
    per_device = [_device_parts(trace, device, span, scopes) for device in devices]
    parts = {part: sum(d[part] for d in per_device) / len(per_device) for part in PARTS if part != "host"}
    inside = _length(_clipped(trace.input_waits, 0.0, span))
    outside = _length(merge_intervals(trace.input_waits)) - inside
    parts["input"] += outside
    wall = max(trace.wall, span + outside)
    parts["host"] = wall - span - outside
    parts = {part: parts[part] * 1e3 for part in PARTS}
    explanation = StepExplanation(
        layout=_layout(par),
        step_ms=wall * 1e3,
        parts=parts,
        compute_by_device={d: p["compute"] * 1e3 for d, p in zip(devices, per_device)},
        predicted=_predicted(par, span),
        biggest=None,
        advice="",
        pipelined=pipelined,
        trace=trace,
        optimizer_scopes=frozenset(scopes),
    )
    biggest, advice = _advice(par, explanation)
    return replace(explanation, biggest=biggest, advice=advice)


# -- the parts --------------------------------------------------------------------------------------------------------
def _optimizer_scopes(par: Parallel) -> set[str]:
    """The name scopes the optimizer's update ops run under: its name (and a loss scale's inner optimizer's)."""
    optimizer = par.model.optimizer
    scopes = set()
    while optimizer is not None:
        scopes.add(optimizer.name)
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return scopes


def _part_of(op: OpRun, optimizer_scopes: set[str]) -> str:
    """Which part ``op`` is work of."""
    if op.op.startswith(("Collective", "Nccl")):
        return "reduction"
    if op.op in SEND_OPS:
        return "transfers"
    if optimizer_scopes.intersection(op.name.split("/")):
        return "optimizer"
    if "Iterator" in op.op:
        return "input"
    return "compute"


def _device_parts(trace: StepTrace, device: str, span: float, scopes: set[str]) -> dict[str, float]:
    """Seconds of ``device``'s span in each part (one part per instant, by :data:`PRIORITY`; idle: "bubble")."""
    intervals: dict[str, list[tuple[float, float]]] = {part: [] for part in PRIORITY}
    for op in trace.ops:
        if op.device == device:
            intervals[_part_of(op, scopes)].append((op.start, op.end))
    intervals["input"] += _clipped(trace.input_waits, 0.0, span)
    seconds = dict.fromkeys(PARTS, 0.0)
    covered: list[tuple[float, float]] = []
    for part in PRIORITY:
        before = _length(covered)
        covered = merge_intervals([*covered, *intervals[part]])
        seconds[part] = _length(covered) - before
    seconds["bubble"] = max(0.0, span - _length(covered))
    return seconds


def _clipped(intervals: Sequence[tuple[float, float]], low: float, high: float) -> list[tuple[float, float]]:
    return [(max(s, low), min(e, high)) for s, e in intervals if min(e, high) > max(s, low)]


def _length(intervals: Sequence[tuple[float, float]]) -> float:
    return sum(end - start for start, end in merge_intervals(intervals))


def _letters(trace: StepTrace, device: str, width: int, scopes: set[str]) -> str:
    """``device``'s row of the text timeline: each column the letter of the part with most time in it."""
    span = trace.span or 1.0
    cells = []
    for column in range(width):
        low, high = column * span / width, (column + 1) * span / width
        time_in = {part: 0.0 for part in LETTERS}
        for op in trace.ops:
            if op.device == device and op.end > low and op.start < high:
                time_in[_part_of(op, scopes)] += min(op.end, high) - max(op.start, low)
        for start, end in _clipped(trace.input_waits, low, high):
            time_in["input"] += end - start
        part, most = max(time_in.items(), key=lambda item: item[1])
        cells.append(LETTERS[part] if most > 0 else ".")
    return "".join(cells)


# -- what the plan predicts, and what to change ------------------------------------------------------------------------
def _layout(par: Parallel) -> str:
    plan = par.plan
    text = f"{par.strategy} on {len(par.devices)} device(s)"
    return text + (f" ({plan.layout})" if plan is not None else "")


def _gradient_bytes(par: Parallel) -> int:
    return sum(
        int(v.shape.num_elements() or 0) * v.dtype.size for v in (getattr(v, "value", v) for v in par.trained_variables)
    )


def _predicted(par: Parallel, span: float) -> dict[str, str]:
    """What the plan says of each part it can predict: a pipeline's bubble, the bytes the replicas exchange."""
    plan = par.plan
    predicted: dict[str, str] = {}
    if plan is not None and plan.schedule is not None and len(plan.stages) > 1:
        bubble = plan.schedule.bubble
        predicted["bubble"] = f"{bubble:.0%} of each device's time ({bubble * span * 1e3:.2f} ms): {plan.schedule.kind}"
    replicas = par.num_replicas
    if replicas > 1:
        gradients = variable_bytes(par.trained_variables)
        factor = 2 * (replicas - 1) / replicas
        zero = plan.zero_stage if plan is not None else 0
        how = "all-reduce"
        if zero == 1:
            factor *= 1.5
            how = "all-reduce, then the updated values sent back"
        elif zero >= 2:
            how = "all-to-all to the owners, then gathered"
        predicted["reduction"] = (
            f"{format_bytes(int(factor * gradients))} sent per replica ({how} of {format_bytes(gradients)})"
        )
    return predicted


def _advice(par: Parallel, explanation: StepExplanation) -> tuple[str | None, str]:
    """The biggest avoidable part and one sentence on what to change."""
    shares = explanation.shares()
    candidates = [part for part in AVOIDABLE if part != "bubble" or explanation.pipelined]
    biggest = max(candidates, key=lambda part: explanation.parts[part])
    if shares[biggest] < WORTH_NAMING:
        compute = shares["compute"] + shares["optimizer"]
        return None, (
            f"compute and the optimizer's update are {compute:.0%} of the step and nothing avoidable reaches "
            f"{WORTH_NAMING:.0%}: the step is its work; jit_compile=True may make that work faster"
        )
    said = f"the biggest avoidable part is {explanation.label(biggest)}: {explanation.parts[biggest]:.2f} ms, " + (
        f"{shares[biggest]:.0%} of the step; "
    )
    if biggest == "host":
        steps = par.steps_per_execution * 4
        change = (
            "the host launches every step itself, so run several per call "
            f"(Parallel(..., steps_per_execution={steps})) or give each replica a larger batch"
        )
    elif biggest == "reduction":
        change = (
            f"the {par.num_replicas} replicas exchange their gradients every step: a larger batch per replica computes "
            f"more per byte exchanged, or train on fewer devices"
        )
    elif biggest == "input":
        change = (
            "the step waits for its next batch: give the dataset's map num_parallel_calls=tf.data.AUTOTUNE, cache what "
            "does not change, and prefetch (dataset.prefetch(tf.data.AUTOTUNE))"
        )
    elif biggest == "bubble":
        plan = par.plan
        micro = plan.micro_batches if plan is not None else 1
        change = (
            f"the stages wait for each other's micro-batches: more micro-batches (micro_batches={2 * micro}), or "
            "schedule='interleaved' or 'zero_bubble'"
        )
    else:
        change = "the devices send each other activations or weights: fewer stages or tensor shards, or a larger batch"
    return biggest, said + change
