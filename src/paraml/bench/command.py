"""``paraml bench``: the backends side by side on this machine, with the evidence to choose between them.

For a model (a preset or ``MODULE:FUNCTION``) and each backend at 1, 2 and 4 devices it measures throughput
(samples/s, the median of several timed windows after warm-up), step time, time to the first step (tracing), the
bytes of variables on each device and the process's peak memory. Every variant is timed two ways: the steady-state
step and the whole ``fit`` call divided by its steps, whose difference is the fixed cost a ``fit`` call pays
(``fixed_ms``); see :mod:`paraml.bench.harness`, the harness that times it (and every script in ``benchmarks/``).

Baselines, run next to paraml: plain Keras ``model.compile(); model.fit()`` on one device with no strategy (what users
compare with), Keras ``fit`` under a ``MirroredStrategy`` on the same devices and a hand-written ``strategy.run``
loop; and, where TensorFlow allows it (``single``, ``mirrored``), paraml with ``jit_compile=True`` (XLA in the
replica step). The ratios (paraml / Keras, XLA / no XLA) are medians of per-window ratios: timings on shared machines
are noisy, so all variants run in one process with their windows interleaved.

``multi_worker`` runs through ``paraml launch`` with 2 local workers running ``bench/_worker.py``
(:func:`worker_main`), which ``benchmarks/bench_multi_worker.py`` runs too.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from paraml.bench.harness import (
    GLOBAL_BATCH,
    HANDWRITTEN,
    KERAS_MIRRORED,
    KERAS_SINGLE,
    PRESETS,
    BenchResult,
    Spec,
    Workload,
    build_variant,
    environment,
    format_table,
    int_at_least,
    json_line,
    make_parallel,
    marked_results,
    measure,
    paired,
    progress_printer,
    random_data,
    resolve_model,
    time_variants,
    write_json,
)
from paraml.checks import check_int
from paraml.planning.sizes import format_bytes

__all__ = [
    "MARKER",
    "RATIOS",
    "WORKER",
    "add_arguments",
    "compute_ratios",
    "format_ratios",
    "run_bench",
    "run_from_args",
    "versus_keras_specs",
    "worker_main",
]

#: Backends whose replica step TensorFlow can compile with XLA (``jit_compile=True``); the others refuse it.
XLA_BACKENDS = ("single", "mirrored")

#: The script each ``multi_worker`` worker runs (under ``paraml launch``): :func:`worker_main`.
WORKER = Path(__file__).with_name("_worker.py")
#: What the chief prints before its result (JSON) on the line it prints it.
MARKER = "PARAML_BENCH_RESULT "


def _specs(device_counts: Sequence[int], micro_batches: Sequence[int], quick: bool = False) -> list[Spec]:
    """The paraml rows, then the baselines. ``quick`` leaves out the rows no ratio needs: data-parallel rows on 1
    device, XLA on more than 2 devices, Keras with XLA."""
    specs = [Spec("single", 1), Spec("single", 1, jit_compile=True)]
    for n in device_counts:
        if quick and n == 1:
            continue
        specs.append(Spec("mirrored", n))
        if not quick or n == 2:
            specs.append(Spec("mirrored", n, jit_compile=True))
        specs.append(Spec("central_storage", n))
        if n > 1:
            specs += [Spec("model_parallel", n, options={"micro_batches": m}) for m in micro_batches]
    specs.append(Spec(KERAS_SINGLE, 1))
    if not quick:
        specs.append(Spec(KERAS_SINGLE, 1, jit_compile=True))
    if 2 in device_counts:
        specs += [Spec(HANDWRITTEN, 2), Spec(KERAS_MIRRORED, 2)]
    return specs


def versus_keras_specs(devices: int, xla: bool = True) -> list[Spec]:
    """paraml against Keras' own ``fit``: ``single`` and plain Keras on one device, and, with ``devices`` > 1,
    ``mirrored`` and Keras under a ``MirroredStrategy`` on ``devices`` devices; with ``xla``, the ``jit_compile=True``
    twins (none of Keras under the strategy)."""
    devices = check_int("devices", devices)
    jit = (False, True) if xla else (False,)
    specs = [spec for j in jit for spec in (Spec(KERAS_SINGLE, 1, jit_compile=j), Spec("single", 1, jit_compile=j))]
    if devices > 1:
        specs += [Spec("mirrored", devices, jit_compile=j) for j in jit] + [Spec(KERAS_MIRRORED, devices)]
    return specs


def _multi_worker(
    model: str, steps_per_call: int, windows: int, threads: int, progress: Callable[[str], None]
) -> BenchResult:
    """``multi_worker`` with 2 local workers through the launcher; the chief prints its result as JSON."""
    import io

    from paraml.cluster.launch import launch

    progress("multi_worker@2x1: starting 2 workers with paraml launch")
    captured = io.StringIO()
    options = ["--model", model, "--steps", str(steps_per_call), "--windows", str(windows), "--threads", str(threads)]
    code = launch(str(WORKER), ["--strategy", "multi_worker", *options], num_workers=2, out=captured)
    results = marked_results(captured.getvalue(), MARKER)
    if code != 0 or len(results) != 1:
        raise RuntimeError(f"multi_worker benchmark failed (exit code {code}):\n{captured.getvalue()[-2000:]}")
    return BenchResult(**results[0])


def worker_main(argv: Sequence[str] | None = None) -> None:
    """One process timing paraml's ``fit`` on its own: a ``multi_worker`` worker (under ``paraml launch``) or
    ``mirrored`` on 2 devices. The chief prints ``PARAML_BENCH_RESULT {json}``: every worker runs the same
    synchronous steps, so its times are the cluster's."""
    parser = argparse.ArgumentParser(prog="bench/_worker.py")
    parser.add_argument("--strategy", choices=("multi_worker", "mirrored"), required=True)
    parser.add_argument("--model", default="mlp", help=f"a preset ({', '.join(PRESETS)}) or MODULE:FUNCTION")
    parser.add_argument("--batch-size", type=int_at_least(1), default=GLOBAL_BATCH, help="global batch")
    parser.add_argument("--steps", type=int_at_least(2), default=32, help="batches per timed fit call")
    parser.add_argument("--windows", type=int_at_least(1), default=5)
    parser.add_argument("--threads", type=int_at_least(0), default=0, help="intra-op threads (0: TF's default)")
    parser.add_argument("--optimizer", default="sgd", help="a Keras optimizer name (default sgd: SGD(0.01))")
    args = parser.parse_args(argv)
    if args.threads:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(args.threads)
    if args.strategy == "multi_worker":
        spec = Spec("multi_worker", None)
    else:
        from paraml.devices import ensure_devices

        ensure_devices(2)
        spec = Spec("mirrored", 2)
    par = make_parallel(spec)  # before anything touches TensorFlow's devices
    model_fn, shape, kind = resolve_model(args.model)
    x, y = random_data(shape, kind, args.steps * args.batch_size)  # the same data on every worker (seed 0)
    work = Workload(model_fn, x, y, args.steps, args.batch_size, args.optimizer)
    (result,) = time_variants([build_variant(spec, work, parallel=par)], args.windows)
    if par.is_chief:
        print(MARKER + json_line(result), flush=True)


#: name -> (numerator, denominator): the ratios reported when both rows ran (< 1: the first is faster). ``{n}`` is
#: the number of devices of the data-parallel rows (2 in ``paraml bench``, every GPU in benchmarks/gpu_check.py).
RATIOS: dict[str, tuple[str, str]] = {
    "single_vs_keras_fit_single": ("single@1", "keras-fit-single@1"),
    "single_xla_vs_keras_fit_single": ("single@1 xla", "keras-fit-single@1"),
    "single_xla_vs_keras_fit_single_xla": ("single@1 xla", "keras-fit-single@1 xla"),
    "paraml_vs_keras_fit": ("mirrored@{n}", "keras-fit-mirrored@{n}"),  # mirrored / Keras fit, same strategy
    "mirrored_xla_vs_keras_fit_mirrored": ("mirrored@{n} xla", "keras-fit-mirrored@{n}"),
    "paraml_vs_handwritten": ("mirrored@{n}", "handwritten-mirrored@{n}"),
    "keras_fit_xla_vs_no_xla": ("keras-fit-single@1 xla", "keras-fit-single@1"),
    "keras_fit_mirrored_vs_single": ("keras-fit-mirrored@{n}", "keras-fit-single@1"),
}


def compute_ratios(results: Sequence[BenchResult], devices: int = 2, metric: str = "step_ms") -> dict[str, float]:
    """The ratios of ``metric`` (one of :data:`paraml.bench.harness.METRICS`), each the median of per-window ratios:
    :data:`RATIOS` (data-parallel rows on ``devices`` devices), ``xla_vs_no_xla_<row>`` for every paraml row with an
    XLA twin, and ``best_single_vs_keras_fit_single`` / ``best_mirrored_vs_keras_fit_mirrored`` (the faster of the
    XLA and plain variant)."""
    by_label = {r.label: r for r in results if r.windows_ms.get(metric)}
    pairs = {name: (a.format(n=devices), b.format(n=devices)) for name, (a, b) in RATIOS.items()}
    for label in by_label:
        plain = label.removesuffix(" xla")
        if plain != label and not label.startswith("keras") and plain in by_label:
            pairs[f"xla_vs_no_xla_{plain}"] = (label, plain)
    ratios = {
        name: paired(by_label[a].windows_ms[metric], by_label[b].windows_ms[metric])
        for name, (a, b) in pairs.items()
        if a in by_label and b in by_label
    }
    for best, candidates in {
        "best_single_vs_keras_fit_single": ("single_vs_keras_fit_single", "single_xla_vs_keras_fit_single"),
        "best_mirrored_vs_keras_fit_mirrored": ("paraml_vs_keras_fit", "mirrored_xla_vs_keras_fit_mirrored"),
    }.items():
        values = [ratios[name] for name in candidates if name in ratios]
        if values:
            ratios[best] = min(values)
    return ratios


def _explain(ns: argparse.Namespace, devices: int) -> int:
    """``paraml bench --explain``: one step of the model under ``--strategy`` on ``devices`` devices, in its parts."""
    from paraml.bench.explain import explain_step
    from paraml.devices import ensure_devices

    options = {} if ns.micro_batches is None else {"micro_batches": ns.micro_batches}
    ensure_devices(devices)
    model_fn, shape, kind = resolve_model(ns.model)
    x, y = random_data(shape, kind, ns.batch_size)
    work = Workload(model_fn, x, y, 1)
    par = make_parallel(Spec(ns.strategy, devices, options=options))
    par.build(work.model_fn, **work.compile_args())
    explanation = explain_step(par, x, y)
    print(explanation)
    if ns.plot and not explanation.plot(ns.plot):
        print("no plot: matplotlib is not installed (pip install 'paraml[plot]')", file=sys.stderr)
    return 0


def run_bench(
    model: str = "mlp",
    *,
    devices: Sequence[int] = (1, 2, 4),
    micro_batches: Sequence[int] = (1, 2, 4),
    steps: int = 31,
    windows: int = 5,
    threads_per_device: int = 0,
    multi_worker: bool = True,
    quick: bool = False,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Run the comparison; return ``{"results": [BenchResult...], "ratios": {...}, "fit_call_ratios": {...},
    "machine": {...}, ...}``.

    A timed window is one ``fit`` call of ``steps + 1`` batches per variant. ``quick`` leaves out the rows no ratio
    needs (1-device data-parallel rows, XLA on more than 2 devices, Keras with XLA). Call it at program start: it sets
    up ``max(devices)`` simulated devices when the machine has fewer.
    """
    steps = check_int("steps", steps)
    windows = check_int("windows", windows)
    threads_per_device = check_int("threads_per_device", threads_per_device, low=0)
    devices = [check_int("devices", n) for n in devices]
    progress = progress or progress_printer("bench")
    if threads_per_device:
        import tensorflow as tf

        tf.config.threading.set_intra_op_parallelism_threads(threads_per_device)
    from paraml.devices import ensure_devices

    ensure_devices(max(devices))
    model_fn, shape, kind = resolve_model(model)
    x, y = random_data(shape, kind, (steps + 1) * GLOBAL_BATCH)
    work = Workload(model_fn, x, y, steps + 1)
    results, _ = measure([(spec, work) for spec in _specs(devices, micro_batches, quick)], windows, progress=progress)
    if multi_worker:
        results.append(_multi_worker(model, steps + 1, windows, threads_per_device, progress))
    ratios = compute_ratios(results, metric="step_ms")
    call_ratios = compute_ratios(results, metric="fit_call_ms")
    by_label = {r.label: r for r in results}
    if "multi_worker@2" in by_label and "mirrored@2" in by_label:
        ratios["multi_worker_vs_mirrored_steps_per_s"] = (
            by_label["mirrored@2"].step_ms / by_label["multi_worker@2"].step_ms
        )
    return {
        "model": model,
        "global_batch": GLOBAL_BATCH,
        "steps_per_fit_call": steps + 1,
        "windows": windows,
        "results": results,
        "ratios": ratios,
        "fit_call_ratios": call_ratios,
        "machine": environment(threads_per_device=threads_per_device or "default"),
    }


def format_ratios(report: dict[str, Any], *, markdown: bool = False) -> str:
    """The ``ratios`` (steady-state) and ``fit_call_ratios`` of ``report`` as one table."""
    steady, call = report["ratios"], report.get("fit_call_ratios", {})
    rows = [
        [f"`{name}`" if markdown else name, f"{value:.3f}", f"{call[name]:.3f}" if name in call else "-"]
        for name, value in steady.items()
    ]
    return format_table(
        rows, ["ratio (< 1: the first is faster)", "steady-state step", "whole fit call"], markdown=markdown
    )


def _result_rows(results: Sequence[BenchResult]) -> list[list[str]]:
    rows = []
    for r in results:
        largest = max(r.variable_bytes_per_device.values(), default=0)
        rows.append(
            [
                r.label,
                f"{r.samples_per_s:.0f}",
                f"{r.step_ms:.2f}",
                f"{r.fit_call_ms:.2f}",
                f"{r.fixed_ms:.1f}",
                f"{r.first_step_s:.2f}",
                format_bytes(largest) if largest else "-",
            ]
        )
    return rows


_RESULT_HEADER = [
    "variant",
    "samples/s",
    "step ms",
    "fit-call ms/step",
    "fixed ms/call",
    "first step s",
    "largest variable bytes on one device",
]


def format_report(report: dict[str, Any]) -> str:
    """The benchmark as a terminal table followed by the ratios."""
    lines = [f"model {report['model']}, global batch {report['global_batch']}, machine {report['machine']}", ""]
    lines += [format_table(_result_rows(report["results"]), _RESULT_HEADER), ""]
    lines.append(format_ratios(report))
    lines += [
        "",
        f"step ms: steady state; fit-call ms: a whole fit call of {report['steps_per_fit_call']} steps per step; "
        "fixed ms: what one fit call costs beyond its steps. Ratios: medians of per-window ratios.",
        "Simulated CPU devices share one thread pool: pipeline and data-parallel gains here are not a GPU's.",
    ]
    return "\n".join(lines)


def format_markdown(report: dict[str, Any], command: str) -> str:
    """The benchmark as a Markdown results page (``docs/results.md`` is one)."""
    machine = report["machine"]
    lines = [
        "# Results of a `paraml bench` run",
        "",
        f"Generated by `{command}`. Machine: {machine['cpus']} CPU cores, {machine['gpus']} GPUs, "
        f"{machine['platform']}, Python {machine['python']}, TensorFlow {machine['tensorflow']}, intra-op threads "
        f"per device: {machine['threads_per_device']}. Model `{report['model']}`, global batch "
        f"{report['global_batch']}, numpy input, {report['windows']} interleaved windows of one fit call of "
        f"{report['steps_per_fit_call']} steps per variant. Devices are logical CPUs sharing the same "
        f"{machine['cpus']} cores, so more devices cannot be faster here: these numbers show paraml's overheads and "
        "memory layout, not a GPU cluster's speed-ups.",
        "",
        format_table(_result_rows(report["results"]), _RESULT_HEADER, markdown=True),
        "",
        "Ratios measured in the same run (windows interleaved, medians of per-window ratios):",
        "",
        format_ratios(report, markdown=True),
        "",
        "Step times are steady-state: from the end of a fit call's first step to its last. The fit-call time is a "
        "whole `fit` call divided by its steps; the difference, times the steps, is the fixed cost of one call "
        "(building the input pipeline and its iterator, callbacks). `xla` rows run with `jit_compile=True`; "
        "`keras-fit-single` is plain `model.compile(); model.fit()` with no strategy.",
        "",
    ]
    return "\n".join(lines)


def write_plot(report: dict[str, Any], path: str) -> bool:
    """A PNG of throughput and largest per-device variable bytes per variant; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    results = report["results"]
    labels = [r.label for r in results]
    figure, (speed, memory) = plt.subplots(1, 2, figsize=(12, 0.4 * len(labels) + 2))
    speed.barh(labels, [r.samples_per_s for r in results])
    speed.set_xlabel("samples/s")
    memory.barh(labels, [max(r.variable_bytes_per_device.values(), default=0) / 2**20 for r in results])
    memory.set_xlabel("largest variable MiB on one device")
    speed.invert_yaxis()
    memory.invert_yaxis()
    figure.suptitle(f"paraml bench: {report['model']}, global batch {report['global_batch']}")
    figure.tight_layout()
    figure.savefig(path)
    return True


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``paraml bench``."""
    parser.add_argument("--model", default="mlp", help=f"a preset ({', '.join(PRESETS)}) or MODULE:FUNCTION")
    parser.add_argument(
        "--quick",
        action="store_true",
        help="1 and 2 devices, micro-batches 4, 2 windows, only the rows a ratio needs",
    )
    parser.add_argument("--devices", default="1,2,4", help="device counts, e.g. 1,2,4")
    parser.add_argument(
        "--steps", type=int_at_least(1), default=31, help="steps per timed window (a fit call: steps + 1)"
    )
    parser.add_argument(
        "--windows", type=int_at_least(1), default=5, help="timed windows per variant (the median is reported)"
    )
    parser.add_argument(
        "--threads-per-device", type=int_at_least(0), default=0, help="intra-op threads (1: one core per device)"
    )
    parser.add_argument("--no-multi-worker", action="store_true", help="skip the 2-worker launcher run")
    parser.add_argument("--json", default=None, help="write the results as JSON here")
    parser.add_argument("--markdown", default=None, help="write a Markdown results page here")
    parser.add_argument(
        "--plot", default=None, help="write a PNG plot here (needs matplotlib: pip install paraml[plot])"
    )
    parser.add_argument(
        "--explain",
        action="store_true",
        help="split one step of --strategy on the first of --devices into its parts (paraml.bench.explain)",
    )
    parser.add_argument("--strategy", default="mirrored", help="with --explain: the strategy whose step is explained")
    parser.add_argument("--micro-batches", type=int_at_least(1), default=None, help="with --explain and model_parallel")
    parser.add_argument(
        "--batch-size", type=int_at_least(1), default=GLOBAL_BATCH, help="with --explain: the global batch"
    )


def run_from_args(ns: argparse.Namespace) -> int:
    """``paraml bench`` with parsed arguments."""
    try:
        devices = (1, 2) if ns.quick else tuple(int(d) for d in ns.devices.split(","))
    except ValueError:
        raise ValueError(
            f"--devices must be device counts separated by commas, e.g. 1,2,4, got {ns.devices!r}"
        ) from None
    if getattr(ns, "explain", False):
        return _explain(ns, devices[0])
    report = run_bench(
        ns.model,
        devices=devices,
        micro_batches=(4,) if ns.quick else (1, 2, 4),
        steps=ns.steps,
        windows=2 if ns.quick else ns.windows,
        threads_per_device=ns.threads_per_device,
        multi_worker=not ns.no_multi_worker,
        quick=ns.quick,
    )
    print(format_report(report))
    if ns.json:
        write_json(report, ns.json, echo=False)
    if ns.markdown:
        with open(ns.markdown, "w") as file:
            file.write(format_markdown(report, "paraml bench " + " ".join(sys.argv[2:])))
    if ns.plot and not write_plot(report, ns.plot):
        print("no plot: matplotlib is not installed (pip install 'paraml[plot]')", file=sys.stderr)
    return 0
