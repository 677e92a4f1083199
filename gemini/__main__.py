"""``python -m gemini`` and the ``gemini`` console script: see :mod:`gemini.tools.cli`."""

import sys

from gemini.tools.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
