"""Expert parallelism on a keras_hub Mixtral: each device's measured peak and the step time, ``single`` against
``Parallel("model_parallel", devices=2, expert_parallel=2)``.

The model is a ``MixtralCausalLM`` (random init, no download; ``--layers`` blocks of hidden ``--hidden``, ``--experts``
experts of intermediate ``--intermediate``, top-2, sequence ``--sequence``), trained with Adam on random token ids.
One configuration per fresh process (``--one``): a device's measured peak is the variables and optimizer state living
on it plus the most bytes of buffers its ops held at once in one step
(:func:`paraml.bench.memory_trace.device_memory_peaks`, replayed from the allocator's events; on CPU the allocator
records buffers of 256 KiB or more only), its state bytes from where the variables live. The time is the median of
``--steps`` one-batch ``fit`` calls after the traced one (a step and a call's fixed cost), per process (the two
configurations are not interleaved: read it as a rough figure; logical CPUs share the cores, so the second device's
experts compete with the first's work).

    .venv/bin/python benchmarks/bench_experts.py [--layers 2] [--hidden 256] [--intermediate 1024] [--experts 8]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3")

CONFIGURATIONS = {"single": {}, "expert_parallel=2": {"devices": 2, "expert_parallel": 2}}
MIB = 2**20


def one(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """This process: each device's measured peak in one step of configuration ``name``, and its step time."""
    from paraml import simulate_devices

    simulate_devices(2)
    import time

    import keras
    import keras_hub  # a benchmark-only dependency (the dev extra), never imported by paraml
    import numpy as np

    from paraml import Parallel
    from paraml.bench.memory_trace import device_memory_peaks

    def mixtral() -> Any:
        backbone = keras_hub.models.MixtralBackbone(
            vocabulary_size=1000,
            num_layers=args.layers,
            num_query_heads=4,
            num_key_value_heads=2,
            hidden_dim=args.hidden,
            intermediate_dim=args.intermediate,
            num_experts=args.experts,
            top_k=2,
            sliding_window=args.sequence,
        )
        return keras_hub.models.MixtralCausalLM(backbone=backbone, preprocessor=None)

    rng = np.random.default_rng(0)
    ids = rng.integers(0, 1000, (args.batch, args.sequence)).astype("int32")
    x, y = {"token_ids": ids, "padding_mask": np.ones_like(ids)}, np.roll(ids, -1, axis=1)
    options = CONFIGURATIONS[name]
    par = Parallel("model_parallel" if options else "single", seed=0, **options)
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    par.build(mixtral, optimizer="adam", loss=loss)
    memory = device_memory_peaks(par, x, y)
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        par.fit(x, y, batch_size=args.batch, epochs=1, verbose=0, shuffle=False)
        times.append(time.perf_counter() - start)
    return {
        "configuration": name,
        "devices": {p.device: {"state": p.state_bytes, "buffers": p.buffer_peak_bytes} for p in memory.devices},
        "unattributed": memory.unattributed_bytes,
        "process_peak": memory.process_peak_bytes,
        "fit_call_ms": sorted(times)[len(times) // 2] * 1000,
        "parameters": sum(int(np.prod(v.shape)) * 4 for v in par.model.weights),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=1024)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--sequence", type=int, default=32)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5, help="timed one-batch fit calls after the measured step")
    parser.add_argument("--one", choices=sorted(CONFIGURATIONS), help=argparse.SUPPRESS)
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.one:
        print("RESULT " + json.dumps(one(args.one, args)), flush=True)
        return 0
    forwarded = list(argv if argv is not None else sys.argv[1:])
    results = []
    for name in CONFIGURATIONS:
        done = subprocess.run(
            [sys.executable, __file__, *forwarded, "--one", name], capture_output=True, text=True, check=False
        )
        lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not lines:
            print(done.stdout[-2000:], done.stderr[-4000:], file=sys.stderr)
            return 1
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    model = f"Mixtral {args.layers}x{args.hidden}, {args.experts} experts of {args.intermediate}"
    print(f"{model}, Adam, batch {args.batch} x {args.sequence} tokens")
    print(f"parameters {results[0]['parameters'] / MIB:.1f} MiB")
    print(f"{'configuration':20} {'device':16} {'state MiB':>10} {'buffers MiB':>12} {'peak MiB':>9} {'call ms':>8}")
    for r in results:
        for device, d in r["devices"].items():
            peak = (d["state"] + d["buffers"]) / MIB
            print(
                f"{r['configuration']:20} {device:16} {d['state'] / MIB:10.1f} {d['buffers'] / MIB:12.1f} "
                f"{peak:9.1f} {r['fit_call_ms']:8.1f}"
            )
        print(f"{'':20} {'unattributed':16} {'':>10} {'':>12} {r['unattributed'] / MIB:9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
