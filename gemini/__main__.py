"""``python -m gemini`` and the ``gemini`` console script: see :mod:`gemini.cli`."""

import sys

from gemini.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
