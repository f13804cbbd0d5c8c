"""``python -m bigviz.distributed``: see :mod:`bigviz.distributed.cli`."""

from __future__ import annotations

import sys

from bigviz.distributed.cli import main

if __name__ == "__main__":
    sys.exit(main())
