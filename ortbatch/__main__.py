"""``python -m ortbatch``: the same command line as ``ortbatch``."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
