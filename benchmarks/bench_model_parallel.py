"""What ``Parallel("model_parallel")`` costs and what it buys, as ratios measured in one process.

The model is 12 identical ``Dense(512)`` layers on a 512-wide input (ReLU except the last, which gives 512 logits),
trained with Adam at the global batch of :data:`paraml.bench.GLOBAL_BATCH`. Identical layers make balanced stages
possible, so the numbers below measure paraml, not a lopsided model. A keras_hub ``GPT2CausalLM`` (random init, a
small config built from its classes, no download) is timed next to it: the staging cost on a real transformer, run by
its own ``call`` with each unit under its stage's device. Three questions:

1. **The cost of staging.** ``Parallel("model_parallel", devices=2, micro_batches=1)`` against ``Parallel("single")``
   on the same model and batch: the ratio of steady-state step times. Staging runs the model layer by layer under
   ``tf.device(stage)`` and copies the activations between devices; with one micro-batch nothing overlaps, so this is
   the price of the split itself (target: <= 1.10). Measured on the Dense stack and on GPT-2 (``--gpt2-*`` options
   set its size; ``--gpt2-layers 0`` leaves it out), in the same interleaved rounds.
2. **The gain of pipelining.** Throughput (samples/s) with ``micro_batches`` 2, 4 and 8 against 1, printed next to
   the ideal GPipe gain ``K*M/(M+K-1)`` for K = 2 stages (bubble-limited, communication-free). Here the devices are
   logical CPUs that share ONE thread pool (field notes 7): stage 1 working on micro-batch i while stage 0 works on
   i+1 competes for the same cores, which one micro-batch's large matmuls (and its independent backward matmuls)
   already keep busy. So this ratio is not what a GPU would show; what it does exercise is the code path a GPU
   takes (the same ``tf.function``, the same split, the same per-stage ``tf.device`` placement).
3. **Memory.** The largest stage's parameter-plus-optimizer bytes, counted from the real variables
   (:func:`paraml.bench.variable_bytes_per_device` of the model's weights and Adam's variables), against a perfect
   1/K split of the same total, for K = 2 and 4 (target: <= 1.10), with the stage plan (``par.describe()``).

Timing follows field notes 9: every variant runs in this one process, after tracing and a warm-up window; the timed
windows are interleaved in rounds whose order rotates (A B C, B C A, ...); each window is one ``fit`` call of
``--steps`` + 1 batches timed from the end of its first batch to its last (``paraml.bench._step_clock``), so a fit
call's fixed costs stay out; each variant's median is reported, and ratios both as the ratio of medians and as the
median of per-round ratios (windows adjacent in time). The process CPU time over the same steps is recorded too:
it hardly moves when other programs take the cores (wall time does), and CPU/wall is how many cores the variant
kept busy.

``--threads-per-device N`` sets TensorFlow's intra-op thread pool (shared by all logical devices) to N threads before
anything else; 1 brings the logical CPUs closer to one core per device.

    .venv/bin/python benchmarks/bench_model_parallel.py [--threads-per-device 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

#: Pipeline stages timed (questions 1 and 2) and stage counts whose memory split is measured (question 3).
TIMED_STAGES = 2
MEMORY_STAGES = (2, 4)
TARGET = 1.10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads-per-device", type=int, default=0, help="intra-op threads (0: TF's default)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per window (default 30)")
    parser.add_argument("--windows", type=int, default=7, help="timed rounds (default 7; the median is reported)")
    parser.add_argument("--micro-batches", default="2,4,8", help="micro-batch counts compared with 1 (default 2,4,8)")
    parser.add_argument("--layers", type=int, default=12, help="Dense layers (default 12)")
    parser.add_argument("--width", type=int, default=512, help="width of the input and of every layer (default 512)")
    parser.add_argument("--gpt2-layers", type=int, default=4, help="GPT-2 transformer layers (default 4; 0: no GPT-2)")
    parser.add_argument("--gpt2-hidden", type=int, default=128, help="GPT-2 hidden size (default 128)")
    parser.add_argument("--gpt2-seq", type=int, default=64, help="GPT-2 sequence length (default 64)")
    parser.add_argument("--gpt2-vocab", type=int, default=1000, help="GPT-2 vocabulary size (default 1000)")
    parser.add_argument("--gpt2-batch", type=int, default=32, help="GPT-2 global batch (default 32)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every round's window times")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON result line to PATH")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import tensorflow as tf

    if args.threads_per_device:  # first: the thread pool, like the device layout, is fixed when TF starts up
        tf.config.threading.set_intra_op_parallelism_threads(args.threads_per_device)
    import paraml

    devices = paraml.ensure_devices(max(MEMORY_STAGES + (TIMED_STAGES,)))  # before anything touches a device

    import keras
    import numpy as np

    from paraml import Parallel
    from paraml.bench import GLOBAL_BATCH, _step_clock, variable_bytes_per_device
    from paraml.sizes import format_bytes

    def log(message: str) -> None:
        print(f"[bench_model_parallel] {message}", file=sys.stderr, flush=True)

    width, depth = args.width, args.layers
    micro_batches = [int(m) for m in args.micro_batches.split(",") if m.strip()]

    def model_fn() -> keras.Model:
        layers = [keras.layers.Dense(width, activation="relu" if i < depth - 1 else None) for i in range(depth)]
        return keras.Sequential([keras.Input((width,)), *layers], name=f"dense{depth}x{width}")

    def gpt2_fn() -> keras.Model:
        import keras_hub  # a benchmark-only dependency (the dev extra), never imported by paraml

        backbone = keras_hub.models.GPT2Backbone(
            vocabulary_size=args.gpt2_vocab,
            num_layers=args.gpt2_layers,
            num_heads=4,
            hidden_dim=args.gpt2_hidden,
            intermediate_dim=4 * args.gpt2_hidden,
            max_sequence_length=args.gpt2_seq,
        )
        return keras_hub.models.GPT2CausalLM(backbone=backbone, preprocessor=None)

    def token_loss(y_true: Any, y_pred: Any) -> Any:
        return keras.ops.mean(keras.losses.sparse_categorical_crossentropy(y_true, y_pred, from_logits=True), axis=-1)

    def build(strategy: str, gpt2: bool = False, **options: Any) -> Parallel:
        par = Parallel(strategy, seed=0, **options)
        loss = token_loss if gpt2 else keras.losses.SparseCategoricalCrossentropy(from_logits=True)
        par.build(gpt2_fn if gpt2 else model_fn, optimizer=keras.optimizers.Adam(1e-3), loss=loss)
        return par

    rng = np.random.default_rng(0)
    rows = (args.steps + 1) * GLOBAL_BATCH
    x = rng.random((rows, width), dtype=np.float32)
    y = rng.integers(0, width, rows).astype(np.int32)
    gpt2_rows = (args.steps + 1) * args.gpt2_batch
    ids = rng.integers(0, args.gpt2_vocab, (gpt2_rows, args.gpt2_seq)).astype(np.int32)
    gpt2_x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    gpt2_y = np.roll(ids, -1, axis=1)
    data = {False: (x, y, GLOBAL_BATCH), True: (gpt2_x, gpt2_y, args.gpt2_batch)}

    # -- build, trace and warm up every timed variant ---------------------------------------------------------------
    specs: list[tuple[str, str, dict[str, Any]]] = [("single", "single", {})]
    specs += [
        (f"mp{TIMED_STAGES} mb={m}", "model_parallel", {"devices": TIMED_STAGES, "micro_batches": m})
        for m in [1, *micro_batches]
    ]
    if args.gpt2_layers:
        specs += [
            ("gpt2 single", "single", {"gpt2": True}),
            (f"gpt2 mp{TIMED_STAGES} mb=1", "model_parallel", {"gpt2": True, "devices": TIMED_STAGES}),
        ]
    variants: dict[str, Callable[[], tuple[float, float]]] = {}
    pars: dict[str, Parallel] = {}
    first_step_s: dict[str, float] = {}
    batches: dict[str, int] = {}
    for i, (name, strategy, options) in enumerate(specs, start=1):
        log(f"{i}/{len(specs)} build, trace and warm up {name}")
        par = pars[name] = build(strategy, **options)
        vx, vy, batch = data[bool(options.get("gpt2"))]
        batches[name] = batch
        start = time.perf_counter()
        first_x = {k: v[:batch] for k, v in vx.items()} if isinstance(vx, dict) else vx[:batch]
        par.fit(first_x, vy[:batch], batch_size=batch, verbose=0)  # traces the step
        first_step_s[name] = time.perf_counter() - start

        def window(par: Parallel = par, vx: Any = vx, vy: Any = vy, batch: int = batch) -> tuple[float, float]:
            """One fit call: steady-state (wall ms per step, process CPU ms per step), over the same batches."""
            clock, cpu = _step_clock(), _step_clock(time.process_time)  # wall and CPU time of the same batches
            par.fit(vx, vy, batch_size=batch, verbose=0, shuffle=False, callbacks=[clock, cpu])
            return clock.ms_per_step(), cpu.ms_per_step()

        window()  # warm-up
        variants[name] = window

    # -- memory: the real variables of each stage, K = 2 and 4 -------------------------------------------------------
    memory: dict[str, Any] = {}
    plans: dict[int, str] = {}
    for k in MEMORY_STAGES:
        name = f"mp{k} mb=1"
        par = pars[name] if name in pars else build("model_parallel", devices=k, micro_batches=1)
        per_device = variable_bytes_per_device(par.model.weights + par.model.optimizer.variables)
        total = sum(per_device.values())
        largest = max(per_device.values())
        plans[k] = par.describe()
        memory[str(k)] = {
            "bytes_per_device": per_device,
            "total_bytes": total,
            "largest_bytes": largest,
            "perfect_bytes": total / k,
            "largest_vs_perfect": largest / (total / k),
            "stages": [list(stage.layers) for stage in par.plan.stages],
        }
    single = pars["single"]
    single_bytes = sum(variable_bytes_per_device(single.model.weights + single.model.optimizer.variables).values())

    # -- timed windows, interleaved with a rotating order ------------------------------------------------------------
    names = list(variants)
    ms: dict[str, list[float]] = {name: [] for name in names}
    cpu_ms: dict[str, list[float]] = {name: [] for name in names}
    for r in range(args.windows):
        log(f"timed round {r + 1}/{args.windows} of {len(names)} variants, interleaved")
        for name in names[r % len(names) :] + names[: r % len(names)]:
            gc.collect()
            step_ms, step_cpu_ms = variants[name]()
            ms[name].append(step_ms)
            cpu_ms[name].append(step_cpu_ms)
        if args.verbose:
            log("  ms/step: " + "  ".join(f"{n} {ms[n][-1]:.1f}" for n in names))

    median = {name: statistics.median(values) for name, values in ms.items()}

    cpu_median = {name: statistics.median(values) for name, values in cpu_ms.items()}
    cores = {name: statistics.median(c / w for c, w in zip(cpu_ms[name], ms[name])) for name in names}

    def ratios(a: str, b: str) -> dict[str, float]:
        """Step time of ``a`` over ``b``: ratio of medians, median of the per-round ratios, ratio of CPU medians."""
        return {
            "median": median[a] / median[b],
            "paired": statistics.median(p / q for p, q in zip(ms[a], ms[b])),
            "cpu": cpu_median[a] / cpu_median[b],
        }

    base = f"mp{TIMED_STAGES} mb=1"
    staging = ratios(base, "single")
    gpt2_staging = ratios(f"gpt2 mp{TIMED_STAGES} mb=1", "gpt2 single") if args.gpt2_layers else None
    pipeline = {}
    for m in micro_batches:
        slower = ratios(f"mp{TIMED_STAGES} mb={m}", base)  # step time ratio; throughput is its inverse
        pipeline[str(m)] = {
            "throughput_ratio": 1 / slower["median"],
            "throughput_ratio_paired": 1 / slower["paired"],
            "ideal": TIMED_STAGES * m / (m + TIMED_STAGES - 1),
        }

    # -- report --------------------------------------------------------------------------------------------------------
    threads = args.threads_per_device or "default"
    print(
        f"model {depth} x Dense({width}) on a {width}-wide input, Adam, global batch {GLOBAL_BATCH}; "
        f"{os.cpu_count()} CPU cores, {len(devices)} logical devices, intra-op threads: {threads}; "
        f"{args.windows} interleaved windows of {args.steps} steps, medians"
    )
    print()
    header = f"{'variant':<18}{'step ms':>9}{'min':>8}{'max':>8}{'samples/s':>11}{'cpu ms':>8}{'cores busy':>12}"
    header += f"{'first step s':>14}"
    print(header)
    print("-" * len(header))
    for name in names:
        print(
            f"{name:<18}{median[name]:>9.2f}{min(ms[name]):>8.2f}{max(ms[name]):>8.2f}"
            f"{batches[name] / median[name] * 1000:>11.0f}{cpu_median[name]:>8.2f}{cores[name]:>12.2f}"
            f"{first_step_s[name]:>14.2f}"
        )
    print()

    def verdict(value: float) -> str:
        return f"target <= {TARGET:.2f}: {'met' if value <= TARGET else 'NOT met'}"

    print(f"1. Cost of staging: step time of {base} / single")
    print(
        f"   Dense stack: {staging['median']:.3f} (ratio of medians), {staging['paired']:.3f} (median of per-round "
        f"ratios), {staging['cpu']:.3f} (CPU time); {verdict(staging['median'])}"
    )
    if gpt2_staging is not None:
        print(
            f"   GPT-2 ({args.gpt2_layers} layers, hidden {args.gpt2_hidden}, seq {args.gpt2_seq}, vocab "
            f"{args.gpt2_vocab}, batch {args.gpt2_batch}): {gpt2_staging['median']:.3f} (ratio of medians), "
            f"{gpt2_staging['paired']:.3f} (paired), {gpt2_staging['cpu']:.3f} (CPU time); "
            f"{verdict(gpt2_staging['median'])}"
        )
        print("   GPT-2 plan:")
        print("\n".join("   " + line for line in pars[f"gpt2 mp{TIMED_STAGES} mb=1"].describe().splitlines()))
    print()
    print(f"2. Pipelining, K={TIMED_STAGES} stages: throughput with M micro-batches / with 1")
    print(f"   {'M':>3}{'measured':>10}{'paired':>9}{'ideal K*M/(M+K-1)':>20}")
    for m, row in pipeline.items():
        print(f"   {m:>3}{row['throughput_ratio']:>10.3f}{row['throughput_ratio_paired']:>9.3f}{row['ideal']:>20.3f}")
    print(
        "   NOTE: the devices are logical CPUs sharing ONE thread pool (the same "
        f"{os.cpu_count()} cores): stages cannot run\n"
        "   side by side as on separate GPUs, so this pipeline ratio is not a GPU's. The code path is the one a GPU\n"
        "   takes: the same tf.function, micro-batch split and per-stage tf.device placement."
    )
    print()
    print("3. Memory: largest stage's parameter + optimizer (Adam) bytes / a perfect 1/K split of the total")
    print(f"   single device total: {format_bytes(single_bytes)}")
    for k, row in memory.items():
        per_device = ", ".join(f"{d.rsplit('/', 1)[-1]} {format_bytes(b)}" for d, b in row["bytes_per_device"].items())
        print(
            f"   K={k}: largest {format_bytes(row['largest_bytes'])} / perfect {format_bytes(row['perfect_bytes'])}"
            f" = {row['largest_vs_perfect']:.4f}; {verdict(row['largest_vs_perfect'])}"
        )
        print(f"        per device: {per_device}")
    for k, text in plans.items():
        print()
        print(f"   plan, K={k} (par.describe()):")
        print("\n".join("   " + line for line in text.splitlines()))
    peak_rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print()
    print(f"peak RSS of the process: {peak_rss_mib:.0f} MiB")

    record = {
        "benchmark": "model_parallel",
        "model": {"layers": depth, "width": width, "optimizer": "adam"},
        "global_batch": GLOBAL_BATCH,
        "steps": args.steps,
        "windows": args.windows,
        "threads_per_device": threads,
        "variants": {
            name: {
                "step_ms": median[name],
                "samples_per_s": batches[name] / median[name] * 1000,
                "windows_ms": ms[name],
                "cpu_ms_per_step": cpu_median[name],
                "cpu_windows_ms": cpu_ms[name],
                "cores_busy": cores[name],
                "first_step_s": first_step_s[name],
            }
            for name in names
        },
        "staging_vs_single": staging,
        "gpt2_staging_vs_single": gpt2_staging,
        "gpt2": {
            "layers": args.gpt2_layers,
            "hidden": args.gpt2_hidden,
            "seq": args.gpt2_seq,
            "vocab": args.gpt2_vocab,
            "batch": args.gpt2_batch,
        },
        "pipeline": pipeline,
        "memory": memory,
        "single_bytes": single_bytes,
        "peak_rss_mib": peak_rss_mib,
        "environment": {
            "tensorflow": tf.__version__,
            "keras": keras.__version__,
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "devices": list(devices),
            "gpus": len(tf.config.list_physical_devices("GPU")),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        },
    }
    from common import write_json  # imported here: it imports TensorFlow, which must not start before the devices

    write_json(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
