"""``python -m paraml``: the same as the ``paraml`` command."""

import sys

from paraml.cli import main

sys.exit(main())
