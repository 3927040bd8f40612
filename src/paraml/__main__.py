"""``python -m paraml``: the same as the ``paraml`` command."""

import sys

from .cli import main

sys.exit(main())
