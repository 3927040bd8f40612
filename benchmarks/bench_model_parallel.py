"""What ``Parallel("model_parallel")`` costs and what it buys, as ratios measured in one process.

The model is 12 identical ``Dense(512)`` layers on a 512-wide input (ReLU except the last, which gives 512 logits),
trained with Adam at the global batch of :data:`paraml.bench.harness.GLOBAL_BATCH`. Identical layers make balanced
stages
possible, so the numbers below measure paraml, not a lopsided model. A keras_hub ``GPT2CausalLM`` (random init, a
small config built from its classes, no download) is timed next to it: the staging cost on a real transformer, run by
its own ``call`` with each unit under its stage's device. Three questions:

1. **The cost of staging.** ``Parallel("model_parallel", devices=2, micro_batches=1)`` against ``Parallel("single")``
   on the same model and batch: the ratio of steady-state step times. Staging runs the model layer by layer under
   ``tf.device(stage)`` and copies the activations between devices; with one micro-batch nothing overlaps, so this is
   the price of the split itself (target: <= 1.10). Measured on the Dense stack and on GPT-2 (``--gpt2-*`` options
   set its size; ``--gpt2-layers 0`` leaves it out), in the same interleaved rounds.
2. **The gain of pipelining.** Throughput (samples/s) with ``micro_batches`` 2, 4 and 8 against 1, printed next to
   the ideal GPipe gain ``K*M/(M+K-1)`` for K = 2 stages (bubble-limited, communication-free). Simulated devices are
   logical CPUs sharing ONE thread pool: stage 1 working on micro-batch i while stage 0 works on i+1 competes for the
   same cores, which one micro-batch's large matmuls already keep busy. So this ratio is not what a GPU would show;
   what it does exercise is the code path a GPU takes (the same ``tf.function``, split and ``tf.device`` placement).
3. **Memory.** The largest stage's parameter-plus-optimizer bytes, counted from the real variables
   (:func:`paraml.memory.variable_bytes_by_device` of the model's weights and Adam's variables), against a perfect
   1/K split of the same total, for K = 2 and 4 (target: <= 1.10), with the stage plan (``par.describe()``).

Timing is :mod:`paraml.bench.harness`'s: every variant in this one process, windows interleaved, each one ``fit`` call
of
``--steps`` + 1 batches timed from the end of its first batch to its last; ratios both as the ratio of medians and as
the median of per-round ratios. The process CPU time over the same steps is reported too: CPU/wall is how many cores
the variant kept busy.

``--threads-per-device N`` sets TensorFlow's intra-op thread pool (shared by all logical devices) to N threads before
anything else; 1 brings the logical CPUs closer to one core per device.

    .venv/bin/python benchmarks/bench_model_parallel.py [--threads-per-device 1] [--json out.json]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

from paraml.bench.harness import int_at_least  # noqa: E402  (imports no TensorFlow)

#: Pipeline stages timed (questions 1 and 2) and stage counts whose memory split is measured (question 3).
TIMED_STAGES = 2
MEMORY_STAGES = (2, 4)
TARGET = 1.10


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    positive = int_at_least(1)
    parser.add_argument("--threads-per-device", type=int_at_least(0), default=0, help="intra-op threads (0: default)")
    parser.add_argument("--steps", type=positive, default=30, help="timed steps per window (default 30)")
    parser.add_argument("--windows", type=positive, default=7, help="timed rounds (default 7; the median is reported)")
    parser.add_argument("--micro-batches", default="2,4,8", help="micro-batch counts compared with 1 (default 2,4,8)")
    parser.add_argument("--layers", type=positive, default=12, help="Dense layers (default 12)")
    parser.add_argument("--width", type=positive, default=512, help="width of the input and of every layer")
    parser.add_argument("--gpt2-layers", type=int_at_least(0), default=4, help="GPT-2 layers (default 4; 0: none)")
    parser.add_argument("--gpt2-hidden", type=positive, default=128, help="GPT-2 hidden size (default 128)")
    parser.add_argument("--gpt2-seq", type=positive, default=64, help="GPT-2 sequence length (default 64)")
    parser.add_argument("--gpt2-vocab", type=positive, default=1000, help="GPT-2 vocabulary size (default 1000)")
    parser.add_argument("--gpt2-batch", type=positive, default=32, help="GPT-2 global batch (default 32)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print every round's step times")
    parser.add_argument("--json", metavar="PATH", help="also write the JSON record to PATH")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import tensorflow as tf

    if args.threads_per_device:  # first: the thread pool, like the device layout, is fixed when TF starts up
        tf.config.threading.set_intra_op_parallelism_threads(args.threads_per_device)
    import paraml

    devices = paraml.ensure_devices(max((*MEMORY_STAGES, TIMED_STAGES)))  # before anything touches a device

    import keras
    import numpy as np

    from paraml.bench.harness import (
        GLOBAL_BATCH,
        Spec,
        Workload,
        environment,
        format_table,
        make_parallel,
        measure,
        paired,
        peak_rss_mib,
        progress_printer,
        write_json,
    )
    from paraml.memory import variable_bytes_by_device
    from paraml.planning.sizes import format_bytes

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

    calls = args.steps + 1  # batches per fit call: the steady state is timed over the last args.steps
    rng = np.random.default_rng(0)
    x = rng.random((calls * GLOBAL_BATCH, width), dtype=np.float32)
    y = rng.integers(0, width, calls * GLOBAL_BATCH).astype(np.int32)
    dense = Workload(model_fn, x, y, calls, GLOBAL_BATCH, "adam")
    ids = rng.integers(0, args.gpt2_vocab, (calls * args.gpt2_batch, args.gpt2_seq)).astype(np.int32)
    gpt2_x = {"token_ids": ids, "padding_mask": np.ones_like(ids)}
    gpt2 = Workload(gpt2_fn, gpt2_x, np.roll(ids, -1, axis=1), calls, args.gpt2_batch, "adam", token_loss)

    def staged(k: int, m: int, tag: str = "") -> Spec:
        return Spec("model_parallel", k, options={"micro_batches": m}, tag=tag)

    plan = [(Spec("single"), dense)] + [(staged(TIMED_STAGES, m), dense) for m in [1, *micro_batches]]
    if args.gpt2_layers:
        plan += [(Spec("single", tag="gpt2"), gpt2), (staged(TIMED_STAGES, 1, "gpt2"), gpt2)]
    progress = progress_printer("bench_model_parallel")
    show = "step_ms" if args.verbose else None
    results, variants = measure(plan, args.windows, progress=progress, show=show)
    by_label = {r.label: r for r in results}
    pars = {r.label: v.parallel for r, v in zip(results, variants)}

    # -- memory: the real variables of each stage, K = 2 and 4 -------------------------------------------------------
    memory: dict[str, Any] = {}
    plans: dict[int, str] = {}
    for k in MEMORY_STAGES:
        label = staged(k, 1).label
        if label in pars:
            par, per_device = pars[label], by_label[label].variable_bytes_per_device
        else:  # not timed: built and trained one batch here, so Adam's variables exist as in the timed ones
            par = make_parallel(staged(k, 1))
            par.build(model_fn, **dense.compile_args())
            par.fit(x[:GLOBAL_BATCH], y[:GLOBAL_BATCH], batch_size=GLOBAL_BATCH, verbose=0)
            per_device = variable_bytes_by_device(par.model.weights + par.model.optimizer.variables)
        total, largest = sum(per_device.values()), max(per_device.values())
        plans[k] = par.describe()
        memory[str(k)] = {
            "bytes_per_device": per_device,
            "total_bytes": total,
            "largest_bytes": largest,
            "perfect_bytes": total / k,
            "largest_vs_perfect": largest / (total / k),
            "stages": [list(stage.layers) for stage in par.plan.stages],
        }
    single_bytes = sum(by_label["single@1"].variable_bytes_per_device.values())

    def ratios(a: str, b: str) -> dict[str, float]:
        """Step time of ``a`` over ``b``: ratio of medians, median of the per-round ratios, ratio of CPU medians."""
        ra, rb = by_label[a], by_label[b]
        return {
            "median": ra.step_ms / rb.step_ms,
            "paired": paired(ra.windows_ms["step_ms"], rb.windows_ms["step_ms"]),
            "cpu": ra.step_cpu_ms / rb.step_cpu_ms,
        }

    def cores(label: str) -> float:
        windows = by_label[label].windows_ms
        return statistics.median(c / w for c, w in zip(windows["step_cpu_ms"], windows["step_ms"]))

    base = staged(TIMED_STAGES, 1).label
    staging = ratios(base, "single@1")
    gpt2_staging = ratios(staged(TIMED_STAGES, 1, "gpt2").label, "gpt2 single@1") if args.gpt2_layers else None
    pipeline = {}
    for m in micro_batches:
        slower = ratios(staged(TIMED_STAGES, m).label, base)  # step time ratio; throughput is its inverse
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
        f"{args.windows} interleaved windows of {args.steps} steps, medians\n"
    )
    header = ["variant", "step ms", "min", "max", "samples/s", "cpu ms", "cores busy", "first step s"]
    rows = [
        [
            r.label,
            r.step_ms,
            min(r.windows_ms["step_ms"]),
            max(r.windows_ms["step_ms"]),
            f"{r.samples_per_s:.0f}",
            r.step_cpu_ms,
            cores(r.label),
            r.first_step_s,
        ]
        for r in results
    ]
    print(format_table(rows, header))
    print()

    def verdict(value: float) -> str:
        return f"target <= {TARGET:.2f}: {'met' if value <= TARGET else 'NOT met'}"

    print(f"1. Cost of staging: step time of {base} / single@1")
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
        print("\n".join("   " + line for line in pars[staged(TIMED_STAGES, 1, "gpt2").label].describe().splitlines()))
    print()
    print(f"2. Pipelining, K={TIMED_STAGES} stages: throughput with M micro-batches / with 1")
    rows = [
        [m, f"{row['throughput_ratio']:.3f}", f"{row['throughput_ratio_paired']:.3f}", f"{row['ideal']:.3f}"]
        for m, row in pipeline.items()
    ]
    print("\n".join("   " + line for line in format_table(rows, ["M", "measured", "paired", "ideal"]).splitlines()))
    print(
        f"   NOTE: the devices are logical CPUs sharing ONE thread pool (the same {os.cpu_count()} cores): stages "
        "cannot run\n   side by side as on separate GPUs, so this pipeline ratio is not a GPU's. The code path is the "
        "one a GPU\n   takes: the same tf.function, micro-batch split and per-stage tf.device placement."
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
        print(f"\n   plan, K={k} (par.describe()):")
        print("\n".join("   " + line for line in text.splitlines()))
    print(f"\npeak RSS of the process: {peak_rss_mib():.0f} MiB")

    record = {
        "benchmark": "model_parallel",
        "model": {"layers": depth, "width": width, "optimizer": "adam"},
        "global_batch": GLOBAL_BATCH,
        "steps": args.steps,
        "windows": args.windows,
        "threads_per_device": threads,
        "results": results,
        "cores_busy": {r.label: cores(r.label) for r in results},
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
        "peak_rss_mib": peak_rss_mib(),
        "environment": environment(devices=list(devices)),
    }
    write_json(record, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
