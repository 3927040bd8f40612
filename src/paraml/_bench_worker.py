"""The script each worker of ``paraml bench``'s multi_worker run executes (under ``paraml launch``)."""

import sys

from paraml.bench import worker_main

worker_main(sys.argv[1:])
