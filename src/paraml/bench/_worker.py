"""The script one timed process runs: a ``multi_worker`` worker of ``paraml bench`` or of
``benchmarks/bench_multi_worker.py`` (under ``paraml launch``), or that benchmark's ``mirrored`` process."""

import sys

from paraml.bench.command import worker_main

worker_main(sys.argv[1:])
